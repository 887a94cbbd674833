"""The resident model's tensor work runs on one long-lived thread.

Gradio answers each event on whichever thread of its pool is free, and a CPU forward that starts
on a thread other than the last one costs more: each calling thread gets its own OpenMP team, and
the team left idle competes for the cores. On the demo pool (2 cores) one live forward took 62 ms
when every forward ran on the same thread and 79 to 87 ms when threads alternated; in the app a
move's forward took 92 ms. So the evaluator hops onto this one thread for its work; the caller
waits for it (the work queue still decides who holds the model, and when).
"""
from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor

_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="merger-model")
_ident: int | None = None


def _mark() -> None:
    global _ident
    _ident = threading.get_ident()


_executor.submit(_mark).result()


def on_model_thread(fn):
    """``fn`` run on the model thread (directly when already there: calls nest)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if threading.get_ident() == _ident:
            return fn(*args, **kwargs)
        return _executor.submit(fn, *args, **kwargs).result()
    return call
