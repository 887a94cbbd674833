"""Task vectors τt = θt − θ0, stacked per tensor on one device in fp32.

Only floating-point tensors of the merge scope (the image tower) are merged; integer buffers
are copied from the base. Stacking per tensor ([T, *shape]) lets every method reduce over
tasks with one vectorised op.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from merger.errors import MergerError
from merger.io.checkpoints import merge_scope

# The 2-D weights of attention and MLP blocks: what the low-rank methods treat as matrices.
MATRIX_SUFFIXES = ("attn.in_proj_weight", "attn.out_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def is_matrix(key: str, shape: Sequence[int]) -> bool:
    return len(shape) == 2 and key.endswith(MATRIX_SUFFIXES)


class TaskVectors:
    """Base weights and stacked task vectors for the merged keys, resident on ``device``."""

    def __init__(
        self,
        base: Mapping[str, torch.Tensor],
        experts: Mapping[str, Mapping[str, torch.Tensor]],
        device: str | torch.device = "cpu",
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
        self.stacked: dict[str, torch.Tensor] = {}
        for k in self.keys:
            out = torch.empty((len(self.tasks), *base[k].shape), dtype=torch.float32, device=self.device)
            for i, t in enumerate(self.tasks):
                out[i].copy_(experts[t][k])
                out[i].sub_(self.base[k])
            self.stacked[k] = out

    @classmethod
    def _from_parts(cls, tasks, device, keys, frozen, base, stacked) -> "TaskVectors":
        tv = cls.__new__(cls)
        tv.tasks, tv.device, tv.keys, tv.frozen, tv.base, tv.stacked = tasks, device, keys, frozen, base, stacked
        return tv

    def subset(self, tasks: Sequence[str]) -> "TaskVectors":
        """Task vectors of the named tasks, in the given order (no copy when nothing changes)."""
        tasks = list(tasks)
        if not tasks:
            raise MergerError("experts: empty subset, pick at least one expert")
        unknown = [t for t in tasks if t not in self.tasks]
        if unknown:
            raise MergerError(f"experts: unknown task(s) {', '.join(unknown)}; known: {', '.join(self.tasks)}")
        if len(set(tasks)) != len(tasks):
            raise MergerError(f"experts: a task is named twice in {', '.join(tasks)}")
        if tasks == self.tasks:
            return self
        idx = torch.tensor([self.tasks.index(t) for t in tasks], device=self.device)
        stacked = {k: v.index_select(0, idx) for k, v in self.stacked.items()}
        return TaskVectors._from_parts(tasks, self.device, self.keys, self.frozen, self.base, stacked)

    def scaled(self, weights: Mapping[str, float]) -> "TaskVectors":
        """Each named task's vector times its weight (a new object; the others as they are)."""
        w = torch.tensor([float(weights.get(t, 1.0)) for t in self.tasks], device=self.device)
        stacked = {k: v * w.view(-1, *([1] * (v.dim() - 1))) for k, v in self.stacked.items()}
        return TaskVectors._from_parts(self.tasks, self.device, self.keys, self.frozen, self.base, stacked)

    def extended(self, name: str, weights: Mapping[str, torch.Tensor]) -> "TaskVectors":
        """These task vectors and one more expert's (a new object; this one is unchanged)."""
        stacked = {k: torch.cat([v, (weights[k].to(self.device, torch.float32) - self.base[k])[None]])
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

    def expert(self, i: int) -> dict[str, torch.Tensor]:
        """θi rebuilt from the base and its task vector."""
        return {k: self.base[k] + self.stacked[k][i] for k in self.keys}
