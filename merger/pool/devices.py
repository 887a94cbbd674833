"""Where a pool's tensors live: a device named by the user, checked; and whether its task vectors
fit in that device's free memory, said before anything is loaded."""
from __future__ import annotations

from typing import Mapping

import torch

from merger.errors import PoolError


def resolve_device(device) -> torch.device:
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise PoolError(f"device {device!r}: not a device (cpu, cuda or cuda:N)") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise PoolError(f"device {device}: CUDA is not available on this machine (use --device cpu)")
    return d


def estimate_bytes(base: Mapping[str, torch.Tensor], n_experts: int, tv_dtype: str = "auto") -> int:
    """Resident bytes of the stacked task vectors (in their storage dtype) plus the fp32 base of the merged keys."""
    from merger.io.checkpoints import merge_scope
    from merger.pool.task_vectors import storage_dtype

    merged = sum(base[k].numel() for k in merge_scope(base) if base[k].is_floating_point())
    size = torch.empty((), dtype=storage_dtype(tv_dtype, merged * n_experts)).element_size()
    return size * merged * n_experts + 4 * merged


def check_memory(base, n_experts: int, device: torch.device, source: str, tv_dtype: str = "auto") -> None:
    """Refuse before loading when the task vectors will not fit in the device's free memory."""
    if device.type != "cuda":
        return
    need = estimate_bytes(base, n_experts, tv_dtype)
    free, _ = torch.cuda.mem_get_info(device)
    if need > 0.85 * free:
        raise PoolError(
            f"{source}: {n_experts} experts need about {need / 2**30:.1f} GB of task vectors on {device}, "
            f"{free / 2**30:.1f} GB is free. Keep them in host memory with --tv-device cpu, or merge fewer experts.")
