"""Live as a person feels it: one move = at most one merge and one forward, previews
before batch work, superseded moves dropped, progressive answers on slow pools, one owner of state.
Everything here is counted or ordered by events, never timed."""
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from helpers import controls, ui_controller

import merger
from merger.evaluation.work_queue import Superseded, WorkQueue


@pytest.fixture(scope="module")
def ctl(tmp_path_factory):
    return ui_controller(tmp_path_factory.mktemp("live"))


@pytest.fixture(scope="module")
def land_state(ctl):
    from merger.ui.landscape_tab import LandscapeController

    lc = LandscapeController(ctl)
    *_, (state, _) = lc.compute(None, [], "pca", None, None, "", "loss", "all tasks (mean)", 7, "surface", [],
                                *controls(ctl, lam=0.3), progress=lambda *a, **k: None)
    return lc, state


def events_for(ctl, lc):
    from merger.ui.merge_events import MergeTabEvents

    return MergeTabEvents(ctl, "task_arithmetic", lc)


def person(name="person"):
    return SimpleNamespace(session_hash=name)


def work(ctl):
    return ctl.session.evaluator.forwards, ctl.session.counts["applies"]


@pytest.mark.parametrize("view", ["contour", "surface"])
def test_a_move_costs_one_forward_and_one_apply_and_a_hit_none(ctl, land_state, view):
    lc, state = land_state
    state = {**state, "view": view}
    events = events_for(ctl, lc)
    list(events.move(person(), state, *controls(ctl, lam=0.05)))  # base, experts: once per split, before
    shift = 0.0 if view == "contour" else 0.3  # values no earlier move computed
    for lam, method in ((0.65 + shift, "task_arithmetic"), (0.7 + shift, "ties"), (0.75 + shift, "tsv_m")):
        before = work(ctl)
        *preparing, numbers, views = list(events.move(person(), state, *controls(ctl, method, lam=lam)))
        assert all("preparing and merging" in frame[3] for frame in preparing)  # a method switch: said first
        after = work(ctl)
        assert (after[0] - before[0], after[1] - before[1]) == (1, 1), method
        assert f"lam={lam:g}" in numbers[3]  # the numbers first, then the figures and the marker
        assert len(views) == 8 and "live merge" in [t.name for t in views[7].data]
        before = work(ctl)
        list(events.move(person(), state, *controls(ctl, method, lam=lam)))  # the same values again
        assert work(ctl) == before


def test_the_3d_marker_is_measured_without_a_second_forward(ctl, land_state):
    """The probe images are a subset of the live ones: the marker's height comes from the move's
    own forward, and equals a forward of the point on the probe split."""
    lc, _ = land_state
    session = ctl.session
    spec = session.spec("task_arithmetic", lam=0.45).snap()
    session.preview(spec)
    acc, loss = session.probe_from_live(spec)
    ref_acc, ref_loss = session.values_at_point(lc.land.spec_point(spec), "probe")
    assert acc == pytest.approx(ref_acc, abs=1e-9) and loss == pytest.approx(ref_loss, rel=1e-4)


def test_a_preview_goes_before_a_running_batch_job(ctl):
    """A preview submitted during a sweep completes before the sweep's next grid point."""
    from merger.evaluation.tuning import sweep

    session = ctl.session
    done, seen = threading.Event(), []
    lams = [round(1.0 + 0.05 * i, 2) for i in range(6)]

    def progress(frac, msg):
        seen.append(done.is_set())
        if len(seen) == 1:
            threading.Thread(target=lambda: (session.preview(session.spec("ties", lam=1.7)), done.set())).start()
            deadline = time.monotonic() + 30
            while session.queue.previews_waiting() == 0 and not done.is_set() and time.monotonic() < deadline:
                time.sleep(0.001)  # until the preview is in line (an ordering check, not a timing one)

    sweep(session, ["task_arithmetic"], "lam", lams, split="val", progress=progress)
    assert seen[0] is False and all(seen[1:]), seen
    assert session.queue.counts["previews"] > 0 and session.queue.counts["chunks"] >= len(lams)


def test_a_batch_job_with_previews_between_equals_the_job_alone(tmp_path):
    from merger.evaluation.tuning import sweep

    alone = ui_controller(tmp_path / "a").session
    shared = ui_controller(tmp_path / "b").session
    lams = [round(0.1 * i, 2) for i in range(1, 8)]
    ref = sweep(alone, ["ties"], "lam", lams, split="val")

    def progress(frac, msg):  # someone drags between the chunks
        shared.preview(shared.spec("cart", lam=1 + frac))

    assert sweep(shared, ["ties"], "lam", lams, split="val", progress=progress) == ref


def test_after_a_batch_job_raised_the_next_preview_is_intact(ctl):
    """A surface that fails mid-grid leaves a plane point's weights in the model; the next preview
    writes all of its own."""
    from merger.landscape.surface import pca_plane

    land = ctl.session.landscape
    plane = pca_plane(land.named_points(["base", "experts"]))

    def boom(frac, msg):
        raise RuntimeError("the job failed")

    with pytest.raises(RuntimeError):
        land.surface(plane, (-3, 3, -3, 3), 5, split="live", progress=boom)
    spec = ctl.session.spec("ties", lam=0.85, sparsity=0.7)
    res = ctl.session.preview(spec)
    ref = merger.evaluate(ctl.pool, merger.merge(ctl.pool, "ties", lam=0.85, sparsity=0.7))
    assert res.accuracy == ref.accuracy and res.loss == pytest.approx(ref.loss, rel=1e-5)


def test_a_superseded_move_is_dropped_before_it_starts(ctl, land_state):
    lc, state = land_state
    events = events_for(ctl, lc)
    queue = ctl.session.queue
    out, started = [], threading.Event()
    with queue.batch(), queue:  # a batch chunk holds the model
        t = threading.Thread(target=lambda: (started.set(), out.extend(events.move(person("p"), state,
                                                                                      *controls(ctl, lam=1.15)))))
        before = work(ctl)
        t.start()
        started.wait()
        deadline = time.monotonic() + 30
        while queue.previews_waiting() == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        queue.ticket("p")  # the same person moved again
    t.join()
    assert work(ctl) == before and queue.counts["dropped"] >= 1
    assert len(out) == 1 and all(o == {"__type__": "update"} for o in out[0])  # every output left as it is
    assert ctl.session.cached(ctl.session.spec("task_arithmetic", lam=1.15)) is None


@pytest.mark.parametrize("overtaken_in", ["evaluate", "summary"])
def test_a_move_overtaken_while_it_computes_leaves_the_screen_to_the_newer_one(ctl, land_state, monkeypatch,
                                                                              overtaken_in):
    """A method switch sends a move with the old values, then one with the new method's defaults: where
    the first is in its evaluation (or sends its numbers) as the second arrives, nothing more of it is
    shown, so that the screen ends on the controls' merge, which the second shows."""
    lc, state = land_state
    events = events_for(ctl, lc)
    list(events.move(person("q"), state, *controls(ctl, lam=1.95)))  # the split's images and experts, once
    owner = ctl.session.evaluator if overtaken_in == "evaluate" else ctl
    step = getattr(owner, overtaken_in)

    def overtaken(*args, **kwargs):
        ctl.session.queue.ticket("q")  # the same page's next move arrives meanwhile
        return step(*args, **kwargs)

    monkeypatch.setattr(owner, overtaken_in, overtaken)
    frames = list(events.move(person("q"), state, *controls(ctl, lam=1.9)))
    skipped = [all(o == {"__type__": "update"} for o in frame) for frame in frames]
    if overtaken_in == "evaluate":
        assert skipped == [True]  # not its numbers, nor its figures
    else:
        assert skipped == [False] and "lam=1.9" in frames[0][3]  # its numbers went; its figures do not
    monkeypatch.undo()
    *_, numbers, views = list(events.move(person("q"), state, *controls(ctl, lam=0.95)))
    assert "lam=0.95" in numbers[3] and len(views) == 8


def test_progressive_answer_partial_then_complete(tmp_path):
    c = ui_controller(tmp_path)
    session = c.session
    session.measure_live(budget_s=0.0)  # as if a full live forward were slow
    n = session.partial_images
    assert n is not None and n < 96
    from merger.ui.merge_events import MergeTabEvents

    ev = session.evaluator
    batches = []
    encode = ev.encode
    ev.encode = lambda x: batches.append(x.shape[0]) or encode(x)
    try:
        frames = list(MergeTabEvents(c, "task_arithmetic").move(person(), None, *controls(c, lam=0.35)))
    finally:
        del ev.encode
    assert len(frames) == 3  # partial, then the complete numbers, then their figures
    assert "partial" in frames[0][3] and f"{n} images per task" in frames[0][3]
    assert "partial" not in frames[1][3] and "96 images per task" in frames[1][3]
    # every input group's first images in one batch, then only the images after them: none forwarded twice
    groups, tasks = len(ev.inputs("live")), len(c.pool.tasks)
    assert batches == [groups * n, groups * (96 - n)]
    ref = merger.evaluate(c.pool, merger.merge(c.pool, "task_arithmetic", lam=0.35))
    res = session.cached(session.spec("task_arithmetic", lam=0.35))
    assert res.accuracy == ref.accuracy and not res.partial and res.counts == ref.counts
    assert res.loss == pytest.approx(ref.loss, rel=1e-5)
    assert [int(res.per_image[t][0].numel()) for t in res.tasks] == [96] * tasks
    rows = c.history.rows(pool=c.pool_ref)
    assert len(rows) == 1  # the complete result only
    session.measure_live(budget_s=1e9)
    assert session.partial_images is None


def test_the_session_owns_the_caches_and_prepared_state_never_changes(ctl):
    session = ctl.session
    m = merger.methods.get("tsv_m")
    key, prepared = session.prepared(m, tuple(ctl.pool.tasks), {})
    snapshot = {k: id(v) for k, v in prepared.items()}
    for r in (0.1, 0.2, "auto"):
        session.delta(session.spec("tsv_m", rank_ratio=r, lam=1.0))
    assert {k: id(v) for k, v in prepared.items()} == snapshot
    ties = merger.methods.get("ties")
    _, prep = session.prepared(ties, tuple(ctl.pool.tasks), {})
    keys = set(prep)
    session.delta(session.spec("ties", sparsity=0.7314))  # off the slider grid
    assert set(prep) == keys
    assert not any(hasattr(ctl.pool, a) for a in ("_prepared", "_explorer", "_evaluator"))  # the pool holds data
    assert merger.session_for(ctl.pool) is session  # one session per pool, not an attribute of the pool


def test_adding_an_expert_invalidates_nothing(ctl):
    session = ctl.session
    spec = session.spec("task_arithmetic", lam=0.5)
    res = session.preview(spec)
    t = ctl.pool.tasks[0]
    tv = ctl.pool.task_vectors
    weights = {k: v.clone() for k, v in ctl.pool.base.items()}
    for k in tv.keys:
        weights[k] = tv.base[k] + 0.5 * tv.stacked[k][0]
    session.add_expert("half-of-first", t, weights, {"owner": "x"})
    assert session.cached(spec) is res
    mine = session.preview(session.spec("task_arithmetic", lam=1.0, experts=["half-of-first"]))
    ref = session.preview(session.spec("task_arithmetic", lam=0.5, experts=[t]))
    assert mine.accuracy == ref.accuracy


def test_work_queue_orders_previews_first_and_batch_jobs_take_turns():
    q, order, lock = WorkQueue(), [], threading.Lock()

    def job(name, n):
        with q.batch():
            for i in range(n):
                with q:
                    with lock:
                        order.append(name)

    def preview():
        with q:
            order.append("preview")

    with q.batch(), q:  # held while everyone lines up
        threads = [threading.Thread(target=job, args=("a", 3)), threading.Thread(target=job, args=("b", 3))]
        for th in threads:
            th.start()
        deadline = time.monotonic() + 30
        while q.batch_waiting() < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        p = threading.Thread(target=preview)
        p.start()
        while q.previews_waiting() == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
    for th in [*threads, p]:
        th.join()
    assert order[0] == "preview"
    rest = order[1:]
    assert sorted(rest) == ["a"] * 3 + ["b"] * 3
    assert all(x != y for x, y in zip(rest, rest[1:])), rest  # they alternate


def _line_up(q, starts, waiting):
    """Start the threads one by one, each once the previous one is in line."""
    deadline = time.monotonic() + 30
    for i, th in enumerate(starts):
        th.start()
        while waiting() < i + 1 and time.monotonic() < deadline:
            time.sleep(0.001)


def test_previews_cannot_starve_batch_work_and_the_shorter_job_goes_first():
    q, order, lock = WorkQueue(), [], threading.Lock()

    def chunk(name, total):
        with q.batch(chunks=total), q:
            with lock:
                order.append(name)

    def preview(name):
        with q:
            with lock:
                order.append(name)

    with q.batch(), q:
        long_job = threading.Thread(target=chunk, args=("long", 50))
        short_job = threading.Thread(target=chunk, args=("short", 2))
        _line_up(q, [long_job, short_job], q.batch_waiting)
        previews = [threading.Thread(target=preview, args=(f"p{i}",)) for i in range(4)]
        _line_up(q, previews, q.previews_waiting)
    for th in [long_job, short_job, *previews]:
        th.join()
    # a preview, then a batch chunk (the short job's), a preview, the long job's chunk, the rest
    assert order[:4] == ["p0", "short", "p1", "long"] and sorted(order[4:]) == ["p2", "p3"], order


def test_a_shorter_job_between_two_of_its_chunks_keeps_its_turn():
    """Between two chunks a job records its result and updates its progress. A longer job's chunk,
    always waiting, once took the model in each of those gaps: a Sweep beside an Auto-tune took
    4.3× its time alone (`bench workshop`)."""
    q, order, lock = WorkQueue(), [], threading.Lock()

    def job(name, n, gap):
        with q.batch(chunks=n):
            for _ in range(n):
                with q:
                    with lock:
                        order.append(name)
                    time.sleep(0.005)
                time.sleep(gap)  # outside the queue, as a result is recorded

    with q.batch(), q:
        long_job = threading.Thread(target=job, args=("long", 8, 0.0))
        short_job = threading.Thread(target=job, args=("short", 4, 0.01))
        _line_up(q, [long_job, short_job], q.batch_waiting)
    t0 = time.monotonic()
    for th in (long_job, short_job):
        th.join()
    assert order == ["short"] * 4 + ["long"] * 8, order
    assert time.monotonic() - t0 < 5 * WorkQueue.HANDOFF_S + 1  # the end of the short job frees the turn at once


def test_a_handoff_ends_with_its_job_or_after_handoff_s():
    """A job that ended holds no one up; one that does not come back holds a longer job's chunk
    HANDOFF_S at most."""
    q = WorkQueue()
    q.HANDOFF_S = 2.0  # long against a slow machine's thread start

    def longer_chunk_granted() -> float:  # another thread's chunk of a 50-chunk job: when it got the model
        granted = []

        def chunk():
            with q.batch(chunks=50), q:
                granted.append(time.monotonic())

        th = threading.Thread(target=chunk)
        th.start()
        th.join(timeout=30)
        return granted[0]

    with q.batch(chunks=5), q:
        pass  # one chunk of five, and the job is over
    ended = time.monotonic()
    assert longer_chunk_granted() - ended < 1.0
    with q.batch(chunks=5):
        with q:
            pass
        left = time.monotonic()
        assert 1.6 <= longer_chunk_granted() - left < 10  # its next chunk did not come


def test_work_after_a_nested_counted_job_is_not_taken_for_its_last_chunk():
    """A Trade-offs tune runs AdaMerging after its grid (a counted job inside it): that run once lined
    up with the grid's 0 chunks left, ahead of every counted job, and a Sweep waited for all of it."""
    q, order, lock = WorkQueue(), [], threading.Lock()
    grid_done, go = threading.Event(), threading.Event()

    def tune():
        with q.batch():
            with q.batch(chunks=1), q:
                pass  # the grid
            grid_done.set()
            go.wait(30)
            with q:  # a step of the run that follows
                with lock:
                    order.append("run")

    def sweep():
        with q.batch(chunks=3):
            for _ in range(3):
                with q:
                    with lock:
                        order.append("sweep")

    tuner = threading.Thread(target=tune)
    tuner.start()
    assert grid_done.wait(30)
    with q.batch(), q:  # held while both line up
        sweeper = threading.Thread(target=sweep)
        _line_up(q, [sweeper], q.batch_waiting)
        go.set()
        deadline = time.monotonic() + 30
        while q.batch_waiting() < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
    for th in (tuner, sweeper):
        th.join()
    assert order == ["sweep"] * 3 + ["run"], order


def test_a_stream_of_uncounted_jobs_neither_starves_a_sweep_nor_waits_for_its_end():
    """Scripts evaluating val/test through the endpoint are batch jobs that do not say their length,
    one after the other. A sweep (a counted job) goes first, yet they get a turn every
    BATCH_PATIENCE chunks (marked as one-chunk jobs they once held a 40-chunk sweep at 4 chunks while
    they took 146; left last, they would wait for every chunk of a long auto-tune)."""
    q, order, lock = WorkQueue(), [], threading.Lock()

    def hold(name):
        with lock:
            order.append(name)
        time.sleep(0.002)

    def sweep():
        with q.batch(chunks=40):
            for _ in range(40):
                with q:
                    hold("sweep")

    def script():
        for _ in range(15):
            with q.batch(), q:
                hold("script")

    # two sweeps: a counted chunk always waits, so only the patience lets a script in before their end
    threads = [threading.Thread(target=f) for f in (sweep, sweep, script, script)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    sweeps = [i for i, x in enumerate(order) if x == "sweep"]
    assert len(sweeps) == 80 and order.count("script") == 30
    before_end = order[:sweeps[-1]]
    assert before_end.count("script") >= 8  # turns while the sweeps ran (about one in five chunks)
    runs, run = [], 0
    for x in before_end:
        run = run + 1 if x == "script" else 0
        runs.append(run)
    assert max(runs) <= 2, order  # one turn at a time: the sweep goes on after it (two: a thread queued late)


def test_cancel_reaches_every_job_of_a_session_and_a_finished_one_leaves_the_others():
    """One page may run a map and a tune at once: the tune's end once removed the map's flag, and
    Cancel then said 'nothing to cancel' while the map ran on."""
    from merger.ui.scheduling import CancelFlags

    flags = CancelFlags()
    with flags.job("me") as map_flag:
        with flags.job("me") as tune_flag:
            pass
        assert not tune_flag.is_set()
        with flags.job("someone else") as theirs:
            assert flags.cancel("me") and map_flag.is_set() and not theirs.is_set()
    assert not flags.cancel("me") and not flags.cancel("someone else")


def test_yield_point_lets_a_waiting_preview_in():
    q, order = WorkQueue(), []
    with q.batch(), q:
        p = threading.Thread(target=lambda: (q.__enter__(), order.append("preview"), q.__exit__()))
        p.start()
        deadline = time.monotonic() + 30
        while q.previews_waiting() == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        order.append("step 1")
        q.yield_point()
        order.append("step 2")
    p.join()
    assert order == ["step 1", "preview", "step 2"] and q.counts["yields"] == 1


def test_superseded_raises_only_for_older_tickets():
    q = WorkQueue()
    a = q.ticket("s")
    b = q.ticket("s")
    q.drop_if_superseded("s", b)
    q.drop_if_superseded("other", 1)
    with pytest.raises(Superseded):
        q.drop_if_superseded("s", a)


def test_every_forward_runs_on_the_one_model_thread_whoever_calls(ctl, monkeypatch):
    """Gradio answers each move on any of its threads; the forward must still run on one thread
    (a CPU forward that alternates threads pays for another OpenMP team: 62 -> 85 ms on the demo)."""
    from merger.evaluation.evaluator import Evaluator

    seen = []
    encode = Evaluator.encode

    def recording(self, x):
        seen.append(threading.get_ident())
        return encode(self, x)

    monkeypatch.setattr(Evaluator, "encode", recording)
    callers = [threading.Thread(target=ctl.session.preview,
                                args=(ctl.session.spec("task_arithmetic", lam=0.05 * i),)) for i in (27, 29, 31)]
    for t in callers:
        t.start()
        t.join()
    ctl.session.evaluate_exact(ctl.session.spec("task_arithmetic", lam=0.123))  # and from this thread
    assert len(seen) >= 4 and len(set(seen)) == 1
    assert seen[0] not in {t.ident for t in callers} | {threading.get_ident()}


@pytest.mark.parametrize("method", ["ties", "dare_linear", "dare_ties"])
def test_a_lambda_move_of_ties_or_dare_scales_the_merge_it_derived(ctl, method):
    """TIES and DARE derive their merge at λ = 1 once per sparsity and task weighting; a λ move is
    then one scale of it (no pass over every entry), and equals the merge made from scratch."""
    session = ctl.session
    first = session.tasks[0]
    before = session.counts["derives"]
    for lam in (0.55, 0.65, 0.75):
        spec = session.spec(method, lam=lam, sparsity=0.6)
        delta = session.merges.delta(spec)
    assert session.counts["derives"] == before + 1
    ref = merger.merge(ctl.pool, method, lam=0.75, sparsity=0.6)
    base = ctl.pool.task_vectors.base
    assert all(torch.allclose(base[k] + delta[k], ref[k], atol=1e-6) for k in delta)
    session.merges.delta(session.spec(method, lam=0.75, sparsity=0.7))
    session.merges.delta(session.spec(method, lam=0.75, sparsity=0.7, task_weights={first: 0.5}))
    assert session.counts["derives"] == before + 3  # a sparsity move and a weight move derive again


def test_the_derived_states_kept_shrink_with_the_size_of_a_merge(tmp_path):
    """Each derived state is about one fp32 Δ: on a pool where only one fits the budget (ViT-L/14:
    1.2 GB against 2 GB) one is kept, else up to four."""
    session = ui_controller(tmp_path).session
    for p in (0.5, 0.6, 0.7, 0.8, 0.9):
        session.merges.delta(session.spec("ties", lam=0.5, sparsity=p))
    assert session.merges.kept()["derived"] == 4
    session.merges.derived_bytes = 4 * session.pool.task_vectors.numel()  # one Δ's worth
    session.merges.delta(session.spec("ties", lam=0.5, sparsity=0.55))
    assert session.merges.kept()["derived"] == 1


def test_a_move_frees_the_oldest_delta_before_it_computes_its_own(tmp_path, monkeypatch):
    """A full Δ cache drops its oldest entry before the next apply runs, so the process never holds more
    than the cache's size of Δs (each about one fp32 Δ); the other cached Δ stays."""
    import dataclasses
    import weakref

    session = ui_controller(tmp_path).session
    merges = session.merges
    first = merges.delta(session.spec("task_arithmetic", lam=0.1))
    second = merges.delta(session.spec("task_arithmetic", lam=0.2))
    alive = {"first": weakref.ref(next(iter(first.values()))), "second": weakref.ref(next(iter(second.values())))}
    del first, second
    seen = {}
    registered = merger.methods.get
    method = registered("task_arithmetic")

    def watching(*args, **kw):
        seen.update({name: ref() is not None for name, ref in alive.items()})
        return method.apply(*args, **kw)

    watched = dataclasses.replace(method, apply=watching)
    monkeypatch.setattr(merger.methods, "get", lambda name: watched if name == method.name else registered(name))
    merges.delta(session.spec("task_arithmetic", lam=0.3))
    assert seen == {"first": False, "second": True}
    assert merges.kept()["deltas"] == merges.delta_size == 2


def test_a_split_is_read_before_its_first_evaluation_takes_the_model(tmp_path):
    """Reading a split's images needs no model: an auto-tune's first val point once held every other
    job for the 5 s the demo's val split takes to read (and the experts' 7 forwards on it)."""
    c = ui_controller(tmp_path)
    session = c.session
    read = threading.Event()
    original = session.evaluator.read_split

    def reading(split):
        out = original(split)
        read.set()
        return out

    session.evaluator.read_split = reading
    result = {}
    with session.batch(), session.queue:  # another job holds the model
        worker = threading.Thread(target=lambda: result.update(r=session.preview(session.spec("task_arithmetic"), "val")))
        worker.start()
        assert read.wait(10)  # read while the model was held
    worker.join(60)
    assert result["r"].split == "val"


@pytest.mark.parametrize("name", [m.name for m in merger.methods.all_methods() if not m.data_driven])
def test_bench_scale_moves_every_static_method_through_distinct_settings(ctl, name):
    """``bench scale`` moves each method's first slider (or an expert's weight where it has none):
    distinct, valid settings (weight averaging and SLERP once broke a GPU run)."""
    from devtools.bench_scale import move_specs

    specs = move_specs(ctl.session, name, 12)
    assert len({s.snap() for s in specs}) == 12
    m = merger.methods.get(name)
    assert all(len(s.experts) == len(m.experts_for(ctl.session.tasks)) for s in specs)
    if m.params:
        assert len({s.snap().kwargs[m.params[0].name] for s in specs}) == 12
    else:
        assert len({s.task_weights for s in specs}) == 12


def test_a_progressive_answer_on_tasks_with_their_own_images_forwards_each_image_once(tmp_path):
    """Three image sets: the partial answer forwards every set's first images in one batch (per
    set, a GPU waited on kernel launches), the complete one only the images after them, and the
    complete answer equals a non-progressive session's."""
    from helpers import write_pool

    path = write_pool(tmp_path, n_experts=3, scale=0.2, demo_data=True, own_images=True)
    plain, progressive = (merger.PoolSession(merger.open_pool(path)) for _ in range(2))
    progressive.measure_live(budget_s=0.0)
    n = progressive.partial_images
    sets = progressive.evaluator.inputs("live")
    assert len(sets) == 3 and n is not None
    per_set = [x.shape[0] for x, _ in sets]
    spec = progressive.spec("task_arithmetic", lam=0.4)
    progressive.expert_accuracy("live")
    batches = []
    hook = progressive.evaluator.model.visual.register_forward_hook(lambda m, args, out: batches.append(args[0].shape[0]))
    try:
        first = progressive.partial(spec.snap(), n)
        done = progressive.preview(spec)
        again = progressive.preview(progressive.spec("task_arithmetic", lam=0.5))  # no partial before it
    finally:
        hook.remove()
    assert batches == [3 * n, sum(per_set) - 3 * n, sum(per_set)]
    assert first.partial and set(first.counts.values()) == {n}
    ref = plain.preview(plain.spec("task_arithmetic", lam=0.4))
    assert done.accuracy == ref.accuracy and done.counts == ref.counts and not done.partial
    assert done.loss == pytest.approx(ref.loss, rel=1e-5) and again.counts == ref.counts
    for m in (3, 4):  # partial answers of other sizes: one pair of windows kept beside the whole
        progressive.partial(progressive.spec("task_arithmetic", lam=0.6), m)
    assert progressive.evaluator.batches_kept("live") == {(0, None), (0, 4)}
    for bad, why in ((0, "0 is out of range"), (-1, "-1 is out of range"), (2.5, "expected a whole number .* got 2.5"),
                     (True, "expected a whole number .* got True")):
        with pytest.raises(merger.MergerError, match=f"partial: images per task: {why}"):
            progressive.partial(spec, bad)


def test_joined_results_are_the_per_image_values_side_by_side():
    """A task that the partial answer covered whole (fewer images than its limit) has no images after
    it: its complete values are the partial's."""
    from merger.evaluation.evaluator import Result, joined

    first = Result("live", {"a": 0.5, "b": 1.0}, {"a": 1.5, "b": 0.5}, {"a": 0.9}, {"a": 2, "b": 1}, 0.25, partial=True,
                   per_image={"a": (torch.tensor([True, False]), torch.tensor([1.0, 2.0])),
                              "b": (torch.tensor([True]), torch.tensor([0.5]))})
    rest = Result("live", {"a": 1.0}, {"a": 3.0}, {}, {"a": 2}, 0.5, partial=True,
                  per_image={"a": (torch.tensor([True, True]), torch.tensor([3.0, 3.0]))})
    done = joined(first, rest)
    assert not done.partial and done.tasks == ["a", "b"] and done.seconds == 0.75
    assert done.accuracy == {"a": 0.75, "b": 1.0} and done.loss == {"a": 2.25, "b": 0.5} and done.counts == {"a": 4, "b": 1}
    assert done.per_image["a"][1].tolist() == [1.0, 2.0, 3.0, 3.0] and done.expert_accuracy == {"a": 0.9}
