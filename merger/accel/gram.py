"""Spectra through fp64 Gram matrices: the Gram of a matrix's smaller side (G = xᵀx or x xᵀ), its
eigh, and the other side's vectors from one product. Drop-ins for the SVDs of
merger/methods/spectral.py; the figures (speed, error against fp64 SVDs) are in docs/accel.md.

The Gram of fp32 or bf16 entries, formed in fp64, is exact up to fp64 rounding; its eigenvalues σ²
then carry an absolute error of about eps64 · σ1², so a direction whose σi is at least RESOLVED · σ1
comes out within about eps64 · (σ1/σi)² ≈ 1e-8. Where a call needs a smaller one resolved, it goes
back to the reference SVD.
"""
from __future__ import annotations

import torch

from merger.accel.registry import drop_in

RESOLVED = 1e-4  # σ/σ1 down to which the Gram route is within about 1e-8 of an fp64 SVD


def _finite(x: torch.Tensor) -> bool:
    return bool(torch.isfinite(x).all())


def _gram_spectrum(x: torch.Tensor):
    """(σ descending [r], the smaller side's singular vectors as columns [r, r]) of an fp64 x, or None where
    the eigh fails (the reference then says which matrix)."""
    tall = x.shape[0] >= x.shape[1]
    try:
        evals, evecs = torch.linalg.eigh(x.mT @ x if tall else x @ x.mT)  # ascending
    except torch.linalg.LinAlgError:
        return None
    return evals.flip(0).clamp(min=0).sqrt(), evecs.flip(1)


@drop_in("merger.methods.spectral.top_svd",
         "eigh of the fp64 Gram of the smaller side, the other side's k vectors from one product; "
         "the reference where the k-th singular value is under 1e-4 of the largest")
def top_svd(reference, x: torch.Tensor, k: int, what: str = "a matrix"):
    if k == 0 or not _finite(x):
        return reference(x, k, what)
    x = x.double()
    spectrum = _gram_spectrum(x)
    if spectrum is None or not spectrum[0][k - 1] >= RESOLVED * spectrum[0][0] > 0:
        return reference(x, k, what)
    s, vectors = spectrum[0][:k], spectrum[1][:, :k]
    if x.shape[0] >= x.shape[1]:  # vectors = V_k: U_k = x V_k / S_k
        return (x @ vectors) / s, s, vectors.mT
    return vectors, s, (vectors.mT @ x) / s[:, None]  # vectors = U_k: Vh_k = U_kᵀ x / S_k


@drop_in("merger.methods.spectral.singular_basis",
         "eigh of the fp64 Gram of the smaller side (its eigenvectors are those singular vectors)")
def singular_basis(reference, x: torch.Tensor, what: str = "a matrix") -> torch.Tensor:
    spectrum = _gram_spectrum(x.double()) if _finite(x) else None
    return reference(x, what) if spectrum is None else spectrum[1]


@drop_in("merger.methods.spectral.polar_factor",
         "x (xᵀx)^(-1/2) from an eigh of the fp64 Gram; the reference where the singular values spread past 1e4")
def polar_factor(reference, x: torch.Tensor, what: str = "a matrix"):
    wide = x.shape[0] < x.shape[1]
    if not _finite(x) or min(x.shape) == 0:
        return reference(x, what)
    x64 = x.double().mT if wide else x.double()
    try:
        evals, evecs = torch.linalg.eigh(x64.mT @ x64)  # ascending
    except torch.linalg.LinAlgError:
        return reference(x, what)
    s = evals.flip(0).clamp(min=0).sqrt()
    if not s[-1] >= RESOLVED * s[0]:
        return reference(x, what)
    factor = (x64 @ (evecs / evals.sqrt())) @ evecs.mT  # x V diag(σ⁻¹) Vᵀ
    return s, (factor.mT if wide else factor)
