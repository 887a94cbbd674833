"""The linear estimate: f(θ0 + Σ wₜτₜ) ≈ f(θ0) + Σ wₜ (f(θt) − f(θ0)) per image,
from T + 1 forwards kept in memory and on disk; shown first on a slow pool, never stored as a result."""
from types import SimpleNamespace

import pytest
import torch
from helpers import controls, ui_controller, with_weights

from merger.errors import MergerError
from merger.evaluation.session import PoolSession
from merger.io import disk_cache
from merger.pool.pool import open_pool
from devtools.testing import write_pool


@pytest.fixture(scope="module")
def ctl(tmp_path_factory):
    return ui_controller(tmp_path_factory.mktemp("linear"))


def make_tower_linear(session):
    """Replace the image tower by x ↦ x[:, :d] @ proj, linear in one merged weight (visual.proj)."""
    ev = session.evaluator
    proj = ev.model.visual.proj
    ev.encode = lambda x: x.flatten(1)[:, : proj.shape[0]] @ proj


def test_exact_for_a_model_linear_in_its_weights(tmp_path):
    session = ui_controller(tmp_path).session
    make_tower_linear(session)
    for spec in (session.spec("task_arithmetic", lam=0.7),
                 session.spec("task_arithmetic", lam=1.3, task_weights={session.tasks[0]: -0.5,
                                                                          session.tasks[2]: 2.0}),
                 session.spec("weight_averaging")):
        est, exact = session.linear.estimate(spec), session.evaluate_exact(spec)
        assert est.estimate and not exact.estimate
        for t in exact.accuracy:
            assert torch.equal(est.per_image[t][0], exact.per_image[t][0])  # the same prediction per image
            assert torch.allclose(est.per_image[t][1], exact.per_image[t][1], atol=1e-4, rtol=1e-4)


def test_equal_to_the_exact_answer_as_lambda_goes_to_zero(ctl):
    session = ctl.session
    gaps = []
    for lam in (0.3, 0.03, 0.003, 0.0003):
        spec = session.spec("task_arithmetic", lam=lam)
        est, exact = session.linear.estimate(spec), session.evaluate_exact(spec)
        gaps.append(max((est.per_image[t][1] - exact.per_image[t][1]).abs().max().item() for t in exact.loss))
    assert gaps[0] > 0.01  # the tower is not linear: at λ = 0.3 the estimate is off
    assert all(b < a / 5 for a, b in zip(gaps, gaps[1:])), gaps  # and the error vanishes with λ
    zero = session.spec("task_arithmetic", lam=0.0)
    assert session.linear.estimate(zero).accuracy == session.base().accuracy


def test_one_expert_at_full_weight_is_that_expert(ctl):
    session = ctl.session
    task = session.tasks[1]
    est = session.linear.estimate(session.spec("task_arithmetic", experts=[task], lam=1.0))
    assert est.accuracy[task] == session.expert_task_accuracy(task, "live")


def test_no_forward_of_its_own_and_t_plus_one_forwards_in_all(tmp_path):
    session = ui_controller(tmp_path).session
    before = session.evaluator.forwards
    assert session.linear.prepare() == len(session.tasks) + 1  # the base and each expert, once
    assert session.evaluator.forwards == before + len(session.tasks) + 1
    assert session.linear.prepare() == 0
    for lam in (0.1, 0.2, 0.45):
        session.linear.estimate(session.spec("task_arithmetic", lam=lam))
    session.expert_accuracy("live")  # the experts' references come from their kept features too
    assert session.evaluator.forwards == before + len(session.tasks) + 1
    assert session.results() == []  # an estimate is never cached as a result


def test_only_weighted_sums_are_estimated(ctl):
    session = ctl.session
    assert session.linear.applies(session.spec("task_arithmetic", lam=0.3))
    assert not session.linear.applies(session.spec("ties"))
    assert not session.linear.applies(session.spec("task_arithmetic", block_weights={session.pool.blocks[0]: 0.5}))
    assert not session.linear.applies(session.spec("adamerging_task"))  # not run yet
    with pytest.raises(MergerError, match="weighted sum of task vectors"):
        session.linear.estimate(session.spec("cart"))


def test_a_slow_pool_shows_the_estimate_then_the_exact_answer_with_the_error_computed(tmp_path):
    from merger.ui.merge_events import MergeTabEvents

    c = ui_controller(tmp_path)
    session = c.session
    session.measure_live(budget_s=0.0)  # as if a full live forward were slow
    session.linear.prepare()
    frames = list(MergeTabEvents(c, "task_arithmetic").move(SimpleNamespace(session_hash="p"), None,
                                                            *controls(c, lam=0.45)))
    assert len(frames) == 3
    assert "linear estimate" in frames[0][3] and "exact answer follows" in frames[0][3]
    # the plots say it too (a slow pool shows them for seconds), then the exact ones nothing
    assert [f.layout.title.text for f in frames[0][:3]] == [
        f"{what} (≈ linear estimate; the exact answer follows)"
        for what in ("Accuracy per task", "Cross-entropy per task", "Normalised accuracy (merged ÷ expert)")]
    assert frames[-1][0].layout.title.text == "Accuracy per task"
    spec = session.spec("task_arithmetic", lam=0.45)
    est, exact = session.linear.shown(spec), session.cached(spec)
    assert est is not None and exact is not None and not exact.estimate
    err = 100 * (est.average_accuracy - exact.average_accuracy)
    assert f"{100 * est.average_accuracy:.1f}</span> % ({err:+.1f} points" in frames[1][3]
    rows = c.history.rows(pool=c.pool_ref)
    assert len(rows) == 1 and rows[0]["average_accuracy"] == exact.average_accuracy  # the exact answer only
    # moving back to it: the cached answer, with no estimate shown, so none is compared
    again = list(MergeTabEvents(c, "task_arithmetic").move(SimpleNamespace(session_hash="p"), None,
                                                           *controls(c, lam=0.45)))
    assert "cached" in again[0][3] and "est-acc" not in again[0][3]
    # a per-task weight move is estimated too; a TIES move falls back to the partial answer
    frames = list(MergeTabEvents(c, "task_arithmetic").move(
        SimpleNamespace(session_hash="p"), None, *with_weights(c, controls(c, lam=0.45), {session.tasks[0]: 0.5})))
    assert "linear estimate" in frames[0][3]
    frames = list(MergeTabEvents(c, "task_arithmetic").move(SimpleNamespace(session_hash="p"), None,
                                                            *controls(c, "ties", lam=0.45)))
    assert "partial" in frames[0][3] and "linear estimate" not in frames[0][3]
    assert frames[0][0].layout.title.text == "Accuracy per task (partial: the first images of each task)"


def test_the_forwards_are_kept_on_disk_and_a_second_open_makes_none(tmp_path, monkeypatch):
    monkeypatch.setenv("MERGER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(disk_cache, "WORTH_ENTRIES", 0)
    path = write_pool(tmp_path / "pool", n_experts=3, scale=0.2, demo_data=True)
    first = PoolSession(open_pool(path))
    seconds = first.measure_live()
    first.linear.prepare()
    spec = first.spec("task_arithmetic", lam=0.4)
    est = first.linear.estimate(spec)
    cache = disk_cache.DiskCache()
    assert sum("image features" in cache.describe(e["path"]) for e in cache.entries()) == 4

    second = PoolSession(open_pool(path))
    assert second.measure_live() == seconds  # the timing came back with the base's features
    again = second.linear.estimate(second.spec("task_arithmetic", lam=0.4))
    assert second.base().accuracy == first.base().accuracy
    assert again.accuracy == est.accuracy and again.loss == est.loss
    assert second.evaluator.forwards == 0  # no forward at all: base, estimate and references from disk

    # other images (here the first image of the split changed) must not find the old features
    third = PoolSession(open_pool(path))
    third.evaluator.inputs("live")[0][0][0].add_(1.0)
    assert third.linear.missing(third.tasks) == ["", *third.tasks]
    # nor another architecture over the same files
    fourth = PoolSession(open_pool(path))
    assert fourth.linear.missing(fourth.tasks) == []
    fourth.pool.architecture = {**fourth.pool.architecture, "note": "another model"}
    fourth.linear.forget_features()
    assert fourth.linear.missing(fourth.tasks) == ["", *fourth.tasks]
    # nor forwards in another precision (--forward bf16)
    fifth = PoolSession(open_pool(path))
    fifth.evaluator.autocast = fifth.evaluator.EVERYWHERE
    assert fifth.linear.missing(fifth.tasks) == ["", *fifth.tasks]
