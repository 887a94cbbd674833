"""The app's password check (``app.py --auth user:password``), slowed down after failures: Gradio's
/login answered as fast as it was asked (300 wrong passwords took 0.7 s). Checks run one at a time,
each after a wait that doubles with every failure of the last minutes: guesses from any number of
clients run at most one per wait. Gradio does not tell the check who asks, so while someone guesses
the user waits too (at most MAX_WAIT_S per check in line)."""
from __future__ import annotations

import hmac
import threading
import time


class LoginGate:
    """Gradio's ``auth`` callable: under one lock, wait ``FIRST_WAIT_S`` doubled per failure in the last
    ``WINDOW_S`` (none without failures, at most ``MAX_WAIT_S``), then check."""

    FIRST_WAIT_S = 0.25
    MAX_WAIT_S = 8.0
    WINDOW_S = 300.0

    def __init__(self, accounts: dict[str, str], sleep=time.sleep, clock=time.monotonic):
        self._accounts = [(u.encode(), p.encode()) for u, p in accounts.items()]  # the room's, and a presenter's
        self._sleep, self._clock = sleep, clock
        self._lock = threading.Lock()
        self._failures: list[float] = []  # times of recent failures, bounded by the window

    def __call__(self, user: str, password: str) -> bool:
        with self._lock:
            now = self._clock()
            self._failures = [t for t in self._failures if now - t < self.WINDOW_S][-64:]
            if self._failures:
                self._sleep(self.wait_s(len(self._failures)))
            ok = False
            for known_user, known_password in self._accounts:  # every account checked: the time names none
                ok |= (hmac.compare_digest(str(user).encode(), known_user)
                       & hmac.compare_digest(str(password).encode(), known_password))
            if not ok:
                self._failures.append(self._clock())
            return bool(ok)

    def wait_s(self, failures: int) -> float:
        return min(self.MAX_WAIT_S, self.FIRST_WAIT_S * 2 ** (failures - 1))
