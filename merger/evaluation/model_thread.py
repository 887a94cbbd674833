"""The resident model's tensor work runs on one long-lived thread (the Evaluator's ``ModelThread``).

Gradio answers each event on whichever thread of its pool is free, and a CPU forward that starts
on a thread other than the last one costs more: each calling thread gets its own OpenMP team, and
the team left idle competes for the cores. On the demo pool (2 cores) one live forward took 62 ms
when every forward ran on the same thread and 79 to 87 ms when threads alternated; in the app a
move's forward took 92 ms. So the evaluator hops onto its one thread for its work; the caller
waits for it (the work queue still decides who holds the model, and when).
"""
from __future__ import annotations

import contextvars
import functools
import threading
from concurrent.futures import ThreadPoolExecutor


class ModelThread:
    """One thread for one resident model's work, started at its first call (not on import)."""

    def __init__(self):
        self._executor: ThreadPoolExecutor | None = None
        self._ident: int | None = None
        self._lock = threading.Lock()

    def run(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) on the thread (directly when already there: calls nest), in the caller's
        context (``merger.accel.reference_only`` holds for the work done for it)."""
        if threading.get_ident() == self._ident:
            return fn(*args, **kwargs)
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="merger-model")
                self._ident = self._executor.submit(threading.get_ident).result()
        return self._executor.submit(contextvars.copy_context().run, fn, *args, **kwargs).result()


def on_model_thread(method):
    """A method of an object holding ``model_thread`` run on that thread."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        return self.model_thread.run(method, self, *args, **kwargs)
    return call
