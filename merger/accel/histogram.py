"""Order statistics of bf16 task vectors from a histogram of their magnitude codes: a bf16 number's
15 magnitude bits order as its magnitude does, so a count per code (2¹⁵ of them) gives the k-th
largest magnitude exactly, for every k at once, in one pass. A drop-in for TIES' thresholds
(merger/methods/ties.py): the same values bit for bit (tests/test_accel.py)."""
from __future__ import annotations

import torch

from merger.accel.registry import drop_in

CODES = 1 << 15


@drop_in("merger.methods.ties.magnitude_thresholds",
         "a count per bf16 magnitude code, read at each kept count; the reference for other dtypes")
def magnitude_thresholds(reference, rows: list[torch.Tensor], kept: list[int]) -> torch.Tensor:
    if not rows or any(r.dtype != torch.bfloat16 for r in rows):
        return reference(rows, kept)
    counts = torch.zeros(CODES, dtype=torch.int64)
    for r in rows:
        counts += torch.bincount(r.reshape(-1).view(torch.int16).bitwise_and(0x7FFF).int().cpu(), minlength=CODES)
    at_or_above = counts.flip(0).cumsum(0).flip(0)  # entries whose magnitude code is ≥ each code
    codes = [int((at_or_above >= k).nonzero().max()) for k in kept]
    return torch.tensor(codes, dtype=torch.int16).view(torch.bfloat16).float()
