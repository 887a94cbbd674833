"""Iso-CTS (Marczak et al., arXiv 2502.04959): Iso-C's common subspace (the top directions of Σ τ)
plus each task's own top directions outside it, orthogonalised together, with one flat spectrum."""
from __future__ import annotations

import torch

from merger.methods.lowrank import ISO_C, MATRICES_NOTE, _svd, per_matrix, spectral, unit_factors
from merger.methods.registry import (RECOLLECTION, Method, Param, Published, each, frange, lam_times, register,
                                     with_default)
COMMON = Param("common_fraction", 0.8, 0.0, 1.0, 0.05, label="common subspace fraction",
               help="share of the rank r given to the common subspace of Σ τ; the rest is split evenly between the "
                    "tasks' own directions (1: Iso-C)")


def split_rank(r: int, T: int, common_fraction: float) -> tuple[int, int]:
    """(common directions, directions per task) as the authors' code: the task-specific total is rounded
    to a multiple of T and the common part takes the rest (capped so that T · per task ≤ r)."""
    per_task = min(r // T, round((r - int(r * common_fraction)) / T))
    return r - per_task * T, per_task


def _polar(x: torch.Tensor) -> torch.Tensor:
    """The orthogonal factor U·Vᵀ of x = U S Vᵀ (the authors' orthogonalisation)."""
    u, _, vh = per_matrix(_svd, x[None])
    return u[0] @ vh[0]


def iso_cts_matrix(stack: torch.Tensor, total_svd, common_fraction: float) -> torch.Tensor:
    """One matrix's merged direction from its task vectors [T, m, n] and the SVD of their sum."""
    u, s, vh = total_svd
    T, m, n = stack.shape
    c, q = split_rank(min(m, n), T, common_fraction)
    us, ss, vs = [u[:, :c]], [s[:c]], [vh[:c]]
    if q > 0:
        common = u[:, :c]
        residual = stack - common @ (common.T @ stack)  # each τt with the common subspace projected out
        left, right, st = spectral(residual, q, precise=True)
        ut, vt = unit_factors(left, right, st)  # [T, m, q], [T, q, n]
        us.append(ut.permute(1, 0, 2).reshape(m, T * q))
        ss.append(st.reshape(-1))
        vs.append(vt.reshape(T * q, n))
    flat = torch.cat(ss).mean()
    return flat * (_polar(torch.cat(us, 1)) @ _polar(torch.cat(vs, 0)))


def prepare_iso_cts(tv, common_fraction: float, progress=None, cancel=None) -> dict:
    direction = {k: v.mean(0) for k, v in tv.items32()}  # off the matrices: the mean task vector, as Iso-C
    for k in each(tv.matrices, progress, cancel, "subspaces of matrix"):
        stack = tv.fp32(k)
        u, s, vh = per_matrix(_svd, stack.sum(0)[None])
        direction[k] = iso_cts_matrix(stack, (u[0], s[0], vh[0]), common_fraction)
    return {"direction": direction}


register(Method(
    name="iso_cts",
    slow_prepare=True,
    display_name="Iso-CTS",
    paper=ISO_C.paper,
    description="Per matrix, the top directions of Σ τ (the common subspace) and each τt's top directions outside "
                "it, orthogonalised together, all with the mean singular value; the mean τ elsewhere; θ0 + λ·that.",
    params=(with_default(ISO_C.param("lam"), 1.5), COMMON),
    prepare=prepare_iso_cts,
    prepare_params=("common_fraction",),
    apply=lam_times("direction"),
    tune_grid={"lam": frange(0.1, 3.0, 0.1)},  # the authors' grid (0, 3]
    weights=ISO_C.weights,
    conventions=MATRICES_NOTE + " Rank split as the authors' code: c = r − T·round((r − ⌊f·r⌋)/T) common, "
                "(r − c)/T per task; the mean singular value is taken over all r kept directions.",
    published=(Published("ViT-B-32", 86.2, RECOLLECTION, verified=False),),
))
