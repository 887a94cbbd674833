"""Diagnostics against their formulas on small tensors."""
import math

import pytest
import torch
import torch.nn.functional as F

import merger
from merger import analysis
from merger.task_vectors import TaskVectors
from helpers import base_and_experts, write_pool


@pytest.fixture(scope="module")
def tv():
    base, experts = base_and_experts(3, scale=0.05)
    return TaskVectors(base, {f"t{i}": e for i, e in enumerate(experts)})


def flat(tv, i):
    return torch.cat([tv.stacked[k][i].reshape(-1) for k in tv.keys])


def test_norms_cosines_sign_conflicts(tv):
    a, b = flat(tv, 0), flat(tv, 1)
    norms = analysis.task_vector_norms(tv)
    assert norms["global"][0] == pytest.approx(float(a.norm()), rel=1e-5)
    assert sum(v[0] ** 2 for v in norms["layers"].values()) == pytest.approx(float(a.norm()) ** 2, rel=1e-4)
    cos = analysis.cosine_matrix(tv)
    assert cos[0][1] == pytest.approx(float(a @ b / a.norm() / b.norm()), abs=1e-5)
    assert cos[0][0] == pytest.approx(1.0, abs=1e-5)
    sc = analysis.sign_conflicts(tv)
    both = (a != 0) & (b != 0)
    assert sc[0][1] == pytest.approx(float(((a.sign() != b.sign()) & both).sum() / both.sum()))
    assert sc[0][0] == 0.0


def test_mass_kept(tv):
    a2 = flat(tv, 0).pow(2)
    kept = a2.sort(descending=True).values[: math.floor(0.3 * a2.numel() + 1e-6)].sum() / a2.sum()
    assert analysis.mass_kept(tv, 0.7)[0] == pytest.approx(float(kept), rel=1e-5)
    assert analysis.mass_kept(tv, 0.0)[0] == pytest.approx(1.0)


def test_reconstruction_and_interference(tv):
    key = tv.matrices[0]
    x = tv.stacked[key] - tv.stacked[key].mean(0)
    k = 2
    out = analysis.reconstruction_and_interference(tv, [k], centred=True, keys=[key])
    r = 0.0
    svds = [torch.linalg.svd(x[t], full_matrices=False) for t in range(3)]
    for t, (u, s, vh) in enumerate(svds):
        r += float((x[t] - u[:, :k] @ torch.diag(s[:k]) @ vh[:k]).pow(2).sum())
    i_total = 0.0
    for i in range(3):
        for j in range(3):
            if i != j:
                si = torch.diag(svds[i][1][:k] / x[i].norm())
                sj = torch.diag(svds[j][1][:k] / x[j].norm())
                i_total += float((si @ (svds[i][2][:k] @ svds[j][2][:k].T) @ sj).norm())
    assert out["per_layer"][key]["R"][0] == pytest.approx(r, rel=1e-4)
    assert out["per_layer"][key]["I"][0] == pytest.approx(i_total, rel=1e-4)
    full = analysis.reconstruction_and_interference(tv, [min(x.shape[1:])], centred=False, keys=[key])
    assert full["sum"]["R"][0] == pytest.approx(0.0, abs=1e-6)


def test_heterogeneity_and_chi_square(tv):
    lam = [0.2, 0.3, 0.5]
    out = analysis.heterogeneity(tv, lam, mask_sparsity=0.5)
    flats = torch.stack([flat(tv, i) for i in range(3)])
    mean = sum(l * f for l, f in zip(lam, flats))
    assert out["zeta2"][1] == pytest.approx(float((flats[1] - mean).pow(2).sum()), rel=1e-5)
    assert len(out["delta"]) == 3
    assert out["chi2"] == pytest.approx(sum((1 / 3 - c) ** 2 / c ** 2 for c in lam))
    assert out["warnings"] == []
    warn = analysis.chi_square([0.5, 0.5, 0.5])["warnings"]
    assert "Σλ = 1.5 ≠ 1" in warn[0]
    assert any("λ < 0" in w for w in analysis.chi_square([1.2, -0.2])["warnings"])


def test_epoch_dynamics():
    p0 = torch.zeros(4)
    pts = [p0, torch.tensor([1.0, 0, 0, 0]), torch.tensor([1.0, 1, 0, 0]), torch.tensor([1.0, 1, 2, 0])]
    out = analysis.epoch_dynamics(pts)
    assert out["shares"] == pytest.approx([0.25, 0.25, 0.5])
    assert out["cosine"][0][1] == pytest.approx(0.0)
    assert out["cos_to_first"][1] == pytest.approx(1 / math.sqrt(2))
    with pytest.raises(merger.MergerError, match="at least two epochs"):
        analysis.epoch_dynamics(pts[:2])


def test_one_epoch_of_full_batch_gd_is_minus_eta_gradient(tmp_path):
    pool = merger.open_pool(write_pool(tmp_path, n_experts=2, scale=0.1, demo_data=True))
    ev = merger.Evaluator(pool)
    t = pool.tasks[0]
    grad = analysis.gradient_at_base(ev, t)
    eta = 0.05
    # one epoch of full-batch gradient descent from the base, done with an optimiser
    params = {k: v.clone().requires_grad_(True) for k, v in pool.task_vectors.base.items()}
    opt = torch.optim.SGD(list(params.values()), lr=eta)
    from torch.func import functional_call

    from merger.data import preprocess

    d = ev.data.split(t, "train")
    x = preprocess(d.images, pool.preprocess_cfg)
    f = F.normalize(functional_call(ev.model.visual, {k[7:]: v for k, v in params.items()}, (x,)), dim=-1)
    F.cross_entropy(ev.logit_scale * f @ ev.heads[t].T, d.labels).backward()
    opt.step()
    tau1 = torch.cat([(params[k].detach() - pool.task_vectors.base[k]).reshape(-1) for k in params])
    g = torch.cat([grad[k].reshape(-1) for k in params])
    assert torch.allclose(tau1, -eta * g, atol=1e-6)
    assert analysis.gradient_alignment(tau1, g) == pytest.approx(1.0, abs=1e-5)


def test_cross_task_linearity_of_a_linear_model_is_zero():
    torch.manual_seed(0)
    experts = [{"w": torch.randn(5, 3)} for _ in range(3)]
    w = [0.2, 0.5, 0.3]
    merged = {"w": sum(c * e["w"] for c, e in zip(w, experts))}

    def features(weights, x):
        h = x @ weights["w"].T
        return [h, 2 * h]  # two "layers", both linear in the weights

    out = analysis.cross_task_linearity(features, merged, experts, w, torch.randn(16, 3))
    assert max(out["mean"]) == pytest.approx(0.0, abs=1e-6)
    assert all(b > 0 for b in out["baseline"])


def test_block_features_on_open_clip(tmp_path):
    pool = merger.open_pool(write_pool(tmp_path, n_experts=2, scale=0.1, demo_data=True))
    ev = merger.Evaluator(pool)
    x = ev.inputs("live")[0][0][:8]
    feats = analysis.block_features(ev.model.visual, pool.task_vectors.base, x)
    assert len(feats) == len(ev.model.visual.transformer.resblocks) and feats[0].shape[0] == 8
    experts = [pool.task_vectors.expert(i) for i in range(2)]
    fn = lambda wts, xx: analysis.block_features(ev.model.visual, wts, xx)  # noqa: E731
    out = analysis.cross_task_linearity(fn, pool.task_vectors.expert(0), experts, [1.0, 0.0], x)
    assert max(out["mean"]) == pytest.approx(0.0, abs=1e-5)  # the merge is expert 0 itself


def test_interpolation_path_and_logit_ensemble(tmp_path):
    from merger.landscape import Landscape

    pool = merger.open_pool(write_pool(tmp_path, n_experts=2, scale=0.1, demo_data=True))
    ex = merger.Explorer(pool)
    land = Landscape(ex)
    ev = ex.evaluator
    x = ev.inputs("val")[0][0][:16]
    feats = lambda w, xx: analysis.block_features(ev.model.visual, w, xx)  # noqa: E731
    a, b = land.expert_point(pool.tasks[0]), land.expert_point(pool.tasks[1])
    p = analysis.interpolation_path(ev, land.space, a, b, feats, x, alphas=(0.0, 0.5, 1.0))
    assert p["linearity"][0] == pytest.approx(0.0, abs=1e-6) and p["linearity"][2] == pytest.approx(0.0, abs=1e-6)
    end = merger.evaluate(pool, {**pool.base, **pool.task_vectors.expert(1)}, "live")
    assert p["accuracy"][2] == pytest.approx(end.average_accuracy)
    # a one-expert "ensemble" is that expert
    ens = analysis.logit_ensemble_accuracy(ev, [pool.task_vectors.expert(0)], [1.0], "live")
    solo = merger.evaluate(pool, {**pool.base, **pool.task_vectors.expert(0)}, "live")
    assert ens == pytest.approx(solo.accuracy)
