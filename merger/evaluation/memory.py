"""The server's memory budget (app --memory-gb): what the process holds, memory freed inside it handed
back to the system, and the session's caches dropped when it is over the budget.

glibc keeps what a thread frees in that thread's arena for its next allocation: Gradio runs every
listener on a pool of threads, so after merges, landscapes and lab fine-tunes on several of them
the resident memory only grew, though what the app held stayed bounded (``python -m devtools bench
soak`` shows both). ``malloc_trim`` returns it; elsewhere (macOS, Windows, musl) the allocator
returns memory on its own and nothing is done."""
from __future__ import annotations

import ctypes
import os
import sys
import threading

DEFAULT_GB = 4.0  # a laptop's share for the demo or a few ViT-B/32 experts (the pool itself is held)
HEADROOM = 2.0  # the default budget is at least this many times what the process holds with its pool open


def resident_gb() -> float | None:
    """This process's resident memory in GB where the system tells it cheaply (/proc), else None."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def release_freed_memory() -> bool:
    """Hand memory freed inside the process back to the system (glibc's ``malloc_trim``); False
    where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    libc.malloc_trim(0)
    return True


M_ARENA_MAX = -8  # glibc's mallopt parameter
ARENAS = 2  # glibc's default is 8 per core: each of Gradio's worker threads kept its own pool of freed memory


def limit_arenas(arenas: int = ARENAS) -> bool:
    """At start-up (the app's, before its threads): glibc's malloc arenas capped at ``arenas``, so
    memory one worker thread frees serves the next one's allocations instead of staying in its own
    arena; False where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(libc.mallopt(M_ARENA_MAX, int(arenas)))


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        # the running process's own symbols (dlopen(NULL)): no library file is loaded
        libc = ctypes.CDLL(None)
        libc.malloc_trim, libc.mallopt  # noqa: B018 (musl has neither)
    except (OSError, AttributeError):
        return None
    return libc


def default_budget_gb(held_gb: float | None) -> float:
    """``DEFAULT_GB``, or more where the pool alone takes a good part of it."""
    return max(DEFAULT_GB, HEADROOM * held_gb) if held_gb else DEFAULT_GB


class MemoryKeeper:
    """Every ``every_s`` seconds: freed memory back to the system; past ``budget_gb``, the
    session's caches dropped (``PoolSession.shrink``: results, landscape values, derived states;
    never a pool expert, a lab expert or the newest run), then freed memory back again."""

    def __init__(self, session, budget_gb: float, every_s: float = 10.0):
        self.session, self.budget_gb, self.every_s = session, float(budget_gb), every_s
        self.shrinks = 0  # how many times the caches were dropped (said in the log)
        self._halt = threading.Event()

    def check(self) -> float | None:
        """One round; the resident GB after it (None where it cannot be read)."""
        release_freed_memory()
        held = resident_gb()
        if held is not None and held > self.budget_gb:
            self.session.shrink()
            self.shrinks += 1
            release_freed_memory()
            after = resident_gb()
            print(f"memory: {held:.2f} GB held, over the {self.budget_gb:g} GB budget (--memory-gb): caches dropped, "
                  f"{after:.2f} GB now", file=sys.stderr, flush=True)
            return after
        return held

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name="memory-keeper", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._halt.set()

    def _run(self) -> None:
        while not self._halt.wait(self.every_s):
            try:
                self.check()
            except Exception as exc:  # the keeper must never take the server down
                print(f"memory keeper: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
