"""Compiled per-entry passes for large task-vector stacks.

An eager pass over ViT-B/32 × 8 (700 M entries) makes a dozen sweeps of [T, n] temporaries through
memory: TIES' merge took 3 s, a Consensus vote count 1.3 s, a Breadcrumbs mask 1.8 s on 2 cores.
torch.compile fuses each into one sweep. It needs a C++ compiler, so any failure falls back to the
eager code (exact too) for the rest of the process; small stacks (the demo, tests) stay eager.
"""
from __future__ import annotations

import logging
import os

import torch

FUSE_ABOVE = 20_000_000  # task-vector entries (all tasks) above which a method uses its kernel
_KERNELS: dict = {}
_STATE = {"failed": False}


def kernel(fn, *examples: tuple):
    """``fn`` compiled with dynamic shapes and run once on each argument tuple of ``examples`` (the
    compile happens now, in a preparation, not inside a slider move), or None where it cannot be had.
    Set MERGER_NO_COMPILE=1 to merge eagerly."""
    if os.environ.get("MERGER_NO_COMPILE") or _STATE["failed"]:
        return None
    if fn not in _KERNELS:
        try:
            compiled = torch.compile(fn, dynamic=True)
            for args in examples:
                compiled(*args)
            _KERNELS[fn] = compiled
        except Exception as exc:  # no compiler, an unsupported platform: the eager merge is exact too
            logging.getLogger(__name__).warning("torch.compile unavailable (%s); merging eagerly", str(exc)[:200])
            _STATE["failed"] = True
            return None
    return _KERNELS[fn]


def for_stack(tv, fn, *examples: tuple):
    """``kernel(fn, *examples)`` for a stack above FUSE_ABOVE entries, else None (eager)."""
    return kernel(fn, *examples) if tv.numel() * tv.num_tasks > FUSE_ABOVE else None
