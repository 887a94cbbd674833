"""Iso-CTS (merger/methods/iso.py, ``iso_cts_matrix``) from its structure, through fp64 Grams:

- the residuals τt − U_c U_cᵀ τt are orthogonal to U_c, so U = [U_c, U_1 … U_T] has the orthogonal
  factor [U_c, polar([U_1 … U_T])]: a polar of T·q columns, not of r;
- on a square or wide matrix (m ≤ n) the Gram of Σ τ gives all of U, a basis of R^m: the residual is
  W Wᵀ τt with W its last m − c columns, so each task's top q come from an (m − c)² Gram, not n²;
- on a tall one, each residual's right Gram is τtᵀτt − BᵀB (B = U_cᵀ τt), formed in fp64.

Where a singular value it divides by is not resolved by a Gram (under accel.gram.RESOLVED of the
largest), or a concatenation is near singular, the reference runs."""
from __future__ import annotations

import torch

from merger.accel.gram import RESOLVED
from merger.accel.registry import drop_in


def _descending(gram: torch.Tensor):
    evals, evecs = torch.linalg.eigh(gram)
    return evals.flip(0).clamp(min=0).sqrt(), evecs.flip(1)


def _resolved(s: torch.Tensor, k: int) -> bool:
    return k == 0 or bool(s[k - 1] >= RESOLVED * s[0] > 0)


def _polar_rows(rows: torch.Tensor):
    """The orthogonal factor of rows [p, n] (p ≤ n) from their Gram, or None where it is not resolved."""
    s, vecs = _descending(rows @ rows.mT)
    if not _resolved(s, s.numel()):
        return None
    return (vecs / s) @ (vecs.mT @ rows)


@drop_in("merger.methods.iso.iso_cts_matrix",
         "the residuals' orthogonality to U_c, a square or wide matrix's (m − c)² residual Grams, fp64 Grams")
def iso_cts_matrix(reference, stack: torch.Tensor, c: int, q: int, what: str) -> torch.Tensor:
    if q == 0 or not bool(torch.isfinite(stack).all()):
        return reference(stack, c, q, what)
    try:
        return _structured(reference, stack, c, q, what)
    except torch.linalg.LinAlgError:  # an eigh that failed: the reference's SVDs name the matrix if they fail too
        return reference(stack, c, q, what)


def _structured(reference, stack: torch.Tensor, c: int, q: int, what: str) -> torch.Tensor:
    x = stack.double()
    T, m, n = x.shape
    total = x.sum(0)
    values, rows_u, rows_v = [], [], []
    if m <= n:
        s, u = _descending(total @ total.mT)  # u: all of U, a basis of R^m
        if not _resolved(s, c):
            return reference(stack, c, q, what)
        u_c, rest = u[:, :c], u[:, c:]
        vh_c = (u_c.mT @ total) / s[:c, None]
        for tau in x:
            b = rest.mT @ tau  # the residual in the complement's coordinates [m − c, n]
            s_t, w = _descending(b @ b.mT)
            if not _resolved(s_t, q):
                return reference(stack, c, q, what)
            values.append(s_t[:q])
            rows_u.append((rest @ w[:, :q]).mT)
            rows_v.append((w[:, :q].mT @ b) / s_t[:q, None])
    else:
        s, v = _descending(total.mT @ total)
        if not _resolved(s, c):
            return reference(stack, c, q, what)
        u_c, vh_c = (total @ v[:, :c]) / s[:c], v[:, :c].mT
        for tau in x:
            b = u_c.mT @ tau  # [c, n]
            s_t, v_t = _descending(tau.mT @ tau - b.mT @ b)  # the residual's right Gram
            if not _resolved(s_t, q):
                return reference(stack, c, q, what)
            v_t = v_t[:, :q]
            values.append(s_t[:q])
            rows_u.append(((tau @ v_t - u_c @ (b @ v_t)) / s_t[:q]).mT)
            rows_v.append(v_t.mT)
    sigma = torch.cat([s[:c], *values]).mean()
    own_u = _polar_rows(torch.cat(rows_u))  # [T·q, m]: orthogonal to U_c already
    v_side = _polar_rows(torch.cat([vh_c, *rows_v]))  # [r, n]
    if own_u is None or v_side is None:
        return reference(stack, c, q, what)
    return sigma * (torch.cat([u_c, own_u.mT], 1) @ v_side)
