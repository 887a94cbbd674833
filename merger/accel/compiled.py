"""The entry-by-entry merges compiled: torch.compile fuses a function of the entries (TIES' trim, elect
and disjoint mean; Consensus' votes; Breadcrumbs' bounds) into one pass over a whole stack, where the
eager slices make a dozen passes through memory. The function compiled is the
reference's own (merger/methods/entries.py), so the result is the same; only stacks above FUSE_ABOVE
entries take it (the compile takes seconds, once per process and function). Without a working C++
compiler (or with MERGER_NO_COMPILE=1) the eager reference runs."""
from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

import torch

from merger.accel.registry import drop_in
from merger.io.private import why_not_private

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


def why_not_compiled_here() -> str | None:
    """torch.compile loads the code it generated from its cache folder; where someone else could write
    there (a /tmp/torchinductor_<user> made by another user, a shared TORCHINDUCTOR_CACHE_DIR), their
    code would run as ours: then nothing is compiled."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    folder = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())
    reason = why_not_private(folder)
    return None if reason is None else f"torch.compile's cache folder {folder} {reason}"


@drop_in("merger.methods.entries.entrywise",
         "the same function torch.compile'd over the whole stack (stacks above 4 M entries; eager without a compiler)")
def entrywise(reference, fn, stack: torch.Tensor, *aligned: torch.Tensor, args: tuple = ()) -> torch.Tensor:
    if stack.numel() < FUSE_ABOVE or fn.__name__ not in COMPILED or not compiling():
        return reference(fn, stack, *aligned, args=args)
    unsafe = why_not_compiled_here()
    if unsafe:  # said once per reason (the warnings module's own filter), merged eagerly
        warnings.warn(f"{unsafe}; merging eagerly (set TORCHINDUCTOR_CACHE_DIR to a folder only you can write)",
                      RuntimeWarning, stacklevel=2)
        return reference(fn, stack, *aligned, args=args)
    try:
        # torch.compile keeps the compiled graph with fn's code: a later call with other shapes reuses it
        return torch.compile(fn, dynamic=True)(stack, *aligned, *args)
    except Exception as exc:  # noqa: BLE001  (no compiler, an unsupported op: the eager route is the reference)
        logging.getLogger(__name__).warning("torch.compile unavailable (%s); merging eagerly", str(exc)[:200])
        _FAILED["compile"] = True
        return reference(fn, stack, *aligned, args=args)
