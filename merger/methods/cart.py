"""CART: centred low-rank merging (Choi et al., Revisiting weight averaging for model merging, arXiv
2412.12153).

Per attention/MLP matrix (Eq. 4), with θavg = (1/T) Σt θt (Eq. 1) and the centred task vectors
τ̄t = θt − θavg (Eq. 3):

    θ = θavg + λ Σt SVD_k(τ̄t),   SVD_k(X) = Σ_{i ≤ k} σi ui viᵀ,   k = ⌈γ · r⌉ (Algorithm 1, line 6)

and θavg elsewhere. SVD_k(X) = X Vk Vkᵀ = Uk Ukᵀ X (the projection on the top-k singular vectors of
X's smaller side), so the preparation keeps each τ̄t's singular vectors of that side ([T, r, r]) and a
rank move (derive) projects the centred task vectors on their first k; a λ move is one scale.
"""
from __future__ import annotations

import torch

from merger.accel import accelerable
from merger.methods.registry import (CART_README, LAM, MATRICES_NOTE, RANK_RATIO, Method, Paper, Published, each,
                                     frange, kept_rank, register, sum_weights, with_default)
from merger.methods.spectral import singular_basis
from merger.pool.task_vectors import TaskVectors


@accelerable
def prepare_cart(tv: TaskVectors, progress=None, cancel=None) -> dict:
    """τ̄ = mean τ (θavg − θ0) for every tensor; per matrix the singular vectors of each centred τ̄t's
    smaller side, largest first ([T, r, r], fp32 from fp64)."""
    mean = {k: v.mean(0) for k, v in tv.items32()}
    basis = {}
    for key in each(tv.matrices, progress, cancel, "spectra of matrix"):
        centred = tv.fp32(key) - mean[key]  # τ̄t = τt − τ̄ = θt − θavg (Eq. 3)
        basis[key] = torch.stack([singular_basis(x, f"CART, {key}, expert {tv.tasks[t]}").float()
                                  for t, x in enumerate(centred)])
    return {"tv": tv, "mean": mean, "basis": basis}


def low_rank_sum(centred: torch.Tensor, basis: torch.Tensor, k: int) -> torch.Tensor:
    """Σt SVD_k(τ̄t) of one matrix from the centred task vectors [T, m, n] and their bases [T, r, r]."""
    top = basis[:, :, :k]
    if centred.shape[1] >= centred.shape[2]:  # tall or square: SVD_k(X) = X Vk Vkᵀ
        return sum(x @ v @ v.mT for x, v in zip(centred, top))
    return sum(u @ (u.mT @ x) for x, u in zip(centred, top))  # wide: Uk Ukᵀ X


@accelerable
def rank_sums(prepared: dict, rank_ratio: float, near=()) -> dict:
    """CART's derive step: Σt SVD_k(τ̄t) per matrix at one rank ("sums"; None where it is zero: k = 0, or
    full rank, where the centred task vectors sum to zero) and its k ("ranks"), so that a λ move is one axpy.
    ``near``: states derived before from this preparation (the session's), which a drop-in may start from."""
    tv, mean = prepared["tv"], prepared["mean"]
    sums, ranks = {}, {}
    for key, basis in prepared["basis"].items():
        m, n = tv.base[key].shape
        k = ranks[key] = kept_rank(rank_ratio, m, n)
        sums[key] = low_rank_sum(tv.fp32(key) - mean[key], basis, k) if 0 < k < min(m, n) else None
    return {"mean": mean, "sums": sums, "ranks": ranks}


def apply_cart(derived: dict, lam: float, rank_ratio: float) -> dict:
    mean, sums = derived["mean"], derived["sums"]
    return {k: (v if sums.get(k) is None else torch.add(v, sums[k], alpha=lam)) for k, v in mean.items()}


def cart_task_parts(prepared: dict, rank_ratio: float) -> dict:
    """Per matrix, each task's SVD_k(τ̄t) stacked [T, m, n] (AdaMerging+CART's parts, Eq. 8)."""
    tv, out = prepared["tv"], {}
    for key, basis in prepared["basis"].items():
        centred = tv.fp32(key) - prepared["mean"][key]
        k = kept_rank(rank_ratio, *tv.base[key].shape)
        out[key] = torch.stack([low_rank_sum(x[None], b[None], k) for x, b in zip(centred, basis)])
    return out


def cart_note(params, prepared) -> str | None:
    if params.get("rank_ratio", 0) >= 1.0:
        return "λ has no effect: at full rank CART equals weight averaging."
    if prepared is not None and prepared["tv"].num_tasks == 1:
        return "λ has no effect: with one expert θavg is that expert, and θt − θavg is zero."
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
    derive=rank_sums,
    derive_params=("rank_ratio",),
    derive_near=True,
    apply=apply_cart,
    note=cart_note,
    tune_grid={"lam": frange(0.5, 3.0, 0.25), "rank_ratio": (0.04, 0.08, 0.16, 0.32)},
    weights=sum_weights("average"),
    conventions=MATRICES_NOTE + " k = ⌈rank_ratio · r⌉ with r = min(m, n), as the paper's Algorithm 1 (the authors' "
                "code rounds down: max(1, ⌊γ · min(m, n)⌋), one rank fewer at most ratios). Singular vectors in fp64.",
    published=(Published("ViT-B-32", 84.7, CART_README), Published("ViT-L-14", 92.6, CART_README)),
))
