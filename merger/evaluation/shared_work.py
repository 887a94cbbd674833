"""One computation per key, however many callers ask for it at once.

A run or a slow preparation takes minutes. In a workshop ten pages press Run on the same default
settings; a person who reloads the page presses Run again to see the run they started. Each of
those once computed it again, beside the first, at a fraction of the speed. Here the first caller
starts the work on a thread of its own and every caller follows it: each gets its progress (a late
one first gets what was said so far, so its objective curve starts where the run is), and its
result or error. A caller that cancels stops following; the work stops only when every one of
them has cancelled, and the last one out waits for its outcome (its Cancel may come after the last
step: then it gets the result, as a single caller always did)."""
from __future__ import annotations

import threading

from merger.errors import Unfollowed


class SharedWork:
    POLL_S = 0.1  # how often a follower looks at its own cancel

    def __init__(self):
        self._lock = threading.Lock()
        self._jobs: dict = {}

    def running(self, key) -> bool:
        return key in self._jobs

    def get(self, key, compute, progress=None, cancel=None):
        """compute(progress, cancel) once for every caller of ``key`` while it runs; its result,
        or its error raised."""
        with self._lock:
            job = self._jobs.get(key)
            fresh = job is None
            if fresh:
                job = self._jobs[key] = _Job()
            me = job.join(progress, cancel)
        if fresh:
            threading.Thread(target=self._compute, args=(key, job, compute), daemon=True,
                             name="merger-shared-work").start()
        return job.follow(me, self.POLL_S)

    def _compute(self, key, job: _Job, compute) -> None:
        try:
            job.result = compute(job.progress, job.abandoned)
        except BaseException as exc:  # noqa: BLE001  (handed to every follower, raised there)
            job.error = exc
        finally:
            with self._lock:
                del self._jobs[key]
            job.done.set()


class _Job:
    def __init__(self):
        self.done = threading.Event()
        self.result = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._followers: dict = {}  # a token per caller -> (its progress callback, its cancel), each may be None
        self._curve: list[tuple] = []  # the progress calls that carried a value (a curve's points), in order
        self._since: tuple | None = None  # the last call, where it carried no value

    def join(self, progress, cancel):
        me = object()
        with self._lock:
            self._followers[me] = (progress, cancel)
            said = self._curve + ([self._since] if self._since else [])
        if progress is not None:
            for args in said:
                progress(*args)
        return me

    def progress(self, fraction, message, value=None) -> None:
        call = (fraction, message) if value is None else (fraction, message, value)
        with self._lock:
            if value is not None:
                self._curve.append(call)
            self._since = None if value is not None else call
            callbacks = [p for p, _ in self._followers.values() if p is not None]
        for callback in callbacks:
            callback(*call)

    def abandoned(self) -> bool:
        """Every caller has cancelled (asked at each of the work's checks, as a single caller's
        cancel always was): the work's own cancel."""
        with self._lock:
            followers = list(self._followers.values())
        return all(cancel is not None and cancel() for _, cancel in followers)

    def follow(self, me, poll_s: float):
        cancel = self._followers[me][1]
        while not self.done.wait(poll_s):
            if cancel is None or not cancel():
                continue
            with self._lock:
                self._followers.pop(me, None)
            if not self.abandoned():  # another caller still follows it
                raise Unfollowed("you stopped following it; another page asked for the same settings, so it goes "
                                 "on for that page and is kept when done")
            self.done.wait()  # the last one out: the work stops at its next check (or has just ended)
        if self.error is not None:
            raise self.error
        return self.result
