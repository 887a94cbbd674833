"""CART's rank sums (merger/methods/cart.py, ``rank_sums``) from a rank derived before: Σt SVD_k(τ̄t) =
Σt τ̄t V_k V_kᵀ (tall; U_k U_kᵀ τ̄t wide), so the sum at k is the sum at a nearby k0 plus (or minus)
the directions between them, k0..k; and from scratch above half the rank, the complement: the centred
task vectors sum to zero, so Σt τ̄t V_k V_kᵀ = −Σt τ̄t V_tail V_tailᵀ (the directions k..r). A slider
step of 0.01 then costs 8 directions per task on a 768-wide matrix, not k. Each update adds one fp32
rounding of the sum (about 1e-7 of it); a chain of updates is cut at CHAIN.

The preparation (``prepare_cart``) also keeps each centred task vector's coordinates on its first
⌈r · HEAD⌉ directions (τ̄t V_h [m, h], or U_hᵀ τ̄t [h, n] on a wide matrix; fp32): a sum over those
directions is then one product of stored factors, without reading the task vectors again (a rank move
up to 0.125: the default 0.08 and the paper's grid to 0.08)."""
from __future__ import annotations

import math

import torch

from merger.accel.registry import drop_in
from merger.methods.registry import kept_rank

CHAIN = 16  # a sum is updated from one updated before at most this many times, then recomputed
HEAD = 0.125  # of each matrix's rank, the directions whose coordinates the preparation keeps


def _tall(x: torch.Tensor) -> bool:
    return x.shape[0] >= x.shape[1]


@drop_in("merger.methods.cart.prepare_cart",
         "the reference's preparation and each task's coordinates on its first eighth of directions")
def prepare_cart(reference, tv, progress=None, cancel=None) -> dict:
    prepared = reference(tv, progress=progress, cancel=cancel)
    head = {}
    for key, basis in prepared["basis"].items():
        h = math.ceil(HEAD * basis.shape[-1])
        mean, top = prepared["mean"][key], basis[:, :, :h]
        if _tall(mean):
            head[key] = torch.stack([tv.row(key, t) @ v - mean @ v for t, v in enumerate(top)])  # [T, m, h]
        else:
            head[key] = torch.stack([u.mT @ tv.row(key, t) - u.mT @ mean for t, u in enumerate(top)])  # [T, h, n]
    return {**prepared, "head": head}


def _projected(prepared: dict, key: str, lo: int, hi: int, start=None, sign: float = 1.0) -> torch.Tensor:
    """start + sign · Σt of τ̄t = τt − τ̄ projected on its singular directions lo..hi (bases [T, r, r]), in one
    product joining the T tasks: from the kept coordinates where they reach hi, else each τt read once in
    fp32, the centring applied to the projection (τt V − τ̄ V)."""
    tv, mean, basis = prepared["tv"], prepared["mean"][key], prepared["basis"][key]
    part = basis[:, :, lo:hi]
    head = prepared.get("head", {}).get(key)
    if head is not None and hi <= (head.shape[2] if _tall(mean) else head.shape[1]):
        coords = list(head[:, :, lo:hi]) if _tall(mean) else list(head[:, lo:hi])
    elif _tall(mean):
        coords = [tv.row(key, t) @ v - mean @ v for t, v in enumerate(part)]  # τ̄t Vt
    else:
        coords = [u.mT @ tv.row(key, t) - u.mT @ mean for t, u in enumerate(part)]  # Utᵀ τ̄t
    # Σt (τ̄t Vt) Vtᵀ, or Σt Ut (Utᵀ τ̄t) on a wide matrix
    a, b = (torch.cat(coords, 1), torch.cat([v.mT for v in part], 0)) if _tall(mean) else \
        (torch.cat(list(part), 1), torch.cat(coords, 0))
    if start is None:
        return torch.mm(a, b) if sign > 0 else torch.mm(a, b).neg_()
    return torch.addmm(start, a, b, alpha=sign)


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
            out["sums"][key] = _projected(prepared, key, *sorted((k0, k)), start["sums"][key], 1.0 if k > k0 else -1.0)
            out["chains"][key] = start.get("chains", {}).get(key, 0) + 1
        else:
            out["sums"][key] = (_projected(prepared, key, 0, k) if 2 * k <= r
                                else _projected(prepared, key, k, r, sign=-1.0))
    return out
