"""What the spectral merges (TSV-M, Iso-C, Iso-CTS, CART) are written in: thin SVDs, top singular
triplets and orthogonal factors, plain torch, in fp64.

fp64, because the singular vectors are then used by an orthogonal factor or a projection: an fp32
SVD put Iso-CTS 1.6e-4 (relative) off its fp64 definition on a 2304 × 768 matrix of bf16 task
vectors, and TSV-M up to 5.6e-5, against the 1e-4 the precision contract allows (docs/precision.md; the
figures: docs/precision.md). Each function marked ``accelerable`` is the reference a faster route in
merger/accel may replace, tested equal to it.

``what`` names the matrix in a refusal (the matrix key, and the method).
"""
from __future__ import annotations

import torch

from merger.accel import accelerable
from merger.errors import MethodError

# A singular value at or below this fraction of the largest is numerically zero: a direction the stored
# task vectors (bf16 or fp32) do not determine. A triplet with one carries no direction into a merge.
NULL = 1e-6
# An orthogonal factor of a matrix whose singular values spread further than this is not determined by
# its entries (its smallest directions are rounding): refused, naming the matrix.
SINGULAR = 1e-6


def finite(x: torch.Tensor, what: str) -> torch.Tensor:
    if not bool(torch.isfinite(x).all()):
        raise MethodError(f"{what}: holds NaN or Inf (an expert's weights are not finite here)")
    return x


def svd(x: torch.Tensor, what: str = "a matrix"):
    """x = U diag(S) Vh, thin, in fp64 (singular values in descending order). A wide matrix is solved
    through its transpose (the same factors; LAPACK took 2.5× as long on a 768 × 3072 matrix as on its
    transpose)."""
    x = finite(x, what).double()
    try:
        if x.shape[0] < x.shape[1]:
            v, s, uh = torch.linalg.svd(x.mT, full_matrices=False)
            return uh.mT, s, v.mT
        return torch.linalg.svd(x, full_matrices=False)
    except torch.linalg.LinAlgError as exc:
        raise MethodError(f"{what}: its SVD did not converge ({str(exc).splitlines()[0][:160]})") from None


@accelerable
def top_svd(x: torch.Tensor, k: int, what: str = "a matrix"):
    """The top-k singular triplets of x: (U_k [m, k], S_k [k], Vh_k [k, n]), fp64."""
    u, s, vh = svd(x, what)
    return u[:, :k], s[:k], vh[:k]


@accelerable
def singular_basis(x: torch.Tensor, what: str = "a matrix") -> torch.Tensor:
    """The singular vectors of x's smaller side, largest first, as columns [r, r], fp64: V where x is
    tall or square (SVD_k(x) = x V_k V_kᵀ), U where it is wide (SVD_k(x) = U_k U_kᵀ x)."""
    u, _, vh = svd(x, what)
    return vh.mT if x.shape[0] >= x.shape[1] else u


@accelerable
def polar_factor(x: torch.Tensor, what: str = "a matrix"):
    """(S, U₊·Vh₊) of x = U S Vh: its singular values [r], and its orthogonal factor on its range (the
    nearest matrix with orthonormal columns where x is tall, rows where wide; directions whose singular
    value is numerically zero, under NULL · the largest, are left out: x does not determine them), fp64."""
    u, s, vh = svd(x, what)
    _, u, vh = kept(s, u.mT, vh)
    return s, u.mT @ vh


def polar(x: torch.Tensor, what: str = "a matrix") -> torch.Tensor:
    """The orthogonal factor U·Vh of x = U S Vh, fp64. Refused where x is (near) rank deficient: its
    columns (rows) are then nearly linearly dependent, and the factor is not determined."""
    s, factor = polar_factor(x, what)
    if s.numel() and not s[-1] > SINGULAR * s[0]:
        raise MethodError(f"{what}: the directions to orthogonalise are (nearly) linearly dependent "
                          f"(smallest / largest singular value {float(s[-1] / s[0]) if s[0] > 0 else 0.0:.1e}, "
                          f"under {SINGULAR:g}): their orthogonal factor is not determined. Two experts with the "
                          "same weights here give this; merge one of them.")
    return factor


def kept(s: torch.Tensor, *others: torch.Tensor):
    """(s, *others) without the triplets whose singular value is numerically zero (≤ NULL · the largest
    of ``s``): their vectors are arbitrary and carry nothing; ``others`` are sliced along s's axis
    (U's columns: pass u.mT and transpose back, or rows of Vh)."""
    keep = s > NULL * s.max() if s.numel() else s > 0
    return (s[keep], *(o[keep] for o in others))
