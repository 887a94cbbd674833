"""The entry-by-entry merges compiled: torch.compile fuses a function of the entries (TIES' trim, elect
and disjoint mean; Consensus' votes; Breadcrumbs' bounds) into one pass over a whole stack, where the
eager slices make a dozen passes through memory. The function compiled is the
reference's own (merger/methods/entries.py), so the result is the same; only stacks above FUSE_ABOVE
entries take it (the compile takes seconds, once per process and function). Without a working C++
compiler (or with MERGER_NO_COMPILE=1) the eager reference runs."""
from __future__ import annotations

import logging
import os

import torch

from merger.accel.registry import drop_in

FUSE_ABOVE = 4_000_000  # entries of one tensor's stack (all tasks) above which it is compiled
# The functions compiled: each ran at least 1.5× its eager slices in `bench accel`. DARE's two ran at 1.1×
# (their eager slices are a compare and a sum, already near memory speed; inductor kept DARE-TIES' dropped
# stack in memory between the election and the mean): they stay eager.
COMPILED = ("ties_entries", "consensus_entries", "breadcrumb_entries")
# Whether torch.compile failed in this process (no compiler, an unsupported platform): a fact of the
# machine, so it is not tried again (ARCHITECTURE.md lists the module-level state that stays).
_FAILED = {"compile": False}


def compiling() -> bool:
    return not (os.environ.get("MERGER_NO_COMPILE", "") not in ("", "0") or _FAILED["compile"])


@drop_in("merger.methods.entries.entrywise",
         "the same function torch.compile'd over the whole stack (stacks above 4 M entries; eager without a compiler)")
def entrywise(reference, fn, stack: torch.Tensor, *aligned: torch.Tensor, args: tuple = ()) -> torch.Tensor:
    if stack.numel() < FUSE_ABOVE or fn.__name__ not in COMPILED or not compiling():
        return reference(fn, stack, *aligned, args=args)
    try:
        # torch.compile keeps the compiled graph with fn's code: a later call with other shapes reuses it
        return torch.compile(fn, dynamic=True)(stack, *aligned, *args)
    except Exception as exc:  # noqa: BLE001  (no compiler, an unsupported op: the eager route is the reference)
        logging.getLogger(__name__).warning("torch.compile unavailable (%s); merging eagerly", str(exc)[:200])
        _FAILED["compile"] = True
        return reference(fn, stack, *aligned, args=args)
