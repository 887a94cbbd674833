"""Low-rank and spectral merges: CART, TSV-M, Iso-C.

Each SVD is taken once in prepare, so a rank change is a slice and a λ change is a scale.
"""
from __future__ import annotations

import math

import torch

from merger.methods.registry import (CART_README, LAM, RANK_RATIO, RECOLLECTION, Method, Paper, Published, each,
                                     frange, kept_rank, lam_times, register, sum_weights, with_default)
from merger.methods.linalg import (BF16_MATMUL, divided, each_matrix, gram_rows, inverse_sqrt, spectral, thin_svd,
                                   unit_factors, workers)
from merger.pool.task_vectors import TaskVectors

MATRICES_NOTE = ("Matrices = the 2-D attention and MLP weights (in_proj, out_proj, c_fc, c_proj); "
                 "every other tensor (biases, norms, embeddings, conv1, visual projection) is 'other'.")


# ---- CART ---------------------------------------------------------------------------------

def prepare_cart(tv: TaskVectors, progress=None, cancel=None) -> dict:
    """Mean task vector τ̄, and per matrix every direction of each centred θt − θavg = τt − τ̄."""
    mean = {k: v.mean(0) for k, v in tv.items32()}
    factors = {}
    # A matrix at a time (its T tasks side by side, each task's Gram, eigh and products on one
    # worker): whole matrices side by side were slower here (16.7 s against 13.4 s for ViT-B/32 × 8),
    # two working sets of T·m·n.
    for k in each(tv.matrices, progress, cancel, "spectrum of matrix"):
        factors[k] = spectral(tv.fp32(k) - mean[k], dtype=tv.dtype)[:2]  # [T,m,r], [T,r,n]
    return {"mean": mean, "factors": factors, "T": tv.num_tasks}


def _factors(us: torch.Tensor, vh: torch.Tensor, k: int, start: int = 0):
    """Factors start..k of every task side by side, in their stored dtype, so Σt Σ_{start ≤ i < k} σi ui viᵀ
    is one matmul (``_product``)."""
    T, m, _ = us.shape
    w = k - start
    return us[:, :, start:k].permute(1, 0, 2).reshape(m, T * w), vh[:, start:k, :].reshape(T * w, vh.shape[-1])


def _product(a: torch.Tensor, b: torch.Tensor, base: torch.Tensor | None = None, alpha: float = 1.0) -> torch.Tensor:
    """base + alpha · a @ b (or a @ b) in fp32 from stored factors. bf16 factors on a CPU with bf16 matmul
    units (linalg.BF16_MATMUL) multiply as they are, fp32 accumulation, the product rounded once to bf16:
    2× faster (CART's rank 0.32 move on ViT-B/32 × 8: 1.25 → 0.6 s on a 2-core Zen 4), and a rank-k sum
    5–18 % further from the exact one than the fp32 product's (3.5e-3 → 3.9e-3 of its norm at rank 0.32:
    the bf16 factors' own rounding is most of it). Elsewhere (fp32 pools, a GPU) the fp32 product as before."""
    if a.dtype == b.dtype == torch.bfloat16 and a.device.type == "cpu" and BF16_MATMUL:
        product = torch.mm(a, b)
        return product.float() if base is None else torch.add(base, product, alpha=alpha)
    a, b = a.float(), b.float()  # one fp32 copy of each: the stored bf16 ones are sliced, not copied
    return torch.mm(a, b) if base is None else torch.addmm(base, a, b, alpha=alpha)


def low_rank_sum(us: torch.Tensor, vh: torch.Tensor, k: int) -> torch.Tensor:
    """Σt SVD_k(Mt) from the stacked factors us [T,m,r] and vh [T,r,n] (see ``spectral``)."""
    return _product(*_factors(us, vh, k))


def rank_k_sum(us: torch.Tensor, vh: torch.Tensor, k: int) -> torch.Tensor | None:
    """Σt SVD_k(τt − τ̄) of one matrix from scratch, or None where it is exactly zero (k = 0, or
    full rank: the centred matrices sum to zero). Above half the rank the complement is cheaper
    and exact: Σt SVD_k(Mt) = −Σt (Mt − SVD_k(Mt)), the directions k..r."""
    r = min(us.shape[1], vh.shape[2])
    if not 0 < k < r:
        return None
    return _product(*_factors(us, vh, k)) if 2 * k <= r else _product(*_factors(us, vh, r, start=k)).neg_()


def cart_task_parts(prepared: dict, rank_ratio: float) -> dict:
    """Per matrix, each task's SVD_k(τt − τ̄) stacked [T, m, n] (AdaMerging+CART's parts)."""
    out = {}
    for k, (us, vh) in prepared["factors"].items():
        r = kept_rank(rank_ratio, us.shape[1], vh.shape[2])
        out[k] = torch.bmm(us[:, :, :r].float(), vh[:, :r].float())
    return out


CHAIN = 16  # a rank-k sum is updated from one updated before at most this many times, then recomputed


def cart_sums(prepared: dict, rank_ratio: float, near=()) -> dict:
    """CART's derive step: Σt SVD_k(τt − τ̄) per matrix at one rank (None where it is zero: k = 0
    or full rank), so that a λ move is one axpy. ``near``: sums derived before from the same
    preparation; one whose rank is closer than the cost of starting over is updated by the
    directions in between (a slider step of 0.01 is 8 directions per task, not k; a jump from 0.16
    to 0.32 is 123, not 246). Updates chain up to CHAIN deep per matrix (``chains``: 0 = computed
    from scratch); each adds one rounding: of the sum in fp32 (about 1e-7 of it), or, with bf16 factors
    multiplied in bf16 (``_product``), of the increment (about 2e-3 of it), so a long drag cannot pile
    drift up."""
    out = {"mean": prepared["mean"], "ranks": {}, "sums": {}, "chains": {}}
    for key, (us, vh) in prepared["factors"].items():
        m, n = us.shape[1], vh.shape[2]
        k, r = kept_rank(rank_ratio, m, n), min(m, n)
        out["ranks"][key], out["chains"][key] = k, 0
        usable = [d for d in near if d["sums"][key] is not None and d["chains"][key] < CHAIN] if 0 < k < r else []
        base = min(usable, key=lambda d: (abs(d["ranks"][key] - k), d["chains"][key]), default=None)
        if base is not None and abs(base["ranks"][key] - k) < min(k, r - k):
            k0 = base["ranks"][key]
            lo, hi = sorted((k0, k))
            out["sums"][key] = _product(*_factors(us, vh, hi, start=lo), base=base["sums"][key],
                                        alpha=1.0 if k > k0 else -1.0)
            out["chains"][key] = base["chains"][key] + 1
        else:
            out["sums"][key] = rank_k_sum(us, vh, k)
    return out


def apply_cart(derived: dict, lam: float, rank_ratio: float) -> dict:
    mean, sums = derived["mean"], derived["sums"]
    return {k: (v if sums.get(k) is None else torch.add(v, sums[k], alpha=lam)) for k, v in mean.items()}


def cart_note(params, prepared) -> str | None:
    if params.get("rank_ratio", 0) >= 1.0:
        return "λ has no effect: at full rank CART equals weight averaging."
    if prepared is not None and prepared.get("T") == 1:
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
    """The mean τ, and per matrix each τt's top K = ⌊r/T⌋ singular triplets (the most any rank the
    slider reaches keeps: T·k ≤ r) with the Grams of their concatenations at K, of which every
    rank's Grams are submatrices; the default rank's direction is derived here too."""
    mean = {k: v.mean(0) for k, v in tv.items32()}
    prepared = {"mean": mean, "factors": {}, "grams": {}, "T": tv.num_tasks}
    for k in each(tv.matrices, progress, cancel, "spectrum of matrix"):  # a matrix at a time, as CART
        left, right, s = spectral(tv.stacked[k], min(tv.base[k].shape) // tv.num_tasks, dtype=tv.dtype)
        prepared["factors"][k], prepared["grams"][k] = (left, right, s), _concatenated_grams(left, right, s)
    return {**prepared, "auto": tsv_direction(prepared, "auto")}


def _concatenated_grams(left, right, s) -> torch.Tensor:
    """[G_U, G_V] of one matrix's unit factors concatenated task by task ([2, T·K, T·K], fp32):
    summed in fp64 on a side where the concatenation is square (T·K = its dimension: near singular,
    see _tsv_matrix), in fp32 on a longer one (well conditioned; 0.4 s less for ViT-B/32 × 8)."""
    T, m, K = left.shape
    u, vh = unit_factors(left, right, s)

    def gram(rows):  # rows [T·K, side]
        return gram_rows(rows.double() if _square(T * K, rows.shape[1]) else rows).float()

    return torch.stack([gram(u.permute(0, 2, 1).reshape(T * K, m)), gram(vh.reshape(T * K, -1))])


def _square(width: int, side: int) -> bool:
    """Whether T·k concatenated singular vectors fill a side of this dimension (T·k ≤ r, so only
    equal): the concatenation is then square and its Gram near singular, solved in fp64 at once."""
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
    rank k are read off those prepared at K (the first k of each task's K directions).

    ``parts``: the session's store (get, put) of each matrix's work at each k but its last product
    (``_tsv_half``): one found there leaves that product alone (the eighs were 60 % of a move at rank
    0.1 on ViT-B/32 × 8); those computed here are put there. ``tsv_warm`` fills it ahead."""
    if rank_ratio == "auto" and "auto" in prepared:
        return prepared["auto"]
    out = dict(prepared["mean"])
    out.update(each_matrix(lambda key: _tsv_matrix(prepared, key, rank_ratio, parts), prepared["factors"]))
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
    share = workers()
    for i in range(0, len(missing), share):
        if not gate():
            return
        for item, half in each_matrix(lambda item: _tsv_half(prepared, *item), missing[i:i + share]):
            parts.put(item, half)


def _tsv_matrix(prepared: dict, key: str, rank_ratio, parts=None) -> torch.Tensor:
    left, right, _ = prepared["factors"][key]
    T, m, _ = left.shape
    k = tsv_rank(rank_ratio, m, right.shape[2], T)
    if k == 0:  # fewer dimensions than tasks: no task keeps a singular vector here
        return torch.zeros_like(prepared["mean"][key])
    half = None if parts is None else parts.get((key, k))
    if half is None:
        half = _tsv_half(prepared, key, k)
        if parts is not None:
            parts.put((key, k), half)
    return _tsv_product(prepared, key, k, *half)


def _tsv_half(prepared: dict, key: str, k: int) -> tuple[torch.Tensor, str]:
    """All of one matrix's direction at rank k but its last product: its two eighs, the [T·k, T·k]
    core between them, and the core times the factor of the shorter side. (that product, which side
    it holds: "right" = core · Vᵀ [T·k, n], to take U · it; "left" = U · core [m, T·k], to take it · Vᵀ;
    "unit left" = the same with the singular vectors, S divided out: the fp64 route's order)."""
    left, right, s = prepared["factors"][key]
    T, m, K = left.shape
    n = right.shape[2]
    # the first k of each task's K directions, task-major as the concatenation (a copy of [2, T·k, T·k])
    grams = prepared["grams"][key].view(2, T, K, T, K)[:, :, :k, :, :k].reshape(2, T * k, T * k)
    left_isqrt, right_isqrt = (inverse_sqrt(g[None], refined=not _square(T * k, side))[0]
                               for g, side in zip(grams, (m, n)))
    sk = s[:, :k].reshape(-1)
    if left_isqrt.dtype == right_isqrt.dtype == torch.float32:
        # the stored factors taken as they are: S, which ``spectral`` left on one side, is divided out
        # in the core (its rows where m ≥ n, see unit_factors) instead of across a [m, T·k] factor
        core = (left_isqrt * sk) @ right_isqrt
        core = divided(core, sk[:, None]) if m >= n else divided(core, sk)
        if m > n:
            return core @ right[:, :k].reshape(T * k, n).float(), "right"
        return left[:, :, :k].permute(1, 0, 2).reshape(m, T * k).float() @ core, "left"
    # T·k = r, or a Gram near singular (linalg.REFINED_COND): fp64, and the one order this always had:
    # its rounding shows there (the order moved the default merge of ViT-B/32's in_proj by 5e-4 and
    # out_proj by 9%, random experts).
    core = ((left_isqrt.double() * sk.double()) @ right_isqrt.double()).float()
    u, _ = unit_factors(left[:, :, :k], right[:, :k], s[:, :k])
    return u.permute(1, 0, 2).reshape(m, T * k) @ core, "unit left"


def _tsv_product(prepared: dict, key: str, k: int, half: torch.Tensor, side: str) -> torch.Tensor:
    """The direction of one matrix at rank k from its ``_tsv_half``: the one product left."""
    left, right, s = prepared["factors"][key]
    T, m, _ = left.shape
    n = right.shape[2]
    if side == "right":
        return left[:, :, :k].permute(1, 0, 2).reshape(m, T * k).float() @ half
    vh = unit_factors(left[:, :, :k], right[:, :k], s[:, :k])[1] if side == "unit left" else right[:, :k].float()
    return half @ vh.reshape(T * k, n)


# The Gram of one side's concatenated singular vectors is solved in fp32 with its small eigenpairs
# refined in fp64 (linalg.inverse_sqrt, refined): the direction within about 2e-5 of fp64's, relative,
# below the 2e-3 that bf16 storage of the singular vectors already carries. Before, an fp32 eigh was
# kept only up to a condition of 1e3 and fp64 taken above it: on a ViT-B/32 × 8 pool at rank 0.12
# (T·k = 736 of 768) 60 of the 96 Grams were above it (up to 9.4e3), and the move took 7.6 s on this
# 2-core CPU against 2.6 s at 0.1. Where T·k equals that side's dimension (the default rank's r side)
# the concatenation is square and its Gram near singular: fp64 at once (an fp32 eigh there was 0.05
# off the authors' SVDs on a test pool).


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

    direction.update(each_matrix(flat_spectrum, tv.matrices, progress, cancel, "SVD of matrix"))
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
