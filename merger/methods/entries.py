"""What the entry-by-entry merges (TIES, DARE, Consensus, Breadcrumbs) share: a function of the task
vectors' entries applied over one tensor's stack, a slice at a time (a temporary the size of a whole
stack costs more in memory traffic than in arithmetic). A drop-in in merger/accel compiles the same
function over the whole stack on large pools."""
from __future__ import annotations

import torch

from merger.accel import accelerable

CHUNK = 1 << 18  # entries per slice (of one task)


@accelerable
def entrywise(fn, stack: torch.Tensor, *aligned: torch.Tensor, args: tuple = ()) -> torch.Tensor:
    """fn(τ slice [T, ...] as stored, *the same slice of each ``aligned`` tensor, *args) -> the merged slice,
    over one tensor's stack [T, *shape], sliced along its first dimension: the merged tensor [*shape], fp32.
    ``fn`` reduces over the task axis; ``aligned`` tensors have the stack's first two dimensions (per entry,
    or per row with size 1 after them); ``args`` are tensors (0-d for numbers)."""
    if stack.dim() == 1:  # a scalar parameter's stack [T]
        return fn(stack, *aligned, *args)
    rows = stack.shape[1]
    step = max(1, CHUNK // max(1, stack[0, 0].numel()))
    out = torch.empty(stack.shape[1:], dtype=torch.float32, device=stack.device)
    for s in range(0, rows, step):
        out[s:s + step] = fn(stack[:, s:s + step], *(x[:, s:s + step] for x in aligned), *args)
    return out


def first_call(fn, stacks: dict, aligned: dict | None = None, args: tuple = ()) -> None:
    """``entrywise(fn, …)`` once over the largest stack of each shape length, the results dropped: a
    preparation makes it so that a compiled drop-in compiles there (with its progress), not in the first
    move. Eager, it costs a few tensors' merge."""
    largest = {}
    for key, stack in stacks.items():
        if stack.numel() > largest.get(stack.dim(), (None, 0))[1]:
            largest[stack.dim()] = (key, stack.numel())
    for key, _ in largest.values():
        entrywise(fn, stacks[key], *((aligned[key],) if aligned else ()), args=args)
