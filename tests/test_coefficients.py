"""Per-task and per-block weights: formulas against independent computations, the
plain method bit for bit at all-ones, mergekit's weighted TIES, round trips and bad input."""
import re

import pytest
import torch
from helpers import write_pool

import merger
from merger.errors import MergerError
from merger.pool.blocks import block_of


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    return merger.open_pool(write_pool(tmp_path_factory.mktemp("coef"), n_experts=3, scale=0.2))


def test_task_arithmetic_with_task_weights_is_the_weighted_sum(pool):
    w = {"task0": 1.4, "task2": -0.5}
    merged = merger.merge(pool, "task_arithmetic", lam=0.7, task_weights=w)
    tv = pool.task_vectors
    for k in tv.keys:
        want = pool.base[k].float() + 0.7 * sum(w.get(t, 1.0) * tv.stacked[k][i] for i, t in enumerate(tv.tasks))
        torch.testing.assert_close(merged[k].float(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method,params", [("task_arithmetic", {"lam": 0.4}), ("ties", {"lam": 1.0, "sparsity": 0.8}),
                                           ("dare_ties", {"lam": 0.9, "sparsity": 0.5, "seed": 3}),
                                           ("tsv_m", {"lam": 1.0}), ("cart", {"lam": 1.2, "rank_ratio": 0.2}),
                                           ("weight_averaging", {})])
def test_all_ones_weights_are_the_plain_method_bit_for_bit(pool, method, params):
    plain = merger.merge(pool, method, **params)
    ones = merger.merge(pool, method, task_weights={t: 1.0 for t in pool.tasks},
                        block_weights={b: 1.0 for b in pool.blocks}, **params)
    assert pool.make_spec(method, params, task_weights={"task0": 1}) == pool.make_spec(method, params)
    for k in plain:
        assert torch.equal(plain[k], ones[k]), k


@pytest.mark.parametrize("method,params", [("task_arithmetic", {"lam": 0.4}), ("ties", {"lam": 1.0, "sparsity": 0.8}),
                                           ("iso_c", {"lam": 1.0})])
def test_a_zero_block_weight_leaves_that_block_at_the_base(pool, method, params):
    merged = merger.merge(pool, method, block_weights={"block0": 0.0, "projection": 0.5}, **params)
    plain = merger.merge(pool, method, **params)
    keys = pool.task_vectors.keys
    assert {block_of(k) for k in keys} >= {"block0", "embeddings", "projection"}
    for k in keys:
        if block_of(k) == "block0":
            assert torch.equal(merged[k], pool.base[k]), k
        elif block_of(k) == "projection":
            torch.testing.assert_close(merged[k] - pool.base[k], 0.5 * (plain[k] - pool.base[k]))
        else:
            assert torch.equal(merged[k], plain[k]), k


def mergekit_ties(deltas: torch.Tensor, weights: torch.Tensor, density: float, lam: float) -> torch.Tensor:
    """mergekit's generalized task arithmetic, TIES (sum consensus, normalize=True), transcribed:
    per-model magnitude sparsification, weighted deltas elect the sign, Σ wτ·mask / Σ w·mask."""
    kept = []
    for d in deltas:
        k = int(density * d.numel())
        top = d.abs().flatten().topk(k).indices
        mask = torch.zeros(d.numel(), dtype=torch.bool)
        mask[top] = True
        kept.append(d * mask.view_as(d))
    weighted = torch.stack(kept) * weights.view(-1, *[1] * deltas[0].dim())
    sign = weighted.sign()
    majority = (weighted.sum(0) >= 0) * 2 - 1
    mask = sign == majority
    mixed = (weighted * mask).sum(0)
    divisor = (weights.view(-1, *[1] * deltas[0].dim()) * mask).sum(0)
    divisor[divisor == 0] = 1
    return lam * mixed / divisor


def test_ties_with_weights_is_mergekits_weighted_disjoint_merge():
    g = torch.Generator().manual_seed(0)
    base = {"visual.proj": torch.zeros(6, 5)}
    deltas = torch.randn(3, 6, 5, generator=g)
    experts = {f"e{i}": {"visual.proj": deltas[i]} for i in range(3)}
    weights = {"e0": 1.5, "e1": 0.25, "e2": -0.75}
    got = merger.merge_state_dicts(base, experts, "ties", lam=0.9, sparsity=0.4, task_weights=weights)
    want = mergekit_ties(deltas, torch.tensor(list(weights.values())), density=0.6, lam=0.9)
    torch.testing.assert_close(got["visual.proj"], want)


def test_low_rank_methods_merge_the_weighted_task_vectors(pool):
    """A method without its own weighting prepares on wₜτₜ: the same as experts whose task
    vectors were scaled by hand."""
    w = {"task1": 0.5, "task2": 1.5}
    got = merger.merge(pool, "tsv_m", lam=1.0, task_weights=w)
    tv = pool.task_vectors
    scaled = {t: {k: pool.base[k].float() + w.get(t, 1.0) * tv.stacked[k][i] for k in tv.keys}
              for i, t in enumerate(tv.tasks)}
    want = merger.merge_state_dicts({k: pool.base[k] for k in tv.keys}, scaled, "tsv_m", lam=1.0)
    for k in tv.keys:
        torch.testing.assert_close(got[k].float(), want[k].float(), rtol=1e-4, atol=2e-5)


def test_spec_yaml_round_trip_with_weights_replays_identical_tensors(pool, tmp_path):
    import yaml

    spec = pool.make_spec("ties", {"lam": 1.1, "sparsity": 0.7}, task_weights="task0=1.4,task1=0.5",
                          block_weights={"block0": 0.0})
    text = yaml.safe_dump(spec.as_dict())
    back = yaml.safe_load(text)
    again = pool.make_spec(back["method"], back["params"], back["experts"], back.get("task_weights"),
                           back.get("block_weights"))
    assert again == spec and "w[task0=1.4, task1=0.5] b[block0=0]" in spec.label()
    a, b = merger.api.merge_spec(pool, spec), merger.api.merge_spec(pool, again)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kwargs,message", [
    ({"task_weights": {"nope": 1.0}}, "task_weights.nope: not a ticked expert"),
    ({"task_weights": {"task2": 1.0}, "experts": ["task0", "task1"]}, "task_weights.task2: not a ticked expert"),
    ({"block_weights": {"block9": 1.0}}, "block_weights.block9: not a block group"),
    ({"task_weights": {"task0": float("nan")}}, "task_weights.task0: nan is outside [-3, 3]"),
    ({"block_weights": {"block0": 3.5}}, "block_weights.block0: 3.5 is outside [-3, 3]"),
    ({"task_weights": "task0"}, "task_weights: 'task0' is not name=weight"),
    ({"task_weights": {"task0": "x"}}, "task_weights.task0: 'x' is not a number"),
    # a dict would keep the last; False would silently drop the task; '=1' names nothing
    ({"task_weights": "task0=1,task0=2"}, "task_weights: given twice: task0"),
    ({"task_weights": [("task1", 1.0), ("task1", 2.0)]}, "task_weights: given twice: task1"),
    ({"task_weights": {"task0": False}}, "task_weights.task0: 'False' is not a number"),
    ({"block_weights": {"block0": True}}, "block_weights.block0: 'True' is not a number"),
    ({"task_weights": "=1"}, "task_weights: a weight without a name ('=w'); known: task0"),
    ({"task_weights": [[["task0"], 1.0]]}, "task_weights: every name must be a string"),
    ({"experts": ["task0", "task1", "task0"]}, "experts: named twice: task0"),
    ({"experts": ["x" * 100000]}, "experts: unknown task(s) " + "x" * 60 + "…; known"),
    ({"experts": [f"e{i}" for i in range(20000)]}, "experts: unknown task(s) e0, e1, e2, e3, e4, e5, e6, e7, e8, "
                                                   "e9, … (20000 in all); known"),
])
def test_bad_weights_get_a_message_naming_the_key(pool, kwargs, message):
    with pytest.raises(MergerError, match=re.escape(message)):
        merger.merge(pool, "task_arithmetic", lam=0.3, **kwargs)


def test_data_driven_methods_refuse_weights(pool):
    with pytest.raises(MergerError, match="adamerging_task learns its own coefficients"):
        pool.make_spec("adamerging_task", {}, task_weights={"task0": 2.0})


def test_endpoint_and_history_take_the_weights(tmp_path):
    from helpers import ui_controller

    from merger.ui.endpoint import evaluate_endpoint

    ctl = ui_controller(tmp_path)
    endpoint = evaluate_endpoint(ctl)
    tasks = ctl.pool.tasks
    out = endpoint("task_arithmetic", lam=0.5, task_weights={tasks[0]: 2.0}, block_weights="block0=0.5")
    spec = ctl.session.spec("task_arithmetic", lam=0.5, task_weights={tasks[0]: 2.0}, block_weights={"block0": 0.5})
    want = merger.evaluate(ctl.pool, merger.api.merge_spec(ctl.pool, spec), "live")
    assert out["accuracy"] == pytest.approx(want.accuracy) and out["loss"] == pytest.approx(want.loss)
    assert out["spec"]["task_weights"] == {tasks[0]: 2.0} and out["spec"]["block_weights"] == {"block0": 0.5}
    row = ctl.history.rows()[0]
    assert '"task_weights": {"' + tasks[0] + '": 2.0}' in row["params"]
    import gradio as gr

    with pytest.raises(gr.Error, match="block_weights.block7: not a block group"):
        endpoint("task_arithmetic", lam=0.5, block_weights={"block7": 0.0})


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    pool = merger.open_pool(write_pool(tmp_path_factory.mktemp("coef-data"), n_experts=3, scale=0.2, demo_data=True))
    return merger.PoolSession(pool)


@pytest.mark.parametrize("method,params", [("adamerging_task", {"steps": 3, "samples": 8, "lr": 0.05}),
                                           ("fw_hard", {"steps": 3, "samples": 8})])
def test_start_from_learned_reproduces_the_run(session, method, params):
    from merger.analysis.coefficients import learned

    spec = session.spec(method, **params)
    run = session.run(spec)
    got = learned(run, session.pool)
    assert got.block_weights == {} and got.fit_error == 0.0
    assert list(got.task_weights.values()) == pytest.approx(run.coefficients[:, 0].tolist(), abs=1e-4)
    mine = session.evaluate_exact(got.spec(session, spec.experts), "test")
    theirs = session.evaluate_exact(spec, "test")
    assert mine.accuracy == pytest.approx(theirs.accuracy, abs=1e-9)
    assert mine.loss == pytest.approx(theirs.loss, rel=1e-3)


def test_layer_wise_runs_load_as_a_rank_one_block_by_task_reading(session):
    from merger.analysis.coefficients import learned
    from merger.methods.adaptive import Combination

    tv = session.pool.task_vectors
    keys = list(tv.keys)
    w, b = torch.tensor([0.5, 1.0, 1.5]), {g: 0.5 + 0.25 * i for i, g in enumerate(session.pool.blocks)}
    coef = torch.stack([w * b[block_of(k)] for k in keys], 1)  # [T, tensors]: rank one per block
    run = type("R", (), {"combination": Combination(tv.base, tv.stacked, [[k] for k in keys]),
                         "coefficients": coef, "tasks": tv.tasks, "groups": [k[len("visual."):] for k in keys]})()
    got = learned(run, session.pool)
    assert got.fit_error < 1e-6 and got.blocks == session.pool.blocks
    scale = sum(b.values()) / len(b)
    assert list(got.task_weights.values()) == pytest.approx((w * scale).tolist(), abs=1e-4)
    assert list(got.block_weights.values()) == pytest.approx([v / scale for v in b.values()], abs=1e-4)
    delta = {k: d for k, d in merger.api.merge_spec(session.pool, got.spec(session, tv.tasks)).items() if k in keys}
    for i, k in enumerate(keys):
        want = tv.base[k] + torch.tensordot(coef[:, i], tv.stacked[k], dims=1)
        torch.testing.assert_close(delta[k].float(), want, rtol=1e-3, atol=1e-4)


def test_two_task_map_turn_one_up_and_pareto(session):
    from merger.analysis import coefficients as co

    a, b = session.pool.tasks[:2]
    spec = session.spec("task_arithmetic", lam=0.5)
    values = (0.0, 1.0, 2.0)
    session.preview(spec)  # the experts' references: once per split, before
    before = session.evaluator.forwards
    out = co.two_task_map(session, spec, a, b, values=values)
    assert session.evaluator.forwards - before == 8  # 9 points, one of them (1, 1) the spec itself
    corner = session.preview(session.spec("task_arithmetic", lam=0.5, task_weights={a: 2.0, b: 0.0}))
    assert out["accuracy_a"][0][2] == corner.accuracy[a] and out["accuracy_b"][0][2] == corner.accuracy[b]
    up = co.turn_one_up(session, spec, b, values=values)
    assert up["accuracy"][a][1] == session.preview(spec).accuracy[a]
    points = co.evaluated_points(session, a, b)
    assert len(points) >= 9
    front = co.pareto_front(points)
    for i in front:
        assert not any(q["a"] > points[i]["a"] and q["b"] > points[i]["b"] for q in points)
    with pytest.raises(MergerError, match="pick two different tasks"):
        co.two_task_map(session, spec, a, a)


def test_weight_search_is_deterministic_for_a_seed(session):
    from merger.evaluation.tuning import tune_weights

    runs = [tune_weights(session, "task_arithmetic", {"lam": 0.5}, budget=6, seed=s) for s in (3, 3, 4)]
    assert runs[0]["history"] == runs[1]["history"] and runs[0]["task_weights"] == runs[1]["task_weights"]
    assert runs[0]["task_weights"] != runs[2]["task_weights"]
    assert runs[0]["val_accuracy"] == max(runs[0]["history"]) and runs[0]["trials"] == 6
    assert runs[0]["at_edge"] == [e for e, w in runs[0]["task_weights"].items() if w in (0.0, 2.0)]
    with pytest.raises(MergerError, match=r"budget \(evaluations\): 2.5 is not a whole number"):
        tune_weights(session, "task_arithmetic", budget=2.5)  # it ran 2 trials, unseen
    with_lam = tune_weights(session, "task_arithmetic", {"lam": 0.5}, budget=6, seed=3, with_lam=True)
    lam, grid = with_lam["spec"].kwargs["lam"], merger.methods.get("task_arithmetic").tune_grid["lam"]
    assert ("lam" in with_lam["at_edge"]) == (lam in (min(grid), max(grid)))
    best = session.preview(runs[0]["spec"], "test")
    assert runs[0]["test_accuracy"] == best.average_accuracy
