"""AdaMerging and Frank–Wolfe merging on a small pool over demo-world data."""
import copy
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import yaml
from helpers import write_pool

import merger
from merger.errors import DataError, MethodError
from merger.io.checkpoints import save_safetensors
from merger.methods.adaptive import (Cancelled, Combination, Context, calibration_set, cross_entropy_objective,
                                     entropy_objective)


def finetune_one(pool, task, steps=40):
    """A quick real expert: CE fine-tuning of the image tower on the task's train split."""
    ev = merger.Evaluator(pool)
    model = copy.deepcopy(ev.model)
    model.requires_grad_(False)
    model.visual.requires_grad_(True)
    d = ev.data.split(task, "train")
    from merger.data.tasks import preprocess

    x, y = preprocess(d.images, pool.preprocess_cfg), d.labels
    opt = torch.optim.Adam(model.visual.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randperm(len(y), generator=g)[:64]
        f = F.normalize(model.encode_image(x[idx]), dim=-1)
        loss = F.cross_entropy(ev.logit_scale * f @ ev.heads[task].T, y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith("visual.")}


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapool")
    path = write_pool(root, n_experts=3, scale=0.2, demo_data=True)
    p = merger.open_pool(path)
    # replace the random experts by quickly fine-tuned ones, so the objectives mean something
    for t in p.tasks:
        save_safetensors(finetune_one(p, t), root / "experts" / f"{t}.safetensors")
    return merger.open_pool(path)


@pytest.fixture(scope="module")
def ex(pool):
    return merger.PoolSession(pool)


def test_entropy_decreases_and_coefficients_stay_in_bounds(ex):
    run = ex.run(ex.spec("adamerging_layer", steps=40, lr=0.05, init=0.3))
    obj = run.trace["objective"]
    assert sum(obj[-5:]) / 5 < sum(obj[:5]) / 5
    assert run.coefficients.shape == (3, len(run.groups)) and len(run.groups) > 3
    assert float(run.coefficients.min()) >= 0.0 and float(run.coefficients.max()) <= 1.0
    hot = ex.run(ex.spec("adamerging_task", steps=20, lr=0.9, init=0.95))  # pushed hard against the bound
    assert float(hot.coefficients.max()) <= 1.0 and float(hot.coefficients.min()) >= 0.0


def test_run_is_deterministic_and_cached(pool, ex):
    spec = ex.spec("adamerging_task", steps=10, lr=0.01, seed=3, samples=8)
    a = ex.run(spec)
    assert ex.run(ex.spec("adamerging_task", steps=10, lr=0.01, seed=3, samples=8)) is a
    other = merger.PoolSession(pool)  # a fresh explorer: no cache, same answer
    b = other.run(spec)
    assert torch.equal(a.coefficients, b.coefficients) and a.trace == b.trace
    c = other.run(other.spec("adamerging_task", steps=10, lr=0.01, seed=4, samples=8))
    assert a.trace["objective"] != c.trace["objective"]  # another seed draws other batches


def test_merged_weights_follow_the_learned_coefficients(pool, ex):
    run = ex.run(ex.spec("adamerging_task", steps=10, lr=0.01))
    tv = pool.task_vectors
    k = tv.keys[0]
    expected = sum(float(run.coefficients[i, 0]) * tv.stacked[k][i] for i in range(3))
    assert torch.allclose(run.delta[k], expected, atol=1e-6)
    res = ex.preview(ex.spec("adamerging_task", steps=10, lr=0.01))
    full = merger.merge(pool, "adamerging_task", steps=10, lr=0.01)
    assert merger.evaluate(pool, full).accuracy == res.accuracy


def calibration_loss(ex, pool, coefficients, calib):
    """ℓ at θ0 + Σ ct τt, and its gradient with respect to every merged weight (autograd)."""
    tv = pool.task_vectors
    ctx = Context(pool, ex.evaluator, tuple(pool.tasks))
    params = {k: (tv.base[k] + sum(float(c) * tv.stacked[k][i] for i, c in enumerate(coefficients))).requires_grad_(True)
              for k in tv.keys}
    loss = cross_entropy_objective(ctx, {k[len("visual."):]: v for k, v in params.items()}, calib)
    grads = torch.autograd.grad(loss, list(params.values()))
    return float(loss.detach()), dict(zip(params, grads))


def test_fw_hard_lmo_picks_the_expert_with_the_least_inner_product(pool, ex):
    """The LMO's choice and the FW gap against explicit ⟨∇θℓ, θv⟩ over the experts' full weights."""
    run = ex.run(ex.spec("fw_hard", steps=3))
    calib = calibration_set(Context(pool, ex.evaluator, tuple(pool.tasks)), 100, 0)
    tv = pool.task_vectors
    for i in range(3):
        c = run.iterates[i][:, 0]
        _, grads = calibration_loss(ex, pool, c, calib)
        scores = [sum(float((grads[k] * (tv.base[k] + tv.stacked[k][v])).sum()) for k in tv.keys) for v in range(3)]
        current = sum(float((grads[k] * (tv.base[k] + sum(c[t] * tv.stacked[k][t] for t in range(3)))).sum())
                      for k in tv.keys)
        assert run.trace["chosen"][i] == pool.tasks[scores.index(min(scores))]
        assert run.trace["gap"][i] == pytest.approx(current - min(scores), rel=1e-3, abs=1e-5)


def test_fw_hard_moves_at_its_defaults(ex):
    """From its default start the objective falls and the gap is positive before convergence; the
    start is not a vertex, so the LMO never picks it."""
    run = ex.run(ex.spec("fw_hard"))
    obj, gap = run.trace["objective"], run.trace["gap"]
    assert obj[-1] < obj[0] - 1e-3 and gap[0] > 0
    assert "start" not in run.trace["chosen"]
    w = run.trace["weights"][-1]
    assert min(w) >= -1e-9 and sum(w) == pytest.approx(1.0, abs=1e-6) and w[0] < 0.5


def test_fw_soft_solves_its_inner_problem(pool, ex):
    """λ* over the top-2 vertices against a brute-force argmin on a fine grid of the simplex."""
    run = ex.run(ex.spec("fw_soft", steps=1, k=2))
    lam = run.trace["lambda"][0]
    names = [part.split(":")[0] for part in run.trace["chosen"][0].split(", ")]
    assert len(lam) == 2 and sum(lam) == pytest.approx(1.0, abs=1e-9) and min(lam) >= 0
    calib = calibration_set(Context(pool, ex.evaluator, tuple(pool.tasks)), 100, 0)
    a, b = (pool.tasks.index(n) for n in names)

    def coef(x):
        c = [0.0] * 3
        c[a] += x
        c[b] += 1 - x
        return c

    ctx = Context(pool, ex.evaluator, tuple(pool.tasks))
    with torch.no_grad():
        grid = [float(cross_entropy_objective(ctx, _params(pool, coef(j / 100)), calib)) for j in range(101)]
    found = calibration_loss(ex, pool, coef(lam[0]), calib)[0]
    assert found <= min(grid) + 1e-4
    assert run.trace["best_loss"] == pytest.approx(found, rel=1e-4)


def _params(pool, coefficients):
    tv = pool.task_vectors
    return {k[len("visual."):]: tv.base[k] + sum(c * tv.stacked[k][i] for i, c in enumerate(coefficients))
            for k in tv.keys}


def test_typed_parameters_of_a_run_are_not_snapped(ex):
    """lr = 4e-5 is below the slider step (1e-4); a run must use it, not 0."""
    spec = ex.spec("adamerging_task", steps=3, lr=4e-5, init=0.3)
    assert spec.snap().params == spec.params and "lr=4e-05" in spec.label()
    run = ex.run(spec)
    assert bool((run.coefficients != 0.3).all())  # Adam moved every coefficient
    assert float((run.coefficients - 0.3).abs().max()) < 1e-3


def test_hard_fw_with_a_single_expert_converges_to_it(pool, ex):
    t = pool.tasks[0]
    run = ex.run(ex.spec("fw_hard", steps=10, lam=0.0, experts=[t]))
    assert run.trace["weights"][-1][1] >= 0.9  # barycentric weight of the expert (index 0 is the start)
    assert float(run.coefficients[0, 0]) >= 0.9


def test_gradient_matches_finite_differences(pool):
    ev = merger.Evaluator(pool)
    ctx = Context(pool, ev, tuple(pool.tasks))
    ctx.model = copy.deepcopy(ev.model.visual).double()
    ctx.heads = {t: h.double() for t, h in ev.heads.items()}
    tv = ctx.tv
    keys = tv.keys
    comb = Combination(tv.base, tv.stacked, [keys[: len(keys) // 2], keys[len(keys) // 2:]], dtype=torch.float64)
    x, members = ctx.groups("val")[0]
    batch = [(x[:8].double(), [(t, y[:8]) for t, y in members])]
    coef = torch.full((3, 2), 0.3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda c: entropy_objective(ctx, comb.params(c), batch), (coef,),
                                    eps=1e-6, atol=1e-5, rtol=1e-3)


def test_zero_steps_and_negative_learning_rate(ex):
    with pytest.raises(MethodError, match=r"steps=0 is out of range \[1, 5000\]"):
        ex.spec("adamerging_task", steps=0)
    with pytest.raises(MethodError, match=r"lr=-0.1 is out of range \(0, 1\]"):
        ex.spec("adamerging_layer", lr=-0.1)


@pytest.mark.parametrize("method, params", [("adamerging_task", {"steps": 2}), ("regmean", {"samples": 8}),
                                            ("fisher", {"samples": 8})])
def test_no_unlabeled_data_for_a_task(tmp_path, method, params):
    path = write_pool(tmp_path, n_experts=2, demo_data=True)
    spec = yaml.safe_load(path.read_text())
    t = list(spec["tasks"])[1]
    spec["tasks"][t]["data"] = {"demo": {"train": {"n": 1, "seed": 5}, "test": {"n": 300, "seed": 12}}}
    path.write_text(yaml.safe_dump(spec))
    ex = merger.PoolSession(merger.open_pool(path))
    with pytest.raises(DataError, match=f"task '{t}': the val split has no images"):
        ex.run(ex.spec(method, **params))


def test_cancel_midway_leaves_a_consistent_state(pool, ex):
    before = ex.evaluator.evaluate(None, "live").accuracy
    calls = []

    def cancel():
        calls.append(1)
        return len(calls) > 3

    spec = ex.spec("adamerging_layer", steps=50, seed=9)
    with pytest.raises(Cancelled):
        ex.run(spec, cancel=cancel)
    assert ex.cached_run(spec) is None
    assert ex.evaluator.evaluate(None, "live").accuracy == before  # resident model untouched
    assert ex.run(ex.spec("adamerging_layer", steps=3, seed=9)).trace["objective"]  # and it runs again


def test_cli_merges_with_a_data_driven_method(pool, tmp_path):
    out = tmp_path / "m.safetensors"
    res = subprocess.run([sys.executable, "-m", "merger", "merge", "--pool", pool.source, "--method",
                          "adamerging-layer", "--steps", "5", "--out", str(out)], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert "adamerging_layer: 100%" in res.stderr  # the run's progress bar (tqdm, on stderr)
    spec = yaml.safe_load(out.with_suffix(".yaml").read_text())
    assert spec["method"] == "adamerging_layer" and spec["params"]["steps"] == 5
