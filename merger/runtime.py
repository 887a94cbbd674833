"""The process settings the app and the command line make when they start. ``import merger`` makes
none (no environment variable, thread count, allocator or BLAS setting changes); a script that builds
the app itself (``merger.ui.build_app``) calls ``configure()`` first, as ``app.py`` does."""
from __future__ import annotations

import contextlib
import os
import signal
import threading


def configure() -> None:
    """Gradio sends no usage statistics (nothing leaves the machine unasked); a value the user set stays."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")


class Terminated(KeyboardInterrupt):
    """SIGTERM, unwound like an interrupt: ``finally`` blocks remove temporary files and half-built folders."""


def _terminated(signum, frame):
    raise Terminated


@contextlib.contextmanager
def kill_unwinds():
    """While it lasts, SIGTERM raises ``Terminated`` in the main thread (elsewhere: nothing changes).
    A parent that blocked SIGTERM (a runner's thread) passes its mask on through exec: unblocked here,
    or a kill would wait until the work had ended. The handler and the mask are put back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminated)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM]) if hasattr(signal, "pthread_sigmask") else None
    try:
        yield
    finally:
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGTERM, previous)
