"""The process settings the app and the command line make when they start. ``import merger`` makes
none (no environment variable, thread count, allocator or BLAS setting changes); a script that builds
the app itself (``merger.ui.build_app``) calls ``configure()`` first, as ``app.py`` does."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading


def configure() -> None:
    """Gradio sends no usage statistics (nothing leaves the machine unasked); a value the user set stays."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")


class Terminated(KeyboardInterrupt):
    """SIGTERM, unwound like an interrupt: ``finally`` blocks remove temporary files and half-built folders."""


class _Unwinder:
    """SIGTERM's handler while ``kill_unwinds`` lasts. It also remembers the kill: an exception raised
    in Python code that C code runs and then clears is lost (a kill landing in numpy's lazy import of
    ``numpy.random`` ran this handler and the build went on to its end)."""

    def __init__(self):
        self.received = False

    def __call__(self, signum, frame):
        self.received = True
        raise Terminated


def stop_if_killed() -> None:
    """Raise ``Terminated`` in the main thread where a kill came under ``kill_unwinds`` and its exception
    was lost; a long command calls this at each step of its work."""
    handler = signal.getsignal(signal.SIGTERM)
    if isinstance(handler, _Unwinder) and handler.received and threading.current_thread() is threading.main_thread():
        raise Terminated


@contextlib.contextmanager
def kill_unwinds():
    """While it lasts, SIGTERM raises ``Terminated`` in the main thread (elsewhere: nothing changes).
    A parent that blocked SIGTERM (a runner's thread) passes its mask on through exec: unblocked here,
    or a kill would wait until the work had ended; one already waiting is raised on entry. The
    calling thread's mask and the handler are put back after (threads started meanwhile keep theirs)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    masks = hasattr(signal, "pthread_sigmask")  # POSIX
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, []) if masks else None  # read, unchanged
    previous = signal.signal(signal.SIGTERM, _Unwinder())
    try:
        if masks:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])
        yield
    finally:
        try:
            if mask is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        finally:
            if previous is not None:  # None: a handler not set from Python (an embedding program's)
                signal.signal(signal.SIGTERM, previous)


def run_killable(work) -> int:
    """``work()``'s exit status, under ``kill_unwinds``; on Ctrl+C or a kill (one already waiting as it
    starts included), one line on stderr and the status a shell counts: 130, or 143 for SIGTERM."""
    try:
        with kill_unwinds():
            return work()
    except KeyboardInterrupt as exc:
        print("error: interrupted", file=sys.stderr)
        return 143 if isinstance(exc, Terminated) else 130
