"""The split protocol shared by the demo builder, the evaluator and the tuner.

Validation is 10 % of the train split chosen with seed 0 (never seen by experts when they are
fine-tuned here); "live" is a fixed small subset of the test split for the sliders, and "probe"
the first ``PROBE_SIZE`` of that subset, for surfaces that evaluate hundreds of points (the
loss landscape): each task of the demo has its own images, so a grid costs one forward of
every task's probe per point.
"""
from __future__ import annotations

import torch

SPLITS = ("train", "val", "test", "live", "probe")
VAL_FRACTION = 0.1
LIVE_SIZE = 96
PROBE_SIZE = 48  # LIVE_SIZE 96: seven tasks with their own images forward in ~60 ms on 2 cores


def source_split(split: str) -> str:
    """The stored split a split is drawn from: val from train, live and probe from test."""
    return "test" if split in ("test", "live", "probe") else "train"


def _perm(n: int, seed: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))


def train_val_indices(n_train: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train indices without validation, validation indices), both sorted."""
    perm = _perm(n_train, 0)
    n_val = max(1, int(round(VAL_FRACTION * n_train))) if n_train > 1 else 0
    return perm[n_val:].sort().values, perm[:n_val].sort().values


def live_indices(n_test: int, size: int = LIVE_SIZE) -> torch.Tensor:
    """A fixed subset of the test split (seed 0), sorted; smaller sizes give subsets of larger ones."""
    return _perm(n_test, 0)[: min(size, n_test)].sort().values
