"""Iso-CTS (Marczak et al., arXiv 2502.04959): Iso-C's common subspace (the top directions of Σ τ)
plus each task's own top directions outside it, orthogonalised together, with one flat spectrum."""
from __future__ import annotations

import torch

from merger.methods.linalg import (divided, each_matrix, gram_rows, largest_first, polar_extending, polar_rows,
                                   top_eigh)
from merger.methods.lowrank import ISO_C
from merger.methods.registry import (MATRICES_NOTE, RECOLLECTION, Method, Param, Published, frange, lam_times, register,
                                     with_default)
COMMON = Param("common_fraction", 0.8, 0.0, 1.0, 0.05, label="common subspace fraction",
               help="share of the rank r given to the common subspace of Σ τ; the rest is split evenly between the "
                    "tasks' own directions (1: Iso-C)")


def split_rank(r: int, T: int, common_fraction: float) -> tuple[int, int]:
    """(common directions, directions per task) as the authors' code: the task-specific total is rounded
    to a multiple of T and the common part takes the rest (capped so that T · per task ≤ r)."""
    per_task = min(r // T, round((r - int(r * common_fraction)) / T))
    return r - per_task * T, per_task


def common_subspace(total: torch.Tensor, c: int):
    """Σ τ's full spectrum from the fp64 Gram of its smaller side: (singular values [r], U_c [m, c],
    Vh_c [c, n], the Gram's eigenvectors [r, r]; on a wide or square matrix these are U, whose last
    r − c columns span the complement of U_c: the residuals are then a [r − c]² problem, not T of n²)."""
    t64 = total.double()
    m, n = t64.shape
    s2, vecs = top_eigh(gram_rows(t64 if m <= n else t64.mT, lower=True)[None], min(m, n))
    s, vecs = s2[0].clamp(min=0).sqrt(), vecs[0]
    if m <= n:
        u_c = vecs[:, :c]
        return s, u_c, divided(u_c.mT @ t64, s[:c, None]), vecs
    v_c = vecs[:, :c]
    return s, divided(t64 @ v_c, s[:c]), v_c.mT, vecs


def task_directions(stack: torch.Tensor, u_c: torch.Tensor, vecs: torch.Tensor, q: int, stored: torch.Tensor):
    """Each τt's top q singular triplets once the common subspace is projected out of its columns,
    (I − U_c U_cᵀ) τt, from a Gram: (U_t [T, m, q], s_t [T, q], Vh_t [T, q, n]). ``stored``: the same stack
    as stored (bf16, or ``stack`` itself), whose Grams ``gram_rows`` takes at the bf16 rate."""
    T, m, n = stack.shape
    c = u_c.shape[1]
    if m <= n:  # U is a basis of R^m: the residual lives on its last m − c columns, a [m − c]² problem
        rest = vecs[:, c:].float()
        b = rest.mT @ stack  # [T, m − c, n]
        s2, w = top_eigh(b @ b.mT, q)
        s_t = s2.clamp(min=0).sqrt().float()
        return rest @ w.float(), s_t, divided(w.float().mT @ b, s_t[..., None])
    b = u_c.mT @ stack  # [T, c, n]
    residual_grams = torch.stack([gram_rows(x.mT, lower=True, exact=True) - gram_rows(y.mT, lower=True)  # [T, n, n],
                                  for x, y in zip(stored, b)])  # read by an eigh: lower triangles
    s2, v = top_eigh(residual_grams, q)
    s_t = s2.clamp(min=0).sqrt().float()
    return divided(stack @ v - u_c @ (b @ v), s_t[:, None, :]), s_t, v.mT


def iso_cts_matrix(stack: torch.Tensor, common_fraction: float) -> torch.Tensor:
    """One matrix's merged direction from its task vectors [T, m, n] (fp32, or as stored: bf16).

    The authors take an SVD of each residual and two more to orthogonalise [U_c, U_1..U_T] and
    [Vh_c; Vh_1..Vh_T]. Here the residuals are orthogonal to U_c by construction, so the U side is
    [U_c, polar(U_1..U_T)] (a [T·q]² problem), and the V side extends Vh_c's orthonormal rows
    (``polar_extending``): the same factors up to rounding, with eighs of at most r² and most of q²."""
    stored, stack = stack, stack.float()
    T, m, n = stack.shape
    c, q = split_rank(min(m, n), T, common_fraction)
    s, u_c, vh_c, vecs = common_subspace(stack.sum(0), c)
    if q == 0:  # Iso-C
        return (s[:c].mean() * (u_c @ polar_rows(vh_c))).float()
    u_c = u_c.float()
    u_t, s_t, vh_t = task_directions(stack, u_c, vecs, q, stored)
    u_t = polar_rows(u_t.permute(0, 2, 1).reshape(T * q, m)).mT.float()  # [m, T·q]
    v_c, v_t = polar_extending(vh_c, vh_t.reshape(T * q, n))
    flat = torch.cat([s[:c].float(), s_t.reshape(-1)]).mean()
    return flat * (u_c @ v_c.float() + u_t @ v_t.float())


def prepare_iso_cts(tv, common_fraction: float, progress=None, cancel=None) -> dict:
    direction = {k: v.mean(0) for k, v in tv.items32()}  # off the matrices: the mean task vector, as Iso-C
    direction.update(each_matrix(lambda k: iso_cts_matrix(tv.stacked[k], common_fraction), largest_first(tv),
                                 progress, cancel, "subspaces of matrix", device=tv.device))
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
