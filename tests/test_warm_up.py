"""TSV-M's rank moves on a large pool: what a move at each rank needs but its last product is computed
ahead while the session is idle (warm_up.py); a move then computes no part, and its merge is the same
bit for bit as a cold one."""
import threading
import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from helpers import ui_controller

from merger import methods
from merger.evaluation.merges import Merges
from merger.evaluation.warm_up import PartStore, WarmUp
from merger.evaluation.work_queue import WorkQueue

TSV = methods.get("tsv_m")


@pytest.fixture()
def session(tmp_path):
    s = ui_controller(tmp_path).session
    s.PREPARE_INLINE_ENTRIES = 0  # this small pool stands for a ViT-B/32 one
    return s


def _settings(session):
    return session.merges.warm_settings(TSV, len(session.pool.tasks))


def test_the_settings_warmed_are_the_rank_sliders_steps_under_its_cap():
    assert [s["rank_ratio"] for s in Merges.warm_settings(TSV, 8)] == [round(0.01 * i, 2) for i in range(1, 13)]
    assert Merges.warm_settings(TSV, 3)[-1] == {"rank_ratio": 0.33} and len(Merges.warm_settings(TSV, 3)) == 33


def _count_halves(monkeypatch) -> list:
    """Every matrix's eighs and core (lowrank._tsv_half) computed from now on."""
    from merger.methods import lowrank

    calls, real = [], lowrank._tsv_half
    monkeypatch.setattr(lowrank, "_tsv_half", lambda *a: calls.append(a[1:]) or real(*a))
    return calls


def test_after_the_warm_up_a_rank_move_computes_no_part_and_equals_the_cold_merge(session, monkeypatch):
    spec = session.spec("tsv_m", rank_ratio=0.2, lam=1.0)
    session.prepare(spec)
    assert session.merges.warm_up.wait(timeout=120)
    merges = session.merges
    pkey, state = merges.prepared_for(spec)
    distinct = {(key, _k(state, key, s["rank_ratio"])) for s in _settings(session) for key in state["factors"]}
    assert merges.parts.count(pkey) == len({d for d in distinct if d[1] > 0})  # every k of every matrix, once
    assert session.counts["settings warmed"] == len(_settings(session))
    before = session.counts["parts computed"], session.counts["derives"]
    halves = _count_halves(monkeypatch)
    warm = merges.delta(spec)
    assert halves == [] and session.counts["derives"] == before[1] + 1  # no eigh: the last products only
    assert session.counts["parts computed"] == before[0]
    cold = TSV.delta(state, **spec.kwargs)  # no session, no parts
    assert all(torch.equal(warm[k], cold[k]) for k in cold)


def _k(state, key, ratio):
    from merger.methods.lowrank import tsv_rank

    left, right, _ = state["factors"][key]
    return tsv_rank(ratio, left.shape[1], right.shape[2], left.shape[0])


def test_a_cold_move_puts_its_parts_for_the_next_move_at_that_rank(session, monkeypatch):
    session.merges.warm_ahead = False
    spec = session.spec("tsv_m", rank_ratio=0.2, lam=1.0)
    session.prepare(spec)
    halves = _count_halves(monkeypatch)
    session.merges.delta(spec)
    matrices = len(session.merges.prepared_for(spec)[1]["factors"])
    assert len(halves) == matrices and session.counts["parts computed"] == matrices
    session.merges.forget_derived()
    session.merges.delta(spec)
    assert len(halves) == matrices and session.counts["settings warmed"] == 0


def test_the_warm_up_computes_nothing_while_the_model_is_busy(session):
    spec = session.spec("tsv_m", lam=1.0)
    with session.queue:  # a preview or batch chunk holds the model
        session.prepare(spec)
        pkey = session.merges.prepared_for(spec)[0]
        assert session.merges.warm_up.under_way
        time.sleep(0.5)
        assert session.merges.parts.count(pkey) == 0
    assert session.merges.warm_up.wait(timeout=120) and session.merges.parts.count(pkey) > 0


def test_a_preparation_leaving_the_cache_takes_its_parts_and_warm_up_with_it(session):
    tasks = session.pool.tasks
    first = session.spec("tsv_m", lam=1.0)
    session.prepare(first)
    assert session.merges.warm_up.wait(timeout=120)
    pkey = session.merges.prepared_for(first)[0]
    assert session.merges.parts.count(pkey) > 0
    for experts in ([tasks[0], tasks[1]], [tasks[0], tasks[2]], [tasks[1], tasks[2]]):  # the LRU holds three
        session.prepare(session.spec("tsv_m", experts=experts, lam=1.0))
    assert session.merges.parts.count(pkey) == 0
    assert session.merges.warm_up.wait(timeout=120)


def test_a_preparation_for_the_api_starts_no_warm_up(session):
    session.merges.prepared_for(session.spec("tsv_m", lam=1.0))  # merger.merge, the CLI, exports
    assert not session.merges.warm_up.under_way and session.counts["settings warmed"] == 0


# ---- WarmUp and PartStore on their own --------------------------------------------------------

def _recording_method(calls, part=torch.zeros(10)):
    def warm(state, parts, gate, rank_ratio):
        if gate():
            calls.append(rank_ratio)
            parts.put(rank_ratio, part)
    return SimpleNamespace(warm=warm)


def test_the_settings_nearest_the_last_move_are_warmed_first():
    calls, counts = [], Counter()
    warm_up = WarmUp(WorkQueue(), PartStore(1 << 20), counts)
    warm_up.moved("p", {"rank_ratio": 0.05})
    warm_up.start(_recording_method(calls), "p", None, [{"rank_ratio": round(0.01 * i, 2)} for i in range(1, 10)])
    assert warm_up.wait(timeout=30)
    assert calls[0] == 0.05 and set(calls[1:3]) == {0.04, 0.06} and sorted(calls) == [round(0.01 * i, 2) for i in range(1, 10)]
    assert counts["settings warmed"] == 9 and counts["parts warmed"] == 9


def test_the_warm_up_stops_when_its_parts_fill_the_store():
    calls, counts = [], Counter()
    store = PartStore(cap=400)  # each part 40 bytes: stops once 300 are held
    warm_up = WarmUp(WorkQueue(), store, counts)
    warm_up.start(_recording_method(calls), "p", None, [{"rank_ratio": i / 100} for i in range(1, 30)])
    assert warm_up.wait(timeout=30)
    assert len(calls) == 8 and store.bytes == 320 and counts["warm-ups full"] == 1


def test_a_stopped_warm_up_computes_nothing_more():
    queue, calls = WorkQueue(), []
    warm_up = WarmUp(queue, PartStore(1 << 20), Counter())
    with queue:  # busy: the warm-up waits at its gate
        warm_up.start(_recording_method(calls), "p", None, [{"rank_ratio": 0.1}, {"rank_ratio": 0.2}])
        stopper = threading.Thread(target=warm_up.stop)
        stopper.start()
        stopper.join(timeout=10)
    assert not stopper.is_alive() and not warm_up.under_way and calls == []


def test_a_warm_up_replaced_ends_before_the_next_begins_and_none_is_left_behind():
    calls, release = [], threading.Event()

    def warm(state, parts, gate, rank_ratio):
        release.wait(timeout=30)
        if gate():
            calls.append((state, rank_ratio))
            parts.put(rank_ratio, torch.zeros(1))

    store = PartStore(1 << 20)
    warm_up = WarmUp(WorkQueue(), store, Counter())
    method = SimpleNamespace(warm=warm, name="fake")
    warm_up.start(method, "a", "a", [{"rank_ratio": 0.1}, {"rank_ratio": 0.2}])
    warm_up.start(method, "b", "b", [{"rank_ratio": 0.1}])  # replaces a's: a stops after its share
    store.drop("a")
    release.set()
    assert warm_up.wait(timeout=30)
    assert calls == [("b", 0.1)] and store.count("a") == 0 and store.count("b") == 1
    assert not [t for t in threading.enumerate() if t.name == "merger-warm-up"]


def test_the_part_store_drops_the_least_recently_used_above_its_cap():
    store = PartStore(cap=100)
    for i in range(3):
        store.put(("p", i), torch.zeros(10))  # 40 bytes each
    assert store.get(("p", 0)) is None and store.get(("p", 2)) is not None and store.bytes == 80
    store.drop("p")
    assert store.bytes == 0 and store.count("p") == 0
    store.put(("p", 5), torch.zeros(10))  # a share that ended after the drop
    assert store.count("p") == 0
    store.allow("p")  # the preparation back in the session's cache
    store.put(("p", 5), torch.zeros(10))
    assert store.count("p") == 1


def test_another_preparations_parts_do_not_stop_a_warm_up():
    calls, counts = [], Counter()
    store = PartStore(cap=400)
    for i in range(8):
        store.put(("other", i), torch.zeros(10))  # 320 bytes: past 3/4 of the cap, all another preparation's
    warm_up = WarmUp(WorkQueue(), store, counts)
    warm_up.start(_recording_method(calls), "p", None, [{"rank_ratio": i / 100} for i in range(1, 4)])
    assert warm_up.wait(timeout=30)
    assert len(calls) == 3 and counts["warm-ups full"] == 0 and store.count("p") == 3
