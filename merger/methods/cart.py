"""CART: θavg + λ Σt SVD_k(θt − θavg) on the attention/MLP matrices, θavg elsewhere.

A rank change is a slice of each matrix's spectrum and a λ change is a scale. The spectrum comes in two
stages (issue 18): the preparation takes each task's top EAGER_SHARE of directions per matrix (every rank
up to 0.125: the default 0.08 and the paper's grid to 0.08), by LAPACK's subset solver; every direction
(``whole_spectrum``) replaces that when a rank move first needs more, or ahead of it in idle time (the
warm-up, ``cart_warm``). ViT-B/32 × 8 on a 2-core Zen 4: 11–12 s against 21–24 s for every direction at
once. The preparation holds its task vectors until its spectrum is whole.
"""
from __future__ import annotations

import threading

import torch

from merger.methods.linalg import BF16_MATMUL, spectral, workers
from merger.methods.registry import (CART_README, LAM, MATRICES_NOTE, RANK_RATIO, Method, Paper, Published, each,
                                     frange, kept_rank, register, sum_weights, with_default)
from merger.pool.task_vectors import TaskVectors

EAGER_SHARE = 0.125  # of each matrix's rank r, per task, in the preparation; the rest when a move needs it
_PUBLISHING = threading.Lock()  # a whole spectrum replaces the first stage's once (a move and the warm-up may race)


def prepare_cart(tv: TaskVectors, progress=None, cancel=None, share: float = EAGER_SHARE,
                 rank_ratio: float | None = None) -> dict:
    """Mean task vector τ̄, and per matrix the top ⌈share · r⌉ directions (kept_rank) of each centred
    θt − θavg = τt − τ̄ ([T, m, q], [T, q, n]; every one at share 1). ``rank_ratio``: the rank of the merge
    that asks (a hint, not part of what is prepared): one whose sums take more than that share prepares
    every direction at once (a CLI merge at 0.3 would otherwise pay both stages)."""
    shapes = [tv.base[k].shape for k in tv.matrices]
    if rank_ratio is not None and any(_directions_at(rank_ratio, *s) > kept_rank(share, *s) for s in shapes):
        share = 1.0
    mean = {k: v.mean(0) for k, v in tv.items32()}
    factors = {}
    # A matrix at a time (its T tasks side by side, each task's Gram, eigh and products on one
    # worker): whole matrices side by side were slower here (16.7 s against 13.4 s for ViT-B/32 × 8),
    # two working sets of T·m·n.
    for k in each(tv.matrices, progress, cancel, "spectrum of matrix"):
        factors[k] = spectral(tv.fp32(k) - mean[k], kept_rank(share, *tv.base[k].shape), dtype=tv.dtype)[:2]
    state = {"mean": mean, "factors": factors, "T": tv.num_tasks}
    if not all(_whole(*f) for f in factors.values()):
        state["tv"] = tv  # what the rest is computed from; let go once every spectrum is whole
    return state


def _whole(us: torch.Tensor, vh: torch.Tensor) -> bool:
    return us.shape[2] == min(us.shape[1], vh.shape[2])


def _needed(k: int, r: int) -> int:
    """Directions a rank-k sum takes from scratch: the top k, or, above half the rank, all (``rank_k_sum``);
    none at k = 0 or full rank (the sum is zero)."""
    if not 0 < k < r:
        return 0
    return k if 2 * k <= r else r


def _directions_at(rank_ratio: float, m: int, n: int) -> int:
    """Directions CART's sum at this rank takes from an m × n matrix's spectrum."""
    return _needed(kept_rank(rank_ratio, m, n), min(m, n))


def whole_spectrum(prepared: dict, key: str, gate=lambda: True) -> bool:
    """Every direction of one matrix in place of the first stage's top ones (the same ``spectral``, whole),
    a worker's share of tasks at a time with ``gate()`` before each share (False: stop, nothing kept;
    the warm-up's); whether the spectrum is whole now. The last matrix made whole lets the task vectors go."""
    us, vh = prepared["factors"][key]
    tv = prepared.get("tv")
    if _whole(us, vh) or tv is None:
        return _whole(*prepared["factors"][key])
    x = tv.fp32(key) - prepared["mean"][key]
    share = workers() if x.device.type == "cpu" else x.shape[0]
    parts = []
    for i in range(0, x.shape[0], share):
        if not gate():
            return False
        if _whole(*prepared["factors"][key]):  # made whole by a move while the gate waited
            return True
        parts.append(spectral(x[i:i + share], dtype=us.dtype)[:2])
    whole = tuple(torch.cat(p) for p in zip(*parts))
    with _PUBLISHING:
        if not _whole(*prepared["factors"][key]):
            prepared["factors"][key] = whole
        if all(_whole(*f) for f in prepared["factors"].values()):
            prepared.pop("tv", None)
    return True


def cart_factors(prepared: dict, key: str, directions: int):
    """(us, vh) of one matrix holding at least its top ``directions`` (whole where the first stage's are fewer)."""
    if prepared["factors"][key][0].shape[2] < directions:
        whole_spectrum(prepared, key)
    return prepared["factors"][key]


def cart_warm(prepared: dict, parts, gate, rank_ratio) -> None:
    """The warm-up's step for one rank: every matrix whose first stage lacks the directions it takes, made
    whole in idle time (``parts`` unused: the spectrum lives in the preparation)."""
    for key, (us, vh) in list(prepared["factors"].items()):
        if us.shape[2] < _directions_at(rank_ratio, us.shape[1], vh.shape[2]):
            if not whole_spectrum(prepared, key, gate):
                return


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
    """Σt SVD_k(Mt) from the stacked factors us [T,m,q] and vh [T,q,n], q ≥ k (see ``spectral``)."""
    if us.shape[2] < k:
        raise ValueError(f"{k} directions asked of factors holding {us.shape[2]}")
    return _product(*_factors(us, vh, k))


def rank_k_sum(us: torch.Tensor, vh: torch.Tensor, k: int) -> torch.Tensor | None:
    """Σt SVD_k(τt − τ̄) of one matrix from scratch, or None where it is exactly zero (k = 0, or
    full rank: the centred matrices sum to zero). Above half the rank the complement is cheaper
    and exact: Σt SVD_k(Mt) = −Σt (Mt − SVD_k(Mt)), the directions k..r (a whole spectrum's)."""
    r = min(us.shape[1], vh.shape[2])
    if not 0 < k < r:
        return None
    if us.shape[2] < _needed(k, r):
        raise ValueError(f"a rank-{k} sum of {r} takes {_needed(k, r)} directions; the factors hold {us.shape[2]}")
    return _product(*_factors(us, vh, k)) if 2 * k <= r else _product(*_factors(us, vh, r, start=k)).neg_()


def cart_task_parts(prepared: dict, rank_ratio: float) -> dict:
    """Per matrix, each task's SVD_k(τt − τ̄) stacked [T, m, n] (AdaMerging+CART's parts)."""
    out = {}
    for key, (us, vh) in list(prepared["factors"].items()):
        r = kept_rank(rank_ratio, us.shape[1], vh.shape[2])
        us, vh = cart_factors(prepared, key, r)
        out[key] = torch.bmm(us[:, :, :r].float(), vh[:, :r].float())
    return out


CHAIN = 16  # a rank-k sum is updated from one updated before at most this many times, then recomputed


def cart_sums(prepared: dict, rank_ratio: float, near=(), parts=None) -> dict:
    """CART's derive step: Σt SVD_k(τt − τ̄) per matrix at one rank (None where it is zero: k = 0
    or full rank), so that a λ move is one axpy. ``near``: sums derived before from the same
    preparation; one whose rank is closer than the cost of starting over is updated by the
    directions in between (a slider step of 0.01 is 8 directions per task, not k; a jump from 0.16
    to 0.32 is 123, not 246). Updates chain up to CHAIN deep per matrix (``chains``: 0 = computed
    from scratch); each adds one rounding: of the sum in fp32 (about 1e-7 of it), or, with bf16 factors
    multiplied in bf16 (``_product``), of the increment (about 2e-3 of it), so a long drag cannot pile
    drift up. A matrix whose first-stage spectrum lacks the directions is made whole first; a sum taken
    from the first stage is then no starting point (``stage``: the directions its factors held). ``parts``:
    the session's derive parts, unused (the whole spectrum lives in the preparation, see ``cart_warm``)."""
    out = {"mean": prepared["mean"], "ranks": {}, "sums": {}, "chains": {}, "stage": {}}
    for key, (us, vh) in list(prepared["factors"].items()):
        m, n = us.shape[1], vh.shape[2]
        k, r = kept_rank(rank_ratio, m, n), min(m, n)
        us, vh = cart_factors(prepared, key, _needed(k, r))
        out["ranks"][key], out["chains"][key], out["stage"][key] = k, 0, us.shape[2]
        usable = [d for d in near if d["sums"][key] is not None and d["chains"][key] < CHAIN
                  and d["stage"][key] == us.shape[2]] if 0 < k < r else []
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
    prepare_hints=("rank_ratio",),
    derive=cart_sums,
    derive_params=("rank_ratio",),
    derive_near=True,
    warm=cart_warm,
    apply=apply_cart,
    note=cart_note,
    tune_grid={"lam": frange(0.5, 3.0, 0.25), "rank_ratio": (0.04, 0.08, 0.16, 0.32)},
    weights=sum_weights("average"),
    conventions=MATRICES_NOTE + " k = ⌈rank_ratio · r⌉ as the paper's Algorithm 1 (the authors' code rounds "
                "down: max(1, ⌊γ · min(m, n)⌋), one rank fewer at most ratios).",
    published=(Published("ViT-B-32", 84.7, CART_README), Published("ViT-L-14", 92.6, CART_README)),
))
