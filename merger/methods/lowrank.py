"""Low-rank and spectral merges: CART, TSV-M, Iso-C.

Each SVD is taken once in prepare, so a rank change is a slice and a λ change is a scale.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..task_vectors import TaskVectors
from .registry import LAM, RANK_RATIO, Method, Paper, kept_rank, register, with_default


def _svd(x: torch.Tensor):
    return torch.linalg.svd(x, full_matrices=False)


# ---- CART ---------------------------------------------------------------------------------

def prepare_cart(tv: TaskVectors) -> dict:
    """Mean task vector τ̄, and per matrix the SVD of every centred θt − θavg = τt − τ̄."""
    mean = {k: v.mean(0) for k, v in tv.stacked.items()}
    factors = {}
    for k in tv.matrices:
        u, s, vh = _svd(tv.stacked[k] - mean[k])  # batched over tasks: [T,m,r], [T,r], [T,r,n]
        factors[k] = (u * s[:, None, :], vh)
    return {"mean": mean, "factors": factors, "T": tv.num_tasks}


def _factors(us: torch.Tensor, vh: torch.Tensor, k: int):
    """Top-k factors of every task side by side, so Σt SVD_k(Mt) is one matmul."""
    T, m, _ = us.shape
    return us[:, :, :k].permute(1, 0, 2).reshape(m, T * k), vh[:, :k, :].reshape(T * k, vh.shape[-1])


def low_rank_sum(us: torch.Tensor, vh: torch.Tensor, k: int) -> torch.Tensor:
    """Σt SVD_k(Mt) from the stacked factors us = U·S [T,m,r] and vh [T,r,n]."""
    return torch.mm(*_factors(us, vh, k))


def cart_delta(prepared: dict, lam: float, rank) -> dict:
    """Δ = τ̄ + λ Σt SVD_k(τt − τ̄) on matrices, τ̄ elsewhere. ``rank(m, n) -> k`` (k may be 0)."""
    delta = dict(prepared["mean"])
    for key, (us, vh) in prepared["factors"].items():
        m, n = us.shape[1], vh.shape[2]
        k = rank(m, n)
        if 0 < k < min(m, n):  # at k = 0 and at full rank the low-rank sum is exactly zero
            delta[key] = torch.addmm(prepared["mean"][key], *_factors(us, vh, k), alpha=lam)
    return delta


def apply_cart(prepared: dict, lam: float, rank_ratio: float) -> dict:
    return cart_delta(prepared, lam, lambda m, n: kept_rank(rank_ratio, m, n))


def cart_note(params, prepared) -> str | None:
    if params.get("rank_ratio", 0) >= 1.0:
        return "λ has no effect: at full rank CART equals weight averaging."
    return None


register(Method(
    name="cart",
    display_name="CART (centred low-rank)",
    paper=Paper("Revisiting weight averaging for model merging", "2412.12153"),
    description="θavg + λ Σt SVD_k(θt − θavg) on attention/MLP matrices, θavg elsewhere.",
    params=(with_default(LAM, 1.5), RANK_RATIO),
    prepare=prepare_cart,
    apply=apply_cart,
    note=cart_note,
))


# ---- TSV-M --------------------------------------------------------------------------------

def _orthogonal_factor(x: torch.Tensor) -> torch.Tensor:
    """Nearest matrix with orthonormal columns (or rows): X = P S Qᵀ → P Qᵀ."""
    p, _, qh = _svd(x)
    return p @ qh


def prepare_tsv(tv: TaskVectors) -> dict:
    mean = {k: v.mean(0) for k, v in tv.stacked.items()}
    factors = {k: _svd(tv.stacked[k]) for k in tv.matrices}  # u [T,m,r], s [T,r], vh [T,r,n]
    return {"mean": mean, "factors": factors, "T": tv.num_tasks, "by_rank": OrderedDict()}


def _tsv_direction(prepared: dict, rank_ratio: float) -> dict:
    cache = prepared["by_rank"]
    if rank_ratio in cache:
        cache.move_to_end(rank_ratio)
        return cache[rank_ratio]
    out = dict(prepared["mean"])
    for key, (u, s, vh) in prepared["factors"].items():
        T, m, _ = u.shape
        k = kept_rank(rank_ratio, m, vh.shape[2])
        u_cat = u[:, :, :k].permute(1, 0, 2).reshape(m, T * k)
        v_cat = vh[:, :k, :].reshape(T * k, -1).T
        s_cat = s[:, :k].reshape(-1)
        out[key] = (_orthogonal_factor(u_cat) * s_cat) @ _orthogonal_factor(v_cat).T
    cache[rank_ratio] = out
    while len(cache) > 4:
        cache.popitem(last=False)
    return out


def apply_tsv(prepared: dict, lam: float, rank_ratio: float) -> dict:
    return {k: v * lam for k, v in _tsv_direction(prepared, rank_ratio).items()}


register(Method(
    name="tsv_m",
    display_name="TSV-Merge",
    paper=Paper("Task singular vectors: reducing task interference in model merging", "2412.00081"),
    description="Per matrix, top-k singular vectors of each τt, concatenated and orthogonalised, "
                "rebuilt with their singular values; mean τ elsewhere; θ0 + λ·that.",
    params=(LAM, with_default(RANK_RATIO, None)),
    prepare=prepare_tsv,
    apply=apply_tsv,
    defaults_for=lambda T: {"rank_ratio": round(1.0 / T, 6)},
))


# ---- Iso-C --------------------------------------------------------------------------------

def prepare_iso(tv: TaskVectors) -> dict:
    direction = {k: v.sum(0) for k, v in tv.stacked.items()}
    for k in tv.matrices:
        u, s, vh = _svd(direction[k])
        direction[k] = (u @ vh) * s.mean()  # flatten the spectrum: Σ → σ̄ I
    return {"direction": direction}


def apply_iso(prepared: dict, lam: float) -> dict:
    return {k: v * lam for k, v in prepared["direction"].items()}


register(Method(
    name="iso_c",
    display_name="Iso-C",
    paper=Paper("No task left behind: isotropic model merging with common and task-specific "
                "subspaces", "2502.04959"),
    description="Per matrix, Σ τt = U Σ Vᵀ with Σ replaced by its mean singular value; Σ τt elsewhere; θ0 + λ·that.",
    params=(with_default(LAM, 1.3),),
    prepare=prepare_iso,
    apply=apply_iso,
))
