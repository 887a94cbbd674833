"""merger/evaluation/shared_work.py: callers of the same run or preparation while it goes follow
one computation, and it stops only when all of them have cancelled."""
import threading
import time
from types import SimpleNamespace

import pytest

from merger.errors import Cancelled, Unfollowed
from merger.evaluation.shared_work import SharedWork


def in_thread(fn):
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    return thread, box


def wait_until(condition, seconds: float = 10) -> bool:
    for _ in range(int(seconds / 0.01)):
        if condition():
            return True
        time.sleep(0.01)
    return False


def stepped_work(release: threading.Event, started: threading.Event, computed: list, steps: int = 50):
    """A work of ``steps`` checks: two curve points said at once, then one step per 10 ms once released."""
    def compute(progress, cancel):
        computed.append(1)
        for i in range(steps):
            progress((i + 1) / steps, f"step {i + 1}", float(i))
            if i == 1:
                started.set()
                release.wait(10)
            if cancel():
                raise Cancelled("cancelled: nothing was cached")
            release.wait(0.01)
        return SimpleNamespace(steps=steps)
    return compute


def two_callers(work, compute, started, cancel_a=None, cancel_b=None):
    """A first caller of ``compute`` under way (``started``), then a second one following it."""
    a, box_a = in_thread(lambda: work.get("k", compute, cancel=cancel_a))
    assert started.wait(10)
    b, box_b = in_thread(lambda: work.get("k", compute, cancel=cancel_b))
    assert wait_until(lambda: work.followers("k") == 2)
    return a, box_a, b, box_b


def leader_and_follower(work, error: BaseException):
    """Two callers of one work that raises ``error``: (first's box, follower's box, computations)."""
    started, release, computed = threading.Event(), threading.Event(), []

    def failing(progress, cancel):
        computed.append(1)
        started.set()
        release.wait(10)
        raise error

    a, box_a = in_thread(lambda: work.get("k", failing))
    assert started.wait(10)
    b, box_b = in_thread(lambda: work.get("k", failing))
    assert wait_until(lambda: work.followers("k") == 2)
    release.set()
    a.join(10), b.join(10)
    return box_a, box_b, computed


def test_callers_of_the_same_key_follow_one_computation_and_get_its_curve_so_far():
    work, release, started, computed = SharedWork(), threading.Event(), threading.Event(), []
    compute = stepped_work(release, started, computed)
    seen_a, seen_b = [], []
    a, box_a = in_thread(lambda: work.get("k", compute, lambda *c: seen_a.append(c)))
    assert started.wait(10) and work.running("k")
    b, box_b = in_thread(lambda: work.get("k", compute, lambda *c: seen_b.append(c)))
    assert wait_until(lambda: len(seen_b) >= 2)  # b has joined: it got the curve so far
    assert work.followers("k") == 2 and seen_b[:2] == [(1 / 50, "step 1", 0.0), (2 / 50, "step 2", 1.0)]
    release.set()
    a.join(10), b.join(10)
    assert computed == [1] and box_a["value"] is box_b["value"] and box_a["value"].steps == 50
    assert [c[2] for c in seen_b] == [float(i) for i in range(50)] == [c[2] for c in seen_a]  # the whole curve
    assert not work.running("k")
    # once it has ended, the same key computes again (the session's cache answers before that)
    assert work.get("k", stepped_work(threading.Event(), threading.Event(), computed, steps=3)).steps == 3
    assert computed == [1, 1]


def test_a_caller_that_cancels_stops_following_and_the_work_goes_on_for_the_other():
    work, release, started, computed = SharedWork(), threading.Event(), threading.Event(), []
    compute = stepped_work(release, started, computed)
    stop_b = threading.Event()
    a, box_a, b, box_b = two_callers(work, compute, started, cancel_b=stop_b.is_set)
    assert not work.goes_on_after_cancel("k", stop_b.is_set)  # nobody has cancelled
    stop_b.set()
    b.join(10)
    assert isinstance(box_b["error"], Unfollowed) and "goes on for that page" in str(box_b["error"])
    # the follower that left is never told it goes on "for another page" (its page said so, briefly)
    assert not work.goes_on_after_cancel("k", stop_b.is_set)
    release.set()
    a.join(10)
    assert box_a["value"].steps == 50 and computed == [1]


def test_the_first_callers_cancel_is_told_that_the_work_goes_on_for_a_follower():
    work, release, started, computed = SharedWork(), threading.Event(), threading.Event(), []
    compute = stepped_work(release, started, computed)
    stop_a = threading.Event()
    a, box_a, b, box_b = two_callers(work, compute, started, cancel_a=stop_a.is_set)
    stop_a.set()
    assert work.goes_on_after_cancel("k", stop_a.is_set)  # a fresh bound method: the same check
    release.set()
    a.join(10), b.join(10)
    assert box_a["value"].steps == box_b["value"].steps == 50 and computed == [1]
    assert not work.goes_on_after_cancel("k", stop_a.is_set)  # ended


def test_the_work_stops_when_every_caller_has_cancelled_and_each_gets_its_cancel():
    work, release, started, computed = SharedWork(), threading.Event(), threading.Event(), []
    compute = stepped_work(release, started, computed)
    stop = threading.Event()
    a, box_a, b, box_b = two_callers(work, compute, started, cancel_a=stop.is_set, cancel_b=stop.is_set)
    stop.set()
    release.set()
    a.join(10), b.join(10)
    for box in (box_a, box_b):  # the work's own Cancelled (nothing cached), not "it goes on"
        assert type(box["error"]) is Cancelled
    assert not work.running("k")


def test_an_error_reaches_every_caller():
    work = SharedWork()

    def compute(progress, cancel):
        raise ValueError("bad file")

    with pytest.raises(ValueError, match="bad file"):
        work.get("k", compute)
    assert not work.running("k")
    # a follower gets it too: its own copy (one object raised on two threads mixes their frames in
    # one traceback), with the work's error as its cause
    box_a, box_b, _ = leader_and_follower(work, ValueError("bad file"))
    assert type(box_b["error"]) is ValueError and str(box_b["error"]) == "bad file"
    assert box_b["error"] is not box_a["error"] and box_b["error"].__cause__ is box_a["error"]



def test_a_caller_after_every_caller_cancelled_starts_afresh_and_is_never_told_cancelled():
    """The work's check found every caller cancelled: it stops, and the job is closed at once; a
    caller arriving while it unwinds gets a fresh work (it once joined the dying one and got a
    Cancelled it never asked for)."""
    work, unwinding, computed = SharedWork(), threading.Event(), []
    stop = threading.Event()

    def slow_to_stop(progress, cancel):
        computed.append(1)
        while not cancel():
            time.sleep(0.01)
        unwinding.set()
        time.sleep(0.3)  # still unwinding when the next caller comes
        raise Cancelled("cancelled: nothing was cached")

    a, box_a = in_thread(lambda: work.get("k", slow_to_stop, cancel=stop.is_set))
    assert wait_until(lambda: computed == [1])
    stop.set()
    assert unwinding.wait(10)
    assert work.get("k", lambda progress, cancel: "fresh") == "fresh"
    a.join(10)
    assert type(box_a["error"]) is Cancelled


def test_a_follower_who_cancelled_leaves_as_soon_as_another_caller_follows_again():
    """The last follower out waits for the outcome only while nobody else wants the work: a caller
    joining before the work's next check keeps it going, and the one who left is told so at once
    (it once waited for that caller's whole run, then got the result)."""
    work, release, started, computed = SharedWork(), threading.Event(), threading.Event(), []
    lead_stop, b_stop = threading.Event(), threading.Event()

    def compute(progress, cancel):  # checks its cancel only once released
        computed.append(1)
        started.set()
        release.wait(10)
        if cancel():
            raise Cancelled("cancelled: nothing was cached")
        return "done"

    a, box_a = in_thread(lambda: work.get("k", compute, cancel=lead_stop.is_set))
    assert started.wait(10)
    b, box_b = in_thread(lambda: work.get("k", compute, cancel=b_stop.is_set))
    assert wait_until(lambda: work.followers("k") == 2)
    lead_stop.set(), b_stop.set()  # both cancel: b leaves and waits for the outcome
    assert wait_until(lambda: work.followers("k") == 1)
    c, box_c = in_thread(lambda: work.get("k", compute))  # someone wants it again before the check
    b.join(5)
    assert not b.is_alive() and isinstance(box_b["error"], Unfollowed)
    release.set()
    a.join(10), c.join(10)
    assert box_a["value"] == box_c["value"] == "done" and computed == [1]


def test_a_late_caller_gets_the_curve_so_far_in_order_while_points_keep_coming():
    """Its replay and the new points come in one order (they once interleaved: 101, 1, 102, 3)."""
    work, midway, computed, seen = SharedWork(), threading.Event(), [], []

    def fast(progress, cancel):
        computed.append(1)
        for i in range(100_000):
            progress(i / 100_000, "step", float(i))
            if i == 100:
                midway.set()
        return "done"

    a, _ = in_thread(lambda: work.get("k", fast))
    assert midway.wait(10)
    b, box_b = in_thread(lambda: work.get("k", fast, lambda *call: seen.append(call[2])))
    a.join(30), b.join(30)
    assert box_b["value"] == "done" and computed == [1]  # b followed the running one
    assert seen == [float(i) for i in range(100_000)]


def test_a_followers_failing_progress_is_its_own_error_and_the_work_goes_on():
    work, release, started, computed = SharedWork(), threading.Event(), threading.Event(), []
    compute = stepped_work(release, started, computed, steps=5)

    def broken(*call):
        raise BrokenPipeError("the page is gone")

    a, box_a = in_thread(lambda: work.get("k", compute))
    assert started.wait(10)
    b, box_b = in_thread(lambda: work.get("k", compute, broken))
    b.join(10)  # the replay of the curve so far already fails it
    release.set()
    a.join(10)
    assert isinstance(box_b["error"], BrokenPipeError) and box_a["value"].steps == 5 and computed == [1]


def test_an_interrupted_first_caller_stops_its_followers_with_a_cancel():
    """The first caller computes on its own thread, so Ctrl+C (or SIGTERM) there stops the work
    as before; a follower is told it stopped, not handed the KeyboardInterrupt."""
    box_a, box_b, computed = leader_and_follower(SharedWork(), KeyboardInterrupt())
    assert computed == [1] and isinstance(box_a["error"], KeyboardInterrupt)
    assert type(box_b["error"]) is Cancelled and "interrupted" in str(box_b["error"])


def test_a_caller_holding_what_the_work_needs_computes_on_its_own():
    work, release, started, computed = SharedWork(), threading.Event(), threading.Event(), []
    a, box_a = in_thread(lambda: work.get("k", stepped_work(release, started, computed, steps=3)))
    assert started.wait(10)
    assert work.get("k", lambda progress, cancel: "its own", alone=True) == "its own"  # no wait for a's
    release.set()
    a.join(10)
    assert box_a["value"].steps == 3
