"""Iso-C and Iso-CTS: isotropic merging in common and task-specific subspaces (Marczak et al.,
arXiv 2502.04959; the authors' code: iso.py, FusionBench's isotropic_merging/iso_utils.py).

Per attention/MLP matrix, with τt = θt − θ0 and r = min(m, n):

- Iso-C: Σt τt = U Σ Vᵀ; the spectrum flattened to its mean, Δ = σ̄ U Vᵀ (σ̄ = the mean of all r
  singular values).
- Iso-CTS: the common subspace U_c, V_c = the top c singular vectors of Σt τt; each task's top q
  directions once the common subspace is projected out of it, τt − U_c U_cᵀ τt; U = [U_c, U_1 … U_T]
  and V = [V_c, V_1 … V_T] replaced by their orthogonal factors; Δ = σ̄ U⊥ V⊥ᵀ, σ̄ the mean of the
  c + T·q singular values kept.

Every other tensor: the mean task vector. Merged: θ0 + λ Δ. Both prepare Δ/λ whole: λ is one scale.
"""
from __future__ import annotations

import torch

from merger.accel import accelerable
from merger.methods.registry import (LAM, MATRICES_NOTE, RECOLLECTION, Method, Paper, Param, Published, each, frange,
                                     lam_times, register, sum_weights, with_default)
from merger.methods.spectral import NULL, finite, kept, polar, polar_factor, top_svd
from merger.pool.task_vectors import TaskVectors

PAPER = Paper("No task left behind: isotropic model merging with common and task-specific subspaces", "2502.04959")
COMMON = Param("common_fraction", 0.8, 0.0, 1.0, 0.05, label="common subspace fraction",
               help="share of the rank r given to the common subspace of Σ τ; the rest is split evenly between the "
                    "tasks' own directions (1: Iso-C)")


def iso_c_matrix(stack: torch.Tensor, what: str) -> torch.Tensor:
    """Iso-C's Δ/λ of one matrix from its task vectors [T, m, n], fp64."""
    s, factor = polar_factor(stack.double().sum(0), what)  # Σ τt = U Σ Vᵀ
    return s.mean() * factor  # Σ → σ̄ I


def split_rank(r: int, T: int, common_fraction: float) -> tuple[int, int]:
    """(c common directions, q per task) as the authors' code: the task-specific total rounded to a
    multiple of T, the common part the rest (q capped so that T·q ≤ r)."""
    q = min(r // T, round((r - int(r * common_fraction)) / T))
    return r - q * T, q


@accelerable
def iso_cts_matrix(stack: torch.Tensor, c: int, q: int, what: str) -> torch.Tensor:
    """Iso-CTS's Δ/λ of one matrix from its task vectors [T, m, n], with c common directions and q per
    task (``split_rank``), fp64."""
    stack = finite(stack, what).double()
    u_c, s_c, vh_c = top_svd(stack.sum(0), c, f"{what}, Σ τ")  # the common subspace
    if q == 0:  # every direction is common: Iso-C
        return iso_c_matrix(stack, what)
    values, rows_u, rows_v = [s_c], [u_c.mT], [vh_c]
    for t, tau in enumerate(stack):
        residual = tau - u_c @ (u_c.mT @ tau)  # τt with the common subspace projected out
        u_t, s_t, vh_t = top_svd(residual, q, f"{what}, expert {t + 1}'s own directions")
        values.append(s_t)
        rows_u.append(u_t.mT)
        rows_v.append(vh_t)
    sigma = torch.cat(values).mean()  # over the c + T·q kept directions
    _, u, vh = kept(torch.cat(values), torch.cat(rows_u), torch.cat(rows_v))
    return sigma * (polar(u.mT, what) @ polar(vh, what))


def prepare_iso_c(tv: TaskVectors, progress=None, cancel=None) -> dict:
    # Off the matrices the mean task vector, as the authors' code and FusionBench: with λ near 1.3 a sum
    # would move biases, norms and embeddings T times too far.
    direction = {k: v.mean(0) for k, v in tv.items32()}
    for key in each(tv.matrices, progress, cancel, "SVD of matrix"):
        direction[key] = iso_c_matrix(tv.stacked[key], f"Iso-C, {key}").float()
    return {"direction": direction}


def prepare_iso_cts(tv: TaskVectors, common_fraction: float, progress=None, cancel=None) -> dict:
    direction = {k: v.mean(0) for k, v in tv.items32()}  # off the matrices: the mean task vector, as Iso-C
    for key in each(tv.matrices, progress, cancel, "subspaces of matrix"):
        c, q = split_rank(min(tv.base[key].shape), tv.num_tasks, common_fraction)
        direction[key] = iso_cts_matrix(tv.stacked[key], c, q, f"Iso-CTS, {key}").float()
    return {"direction": direction}


NULL_NOTE = (f" Directions whose singular value is under {NULL:g} of the largest (a rank-deficient Σ τ, as low-rank "
             "experts give) are left out of U Vᵀ: their vectors are arbitrary (the authors' code keeps them). Computed "
             "in fp64.")

ISO_C = register(Method(
    name="iso_c",
    slow_prepare=True,
    display_name="Iso-C",
    paper=PAPER,
    description="Per matrix, Σ τt = U Σ Vᵀ with Σ replaced by its mean singular value; the mean τ elsewhere; "
                "θ0 + λ·that.",
    params=(with_default(LAM, 1.3),),
    prepare=prepare_iso_c,
    apply=lam_times("direction"),
    tune_grid={"lam": frange(0.1, 3.0, 0.1)},  # the authors' grid (0, 3]
    weights=sum_weights("sum"),
    conventions=MATRICES_NOTE + " The Iso authors' code treats every 2-D tensor but the embeddings as a matrix "
                "(so also the visual projection, which gets the mean here)." + NULL_NOTE,
    published=(Published("ViT-B-32", 86.3, RECOLLECTION, verified=False),),
))

ISO_CTS = register(Method(
    name="iso_cts",
    slow_prepare=True,
    display_name="Iso-CTS",
    paper=PAPER,
    description="Per matrix, the top directions of Σ τ (the common subspace) and each τt's top directions outside "
                "it, orthogonalised together, all with the mean singular value; the mean τ elsewhere; θ0 + λ·that.",
    params=(with_default(LAM, 1.5), COMMON),
    prepare=prepare_iso_cts,
    prepare_params=("common_fraction",),
    apply=lam_times("direction"),
    tune_grid={"lam": frange(0.1, 3.0, 0.1)},  # the authors' grid (0, 3]
    weights=ISO_C.weights,
    conventions=MATRICES_NOTE + " Rank split as the authors' code: c = r − T·round((r − ⌊f·r⌋)/T) common, "
                "(r − c)/T per task; the mean singular value is taken over all r kept directions." + NULL_NOTE,
    published=(Published("ViT-B-32", 86.2, RECOLLECTION, verified=False),),
))
