"""Slow preparations (registry ``slow_prepare``): progress, cancel, and on a large pool the Merge
tab prepares through Run instead of stalling a move; a preparation never holds previews back."""
import threading
from types import SimpleNamespace

import pytest
import torch
from helpers import controls, ui_controller

import merger
from merger import methods
from merger.errors import Cancelled
from merger.methods.registry import Method, Paper, register

SLOW = [m.name for m in methods.all_methods() if m.slow_prepare]


@pytest.fixture()
def ctl(tmp_path):
    return ui_controller(tmp_path)


def test_the_methods_that_sort_or_decompose_every_entry_declare_a_slow_prepare():
    assert set(SLOW) == {"ties", "cart", "tsv_m", "iso_c", "iso_cts", "wudi", "magmax", "breadcrumbs"}


def test_a_slow_prepare_without_progress_and_cancel_is_refused_at_registration():
    bare = Method(name="bare_slow", display_name="Bare", paper=Paper("x", "0"), description="d", params=(),
                  prepare=lambda tv: None, apply=lambda s: {}, tune_grid={}, slow_prepare=True,
                  weights=lambda p, T, s: ([1.0] * T, "one"))
    with pytest.raises(ValueError, match="progress=None, cancel=None"):
        register(bare)
    assert "bare_slow" not in methods.names()


@pytest.mark.parametrize("name", SLOW)
def test_progress_reaches_the_end_and_the_state_equals_a_plain_prepare(name, ctl):
    m = methods.get(name)
    tv = ctl.pool.task_vectors
    seen = []
    spec = ctl.session.spec(name)
    kw = spec.kwargs
    args = {k: kw[k] for k in m.prepare_params}
    with_progress = m.prepare_with(tv, progress=lambda f, msg: seen.append(f), **args)
    assert seen == sorted(seen) and seen[-1] == pytest.approx(1.0) and len(seen) > 1
    a, b = m.delta(with_progress, **kw), m.delta(m.prepare(tv, **args), **kw)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", SLOW)
def test_a_cancelled_preparation_caches_nothing(name, ctl):
    spec = ctl.session.spec(name)
    before = ctl.session.counts["prepares"]
    steps = []
    with pytest.raises(Cancelled, match="nothing was cached"):
        ctl.session.prepare(spec, progress=lambda f, msg: steps.append(f), cancel=lambda: len(steps) >= 2)
    assert len(steps) == 2 and not ctl.session.is_prepared(spec)
    assert ctl.session.counts["prepares"] == before
    ctl.session.prepare(spec)
    assert ctl.session.is_prepared(spec) and ctl.session.counts["prepares"] == before + 1


def test_on_a_large_pool_a_move_asks_for_run_and_run_prepares_with_progress(ctl):
    from merger.ui.merge_events import MergeTabEvents
    from merger.ui.runs import RunController

    ctl.session.PREPARE_INLINE_ENTRIES = 0  # this small pool stands for a ViT-B/32 one
    inputs = controls(ctl, "tsv_m", rank_ratio="auto", lam=1.0)
    events = MergeTabEvents(ctl, "task_arithmetic")
    frames = list(events.move(SimpleNamespace(session_hash="p"), None, *inputs))
    assert "press **Run** to prepare" in frames[-1][3]
    assert ctl.session.counts["prepares"] == 0 and ctl.session.evaluator.forwards == 0  # the move did no work

    status = [f[0] for f in RunController(ctl).run(None, *inputs)]
    assert status[-1].startswith("✓ TSV-Merge: prepared in") and ctl.session.counts["prepares"] == 1
    frames = list(events.move(SimpleNamespace(session_hash="p"), None, *controls(ctl, "tsv_m", rank_ratio="auto",
                                                                                  lam=1.1)))
    assert "Average accuracy" in frames[0][3] and ctl.session.counts["prepares"] == 1
    # methods that prepare quickly never ask
    frames = list(events.move(SimpleNamespace(session_hash="p"), None, *controls(ctl, "task_arithmetic", lam=0.4)))
    assert "Average accuracy" in frames[0][3]


def test_a_preparation_does_not_hold_previews_back(ctl):
    """A preview on another method completes while a preparation is half-way (events, no sleeps)."""
    spec = ctl.session.spec("cart")
    halfway, previewed, done = threading.Event(), threading.Event(), {}

    def progress(frac, msg):
        if not halfway.is_set():
            halfway.set()
            done["waited"] = previewed.wait(timeout=60)

    worker = threading.Thread(target=lambda: ctl.session.prepare(spec, progress=progress))
    worker.start()
    assert halfway.wait(timeout=60)
    result = ctl.session.preview(ctl.session.spec("task_arithmetic", lam=0.35))
    previewed.set()
    worker.join(timeout=120)
    assert done["waited"] and ctl.session.is_prepared(spec)
    ref = merger.evaluate(ctl.pool, merger.merge(ctl.pool, "task_arithmetic", lam=0.35), "live")
    assert result.accuracy == ref.accuracy


def test_a_preparation_under_way_is_named_and_a_second_caller_follows_it(ctl, monkeypatch):
    """A page loaded while a slow preparation goes names it; a second Run of it follows (one prepare)."""
    experts = ctl.pool.tasks[:2]
    spec = ctl.session.spec("tsv_m", experts=experts)
    started, release = threading.Event(), threading.Event()
    compute = ctl.session.merges.compute

    def held(*args):  # held before its first step (a progress callback would hold the job's lock)
        started.set()
        release.wait(30)
        return compute(*args)

    monkeypatch.setattr(ctl.session.merges, "compute", held)
    first_cancels = threading.Event()
    first = threading.Thread(target=ctl.session.prepare, args=(spec, None, first_cancels.is_set))
    first.start()
    assert started.wait(10)
    assert ctl.session.under_way() == {f"preparing TSV-Merge on {', '.join(experts)}": spec}  # a page can set its controls to it
    first_cancels.set()  # with nobody else following it, the first caller's Cancel stops it
    assert not ctl.session.goes_on_after_cancel(spec, first_cancels.is_set)
    second = threading.Thread(target=ctl.session.prepare, args=(spec,))
    second.start()
    for _ in range(1000):  # the second caller has joined the first one's work
        if ctl.session.followers(spec) == 2:
            break
        threading.Event().wait(0.01)
    assert ctl.session.followers(spec) == 2
    assert ctl.session.goes_on_after_cancel(spec, first_cancels.is_set)  # it goes on for the second: the first page says so
    release.set()
    first.join(30), second.join(30)
    assert ctl.session.is_prepared(spec) and ctl.session.counts["prepares"] == 1 and ctl.session.under_way() == {}
