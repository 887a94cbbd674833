"""Derive parts computed ahead, in idle time: a move to a setting whose parts are kept costs only
what remains of its derive (TSV-M: a rank move's 96 eighs are 60 % of it on ViT-B/32 × 8; kept
cores leave the two products per matrix). Both are owned by ``Merges``."""
from __future__ import annotations

import sys
import threading
from collections import OrderedDict

import torch


def nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(nbytes(v) for v in value)
    return 0


class PartStore:
    """Derive parts per preparation (key -> value), least recently used first out above ``cap`` bytes;
    shared by the move that derives and the warm-up thread, so every access holds a lock."""

    def __init__(self, cap: int):
        self.cap = cap
        self._parts: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self._dropped: set = set()  # preparations gone: a share that ends after the drop puts nothing
        self.bytes = 0

    def view(self, prepared_key) -> "PartView":
        return PartView(self, prepared_key)

    def get(self, key):
        with self._lock:
            if key not in self._parts:
                return None
            self._parts.move_to_end(key)
            return self._parts[key]

    def put(self, key, value) -> None:
        with self._lock:
            if key in self._parts or key[0] in self._dropped:
                return
            self._parts[key] = value
            self.bytes += nbytes(value)
            while self.bytes > self.cap and len(self._parts) > 1:
                _, old = self._parts.popitem(last=False)
                self.bytes -= nbytes(old)

    def __contains__(self, key) -> bool:
        with self._lock:
            return key in self._parts

    def drop(self, prepared_key) -> None:
        """Every part of one preparation (it left the session's cache), and any put for it from now on."""
        with self._lock:
            self._dropped.add(prepared_key)
            for key in [k for k in self._parts if k[0] == prepared_key]:
                self.bytes -= nbytes(self._parts.pop(key))

    def allow(self, prepared_key) -> None:
        """A preparation (back) in the session's cache: its parts are kept."""
        with self._lock:
            self._dropped.discard(prepared_key)

    def count(self, prepared_key) -> int:
        with self._lock:
            return sum(1 for k in self._parts if k[0] == prepared_key)

    def bytes_of(self, prepared_key) -> int:
        with self._lock:
            return sum(nbytes(v) for k, v in self._parts.items() if k[0] == prepared_key)


class PartView:
    """One preparation's parts (what a method's derive and warm see): get, put, in."""

    def __init__(self, store: PartStore, prepared_key):
        self.store, self.prepared_key = store, prepared_key
        self.computed = 0  # parts put through this view: the work a move or a warm-up did

    def get(self, key):
        return self.store.get((self.prepared_key, key))

    def put(self, key, value) -> None:
        self.computed += 1
        self.store.put((self.prepared_key, key), value)

    def __contains__(self, key) -> bool:
        return (self.prepared_key, key) in self.store


class WarmUp:
    """One thread that computes a preparation's derive parts for each of its settings, nearest the
    setting last moved to first, only while the session's queue is idle (nothing holds or waits for
    the model) and no slow preparation goes on; a share of matrices at a time (each about 0.1 s on
    two cores), so a move that arrives waits at most for that share. It stops when its preparation
    is replaced or dropped, or when that preparation's parts reach ``FILL`` of the store's cap (the
    moves' own parts must still fit; another preparation's give way, least recently used first)."""
    POLL_S = 0.05
    FILL = 0.75

    def __init__(self, queue, parts: PartStore, counts, busy=lambda: False):
        self.queue, self.parts, self.counts, self.busy = queue, parts, counts, busy
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._key = None
        self._last: dict = {}  # prepared key -> the setting last moved to (its one value)
        self._lock = threading.Lock()

    def start(self, method, prepared_key, state, settings: list[dict]) -> None:
        """Warm this preparation's settings up, in place of any warm-up under way (which ends first)."""
        with self._lock:
            self._stop.set()
            self._stop = stop = threading.Event()
            self._key, previous = prepared_key, self._thread
            self._thread = threading.Thread(target=self._run, name="merger-warm-up", daemon=True,
                                            args=(method, prepared_key, state, settings, stop, previous))
            self._thread.start()

    def stop(self, prepared_key=None) -> None:
        """Stop the warm-up (of ``prepared_key`` only, where given) and wait for the share under way.
        Never call it inside side_by_side work (holding linalg's lock): the share waits for that lock."""
        with self._lock:
            self._last.pop(prepared_key, None)
            if self._thread is None or (prepared_key is not None and prepared_key != self._key):
                return
            self._stop.set()
            thread, self._thread, self._key = self._thread, None, None
        if thread is not threading.current_thread():
            thread.join()  # which joins the warm-ups it replaced first

    def moved(self, prepared_key, setting: dict) -> None:
        """A move derived this setting: the warm-up goes on from the settings nearest it."""
        self._last[prepared_key] = setting

    def wait(self, timeout: float | None = None) -> bool:
        """Until the warm-up under way ends (tests and benches); whether it has."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    @property
    def under_way(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def _idle(self, stop: threading.Event) -> bool:
        """Wait until nothing else wants the CPU; False once stopped."""
        while not stop.is_set():
            if self.queue.idle() and not self.busy():
                return True
            stop.wait(self.POLL_S)
        return False

    def _run(self, method, prepared_key, state, settings, stop, previous) -> None:
        if previous is not None:
            previous.join()  # its stop is set: it ends after its share under way
        view = self.parts.view(prepared_key)
        left = list(settings)
        while left and not stop.is_set():
            if self.parts.bytes_of(prepared_key) >= self.FILL * self.parts.cap:  # others' parts make room (LRU)
                self.counts["warm-ups full"] += 1
                return
            setting = min(left, key=lambda s: _distance(s, self._last.get(prepared_key)))
            left.remove(setting)
            try:
                method.warm(state, view, lambda: self._idle(stop), **setting)
            except Exception as exc:  # noqa: BLE001  (a warm-up only saves time: a move computes what it lacks)
                self.counts["warm-up errors"] += 1
                print(f"warm-up of {method.name} stopped: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                return
            if not stop.is_set():
                self.counts["settings warmed"] += 1
        self.counts["parts warmed"] += view.computed


def _distance(setting: dict, last: dict | None) -> float:
    """How far a setting is from the one last moved to ("auto" counts as past every step)."""
    if not last:
        return 0.0
    (name, value), = setting.items()
    other = last.get(name)
    return abs(value - (2.0 if isinstance(other, str) else float(other)))
