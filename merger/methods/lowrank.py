"""Low-rank and spectral merges: CART, TSV-M, Iso-C.

Each SVD is taken once in prepare, so a rank change is a slice and a λ change is a scale.
"""
from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from merger.methods.registry import (CART_README, LAM, RANK_RATIO, RECOLLECTION, Method, Paper, Published, each,
                                     frange, kept_rank, lam_times, register, sum_weights, with_default)
from merger.pool.task_vectors import TaskVectors

MATRICES_NOTE = ("Matrices = the 2-D attention and MLP weights (in_proj, out_proj, c_fc, c_proj); "
                 "every other tensor (biases, norms, embeddings, conv1, visual projection) is 'other'.")


_LAPACK_LOCK = threading.Lock()
_LAPACK_POOL: ThreadPoolExecutor | None = None


def per_matrix(fn, x: torch.Tensor):
    """``fn`` (a LAPACK routine: eigh, svd) on each matrix of a batch [B, ...], each single-
    threaded on a worker thread, as many at once as torch has threads; the results stacked as
    ``fn`` returns them.

    LAPACK's syevd and gesdd fork and join their OpenMP team many times per matrix. Once a second
    thread of this process has run torch work (the model thread's forwards always have), libgomp
    has more threads than cores and throttles its spin-wait, and each join pays a sleep: a batched
    eigh of 8 Grams of 768² then took 0.80 s instead of 0.17 s on this 2-core machine. One matrix
    per worker, single-threaded, takes 0.13 s in either state. A worker's thread count is its own,
    but setting it also sets the count new threads start with: that is put back to the caller's
    afterwards, under a lock."""
    global _LAPACK_POOL
    if x.device.type != "cpu":  # a GPU solves the batch at once
        return tuple(fn(x))
    with _LAPACK_LOCK:
        threads = torch.get_num_threads()
        if _LAPACK_POOL is None:
            _LAPACK_POOL = ThreadPoolExecutor(max(1, threads), thread_name_prefix="merger-lapack")
        try:
            parts = list(_LAPACK_POOL.map(lambda m: _single_threaded(fn, m), x.unbind(0)))
        finally:
            torch.set_num_threads(threads)
    return tuple(torch.stack(p) for p in zip(*parts))


def _single_threaded(fn, m: torch.Tensor):
    torch.set_num_threads(1)
    return fn(m)


def _svd(x: torch.Tensor):
    return torch.linalg.svd(x, full_matrices=False)


def spectral(x: torch.Tensor, keep: int | None = None, dtype: torch.dtype = torch.float32, precise: bool = False):
    """Batched SVD of x [T, m, n] through the Gram matrix of its smaller side (one batched eigh:
    4× faster than a batched SVD on this CPU): (left [T, m, q], right [T, q, n], s [T, q]) with
    the top q = keep directions, largest first, and x ≈ left @ right.

    One factor is exact given the other (left = x·V, or right = Uᵀ·x), so at q = min(m, n) the
    product is x itself up to rounding; the split of S between them is the Gram's side (read ``s``
    for the singular values). Factors are stored in ``dtype`` (the task vectors' storage dtype)."""
    T, m, n = x.shape
    r = min(m, n)
    q = r if keep is None else max(0, min(r, keep))
    tall = m >= n
    # fp64 Gram and eigh: squaring x squares its condition number, which fp32 cannot carry.
    x64 = x.double() if precise else x
    gram = x64.mT @ x64 if tall else x64 @ x64.mT  # [T, r, r]
    evals, evecs = per_matrix(torch.linalg.eigh, gram)  # ascending
    top = evecs[..., r - q:].flip(-1).float()  # [T, r, q]
    s = evals[..., r - q:].flip(-1).clamp(min=0).sqrt().float()
    if tall:  # x ≈ (x V)(Vᵀ)
        left, right = x @ top, top.mT
    else:  # x ≈ (U)(Uᵀ x)
        left, right = top, top.mT @ x
    return left.to(dtype), right.to(dtype), s


def unit_factors(left: torch.Tensor, right: torch.Tensor, s: torch.Tensor):
    """(U, Vh) of ``spectral``'s factors: the singular vectors with S divided out of its side."""
    inv = torch.where(s > 0, 1.0 / s.clamp(min=1e-30), 0.0)
    if left.shape[1] >= right.shape[2]:  # S sits in left
        return left.float() * inv[:, None, :], right.float()
    return left.float(), right.float() * inv[:, :, None]


# ---- CART ---------------------------------------------------------------------------------

def prepare_cart(tv: TaskVectors, progress=None, cancel=None) -> dict:
    """Mean task vector τ̄, and per matrix every direction of each centred θt − θavg = τt − τ̄."""
    mean = {k: v.mean(0) for k, v in tv.items32()}
    factors = {}
    for k in each(tv.matrices, progress, cancel, "spectrum of matrix"):
        left, right, _ = spectral(tv.fp32(k) - mean[k], dtype=tv.dtype)  # [T,m,r], [T,r,n]
        factors[k] = (left, right)
    return {"mean": mean, "factors": factors, "T": tv.num_tasks}


def _factors(us: torch.Tensor, vh: torch.Tensor, k: int, start: int = 0):
    """Factors start..k of every task side by side, so Σt Σ_{start ≤ i < k} σi ui viᵀ is one matmul."""
    T, m, _ = us.shape
    w = k - start
    return (us[:, :, start:k].float().permute(1, 0, 2).reshape(m, T * w),
            vh[:, start:k, :].float().reshape(T * w, vh.shape[-1]))


def low_rank_sum(us: torch.Tensor, vh: torch.Tensor, k: int) -> torch.Tensor:
    """Σt SVD_k(Mt) from the stacked factors us [T,m,r] and vh [T,r,n] (see ``spectral``)."""
    return torch.mm(*_factors(us, vh, k))


def rank_k_sum(us: torch.Tensor, vh: torch.Tensor, k: int) -> torch.Tensor | None:
    """Σt SVD_k(τt − τ̄) of one matrix from scratch, or None where it is exactly zero (k = 0, or
    full rank: the centred matrices sum to zero). Above half the rank the complement is cheaper
    and exact: Σt SVD_k(Mt) = −Σt (Mt − SVD_k(Mt)), the directions k..r."""
    r = min(us.shape[1], vh.shape[2])
    if not 0 < k < r:
        return None
    return torch.mm(*_factors(us, vh, k)) if 2 * k <= r else -torch.mm(*_factors(us, vh, r, start=k))


def cart_task_parts(prepared: dict, rank_ratio: float) -> dict:
    """Per matrix, each task's SVD_k(τt − τ̄) stacked [T, m, n] (AdaMerging+CART's parts)."""
    out = {}
    for k, (us, vh) in prepared["factors"].items():
        r = kept_rank(rank_ratio, us.shape[1], vh.shape[2])
        out[k] = torch.bmm(us[:, :, :r].float(), vh[:, :r].float())
    return out


def cart_sums(prepared: dict, rank_ratio: float, near=()) -> dict:
    """CART's derive step: Σt SVD_k(τt − τ̄) per matrix at one rank (None where it is zero: k = 0
    or full rank), so that a λ move is one axpy. ``near``: sums derived before from the same
    preparation; one whose rank is closer than the cost of starting over is updated by the
    directions in between (a slider step of 0.01 is 8 directions per task, not k)."""
    bases = [d for d in near if d.get("exact")]  # only sums computed from scratch: no drift piles up
    out = {"mean": prepared["mean"], "ranks": {}, "sums": {}, "exact": True}
    for key, (us, vh) in prepared["factors"].items():
        m, n = us.shape[1], vh.shape[2]
        k, r = kept_rank(rank_ratio, m, n), min(m, n)
        out["ranks"][key] = k
        usable = [d for d in bases if d["sums"][key] is not None] if 0 < k < r else []
        base = min(usable, key=lambda d: abs(d["ranks"][key] - k), default=None)
        if base is not None and abs(base["ranks"][key] - k) < min(k, r - k):
            k0 = base["ranks"][key]
            lo, hi = sorted((k0, k))
            out["sums"][key] = torch.addmm(base["sums"][key], *_factors(us, vh, hi, start=lo),
                                           alpha=1.0 if k > k0 else -1.0)
            out["exact"] = False
        else:
            out["sums"][key] = rank_k_sum(us, vh, k)
    return out


def apply_cart(derived: dict, lam: float, rank_ratio: float) -> dict:
    mean, sums = derived["mean"], derived["sums"]
    return {k: (v if sums.get(k) is None else torch.add(v, sums[k], alpha=lam)) for k, v in mean.items()}


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
    derive=cart_sums,
    derive_params=("rank_ratio",),
    derive_near=True,
    apply=apply_cart,
    note=cart_note,
    tune_grid={"lam": frange(0.5, 3.0, 0.25), "rank_ratio": (0.04, 0.08, 0.16, 0.32)},
    weights=sum_weights("average"),
    conventions=MATRICES_NOTE + " k = ⌈rank_ratio · r⌉ as the paper's Algorithm 1 (the authors' code rounds "
                "down: max(1, ⌊γ · min(m, n)⌋), one rank fewer at most ratios).",
    published=(Published("ViT-B-32", 84.7, CART_README), Published("ViT-L-14", 92.6, CART_README)),
))


# ---- TSV-M --------------------------------------------------------------------------------

def prepare_tsv(tv: TaskVectors, progress=None, cancel=None) -> dict:
    """The mean τ, and per matrix each τt's top ⌊r/T⌋ singular triplets (the most any rank the
    slider reaches keeps: T·k ≤ r); the default rank's direction is derived here too."""
    mean = {k: v.mean(0) for k, v in tv.items32()}
    factors = {}
    for k in each(tv.matrices, progress, cancel, "spectrum of matrix"):
        shape = tv.base[k].shape
        factors[k] = spectral(tv.fp32(k), min(shape) // tv.num_tasks, dtype=tv.dtype)
    prepared = {"mean": mean, "factors": factors, "T": tv.num_tasks}
    return {**prepared, "auto": tsv_direction(prepared, "auto")}


def tsv_rank(rank_ratio, m: int, n: int, T: int) -> int:
    """TSV-M's kept rank per task: "auto" is exactly ⌊r/T⌋ (the authors' int(r · 1/T)), else
    ⌊rank_ratio · r⌋; r = min(m, n). Either way T·k ≤ r (the ratio is capped at 1/T)."""
    r = min(m, n)
    if rank_ratio == "auto":
        return r // T
    return min(r // T, math.floor(rank_ratio * r + 1e-9))


def _inverse_sqrt(gram: torch.Tensor) -> torch.Tensor:
    """G^(-1/2) of each PSD Gram matrix of a batch [B, q, q] (a pseudo-inverse on a null space), in
    fp64: the Gram of the concatenated singular vectors can be ill-conditioned (tasks sharing
    directions)."""
    gram = gram.double()
    evals, evecs = per_matrix(torch.linalg.eigh, gram)
    top = evals.max(-1, keepdim=True).values.clamp(min=1e-30)
    floor = top * gram.shape[-1] * torch.finfo(gram.dtype).eps
    inv = torch.where(evals > floor, evals.clamp(min=1e-30).rsqrt(), 0.0)
    return (evecs * inv[..., None, :]) @ evecs.mT


def tsv_direction(prepared: dict, rank_ratio) -> dict:
    """The merged direction at one rank (TSV-M's derive step: cached per rank by the session).

    The orthogonal factors P = U (UᵀU)^(-1/2), Q = V (VᵀV)^(-1/2) of the concatenated singular
    vectors (what an SVD X = P S Qᵀ → P Qᵀ gives) meet in a [T·k, T·k] core, so the direction
    P S Qᵀ = U (G_U^(-1/2) S G_V^(-1/2)) Vᵀ costs two small eighs and two products."""
    if rank_ratio == "auto" and "auto" in prepared:
        return prepared["auto"]
    out = dict(prepared["mean"])
    for key, (left, right, s) in prepared["factors"].items():
        T, m, _ = left.shape
        k = tsv_rank(rank_ratio, m, right.shape[2], T)
        if k == 0:  # fewer dimensions than tasks: no task keeps a singular vector here
            out[key] = torch.zeros_like(prepared["mean"][key])
            continue
        u, vh = unit_factors(left[:, :, :k], right[:, :k], s[:, :k])
        u_cat = u.permute(1, 0, 2).reshape(m, T * k)
        vh_cat = vh.reshape(T * k, -1)
        u64, vh64 = u_cat.double(), vh_cat.double()
        left_isqrt, right_isqrt = _inverse_sqrt(torch.stack([u64.T @ u64, vh64 @ vh64.T]))  # both at once
        core = (left_isqrt * s[:, :k].reshape(-1).double()) @ right_isqrt
        out[key] = (u_cat @ core.float()) @ vh_cat
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
                "projection; here those get the mean. The default rank is exactly ⌊r/T⌋ (auto).",
    published=(Published("ViT-B-32", 85.9, RECOLLECTION, verified=False),),
))


# ---- Iso-C --------------------------------------------------------------------------------

def prepare_iso(tv: TaskVectors, progress=None, cancel=None) -> dict:
    # The mean task vector off the matrices, as the authors' code and FusionBench do: with a λ
    # near 1.3 a sum would move biases, norms and embeddings T times too far.
    direction = {k: v.mean(0) for k, v in tv.items32()}
    pending: list[str] = []

    def flatten_spectra():
        # An SVD, not a Gram eigh: every direction gets unit weight here, the smallest included.
        u, s, vh = per_matrix(_svd, torch.stack([tv.fp32(k).sum(0) for k in pending]))
        for i, k in enumerate(pending):
            direction[k] = (u[i] @ vh[i]) * s[i].mean()  # flatten the spectrum of Σ τt: Σ → σ̄ I
        pending.clear()

    # same-shaped matrices side by side, as many at once as there are threads (see per_matrix)
    for k in each(sorted(tv.matrices, key=lambda k: tuple(tv.base[k].shape)), progress, cancel, "SVD of matrix"):
        if pending and tv.base[k].shape != tv.base[pending[0]].shape:
            flatten_spectra()
        pending.append(k)
        if len(pending) >= torch.get_num_threads():
            flatten_spectra()
    if pending:
        flatten_spectra()
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
