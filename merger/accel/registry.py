"""Drop-ins: a faster route to a named reference function, registered under the reference's
qualified name. The reference is marked ``@accelerable`` where it is defined (it stays the plain
definition a reader checks against the paper); a call of it runs its drop-in, if one is registered,
which may hand the call back to the reference where its own route does not hold.

``reference_only()`` (or MERGER_REFERENCE=1) runs every reference as written, ``reference_only("gram")``
those a piece (a module of merger/accel) replaces: the tests, ``python -m devtools report precision`` and
``bench accel`` compare the routes."""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from dataclasses import dataclass
from typing import Callable, Iterator


@dataclass(frozen=True)
class DropIn:
    reference: str  # the reference's qualified name (module.function)
    fast: Callable  # fast(reference, *args, **kwargs): the same result within the precision contract
    how: str  # one line: what it does instead, and where it hands back to the reference

    @property
    def piece(self) -> str:
        """The module of merger/accel it lives in ("gram", "compiled", …)."""
        return self.fast.__module__.rsplit(".", 1)[-1]


# Filled by this package's modules when merger.accel is imported, never written after (as the method
# registry): which drop-ins exist is a fact of the code, not state.
_DROP_INS: dict[str, DropIn] = {}
# Per thread and task (a context variable): a test or a report may run references while the app does not.
# True: every reference; a frozenset: those of these pieces.
_REFERENCE_ONLY = contextvars.ContextVar("merger_reference_only", default=False)


def drop_in(reference: str, how: str):
    """Register ``fast`` as the drop-in for the reference named ``reference``."""
    def register(fast: Callable) -> Callable:
        if reference in _DROP_INS:
            raise ValueError(f"two drop-ins for {reference}")
        _DROP_INS[reference] = DropIn(reference, fast, how)
        return fast
    return register


def qualified(fn: Callable) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def accelerable(reference: Callable) -> Callable:
    """Mark a reference function: calls run its registered drop-in unless references are asked for.
    ``route.reference`` is the plain function."""
    name = qualified(reference)

    @functools.wraps(reference)
    def route(*args, **kwargs):
        found = _DROP_INS.get(name)
        if found is None or references_asked(found.piece):
            return reference(*args, **kwargs)
        return found.fast(reference, *args, **kwargs)

    route.reference = reference
    return route


def references_asked(piece: str | None = None) -> bool:
    """Whether references run (those ``piece`` replaces, where given) in this context."""
    asked = _REFERENCE_ONLY.get()
    if asked is True or os.environ.get("MERGER_REFERENCE", "") not in ("", "0"):
        return True
    return bool(asked) and piece in asked


@contextlib.contextmanager
def reference_only(*pieces: str) -> Iterator[None]:
    """Within the block (this thread's context), accelerable functions run their references: every one, or
    those the named pieces replace."""
    token = _REFERENCE_ONLY.set(frozenset(pieces) if pieces else True)
    try:
        yield
    finally:
        _REFERENCE_ONLY.reset(token)


def drop_ins() -> list[DropIn]:
    return list(_DROP_INS.values())
