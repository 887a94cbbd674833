"""One computation per key, however many callers ask for it at once.

A run or a slow preparation takes minutes. In a workshop ten pages press Run on the same default
settings; a person who reloads the page presses Run again to see the run they started. Each of
those once computed it again, beside the first, at a fraction of the speed. Here the first caller
computes it on its own thread, as it always did (the model's queue, its batch marks and an
interrupt stay its own), and every later caller follows it: each gets its progress (a late one
first gets what was said so far, in order, so its objective curve starts where the run is), and
its result or error.

Cancel: the work's own check stops it only when every caller has cancelled (asked at each check,
as a single caller's cancel always was). A follower that cancels leaves at once, told that the
work goes on for another caller (``Unfollowed``), or, where none is left, gets the outcome; the
first caller cannot leave its own thread's work, so its Cancel stops it only once the followers
have cancelled too. A stopped work is closed for good: a caller after that starts a fresh one."""
from __future__ import annotations

import copy
import threading

from merger.errors import Cancelled, Unfollowed


def _own(error: Exception) -> Exception:
    """A follower's copy of the work's error: the one object raised on every thread would gather
    each thread's frames into one traceback (the work's own is kept as the cause)."""
    try:
        twin = copy.copy(error)
    except Exception:  # noqa: BLE001  (an exception that cannot be rebuilt from its args)
        return error
    return twin if type(twin) is type(error) and str(twin) == str(error) else error


class SharedWork:
    POLL_S = 0.1  # how often a follower looks at its own cancel

    def __init__(self):
        self._lock = threading.Lock()
        self._jobs: dict = {}

    def running(self, key) -> bool:
        return key in self._jobs

    def goes_on_after_cancel(self, key, cancel) -> bool:
        """Whether the work of ``key`` goes on for another caller while the caller whose cancel
        check is ``cancel`` (the first one, which cannot leave its own work) has cancelled: its
        page says so. A follower that cancelled has left the work: never it."""
        with self._lock:
            job = self._jobs.get(key)
        return job is not None and job.goes_on_for_others(cancel)

    def followers(self, key) -> int:
        """How many callers follow the work of ``key`` now (0: none goes)."""
        with self._lock:
            job = self._jobs.get(key)
        return 0 if job is None else job.callers()

    def under_way(self) -> dict:
        """label -> subject of each work under way (a reloaded page names them, and can set its
        controls to one, so that its Run follows it)."""
        with self._lock:
            return {job.label: job.subject for job in self._jobs.values() if job.label and not job.closed}

    def get(self, key, compute, progress=None, cancel=None, alone: bool = False, label: str = "", subject=None):
        """compute(progress, cancel) once for every caller of ``key`` while it runs; its result, or
        its error raised. ``alone``: the caller holds what the work needs (the model's queue), so
        it could neither wait for another caller's work nor be followed: it computes on its own.
        ``label`` and ``subject`` (the settings it computes for) are what ``under_way`` tells."""
        if alone:
            return compute(progress, cancel or (lambda: False))
        while True:
            with self._lock:
                job = self._jobs.get(key)
                leads = job is None or job.closed
                if leads:
                    job = self._jobs[key] = _Job(lambda job: self._forget(key, job), label, subject)
            me = job.join(progress, cancel)
            if me is not None:
                break  # else it closed between the two locks: ask again (a fresh one)
        return job.lead(me, compute) if leads else job.follow(me, self.POLL_S)

    def _forget(self, key, job) -> None:
        with self._lock:
            if self._jobs.get(key) is job:
                del self._jobs[key]


class _Caller:
    __slots__ = ("progress", "cancel", "error")

    def __init__(self, progress, cancel):
        self.progress, self.cancel, self.error = progress, cancel, None

    def cancelled(self) -> bool:
        return self.cancel is not None and bool(self.cancel())


class _Job:
    def __init__(self, forget, label: str = "", subject=None):
        self._forget, self.label, self.subject = forget, label, subject
        self.done = threading.Event()
        self.result = None
        self.error: BaseException | None = None
        self.closed = False  # every caller had cancelled: the work stops at this check
        self._lock = threading.Lock()  # callers, their deliveries and the replay, in one order
        self._callers: list[_Caller] = []
        self._leader: _Caller | None = None
        self._said: list[tuple] = []  # the progress calls that carried a value (a curve's points)
        self._since: tuple | None = None  # the last call, where it carried no value

    def callers(self) -> int:
        with self._lock:
            return len(self._callers)

    def join(self, progress, cancel) -> _Caller | None:
        """This caller, with what was said so far replayed to it; None where the job has closed."""
        me = _Caller(progress, cancel)
        with self._lock:
            if self.closed:
                return None
            if self._leader is None:
                self._leader = me
            self._callers.append(me)
            if progress is not None:
                for call in self._said + ([self._since] if self._since else []):
                    progress(*call)
        return me

    def lead(self, me: _Caller, compute):
        try:
            self.result = compute(self._progress, self._abandoned)
            return self.result
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            self._forget(self)
            self.done.set()

    def _progress(self, fraction, message, value=None) -> None:
        call = (fraction, message) if value is None else (fraction, message, value)
        with self._lock:
            if value is not None:
                self._said.append(call)
            self._since = None if value is not None else call
            for caller in list(self._callers):
                if caller.progress is None:
                    continue
                if caller is self._leader:  # its own callback's error is its work's, as ever
                    caller.progress(*call)
                    continue
                try:
                    caller.progress(*call)
                except Exception as exc:  # noqa: BLE001  (that follower's page is gone: it alone gets it)
                    caller.error = exc
                    self._callers.remove(caller)

    def _abandoned(self) -> bool:
        """The work's cancel: every caller has cancelled. Once true the job is closed and forgotten,
        so a caller after this check starts a fresh work instead of joining one that stops."""
        with self._lock:
            if not self.closed and all(caller.cancelled() for caller in self._callers):
                self.closed = True
        if self.closed:
            self._forget(self)
        return self.closed

    def goes_on(self) -> bool:
        with self._lock:
            return not self.closed and not all(caller.cancelled() for caller in self._callers)

    def goes_on_for_others(self, cancel) -> bool:
        with self._lock:
            mine = [c for c in self._callers if c.cancel is not None and c.cancel == cancel]
            others = [c for c in self._callers if c not in mine]
            return (bool(mine) and all(c.cancelled() for c in mine) and not self.closed
                    and any(not c.cancelled() for c in others))

    def follow(self, me: _Caller, poll_s: float):
        try:
            while not self.done.wait(poll_s):
                if me.error is not None:
                    raise me.error
                if not me.cancelled():
                    continue
                with self._lock:
                    if me in self._callers:
                        self._callers.remove(me)
                while not self.done.wait(poll_s):  # left: the work goes on for another, or stops soon
                    if self.goes_on():
                        raise Unfollowed("you stopped following it; another page asked for the same settings, so "
                                         "it goes on for that page and is kept when done")
                break
        except BaseException:
            with self._lock:
                if me in self._callers:
                    self._callers.remove(me)
            raise
        if isinstance(self.error, Exception):
            raise _own(self.error) from self.error
        if self.error is not None:  # the first caller was interrupted (Ctrl+C where it ran)
            raise Cancelled("stopped where it ran (interrupted); nothing was cached") from None
        return self.result
