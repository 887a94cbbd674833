"""Low-rank and spectral merges: CART, TSV-M, Iso-C.

Each SVD is taken once in prepare, so a rank change is a slice and a λ change is a scale.
"""
from __future__ import annotations

import math

import torch

from merger.methods.registry import (CART_README, LAM, RANK_RATIO, RECOLLECTION, Method, Paper, Published, each, frange,
                                     kept_rank, register, sum_weights, with_default)
from merger.pool.task_vectors import TaskVectors

MATRICES_NOTE = ("Matrices = the 2-D attention and MLP weights (in_proj, out_proj, c_fc, c_proj); "
                 "every other tensor (biases, norms, embeddings, conv1, visual projection) is 'other'.")


def _svd(x: torch.Tensor):
    return torch.linalg.svd(x, full_matrices=False)


# ---- CART ---------------------------------------------------------------------------------

def prepare_cart(tv: TaskVectors, progress=None, cancel=None) -> dict:
    """Mean task vector τ̄, and per matrix the SVD of every centred θt − θavg = τt − τ̄."""
    mean = {k: v.mean(0) for k, v in tv.stacked.items()}
    factors = {}
    for k in each(tv.matrices, progress, cancel, "SVD of matrix"):
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


CART = register(Method(
    name="cart",
    slow_prepare=True,
    featured=True,
    display_name="CART (centred low-rank)",
    paper=Paper("Revisiting weight averaging for model merging", "2412.12153"),
    description="θavg + λ Σt SVD_k(θt − θavg) on attention/MLP matrices, θavg elsewhere.",
    params=(with_default(LAM, 1.5), RANK_RATIO),
    prepare=prepare_cart,
    apply=apply_cart,
    note=cart_note,
    tune_grid={"lam": frange(0.5, 3.0, 0.25), "rank_ratio": (0.04, 0.08, 0.16, 0.32)},
    weights=sum_weights("average"),
    conventions=MATRICES_NOTE + " k = ⌈rank_ratio · r⌉ as the paper's Algorithm 1 (the authors' code rounds "
                "down: max(1, ⌊γ · min(m, n)⌋), one rank fewer at most ratios).",
    published=(Published("ViT-B-32", 84.7, CART_README), Published("ViT-L-14", 92.6, CART_README)),
))


# ---- TSV-M --------------------------------------------------------------------------------

def _orthogonal_factor(x: torch.Tensor) -> torch.Tensor:
    """Nearest matrix with orthonormal columns (or rows): X = P S Qᵀ → P Qᵀ."""
    p, _, qh = _svd(x)
    return p @ qh


def prepare_tsv(tv: TaskVectors, progress=None, cancel=None) -> dict:
    mean = {k: v.mean(0) for k, v in tv.stacked.items()}
    # u [T,m,r], s [T,r], vh [T,r,n]
    factors = {k: _svd(tv.stacked[k]) for k in each(tv.matrices, progress, cancel, "SVD of matrix")}
    return {"mean": mean, "factors": factors, "T": tv.num_tasks}


def tsv_rank(rank_ratio, m: int, n: int, T: int) -> int:
    """TSV-M's kept rank per task: "auto" is exactly ⌊r/T⌋ (the authors' int(r · 1/T)), else
    ⌊rank_ratio · r⌋; r = min(m, n). Either way T·k ≤ r (the ratio is capped at 1/T)."""
    r = min(m, n)
    if rank_ratio == "auto":
        return r // T
    return min(r // T, math.floor(rank_ratio * r + 1e-9))


def tsv_direction(prepared: dict, rank_ratio) -> dict:
    """The merged direction at one rank (TSV-M's derive step: cached per rank by the session)."""
    out = dict(prepared["mean"])
    for key, (u, s, vh) in prepared["factors"].items():
        T, m, _ = u.shape
        k = tsv_rank(rank_ratio, m, vh.shape[2], T)
        if k == 0:  # fewer dimensions than tasks: no task keeps a singular vector here
            out[key] = torch.zeros_like(prepared["mean"][key])
            continue
        u_cat = u[:, :, :k].permute(1, 0, 2).reshape(m, T * k)
        v_cat = vh[:, :k, :].reshape(T * k, -1).T
        s_cat = s[:, :k].reshape(-1)
        out[key] = (_orthogonal_factor(u_cat) * s_cat) @ _orthogonal_factor(v_cat).T
    return out


def apply_tsv(direction: dict, lam: float, rank_ratio) -> dict:
    return {k: v * lam for k, v in direction.items()}


TSV_M = register(Method(
    name="tsv_m",
    slow_prepare=True,
    display_name="TSV-Merge",
    paper=Paper("Task singular vectors: reducing task interference in model merging", "2412.00081"),
    description="Per matrix, top-k singular vectors of each τt, concatenated and orthogonalised, "
                "rebuilt with their singular values; mean τ elsewhere; θ0 + λ·that.",
    params=(LAM, with_default(RANK_RATIO, "auto", auto="k = ⌊r/T⌋",
                              help="kept rank per task k = ⌊rank_ratio · r⌋, r = min(m, n); auto (default): "
                                   "exactly ⌊r/T⌋ as the authors' code; at most 1/T, so that T·k ≤ r")),
    prepare=prepare_tsv,
    derive=tsv_direction,
    derive_params=("rank_ratio",),
    apply=apply_tsv,
    tune_grid={"lam": frange(0.5, 2.0, 0.1)},
    weights=sum_weights("mean"),
    limits_for=lambda T: {"rank_ratio": (1.0 / T, "TSV-M concatenates T·k singular vectors, which must not "
                                                   "exceed the rank r (k ≤ ⌊r/T⌋); use auto for exactly ⌊r/T⌋")},
    conventions=MATRICES_NOTE + " The TSV authors' code also decomposes the positional embedding and the visual "
                "projection; here those get the mean. The default rank is exactly ⌊r/T⌋ (auto).",
    published=(Published("ViT-B-32", 85.9, RECOLLECTION, verified=False),),
))


# ---- Iso-C --------------------------------------------------------------------------------

def prepare_iso(tv: TaskVectors, progress=None, cancel=None) -> dict:
    # The mean task vector off the matrices, as the authors' code and FusionBench do: with a λ
    # near 1.3 a sum would move biases, norms and embeddings T times too far.
    direction = {k: v.mean(0) for k, v in tv.stacked.items()}
    for k in each(tv.matrices, progress, cancel, "SVD of matrix"):
        u, s, vh = _svd(tv.stacked[k].sum(0))
        direction[k] = (u @ vh) * s.mean()  # flatten the spectrum of Σ τt: Σ → σ̄ I
    return {"direction": direction}


def apply_iso(prepared: dict, lam: float) -> dict:
    return {k: v * lam for k, v in prepared["direction"].items()}


ISO_C = register(Method(
    name="iso_c",
    slow_prepare=True,
    display_name="Iso-C",
    paper=Paper("No task left behind: isotropic model merging with common and task-specific "
                "subspaces", "2502.04959"),
    description="Per matrix, Σ τt = U Σ Vᵀ with Σ replaced by its mean singular value; the mean τ elsewhere; "
                "θ0 + λ·that.",
    params=(with_default(LAM, 1.3),),
    prepare=prepare_iso,
    apply=apply_iso,
    tune_grid={"lam": frange(0.5, 2.0, 0.1)},
    weights=sum_weights("sum"),
    conventions=MATRICES_NOTE + " The Iso authors' code treats every 2-D tensor but the embeddings as a matrix "
                "(so also the visual projection, which gets the mean here).",
    published=(Published("ViT-B-32", 86.3, RECOLLECTION, verified=False),),
))
