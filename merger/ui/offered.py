"""Which experts each browser session is offered to merge: the pool's, its own lab experts, and
every session's lab experts once it opts in. One owner for the opt-ins, read by the Expert lab
(the checkbox choices it sends) and by a History reload (a row may name an expert this page is
not offered: the checkbox would then hold a name it does not list, and every later event fail)."""
from __future__ import annotations

import threading

from merger.analysis.lab import lab_experts


class OfferedExperts:
    def __init__(self, pool):
        self.pool = pool
        self._everyone: set[str] = set()
        self._lock = threading.Lock()

    def opt_in(self, session: str, everyone: bool) -> None:
        """Offer (or stop offering) this session the lab experts other sessions made."""
        with self._lock:
            (self._everyone.add if everyone else self._everyone.discard)(session)

    def forget(self, session: str) -> None:
        with self._lock:
            self._everyone.discard(session)

    def to(self, session: str) -> list[str]:
        with self._lock:
            everyone = session in self._everyone
        return self.pool.tasks + lab_experts(self.pool, owner=session, everyone=everyone)
