"""CART's rank sums (merger/methods/cart.py, ``rank_sums``) from a rank derived before: Σt SVD_k(τ̄t) =
Σt τ̄t V_k V_kᵀ (tall; U_k U_kᵀ τ̄t wide), so the sum at k is the sum at a nearby k0 plus (or minus)
the directions between them, k0..k; and from scratch above half the rank, the complement: the centred
task vectors sum to zero, so Σt τ̄t V_k V_kᵀ = −Σt τ̄t V_tail V_tailᵀ (the directions k..r). A slider
step of 0.01 then costs 8 directions per task on a 768-wide matrix, not k. Each update adds one fp32
rounding of the sum (about 1e-7 of it); a chain of updates is cut at CHAIN."""
from __future__ import annotations

import torch

from merger.accel.registry import drop_in
from merger.methods.registry import kept_rank

CHAIN = 16  # a sum is updated from one updated before at most this many times, then recomputed


def _projected(tv, key: str, mean: torch.Tensor, basis: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Σt of τ̄t = τt − τ̄ projected on its singular directions lo..hi (bases [T, r, r]): each τt read once
    in fp32, the centring applied to the projection (τt V − τ̄ V), the T products joined in one."""
    part = basis[:, :, lo:hi]
    if mean.shape[0] >= mean.shape[1]:  # Σt (τ̄t Vt) Vtᵀ
        coords = [tv.row(key, t) @ v - mean @ v for t, v in enumerate(part)]
        return torch.cat(coords, 1) @ torch.cat([v.mT for v in part], 0)
    coords = [u.mT @ tv.row(key, t) - u.mT @ mean for t, u in enumerate(part)]  # Σt Ut (Utᵀ τ̄t)
    return torch.cat(list(part), 1) @ torch.cat(coords, 0)


@drop_in("merger.methods.cart.rank_sums",
         "from the nearest rank derived before (the directions in between), or the complement above half the rank")
def rank_sums(reference, prepared: dict, rank_ratio: float, near=()) -> dict:
    tv, mean = prepared["tv"], prepared["mean"]
    out = {"mean": mean, "sums": {}, "ranks": {}, "chains": {}}
    for key, basis in prepared["basis"].items():
        m, n = tv.base[key].shape
        r, k = min(m, n), kept_rank(rank_ratio, m, n)
        out["ranks"][key], out["chains"][key] = k, 0
        if not 0 < k < r:
            out["sums"][key] = None
            continue
        usable = [d for d in near if d["sums"].get(key) is not None and d.get("chains", {}).get(key, 0) < CHAIN]
        start = min(usable, key=lambda d: (abs(d["ranks"][key] - k), d.get("chains", {}).get(key, 0)), default=None)
        if start is not None and abs(start["ranks"][key] - k) < min(k, r - k):
            k0 = start["ranks"][key]
            step = _projected(tv, key, mean[key], basis, *sorted((k0, k)))
            out["sums"][key] = start["sums"][key] + step if k > k0 else start["sums"][key] - step
            out["chains"][key] = start.get("chains", {}).get(key, 0) + 1
        else:
            out["sums"][key] = (_projected(tv, key, mean[key], basis, 0, k) if 2 * k <= r
                                else -_projected(tv, key, mean[key], basis, k, r))
    return out
