"""Task vectors τt = θt − θ0, stacked per tensor on one device.

Only floating-point tensors of the merge scope (the image tower) are merged; integer buffers
are copied from the base. Stacking per tensor ([T, *shape]) lets every method reduce over
tasks with one vectorised op.

Storage is fp32 for small pools and bf16 for real ones (``storage_dtype``): a ViT-B/32 × 8
stack is 2.8 GB in fp32 and 1.4 GB in bf16. τt is taken in fp32 and rounded once; methods read
it through ``fp32(key)`` and accumulate in fp32. Experts are read one at a time (``experts``
may be a lazy mapping), so opening a pool never holds more than one expert beside the stack.
"""
from __future__ import annotations

from collections import Counter
from typing import Mapping, Sequence

import torch

from merger.errors import MergerError, listed
from merger.io.checkpoints import merge_scope

# The 2-D weights of attention and MLP blocks: what the low-rank methods treat as matrices.
MATRIX_SUFFIXES = ("attn.in_proj_weight", "attn.out_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def is_matrix(key: str, shape: Sequence[int]) -> bool:
    return len(shape) == 2 and key.endswith(MATRIX_SUFFIXES)


# A stack larger than this in fp32 is stored in bf16 ("auto"): the demo and test pools stay exact.
BF16_ABOVE_BYTES = 1 << 30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def storage_dtype(choice: str, entries: int) -> torch.dtype:
    """The stack's dtype: "float32", "bfloat16", or "auto" (bf16 above BF16_ABOVE_BYTES in fp32)."""
    if choice == "auto":
        return torch.bfloat16 if 4 * entries > BF16_ABOVE_BYTES else torch.float32
    if choice not in DTYPES:
        raise MergerError(f"task-vector dtype {choice!r}: expected auto, float32 or bfloat16")
    return DTYPES[choice]


def check_subset(chosen: Sequence[str], known: Sequence[str]) -> None:
    """An expert subset: not empty, every name known, none twice (the one message for each)."""
    if not chosen:
        raise MergerError("experts: empty subset, pick at least one expert")
    unknown = [e for e in chosen if e not in known]
    if unknown:
        raise MergerError(f"experts: unknown task(s) {listed(unknown)}; known: {', '.join(known)}")
    twice = [e for e, count in Counter(chosen).items() if count > 1]
    if twice:
        raise MergerError(f"experts: named twice: {listed(twice)}")


class TaskVectors:
    """Base weights (fp32) and stacked task vectors (``dtype``) for the merged keys, on ``device``."""

    def __init__(
        self,
        base: Mapping[str, torch.Tensor],
        experts: Mapping[str, Mapping[str, torch.Tensor]],
        device: str | torch.device = "cpu",
        dtype: str = "auto",
    ):
        if not experts:
            raise MergerError("no experts: merging needs at least one expert")
        self.tasks: list[str] = list(experts)
        self.device = torch.device(device)
        scope = merge_scope(base)
        self.keys: list[str] = [k for k in scope if base[k].is_floating_point()]
        self.frozen: list[str] = [k for k in scope if not base[k].is_floating_point()]
        self.base: dict[str, torch.Tensor] = {
            k: base[k].to(self.device, torch.float32) for k in self.keys
        }
        T = len(self.tasks)
        self.dtype = storage_dtype(dtype, T * self.numel())
        self.stacked: dict[str, torch.Tensor] = {
            k: torch.empty((T, *base[k].shape), dtype=self.dtype, device=self.device) for k in self.keys}
        for i, t in enumerate(self.tasks):
            expert = experts[t]  # one expert read at a time (a lazy mapping loads it here)
            for k in self.keys:
                self.stacked[k][i].copy_(expert[k].to(self.device, torch.float32) - self.base[k])
            del expert

    @classmethod
    def from_stacks(cls, base: Mapping[str, torch.Tensor], tasks: Sequence[str], stacked: Mapping[str, torch.Tensor],
                    device: str | torch.device = "cpu") -> "TaskVectors":
        """Task vectors from stacks computed before (the disk cache), checked against the base."""
        device = torch.device(device)
        scope = merge_scope(base)
        keys = [k for k in scope if base[k].is_floating_point()]
        frozen = [k for k in scope if not base[k].is_floating_point()]
        for k in keys:
            if k not in stacked or tuple(stacked[k].shape) != (len(tasks), *base[k].shape):
                raise MergerError(f"task-vector stack of {k} does not match the base")
        return cls._from_parts(list(tasks), device, keys, frozen, {k: base[k].to(device, torch.float32) for k in keys},
                               {k: stacked[k].to(device) for k in keys})

    @classmethod
    def _from_parts(cls, tasks, device, keys, frozen, base, stacked) -> "TaskVectors":
        tv = cls.__new__(cls)
        tv.tasks, tv.device, tv.keys, tv.frozen, tv.base, tv.stacked = tasks, device, keys, frozen, base, stacked
        tv.dtype = next(iter(stacked.values())).dtype if stacked else torch.float32
        return tv

    def fp32(self, key: str) -> torch.Tensor:
        """The stack of one tensor in fp32 [T, *shape] (the stored tensor itself when fp32)."""
        return self.stacked[key].float()

    def items32(self):
        """(key, fp32 stack) per merged tensor, converted one at a time."""
        for k in self.keys:
            yield k, self.fp32(k)

    def row(self, key: str, i: int) -> torch.Tensor:
        """τi of one tensor in fp32."""
        return self.stacked[key][i].float()

    def subset(self, tasks: Sequence[str]) -> "TaskVectors":
        """Task vectors of the named tasks, in the given order (no copy when nothing changes)."""
        tasks = list(tasks)
        check_subset(tasks, self.tasks)
        if tasks == self.tasks:
            return self
        idx = torch.tensor([self.tasks.index(t) for t in tasks], device=self.device)
        stacked = {k: v.index_select(0, idx) for k, v in self.stacked.items()}
        return TaskVectors._from_parts(tasks, self.device, self.keys, self.frozen, self.base, stacked)

    def scaled(self, weights: Mapping[str, float]) -> "TaskVectors":
        """Each named task's vector times its weight (a new object; the others as they are)."""
        w = torch.tensor([float(weights.get(t, 1.0)) for t in self.tasks], device=self.device)
        stacked = {k: (self.fp32(k) * w.view(-1, *([1] * (v.dim() - 1)))).to(v.dtype) for k, v in self.stacked.items()}
        return TaskVectors._from_parts(self.tasks, self.device, self.keys, self.frozen, self.base, stacked)

    def extended(self, name: str, weights: Mapping[str, torch.Tensor]) -> "TaskVectors":
        """These task vectors and one more expert's (a new object; this one is unchanged)."""
        stacked = {k: torch.cat([v, (weights[k].to(self.device, torch.float32) - self.base[k])[None].to(v.dtype)])
                   for k, v in self.stacked.items()}
        return TaskVectors._from_parts(self.tasks + [name], self.device, self.keys, self.frozen, self.base, stacked)

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    @property
    def matrices(self) -> list[str]:
        return [k for k in self.keys if is_matrix(k, self.base[k].shape)]

    def numel(self) -> int:
        return sum(v.numel() for v in self.base.values())

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.stacked.values())

    def task_vector(self, i: int) -> dict[str, torch.Tensor]:
        """τi per key (fp32)."""
        return {k: self.row(k, i) for k in self.keys}

    def expert(self, i: int) -> dict[str, torch.Tensor]:
        """θi rebuilt from the base and its task vector."""
        return {k: self.base[k] + d for k, d in self.task_vector(i).items()}
