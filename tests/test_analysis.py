"""Diagnostics against their formulas on small tensors."""
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import base_and_experts, write_pool

import merger
from merger.analysis import diagnostics as analysis
from merger.pool.task_vectors import TaskVectors


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
    base, experts = base_and_experts(2, scale=0.05)
    same = TaskVectors(base, {"copy": dict(base), "other": experts[1]})  # an expert equal to the base
    assert analysis.mass_kept(same, 0.7)[0] == 1.0 and 0 < analysis.mass_kept(same, 0.7)[1] < 1  # not NaN


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
    out = analysis.heterogeneity(tv, lam)
    flats = torch.stack([flat(tv, i) for i in range(3)])
    mean = sum(l * f for l, f in zip(lam, flats))
    assert out["zeta2"][1] == pytest.approx(float((flats[1] - mean).pow(2).sum()), rel=1e-5)
    assert "delta" not in out
    assert out["chi2"] == pytest.approx(sum((1 / 3 - c) ** 2 / c ** 2 for c in lam))
    assert out["warnings"] == []
    assert analysis.heterogeneity(tv, [1 / 3] * 3)["chi2"] == 0.0  # weight averaging (fp32 λ gave 2.7e-15)
    warn = analysis.chi_square([0.5, 0.5, 0.5])["warnings"]
    assert "Σλ = 1.5 ≠ 1" in warn[0]
    assert any("λ < 0" in w for w in analysis.chi_square([1.2, -0.2])["warnings"])


def hand_made_tv():
    """Two task vectors of four entries, small enough to compute δ(M) by hand."""
    base = {"visual.w": torch.zeros(4)}
    experts = {"a": {"visual.w": torch.tensor([3.0, -1.0, 2.0, 0.5])},
               "b": {"visual.w": torch.tensor([-4.0, 1.5, 1.0, 0.1])}}
    return TaskVectors(base, experts)


def test_ties_mask_elects_signs_and_delta_sums_over_the_dropped_entries_only():
    # top-2 per task: a keeps entries 0, 2; b keeps 0, 1. Trimmed sum [-1, 1.5, 2, 0]: elected signs
    # [-, +, +, 0], so a's entry 0 (+3, kept by magnitude) is dropped by the election.
    tv = hand_made_tv()
    keep = analysis.merge_mask(tv, "ties", 0.5)
    assert keep.tolist() == [[False, False, True, False], [True, True, False, False]]
    out = analysis.heterogeneity(tv, [0.5, 0.5], "ties", 0.5)
    # consensus c = [-0.5, 0.25, 1.5, 0.3]; masked consensus c~ = [-2, 0.75, 1, 0]
    # δa = Σ over a's dropped {0, 1, 3} of (τa − c)² − c~² = (12.25 − 4) + (1.5625 − 0.5625) + 0.04
    # δb = Σ over b's dropped {2, 3}: (0.25 − 1) + 0.04
    assert out["delta"] == pytest.approx([9.29, -0.71], abs=1e-5)
    assert out["zeta2_hat"] == pytest.approx([z - d for z, d in zip(out["zeta2"], out["delta"])])
    assert out["dropped"] == pytest.approx([0.75, 0.5])


def test_dare_masks_are_the_merge_masks(tv):
    keep = analysis.merge_mask(tv, "dare_linear", 0.6, seed=3)
    # the entries dare_linear keeps are exactly those that differ from the base in its merge
    import merger

    one = tv.subset([tv.tasks[0]])
    dare = merger.methods.get("dare_linear")
    delta = dare.delta(dare.prepare(one, seed=3), lam=1.0, sparsity=0.6, seed=3)
    kept = torch.cat([(delta[k] != 0).reshape(-1) for k in tv.keys])
    assert torch.equal(keep[0], kept)
    ties_keep = analysis.merge_mask(tv, "dare_ties", 0.6, seed=3)
    assert bool((ties_keep <= keep).all()) and int(ties_keep.sum()) < int(keep.sum())  # election drops more


def test_epoch_dynamics():
    p0 = torch.zeros(4)
    pts = [p0, torch.tensor([1.0, 0, 0, 0]), torch.tensor([1.0, 1, 0, 0]), torch.tensor([1.0, 1, 2, 0])]
    out = analysis.epoch_dynamics(pts)
    assert out["shares"] == pytest.approx([0.25, 0.25, 0.5])
    assert out["cosine"][0][1] == pytest.approx(0.0)
    assert out["cos_to_first"][1] == pytest.approx(1 / math.sqrt(2))
    with pytest.raises(merger.MergerError, match="at least two epochs"):
        analysis.epoch_dynamics(pts[:2])


def test_one_epoch_of_full_batch_gd_in_the_lab_is_minus_eta_gradient(tmp_path):
    """Through the lab's own code path (its gradient-descent preset): τ(1) = −η ∇L(θ0)."""
    from merger.analysis import lab

    pool = merger.open_pool(write_pool(tmp_path, n_experts=2, scale=0.1, demo_data=True))
    ev = merger.Evaluator(pool)
    t = pool.tasks[0]
    settings = lab.check_settings(**{**lab.GRADIENT_DESCENT, "data_fraction": 1.0, "seed": 0})
    sd, traj, hp = lab.finetune(merger.session_for(pool), t, settings)
    assert len(traj) == 1 and hp["batch_size"] == 0 and hp["optimizer"] == "sgd"
    keys = pool.task_vectors.keys
    tau1 = torch.cat([(sd[k] - pool.task_vectors.base[k]).reshape(-1) for k in keys])
    grad = analysis.gradient_at_base(ev, t)
    g = torch.cat([grad[k].reshape(-1) for k in keys])
    assert analysis.gradient_alignment(tau1, g) == pytest.approx(1.0, abs=1e-4)
    assert torch.allclose(tau1, -settings["lr"] * g, atol=1e-5)
    # the AdamW default with its schedule does not give the identity
    adam, _, _ = lab.finetune(merger.session_for(pool), t, lab.check_settings(1e-3, 1, 64, 1.0, 0))
    tau_adam = torch.cat([(adam[k] - pool.task_vectors.base[k]).reshape(-1) for k in keys])
    assert analysis.gradient_alignment(tau_adam, g) < 0.99


def linear_features(weights, x):
    h = x @ weights["w"].T
    return [h, 2 * h]  # two "layers", both linear in the weights


def test_cross_task_linearity_keeps_the_base_term():
    """Task arithmetic with Σλ ≠ 1: for a model linear in its weights, the affine prediction
    (1 − Σλ) f(θ0) + Σ λ f(θt) is exact; Σ λ f(θt) alone is not."""
    torch.manual_seed(0)
    base = {"w": torch.randn(5, 3)}
    experts = [{"w": base["w"] + 0.5 * torch.randn(5, 3)} for _ in range(3)]
    w = [0.7, 0.7, 0.7]  # Σ = 2.1, as TA at λ = 0.7 over three tasks
    merged = {"w": base["w"] + sum(c * (e["w"] - base["w"]) for c, e in zip(w, experts))}
    x = torch.randn(16, 3)
    out = analysis.cross_task_linearity(linear_features, merged, experts, w, x, base=base)
    assert max(out["mean"]) == pytest.approx(0.0, abs=1e-6)
    without = analysis.cross_task_linearity(linear_features, merged, experts, w, x)
    assert min(without["mean"]) > 1e-3  # the prediction without the base term misses
    # baseline: the merge against each endpoint (the experts and, as 1 − Σλ ≠ 0, the base)
    fm = linear_features(merged, x)[0]
    ends = [linear_features(e, x)[0] for e in experts] + [linear_features(base, x)[0]]
    expected = sum(float((1 - F.cosine_similarity(fm, e, dim=-1)).mean()) for e in ends) / 4
    assert out["baseline"][0] == pytest.approx(expected, rel=1e-5)
    assert out["base_weight"] == pytest.approx(1 - 2.1)
    # the pairs' baseline, the paper's Fig. 2: the experts against each other, over the 3 pairs
    pairs = [float((1 - F.cosine_similarity(ends[i], ends[j], dim=-1)).mean()) for i, j in ((0, 1), (0, 2), (1, 2))]
    assert out["pairwise"][0] == pytest.approx(sum(pairs) / 3, rel=1e-5)
    assert out["pairwise"][1] == pytest.approx(sum(pairs) / 3, rel=1e-5)  # 2h: the same directions
    assert out["pairwise"][0] != pytest.approx(out["baseline"][0], rel=1e-2)
    # an expert weighted 0 is in no pair; one expert left has none
    one = analysis.cross_task_linearity(linear_features, merged, experts, [0.7, 0.0, 0.0], x, base=base)
    assert all(math.isnan(v) for v in one["pairwise"])
    two = analysis.cross_task_linearity(linear_features, merged, experts, [0.7, 0.0, 0.7], x, base=base)
    assert two["pairwise"][0] == pytest.approx(pairs[1], rel=1e-5)


def test_block_features_cover_every_token_and_the_probe_every_task(tmp_path):
    pool = merger.open_pool(write_pool(tmp_path, n_experts=2, scale=0.1, demo_data=True, own_images=True))
    ev = merger.Evaluator(pool)
    x = analysis.probe_images(ev, "live", per_task=4)
    groups = ev.inputs("live")
    assert len(x) == 4 * len(groups) and torch.equal(x[4:8], groups[1][0][:4])  # images of the second task too
    feats = analysis.block_features(ev.model.visual, pool.task_vectors.base, x)
    tokens = (32 // 8) ** 2 + 1
    width = ev.model.visual.transformer.width
    assert len(feats) == len(ev.model.visual.transformer.resblocks) and feats[0].shape == (len(x), tokens * width)
    experts = [pool.task_vectors.expert(i) for i in range(2)]
    fn = lambda wts, xx: analysis.block_features(ev.model.visual, wts, xx)  # noqa: E731
    out = analysis.cross_task_linearity(fn, pool.task_vectors.expert(0), experts, [1.0, 0.0], x,
                                        base=pool.task_vectors.base)
    assert max(out["mean"]) == pytest.approx(0.0, abs=1e-5)  # the merge is expert 0 itself


def test_interpolation_path_and_logit_ensemble(tmp_path):

    pool = merger.open_pool(write_pool(tmp_path, n_experts=2, scale=0.1, demo_data=True))
    ex = merger.PoolSession(pool)
    land = ex.landscape
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
    # weights that do not sum to 1 take the base's logits for the rest: at 0 the ensemble is the base
    # (it summed nothing, and class 0 won everywhere)
    zero = analysis.logit_ensemble_accuracy(ev, [pool.task_vectors.expert(0)], [0.0], "live", base=pool.task_vectors.base)
    assert zero == pytest.approx(merger.evaluate(pool, None, "live").accuracy)


def test_the_masks_of_magmax_consensus_and_breadcrumbs_reach_the_heterogeneity_view():
    # hand_made_tv: a = [3, -1, 2, 0.2], b = [-4, 1.5, 1, 0.1]
    tv = hand_made_tv()
    magmax = analysis.merge_mask(tv, "magmax")  # the larger |τ| per entry: b, b, a, a
    assert magmax.tolist() == [[False, False, True, True], [True, True, False, False]]
    # TALL masks at λ_mask = 0.6 (two tasks: Σ τ − τa = τb): |τa| ≥ 0.6 |τb| everywhere; |τb| ≥ 0.6 |τa| on 0, 1
    consensus = analysis.merge_mask(tv, "consensus_ta", mask_lambda=0.6, agree=2)
    assert consensus.tolist() == [[True, True, False, False]] * 2
    crumbs = analysis.merge_mask(tv, "breadcrumbs", beta=0.25, gamma=0.75)  # drop the largest and the smallest
    assert crumbs.tolist() == [[False, True, True, False], [False, True, True, False]]
    out = analysis.heterogeneity(tv, [0.5, 0.5], "consensus_ta", lam=0.3, mask_lambda=0.6, agree=2)
    assert out["dropped"] == pytest.approx([0.5, 0.5]) and out["mask"] == "consensus_ta"
    # with wa = 3 the merge's MagMax mask is taken on 3·τa = [9, -3, 6, 1.5]: a wins every entry (the
    # unweighted mask was used, b, b, a, a)
    weighted = analysis.heterogeneity(tv, [1.5, 0.5], "magmax", task_weights={"a": 3.0})
    assert weighted["dropped"] == [0.0, 1.0]
    # TIES elects on the weighted trimmed vectors: wb = 0.1 leaves a's entry 0 (+3) elected
    ties = analysis.heterogeneity(tv, [0.5, 0.05], "ties", 0.5, task_weights={"b": 0.1})
    assert ties["dropped"] == [0.5, 0.75]  # b keeps only its entry 1 (+1.5): the unweighted election dropped a's 0
