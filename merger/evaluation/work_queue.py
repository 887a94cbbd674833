"""The queue in front of the one resident model: previews first, batch work in chunks.

Two classes of work share the model and the CPU/GPU. A *preview* (a slider move, the
``evaluate`` endpoint) is one merge and one forward. *Batch* work (sweeps, auto-tune, compare,
landscape surfaces, data-driven runs, lab fine-tunes, exports) is many of those. Batch work runs
in chunks (a grid point, a step): each chunk takes the queue, after the previews waiting. A long
holder (a data-driven run) calls ``yield_point`` between steps.

While batch work waits, previews run at most ``PREVIEW_BURST`` in a row, so a room of people
dragging cannot starve a batch job; among batch jobs, the one with the fewest chunks left goes
first, and keeps its turn for a moment between two of its chunks (``HANDOFF_S``); a job that does
not say how many it has waits for those, but not for more than ``BATCH_PATIENCE`` chunks at a
time. A preview carries a ticket of its browser session; one superseded by a newer move of the
same session is dropped before it starts (``Superseded``).

The class of work belongs to the thread: code inside ``with queue.batch():`` is batch work,
everything else is a preview. The queue is re-entrant for the thread that holds it.
"""
from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from contextlib import contextmanager

from merger.errors import MergerError


class Superseded(MergerError):
    """A newer move of the same session arrived before this preview started."""


class WorkQueue:
    # While batch work waits, at most this many previews run in a row: previews go first, yet a
    # room of people dragging cannot starve a sweep (a batch job keeps at least about half of the
    # model's time; with no batch work waiting, previews run back to back). One, not two: with two,
    # a Sweep in a room of 10 draggers took 2.25× its time alone (goal 2×); with one, 1.65× while
    # the sliders' p95 went from 413 to 637 ms (goal 800): `python -m devtools bench workshop`.
    PREVIEW_BURST = 1
    # A chunk of a job that did not say its length (the endpoint's val/test evaluations, Compare, a
    # run) goes next once this many chunks of counted jobs passed it: shortest-first puts it after
    # them, and a long auto-tune would otherwise hold it to the end. Counted jobs keep shortest-first
    # among themselves: patience there slowed a Sweep beside an Auto-tune from 4.6× to 5.7× its time
    # alone (`bench workshop`), and marking a script's evaluations as one-chunk jobs starved a sweep.
    BATCH_PATIENCE = 4
    # A counted job between two of its chunks (recording a result, a progress update: about 10 ms)
    # keeps its turn for at most this long. Without it a longer job's chunk, always waiting, took the
    # model in each of those gaps: a 93-chunk Sweep beside a 125-chunk Auto-tune let 35 of the
    # Auto-tune's 0.5 s chunks in between its own 0.1 s ones, 4.3× its time alone in `bench workshop`.
    HANDOFF_S = 0.2

    def __init__(self):
        self._cond = threading.Condition()
        self._owner: int | None = None
        self._depth = 0
        self._previews: deque[int] = deque()
        # waiting batch thread -> (chunks left, arrival, batch chunks granted when it arrived)
        self._chunks: dict[int, tuple[float, int, int]] = {}
        self._arrivals = 0
        self._granted = 0
        self._previews_in_a_row = 0
        self._between: tuple[int, float, float] | None = None  # (thread, chunks left, until): see HANDOFF_S
        self._latest: dict[str, int] = {}
        self._local = threading.local()
        self.counts: Counter = Counter()  # previews, chunks, yields, dropped: for tests and benches

    # ---- the class of work ------------------------------------------------------------------
    @contextmanager
    def batch(self, chunks: int | None = None):
        """Everything the thread does inside is batch work (chunked, after waiting previews). A job
        that says how many chunks it has goes before longer ones (shortest remaining first: the
        mean wait is least); jobs that do not say take turns after them."""
        outer = getattr(self._local, "batch", 0)
        counts = outer == 0 or chunks is not None
        if counts:
            saved = getattr(self._local, "remaining", math.inf)
            self._local.remaining = float(chunks) if chunks is not None else math.inf
        self._local.batch = outer + 1
        try:
            yield
        finally:
            self._local.batch -= 1
            if counts:  # the job this level counted is over: the enclosing one's count again
                self._local.remaining = saved  # (a tune's AdaMerging run after its grid is not 0 chunks long)
                self._end_handoff(threading.get_ident())

    def in_batch(self) -> bool:
        return getattr(self._local, "batch", 0) > 0

    def held_here(self) -> bool:
        """This thread holds the model (inside ``with queue``)."""
        return self._owner == threading.get_ident()

    # ---- holding the model ------------------------------------------------------------------
    def __enter__(self):
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return self
            preview = not self.in_batch()
            self._wait_turn(me, preview)
            self._owner, self._depth = me, 1
            if preview:
                self._previews_in_a_row += 1
                self.counts["previews"] += 1
            else:
                self._previews_in_a_row = 0
                self._local.remaining = max(0.0, self._local.remaining - 1)
                self._granted += 1
                self.counts["chunks"] += 1
        return self

    def _next_chunk(self) -> int | None:
        """Shortest job first (then first come), unless an uncounted job's chunk has waited
        BATCH_PATIENCE grants; None while a shorter job is between two of its chunks."""
        if not self._chunks:
            return None
        overdue = [t for t, (left, _, since) in self._chunks.items()
                   if left == math.inf and self._granted - since >= self.BATCH_PATIENCE]
        if overdue:
            return min(overdue, key=lambda t: self._chunks[t][1])
        best = min(self._chunks, key=lambda t: self._chunks[t][:2])
        if self._handing_off() and self._between[1] < self._chunks[best][0]:
            return None
        return best

    def _handing_off(self) -> bool:
        """Whether a job between two of its chunks keeps its turn (an expired handoff is dropped here:
        a wait given no timeout would sleep past it until some other notify)."""
        if self._between is not None and self._between[2] <= time.monotonic():
            self._between = None
        return self._between is not None

    def _end_handoff(self, thread: int) -> None:
        with self._cond:
            if self._between is not None and self._between[0] == thread:
                self._between = None
                self._cond.notify_all()

    def _my_turn(self, me: int, preview: bool) -> bool:
        if self._owner is not None:
            return False
        batch_due = self._next_chunk() is not None and self._previews_in_a_row >= self.PREVIEW_BURST
        if preview:
            return self._previews[0] == me and not batch_due
        return self._next_chunk() == me and (not self._previews or batch_due)

    def _wait_turn(self, me: int, preview: bool) -> None:
        if preview:
            self._previews.append(me)
        else:
            self._arrivals += 1
            self._chunks[me] = (getattr(self._local, "remaining", math.inf), self._arrivals, self._granted)
            if self._between is not None and self._between[0] == me:  # back in line: no longer between
                self._between = None
        try:
            while not self._my_turn(me, preview):
                # the clock read again: a handoff may have lapsed since _my_turn (wait(0) looks again at once)
                self._cond.wait(None if self._between is None else max(0.0, self._between[2] - time.monotonic()))
        finally:
            if preview:
                self._previews.remove(me)
            else:
                del self._chunks[me]
            self._cond.notify_all()

    def __exit__(self, *exc):
        with self._cond:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                left = getattr(self._local, "remaining", math.inf)
                if self.in_batch() and 0 < left < math.inf:
                    self._between = (threading.get_ident(), left, time.monotonic() + self.HANDOFF_S)
                self._cond.notify_all()
        return False

    def yield_point(self) -> None:
        """Between two steps of a long batch job: whoever waits (previews first, then other batch
        jobs' chunks) runs now, then the job goes on."""
        me = threading.get_ident()
        with self._cond:
            if self._owner != me or not (self._previews or self._chunks):
                return
            depth, self._owner, self._depth = self._depth, None, 0
            self.counts["yields"] += 1
            self._cond.notify_all()
            self._wait_turn(me, preview=False)
            self._owner, self._depth = me, depth
            self._previews_in_a_row = 0

    def idle(self) -> bool:
        """Nothing holds the model or waits for it (the warm-up's cue)."""
        with self._cond:
            return self._owner is None and not self._previews and not self._chunks and not self._handing_off()

    def previews_waiting(self) -> int:
        with self._cond:
            return len(self._previews)

    def batch_waiting(self) -> int:
        with self._cond:
            return len(self._chunks)

    # ---- superseded previews ----------------------------------------------------------------
    def ticket(self, session: str) -> int:
        """A new move of a session: every earlier ticket of that session is now superseded."""
        with self._cond:
            n = self._latest.get(session, 0) + 1
            self._latest[session] = n
            return n

    def superseded(self, session: str | None, ticket: int | None) -> bool:
        if session is None or ticket is None:
            return False
        with self._cond:
            return self._latest.get(session, 0) > ticket

    def drop_if_superseded(self, session: str | None, ticket: int | None) -> None:
        if self.superseded(session, ticket):
            self.counts["dropped"] += 1
            raise Superseded("a newer move of this session arrived")
