"""TSV-M: Task Singular Vectors merging (Gargiulo et al., arXiv 2412.00081; the authors' code:
TSVM_utils.py, compute_and_sum_svd_mem_reduction).

Per attention/MLP matrix, with τt = θt − θ0:

1. each τt's top-k singular triplets, τt ≈ Ut,k St,k Vt,kᵀ, k = ⌊r/T⌋ by default (r = min(m, n));
2. concatenated: U = [U1,k … UT,k] (m × T·k), S = diag(S1,k … ST,k), V = [V1,k … VT,k] (n × T·k);
3. U and V replaced by their orthogonal factors (U = P Σ Qᵀ → P Qᵀ, the nearest matrix with
   orthonormal columns): the tasks' directions decorrelated;
4. Δ = U⊥ S V⊥ᵀ. Every other tensor: the mean task vector. Merged: θ0 + λ Δ.

The preparation keeps each task's top ⌊r/T⌋ triplets (the most any rank the slider reaches keeps) and
the default rank's Δ; a rank move (derive) concatenates the first k of each and orthogonalises them.
"""
from __future__ import annotations

import math

import torch

from merger.methods.registry import (LAM, MATRICES_NOTE, RANK_RATIO, RECOLLECTION, Method, Paper, Published, each,
                                     frange, lam_times, register, sum_weights, with_default)
from merger.methods.spectral import NULL, kept, polar, top_svd
from merger.pool.task_vectors import TaskVectors


def tsv_rank(rank_ratio, m: int, n: int, T: int) -> int:
    """k per task: "auto" is exactly ⌊r/T⌋ (the authors' int(r · 1/T)), else ⌊rank_ratio · r⌋, at most
    ⌊r/T⌋ so that T·k ≤ r; r = min(m, n)."""
    r = min(m, n)
    if rank_ratio == "auto":
        return r // T
    return min(r // T, math.floor(rank_ratio * r + 1e-9))


def tsv_matrix(u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor, k: int, what: str) -> torch.Tensor:
    """Δ of one matrix at rank k from each task's top triplets u [T, m, K], s [T, K], vh [T, K, n] (K ≥ k),
    in fp64. A triplet whose singular value is numerically zero (a task vector of rank < k here, as LoRA
    experts have) carries no direction: it is left out of the concatenation (step 2)."""
    T, m, _ = u.shape
    if k == 0:  # fewer dimensions than tasks: no task keeps a singular vector here
        return u.new_zeros(m, vh.shape[2], dtype=torch.float64)
    parts = [kept(s[t, :k].double(), u[t, :, :k].double().mT, vh[t, :k].double()) for t in range(T)]
    S = torch.cat([p[0] for p in parts])  # step 2
    if S.numel() == 0:  # every τt is zero here
        return u.new_zeros(m, vh.shape[2], dtype=torch.float64)
    U = torch.cat([p[1] for p in parts]).mT  # [m, T·k]
    V = torch.cat([p[2] for p in parts]).mT  # [n, T·k]
    return (polar(U, what) * S) @ polar(V, what).mT  # steps 3 and 4: Δ = U⊥ S V⊥ᵀ


def prepare_tsv(tv: TaskVectors, progress=None, cancel=None) -> dict:
    """The mean τ off the matrices; per matrix each τt's top ⌊r/T⌋ triplets (fp32: rounded from fp64)
    and the default rank's Δ (from the fp64 triplets)."""
    T = tv.num_tasks
    matrices = set(tv.matrices)
    mean = {k: v.mean(0) for k, v in tv.items32() if k not in matrices}
    factors, auto = {}, {}
    for key in each(tv.matrices, progress, cancel, "spectra of matrix"):
        stack = tv.stacked[key]
        K = min(stack.shape[1:]) // T
        what = f"TSV-M, {key}"
        u, s, vh = (torch.stack(p) for p in zip(*(top_svd(tau, K, f"{what}, expert {tv.tasks[t]}")
                                                     for t, tau in enumerate(stack))))
        auto[key] = tsv_matrix(u, s, vh, K, what).float()
        factors[key] = (u.float(), s.float(), vh.float())
    return {"mean": mean, "factors": factors, "auto": {**mean, **auto}, "T": T}


def tsv_direction(prepared: dict, rank_ratio) -> dict:
    """Δ/λ at one rank (the derive step, cached per rank by the session): the default rank's from the
    preparation, any other from the stored triplets."""
    if rank_ratio == "auto":
        return prepared["auto"]
    out = dict(prepared["mean"])
    for key, (u, s, vh) in prepared["factors"].items():
        k = tsv_rank(rank_ratio, u.shape[1], vh.shape[2], u.shape[0])
        out[key] = tsv_matrix(u, s, vh, k, f"TSV-M, {key}").float()
    return out


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
    apply=lam_times(),
    tune_grid={"lam": frange(0.5, 2.0, 0.1)},
    weights=sum_weights("mean"),
    limits_for=lambda T: {"rank_ratio": (1.0 / T, "TSV-M concatenates T·k singular vectors, which must not "
                                                   "exceed the rank r (k ≤ ⌊r/T⌋); use auto for exactly ⌊r/T⌋")},
    conventions=MATRICES_NOTE + " The TSV authors' code also decomposes the positional embedding and the visual "
                "projection; here those get the mean. The default rank is exactly ⌊r/T⌋ (auto). Singular triplets "
                f"whose value is under {NULL:g} of a task's largest (a task vector of lower rank than k, as LoRA "
                "experts have) are left out of the concatenation: their vectors are arbitrary (the authors' code keeps "
                "them, and its merge then depends on the SVD routine). Computed in fp64.",
    published=(Published("ViT-B-32", 85.9, RECOLLECTION, verified=False),),
))
