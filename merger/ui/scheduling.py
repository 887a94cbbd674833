"""How the app's listeners reach the one resident model.

Gradio's own queue would run every listener of one concurrency group one at a time, so a sweep
would hold every slider in the room. Instead previews and batch work have their own groups and
the session's ``WorkQueue`` orders the actual work: previews first, batch jobs in chunks, taking
turns. A batch listener is wrapped so that everything it computes is batch work.
"""
from __future__ import annotations

import functools
import inspect
import threading
from contextlib import contextmanager

PREVIEW = "preview"  # slider moves, the evaluate endpoint: no Gradio limit, the WorkQueue orders them
BATCH = "batch"  # sweeps, auto-tune, compare, landscape, runs, lab, exports, analysis
BATCH_LIMIT = 4  # batch jobs running at once (their chunks interleave); more wait in Gradio's queue
PREVIEW_EVENT = {"concurrency_id": PREVIEW, "concurrency_limit": None}
BATCH_EVENT = {"concurrency_id": BATCH, "concurrency_limit": BATCH_LIMIT}


def as_batch(session, fn):
    """``fn`` with all its work marked as batch work. Gradio may run each step of a generator in
    another thread, so the mark is set around each step, never left on a thread."""
    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def steps(*args, **kwargs):
            gen = fn(*args, **kwargs)
            while True:
                with session.batch():
                    try:
                        item = next(gen)
                    except StopIteration:
                        return
                yield item
        return steps

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with session.batch():
            return fn(*args, **kwargs)
    return call


class CancelFlags:
    """Cancel flags per browser session, one for each job it runs: one page may run several at once
    (a map and a tune, two runs), and one job's end must not take another's flag with it."""

    def __init__(self):
        self._flags: dict[str, set[threading.Event]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def job(self, session: str):
        """A job's flag, set by ``cancel`` while the job runs, gone when it ends."""
        flag = self.start(session)
        try:
            yield flag
        finally:
            self.end(session, flag)

    def start(self, session: str) -> threading.Event:
        flag = threading.Event()
        with self._lock:
            self._flags.setdefault(session, set()).add(flag)
        return flag

    def end(self, session: str, flag: threading.Event) -> None:
        with self._lock:
            self._flags.get(session, set()).discard(flag)
            if not self._flags.get(session, True):
                del self._flags[session]

    @staticmethod
    def reporting(flag: threading.Event, progress, what: str):
        """A job's progress callback (fraction, message) that shows it on ``progress`` (a
        gr.Progress) and stops the job at its next report once ``flag`` is set (Cancel): what it
        evaluated so far stays cached (and in the history)."""
        from merger.errors import Cancelled

        def report(fraction, message):
            if flag.is_set():
                raise Cancelled(f"{what} cancelled after {100 * fraction:.0f} % of its points; those it evaluated "
                                "are cached (a move or job asking for one again gets it at once)")
            progress(fraction, desc=message)
        return report

    def cancel_and_say(self, session: str, jobs: str, stops: str) -> None:
        """``cancel``, said in a toast: "Cancelling {stops}…", or that no {jobs} is in progress. The
        status lines and plots stay: each job says in its own line that it stopped."""
        import gradio as gr

        gr.Info(f"Cancelling {stops}…" if self.cancel(session) else f"No {jobs} in progress: nothing to cancel.")

    def cancel(self, session: str) -> bool:
        """Set the flag of each job the session runs; whether there was one."""
        with self._lock:
            flags = list(self._flags.get(session, ()))
        for flag in flags:
            flag.set()
        return bool(flags)
