"""Low-rank and spectral merges: TSV-M, Iso-C (CART: cart.py).

Each SVD is taken once in prepare, so a rank change is a slice and a λ change is a scale.
"""
from __future__ import annotations

import math

import torch

from merger.methods.registry import (LAM, MATRICES_NOTE, RANK_RATIO, RECOLLECTION, Method, Paper, Published,
                                     frange, lam_times, register, sum_weights, with_default)
from merger.methods.linalg import (divided, each_matrix, gram_rows, largest_first, polar_svd, refined_inverse_sqrt,
                                   spectral, thin_svd, unit_factors, workers)
from merger.pool.task_vectors import TaskVectors



# ---- TSV-M --------------------------------------------------------------------------------

def prepare_tsv(tv: TaskVectors, progress=None, cancel=None) -> dict:
    """The mean τ off the matrices, and per matrix each τt's top K = ⌊r/T⌋ singular triplets (the most
    any rank the slider reaches keeps: T·k ≤ r) with the Grams of their concatenations at K, of which
    every rank's Grams are submatrices; the default rank's direction is derived here too.

    A matrix's whole preparation (its T spectra, Grams and default direction) runs on one LAPACK worker,
    the largest matrices first: no worker waits for the other at the end of each matrix's spectra, or for
    Grams taken on the main thread. ViT-B/32 × 8 on 2 cores: 0.2–0.8 s of core time idle per preparation,
    against 1.0–2.3 s a matrix at a time (scripts/prepare_profile.py prints the core time)."""
    T = tv.num_tasks

    def one(key):
        factors = spectral(tv.stacked[key], min(tv.base[key].shape) // T, dtype=tv.dtype)
        grams = _concatenated_grams(*factors)
        return factors, grams, _tsv_matrix({"factors": {key: factors}, "grams": {key: grams}}, key, "auto")

    done = dict(each_matrix(one, largest_first(tv), progress, cancel, "spectrum of matrix", device=tv.device))
    matrices = set(tv.matrices)
    mean = {k: v.mean(0) for k, v in tv.items32() if k not in matrices}  # a matrix gets its direction
    return {"mean": mean, "factors": {k: done[k][0] for k in tv.matrices},
            "grams": {k: done[k][1] for k in tv.matrices}, "T": T,
            "auto": {**mean, **{k: done[k][2] for k in tv.matrices}}}


def _concatenated_grams(left, right, s) -> torch.Tensor:
    """[G_U, G_V] of one matrix's unit factors concatenated task by task ([2, T·K, T·K], fp32). A side
    where T·k fills its dimension is never solved from them (``_tsv_sides``: its polar factor by SVD).

    From the stored factors as they are (bf16: ``gram_rows`` then multiplies them at the bf16 rate, exact
    products in fp32), the side that holds S scaled by S⁻¹ on both sides of its Gram afterwards."""
    T, m, K = left.shape
    n = right.shape[2]
    inverse = divided(torch.ones_like(s), s).reshape(T * K)
    grams = [gram_rows(left.permute(0, 2, 1).reshape(T * K, m), exact=True),
             gram_rows(right.reshape(T * K, n), exact=True)]
    held = 0 if m >= n else 1  # the side spectral left S in (unit_factors)
    grams[held] = grams[held].mul_(inverse[:, None]).mul_(inverse[None, :])
    return torch.stack(grams)


def _square(width: int, side: int) -> bool:
    """Whether T·k concatenated singular vectors fill a side of this dimension (T·k ≤ r, so only
    equal): the concatenation is then square and its Gram near singular (conditions to 4e9 on a
    random ViT-B/32 × 8 pool, the square of the concatenation's)."""
    return width >= side


def tsv_rank(rank_ratio, m: int, n: int, T: int) -> int:
    """TSV-M's kept rank per task: "auto" is exactly ⌊r/T⌋ (the authors' int(r · 1/T)), else
    ⌊rank_ratio · r⌋; r = min(m, n). Either way T·k ≤ r (the ratio is capped at 1/T)."""
    r = min(m, n)
    if rank_ratio == "auto":
        return r // T
    return min(r // T, math.floor(rank_ratio * r + 1e-9))


def tsv_direction(prepared: dict, rank_ratio, parts=None) -> dict:
    """The merged direction at one rank (TSV-M's derive step: cached per rank by the session).

    The orthogonal factors P = U (UᵀU)^(-1/2), Q = V (VᵀV)^(-1/2) of the concatenated singular
    vectors (what an SVD X = P S Qᵀ → P Qᵀ gives) meet in a [T·k, T·k] core, so the direction
    P S Qᵀ = U (G_U^(-1/2) S G_V^(-1/2)) Vᵀ costs two small eighs and two products; the Grams at
    rank k are read off those prepared at K (the first k of each task's K directions). A side whose
    Gram is near singular takes its polar factor from an SVD instead (``_tsv_sides``).

    ``parts``: the session's store (get, put) of each matrix's work at each k but its last product
    (``_tsv_half``): one found there leaves that product alone (the eighs were 60 % of a move at rank
    0.1 on ViT-B/32 × 8); those computed here are put there. ``tsv_warm`` fills it ahead."""
    if rank_ratio == "auto" and "auto" in prepared:
        return prepared["auto"]
    out = dict(prepared["mean"])
    out.update(each_matrix(lambda key: _tsv_matrix(prepared, key, rank_ratio, parts), prepared["factors"],
                           device=_device(prepared)))
    return out


def tsv_warm(prepared: dict, parts, gate, rank_ratio) -> None:
    """Put the halves (``_tsv_half``) of every matrix at one rank that ``parts`` lacks, a worker's share
    of matrices at a time (each_matrix), ``gate()`` before each share: False stops (the session's
    idle-time warm-up)."""
    if rank_ratio == "auto" and "auto" in prepared:
        return
    missing = []
    for key, (left, right, _) in prepared["factors"].items():
        k = tsv_rank(rank_ratio, left.shape[1], right.shape[2], left.shape[0])
        if k and (key, k) not in parts:
            missing.append((key, k))
    device = _device(prepared)
    share = workers() if device.type == "cpu" else max(1, len(missing))  # a GPU's are quick
    for i in range(0, len(missing), share):
        if not gate():
            return
        for item, half in each_matrix(lambda item: _tsv_half(prepared, *item), missing[i:i + share], device=device):
            parts.put(item, half)


def _device(prepared: dict) -> torch.device:
    return next((left.device for left, _, _ in prepared["factors"].values()), torch.device("cpu"))


def _tsv_matrix(prepared: dict, key: str, rank_ratio, parts=None) -> torch.Tensor:
    left, right, _ = prepared["factors"][key]
    T, m, _ = left.shape
    k = tsv_rank(rank_ratio, m, right.shape[2], T)
    if k == 0:  # fewer dimensions than tasks: no task keeps a singular vector here
        return left.new_zeros(m, right.shape[2], dtype=torch.float32)
    half = None if parts is None else parts.get((key, k))
    if half is None:
        half = _tsv_half(prepared, key, k)
        if parts is not None:
            parts.put((key, k), half)
    return _tsv_product(prepared, key, k, *half)


def _tsv_sides(prepared: dict, key: str, k: int):
    """Each side's way to its orthogonal factor at rank k: ("isqrt", G^(-1/2)) from the Gram prepared
    at K, in fp32 refined (linalg.refined_inverse_sqrt), or ("polar", P) where T·k fills the side or the
    Gram is too near singular for that: P = U·Vh of an fp32 SVD of the concatenation itself ([side, T·k];
    linalg.polar_svd, the TSV authors' way). (U side, V side)."""
    left, right, s = prepared["factors"][key]
    T, m, K = left.shape
    n = right.shape[2]
    # the first k of each task's K directions, task-major as the concatenation (a copy of [2, T·k, T·k])
    grams = prepared["grams"][key].view(2, T, K, T, K)[:, :, :k, :, :k].reshape(2, T * k, T * k)
    sides, units = [], None
    for i, (gram, dim) in enumerate(zip(grams, (m, n))):
        isqrt = None if _square(T * k, dim) else refined_inverse_sqrt(gram)
        if isqrt is not None:
            sides.append(("isqrt", isqrt))
            continue
        units = units or unit_factors(left[:, :, :k], right[:, :k], s[:, :k])
        unit = units[0].permute(1, 0, 2).reshape(m, T * k) if i == 0 else units[1].reshape(T * k, n).mT
        sides.append(("polar", polar_svd(unit)))
    return sides


def _tsv_half(prepared: dict, key: str, k: int) -> tuple[torch.Tensor, str]:
    """All of one matrix's direction at rank k but its last product (the part a warm-up keeps), and
    which product is left: "right" = a [T·k, n] half to take the stored left factor times it; "left" =
    a [m, T·k] half to take it times the stored right factor; "whole" = the direction itself (both
    polar factors explicit). S, which ``spectral`` left in one stored factor (left where m ≥ n, see
    unit_factors), is divided out in the half instead of across a factor."""
    left, right, s = prepared["factors"][key]
    T, m, K = left.shape
    n = right.shape[2]
    sk = s[:, :k].reshape(-1)
    (u_way, u_side), (v_way, v_side) = _tsv_sides(prepared, key, k)
    if u_way == v_way == "polar":
        return (u_side * sk) @ v_side.mT, "whole"
    if v_way == "polar":  # U G_U^(-1/2) S Qᵀ = stored left · (S⁻¹ where m ≥ n) G_U^(-1/2) S Qᵀ
        half = u_side @ (sk[:, None] * v_side.mT)
        return (divided(half, sk[:, None]) if m >= n else half), "right"
    if u_way == "polar":  # P S G_V^(-1/2) Vᵀ = P S G_V^(-1/2) (S⁻¹ where m < n) · stored right
        half = (u_side * sk) @ v_side
        return (divided(half, sk) if m < n else half), "left"
    core = (u_side * sk) @ v_side
    core = divided(core, sk[:, None]) if m >= n else divided(core, sk)
    if m > n:
        return core @ right[:, :k].reshape(T * k, n).float(), "right"
    return left[:, :, :k].permute(1, 0, 2).reshape(m, T * k).float() @ core, "left"


def _tsv_product(prepared: dict, key: str, k: int, half: torch.Tensor, side: str) -> torch.Tensor:
    """The direction of one matrix at rank k from its ``_tsv_half``: the one product left."""
    if side == "whole":
        return half
    left, right, _ = prepared["factors"][key]
    T, m, _ = left.shape
    if side == "right":
        return left[:, :, :k].permute(1, 0, 2).reshape(m, T * k).float() @ half
    return half @ right[:, :k].reshape(T * k, right.shape[2]).float()


# A Gram of one side's concatenated singular vectors is solved in fp32 with its small eigenpairs
# refined in fp64 (linalg.refined_inverse_sqrt): the direction within about 2e-5 of fp64's, relative,
# below the 2e-3 that bf16 storage of the singular vectors already carries. Before, an fp32 eigh was
# kept only up to a condition of 1e3 and fp64 taken above it: on a ViT-B/32 × 8 pool at rank 0.12
# (T·k = 736 of 768) 60 of the 96 Grams were above it (up to 9.4e3), and the move took 7.6 s on this
# 2-core CPU against 2.6 s at 0.1. Where T·k equals that side's dimension (the default rank's r side)
# the concatenation is square and near singular: its Gram, rounded to fp32, moved the default merge of
# a random ViT-B/32 pool by up to 8 % (an fp64 eigh of it did not help: the rounding was in the Gram),
# and an SVD of the concatenation (the authors') is within 5e-6 of fp64 in less time than an fp64 eigh.


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
    warm=tsv_warm,
    apply=lam_times(),
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
    direction = {k: v.mean(0) for k, v in tv.items32()}

    def flat_spectrum(key):
        # An SVD, not a Gram eigh: every direction gets unit weight here, the smallest included.
        u, s, vh = thin_svd(tv.fp32(key).sum(0))
        return (u @ vh) * s.mean()  # flatten the spectrum of Σ τt: Σ → σ̄ I

    direction.update(each_matrix(flat_spectrum, largest_first(tv), progress, cancel, "SVD of matrix", device=tv.device))
    return {"direction": direction}


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
    apply=lam_times("direction"),
    tune_grid={"lam": frange(0.1, 3.0, 0.1)},  # the authors' grid (0, 3]
    weights=sum_weights("sum"),
    conventions=MATRICES_NOTE + " The Iso authors' code treats every 2-D tensor but the embeddings as a matrix "
                "(so also the visual projection, which gets the mean here).",
    published=(Published("ViT-B-32", 86.3, RECOLLECTION, verified=False),),
))
