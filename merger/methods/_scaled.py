"""Δ = λ · a state a method prepared or derived: the apply of every method whose λ only scales."""
from __future__ import annotations

from collections.abc import Callable, Mapping


class Scaled(Mapping):
    """Δ = λ · a prepared or derived state, each tensor multiplied when it is read (``v * λ``, the
    same bits at every read): the state is held once. A Δ of its own beside it was one more model's
    worth of memory at the peak of a move (docs/memory.md)."""

    def __init__(self, state: Mapping, lam: float):
        self.state, self.lam = state, lam

    def __getitem__(self, key):
        return self.state[key] * self.lam

    def __contains__(self, key) -> bool:  # Mapping's would compute the value
        return key in self.state

    def __iter__(self):
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)


def lam_times(field: str | None = None) -> Callable[..., Mapping]:
    """The apply of a method whose λ only scales what it prepared or derived (``state[field]``, or the
    state itself): Δ = λ · that, one multiply per tensor as it is read; the other parameters acted before."""
    def apply(state, lam: float, **_) -> Mapping:
        return Scaled(state[field] if field else state, lam)
    return apply
