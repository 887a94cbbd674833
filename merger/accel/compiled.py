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
# The functions compiled: each ran at least 1.5× its eager slices in `bench accel`. TIES' and DARE's are
# compiled as their task-by-task rewrites below (BY_TASK): inductor's code for a reduction over the task
# axis of a [T, n] stack was scalar and kept the whole dropped stack between the election and the mean
# (DARE's ran 1.1× its eager slices that way).
COMPILED = ("ties_entries", "dare_linear_entries", "dare_ties_entries", "consensus_entries", "breadcrumb_entries")
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


# ---- TIES' and DARE's entry functions, written task by task (the same arithmetic) ----------------------

def _disjoint_by_task(kept: list, weights: torch.Tensor) -> torch.Tensor:
    """``ties.disjoint_merge`` over a list of the T kept [n] (fp32): the sign elected on the fp64 sum of
    kept·w (exact products, as the reference's), masks as 0/1 factors."""
    total = kept[0].double() * weights[0].double()
    for i in range(1, len(kept)):
        total = total + kept[i].double() * weights[i].double()
    elected = total.sign().float()
    weighted = [k * weights[i] for i, k in enumerate(kept)]
    agree = [((x * elected) > 0).float() for x in weighted]
    divisor, merged = agree[0] * weights[0], weighted[0] * agree[0]
    for i in range(1, len(kept)):
        divisor = divisor + agree[i] * weights[i]
        merged = merged + weighted[i] * agree[i]
    return merged / torch.where(divisor == 0, 1.0, divisor)


def ties_by_task(tau, thresholds, weights):
    t = [tau[i].float() for i in range(tau.shape[0])]
    return _disjoint_by_task([x * (x.abs() >= thresholds[i]).float() for i, x in enumerate(t)], weights)


def dare_linear_by_task(tau, draws, level, scale, weights):
    total = tau[0].float() * (draws[0] >= level).float() * weights[0]
    for i in range(1, tau.shape[0]):
        total = total + tau[i].float() * (draws[i] >= level).float() * weights[i]
    return total * scale


def dare_ties_by_task(tau, draws, level, scale, weights):
    kept = [tau[i].float() * (draws[i] >= level).float() for i in range(tau.shape[0])]
    return _disjoint_by_task(kept, weights) * scale


BY_TASK = {"ties_entries": ties_by_task, "dare_linear_entries": dare_linear_by_task,
           "dare_ties_entries": dare_ties_by_task}


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
        if fn.__name__ in BY_TASK:  # entries flattened: [T, n] views of the contiguous stacks
            flat = [x.reshape(stack.shape[0], -1) for x in (stack, *aligned)]
            if fn.__name__.startswith("dare"):  # DARE's draws and level read as bf16 (ties.FIRST says why)
                flat[1] = flat[1].view(torch.bfloat16)
                args = (args[0].to(torch.int16).view(torch.bfloat16), *args[1:])
            merged = torch.compile(BY_TASK[fn.__name__], dynamic=True)(*flat, *args)
            return merged.reshape(stack.shape[1:])
        # torch.compile keeps the compiled graph with fn's code: a later call with other shapes reuses it
        return torch.compile(fn, dynamic=True)(stack, *aligned, *args)
    except Exception as exc:  # noqa: BLE001  (no compiler, an unsupported op: the eager route is the reference)
        logging.getLogger(__name__).warning("torch.compile unavailable (%s); merging eagerly", str(exc)[:200])
        _FAILED["compile"] = True
        return reference(fn, stack, *aligned, args=args)
