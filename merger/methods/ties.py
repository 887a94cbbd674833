"""TIES-merging and DARE (linear and TIES variants).

Both reduce over the task axis entry by entry. The reductions run over chunks of a few
thousand entries so every temporary stays in cache: a [T, n] temporary the size of a ViT-B/32
task-vector stack costs more in page faults than in arithmetic. A chunked merge of ViT-B/32 × 8
is under a second on 2 cores, so TIES prepares only its thresholds (no per-entry tables).
"""
from __future__ import annotations

import math
import zlib

import numpy as np
import torch

from merger.methods import compiled
from merger.methods.registry import (CART_README, LAM, SEED, SPARSITY, Method, Paper, Published, each, frange,
                                     lam_times, register, sum_weights, with_default)
from merger.pool.task_vectors import TaskVectors

CHUNK = 1 << 14
GRID = 100  # sparsity thresholds precomputed at steps of 1/GRID (the slider step)
_LOWEST, _LEVELS = 0x0080, 0x7F80 - 0x0080  # DARE's draws: the bits of bf16's positive normal numbers


def _n_keep(numel: int, sparsity: float) -> int:
    return max(1, math.floor((1.0 - sparsity) * numel + 1e-6))


def _thresholds_on_grid(magnitudes: torch.Tensor) -> torch.Tensor:
    """Exact keep-thresholds for sparsity j/GRID, j = 0..GRID-1 (one multi-k selection)."""
    n = magnitudes.numel()
    kth = np.array([n - _n_keep(n, j / GRID) for j in range(GRID)])
    part = np.partition(magnitudes.numpy(), kth)
    return torch.from_numpy(part[kth].copy())


def _magnitude_histogram(tv: TaskVectors, i: int) -> torch.Tensor:
    """How many entries of bf16 τi have each magnitude: bf16 has 2¹⁵ non-negative codes, in the
    order of their values, so a count per code is an exact order statistic of every entry."""
    hist = torch.zeros(1 << 15, dtype=torch.int64)
    for v in tv.stacked.values():
        codes = v[i].reshape(-1).view(torch.int16).bitwise_and(0x7FFF).cpu().int()
        hist += torch.bincount(codes, minlength=1 << 15)
    return hist


def _threshold_from_histogram(hist: torch.Tensor, sparsity: float) -> torch.Tensor:
    """The k-th largest magnitude (k = the kept count): the largest code with ≥ k entries at or above it."""
    n = int(hist.sum())
    at_or_above = hist.flip(0).cumsum(0).flip(0)
    code = int((at_or_above >= _n_keep(n, sparsity)).nonzero().max())
    return torch.tensor([code], dtype=torch.int16).view(torch.bfloat16).float()[0]


def prepare_ties(tv: TaskVectors, progress=None, cancel=None) -> dict:
    """Each task's magnitude threshold at every slider step of sparsity (exact top-k over its whole
    task vector). bf16 task vectors: from a histogram of magnitude codes (one pass, any sparsity
    later); fp32: one multi-k partition. A move is then the direct trim-elect-merge (chunked)."""
    thresholds, hists = [], []
    for i in each(range(tv.num_tasks), progress, cancel, "magnitude order of task"):
        if tv.dtype == torch.bfloat16:
            hists.append(_magnitude_histogram(tv, i))
            thresholds.append(torch.stack([_threshold_from_histogram(hists[-1], j / GRID) for j in range(GRID)]))
        else:
            mags = torch.cat([v[i].reshape(-1).abs().cpu() for v in tv.stacked.values()])
            thresholds.append(_thresholds_on_grid(mags))
    _use_fused(tv, "ties")  # the kernel is compiled with the preparation, not in the first move
    state = {"tv": tv, "grid": torch.stack(thresholds, 1)}  # [GRID, T]
    if hists:
        state["hist"] = torch.stack(hists)  # [T, 2¹⁵]
    return state


def _grid_step(sparsity: float) -> int | None:
    j = sparsity * GRID
    return int(round(j)) if abs(j - round(j)) < 1e-9 else None


def _thresholds(prepared: dict, sparsity: float) -> torch.Tensor:
    """Per-task magnitude threshold: keep entries with |τ| ≥ threshold (TIES' top-k rule)."""
    j = _grid_step(sparsity)
    if j is not None:
        return prepared["grid"][j]
    if "hist" in prepared:
        return torch.stack([_threshold_from_histogram(h, sparsity) for h in prepared["hist"]])
    # Off the slider grid (a typed value): computed each time; prepared state is never written.
    tv = prepared["tv"]
    out = []
    for i in range(tv.num_tasks):
        mags = torch.cat([v[i].reshape(-1).abs().cpu() for v in tv.stacked.values()])
        n = mags.numel()
        out.append(mags.kthvalue(n - _n_keep(n, sparsity) + 1).values)
    return torch.stack(out)


def _disjoint_merge(tau: torch.Tensor, keep=None, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Elect s = sign(Σ τ̂t), then average the τ̂t whose sign is s (zeros excluded), in fp32.

    ``tau`` is [T, n] (fp32 or bf16); ``keep(chunk, start, stop)`` returns the trimmed/dropped
    chunk. With task ``weights`` [T], as mergekit: the weighted τ̂ elect the sign and the merge is
    Σ wₜτ̂ₜ·agree / Σ wₜ·agree (a zero divisor read as 1).
    """
    T, n = tau.shape
    out = torch.empty(n, dtype=torch.float32, device=tau.device)
    w = None if weights is None else weights.to(tau.device, torch.float32)[:, None]
    for s in range(0, n, CHUNK):
        e = min(n, s + CHUNK)
        t = tau[:, s:e].float()
        t = t if keep is None else keep(t, s, e)
        if w is not None:
            t = t * w
        elected = t.sum(0).sign_()
        agree = (t * elected) > 0
        total = torch.where(agree, t, 0.0).sum(0)
        if w is None:
            out[s:e] = total.div_(agree.sum(0).clamp_(min=1))
        else:
            divisor = torch.where(agree, w, 0.0).sum(0)
            out[s:e] = total.div_(torch.where(divisor == 0, 1.0, divisor))
    return out


# ---- the fused kernels (large stacks: see compiled.py) ---------------------------------------

def _kernel(tau, score, level, scale, w, disjoint: bool):
    """Keep τt where score ≥ level (times scale), weight by w [T, 1], then sum or disjoint-merge.

    Written task by task, not as a reduction over the task axis: inductor's CPU code for a sum
    over dim 0 of a [T, n] stack was scalar, and the disjoint merge stored the whole fp32 [T, n]
    stack between its two passes (60 ms per 3072×768 × 8 where this takes 12). Masks multiply
    rather than select: a data-dependent torch.where ran 9× slower at a 50 % keep rate than at
    10 %. Scores are floats: int16 loads did not vectorise (see ``prepare_dare``)."""
    terms = [tau[i].float() * ((score[i] >= level[i]).to(torch.float32) * scale) * w[i] for i in range(tau.shape[0])]
    return _combined(terms, w, disjoint)


def _ties_kernel(tau, thr, w):
    return _kernel(tau, tau.abs(), thr, 1.0, w, True)  # |bf16| widens exactly: the fp32 magnitude's order


def _combined(terms: list, w, disjoint: bool):
    total = sum(terms)
    if not disjoint:
        return total
    elected = total.sign()
    agree = [((t * elected) > 0).to(torch.float32) for t in terms]
    divisor = sum(wi * a for wi, a in zip(w, agree))
    return sum(t * a for t, a in zip(terms, agree)) / torch.where(divisor == 0, 1.0, divisor)


def _examples(tv: TaskVectors, name: str) -> tuple:
    """One call per graph a merge can take, at the pool's task count and contiguous [T, n] layout, so
    that all compile with the preparation (a task count or a layout of its own is a recompile)."""
    T, dev = tv.num_tasks, tv.device
    x, w = torch.zeros((T, 64), dtype=tv.dtype, device=dev), torch.ones((T, 1), device=dev)
    if name == "ties":
        return _ties_kernel, (x, torch.zeros((T, 1), device=dev), w)
    draws = torch.zeros((T, 64), dtype=torch.bfloat16, device=dev)
    level = torch.zeros((T, 1), dtype=torch.bfloat16, device=dev)
    return _kernel, *((x, draws, level, torch.tensor(1.0, device=dev), w, disjoint) for disjoint in (False, True))


def _use_fused(tv: TaskVectors, name: str):
    fn, *examples = _examples(tv, name)
    return compiled.for_stack(tv, fn, *examples)


def _weight_column(tv: TaskVectors, task_weights) -> torch.Tensor:
    w = torch.ones(tv.num_tasks) if task_weights is None else _weights(task_weights)
    return w.to(tv.device)[:, None]


def _weights(task_weights) -> torch.Tensor | None:
    return None if task_weights is None else torch.tensor(task_weights, dtype=torch.float32)


def merged_at(apply):
    """TIES' and DARE's derive step: the merge at λ = 1 for one sparsity (and task weighting), so a
    λ move is one scale of it (λ multiplies the whole merge), not a pass over every entry."""
    def derive(prepared: dict, sparsity: float, task_weights=None) -> dict:
        return {"merged": apply(prepared, 1.0, sparsity, task_weights=task_weights)}
    return derive


def apply_ties(prepared: dict, lam: float, sparsity: float, task_weights=None) -> dict:
    tv = prepared["tv"]
    thr = _thresholds(prepared, sparsity).to(tv.device)[:, None]
    delta = {}
    kernel = _use_fused(tv, "ties")
    for k, v in tv.stacked.items():
        flat = v.reshape(tv.num_tasks, -1)
        if kernel is not None:
            delta[k] = kernel(flat, thr, _weight_column(tv, task_weights)).mul_(lam).reshape(v.shape[1:])
            continue
        merged = _disjoint_merge(flat, lambda c, s, e: torch.where(c.abs() >= thr, c, 0.0), _weights(task_weights))
        delta[k] = merged.mul_(lam).reshape(v.shape[1:])
    return delta


TRIM_NOTE = ("Top-k over the whole flattened task vector (global, as the paper and FusionBench; mergekit trims "
             "each tensor on its own).")
MEAN_NOTE = ("The disjoint MEAN of the entries that agree with the elected sign, as the paper (FusionBench's "
             "default merge_func is a sum: the mean times the number of agreeing tasks).")
WEIGHTS_NOTE = ("Task weights as mergekit: they multiply the trimmed (or dropped and rescaled) τ̂t, the weighted "
                "vectors elect the sign, and the merge divides by the sum of the agreeing tasks' weights "
                "(Σ wₜτ̂ₜ / Σ wₜ over agreeing tasks): scaling every weight alike changes nothing.")
TIES_NOTE = TRIM_NOTE + " " + MEAN_NOTE + " " + WEIGHTS_NOTE

TIES = register(Method(
    name="ties",
    slow_prepare=True,
    featured=True,
    display_name="TIES-merging",
    paper=Paper("TIES-Merging: Resolving interference when merging models", "2306.01708"),
    description="Trim each τt to its top (1 − sparsity) by magnitude, elect signs, disjoint mean; θ0 + λ·that.",
    params=(LAM, SPARSITY),
    prepare=prepare_ties,
    derive=merged_at(apply_ties),
    derive_params=("sparsity",),
    apply=lam_times("merged"),
    task_weighted=True,
    tune_grid={"lam": frange(0.4, 1.5, 0.1), "sparsity": (0.5, 0.7, 0.8, 0.9)},
    weights=sum_weights("mean"),
    mask=lambda tv, sparsity, lam=None: kept_entries(tv, "ties", sparsity),
    conventions=TIES_NOTE,
    published=(Published("ViT-B-32", 72.4, CART_README),),
))


# ---- DARE ---------------------------------------------------------------------------------

def _task_seed(seed: int, task: str) -> int:
    # Seeded by task name, so a task's mask does not change when the expert subset does.
    return (int(seed) * 1_000_003 + zlib.crc32(task.encode())) % (2**63 - 1)


def prepare_dare(tv: TaskVectors, seed: int) -> dict:
    """One uniform draw per entry among _LEVELS values, stored as the bf16 whose bits are
    _LOWEST + draw: the positive normal bf16 numbers sort as their bits do, so the drop mask for
    rate p is a bf16 compare, draw < level(p) (compiled kernels vectorise a bf16 load, not an int16
    one: 4 ms against 20 for a 3072×768 × 8 merge; no subnormals, no NaN, whatever the FPU flags)."""
    draws = {}
    gens = [torch.Generator().manual_seed(_task_seed(seed, t)) for t in tv.tasks]
    for k, v in tv.stacked.items():
        d = torch.empty(v.shape, dtype=torch.int16)
        for i, g in enumerate(gens):
            d[i] = torch.randint(_LOWEST, _LOWEST + _LEVELS, v.shape[1:], generator=g, dtype=torch.int16)
        draws[k] = d.view(torch.bfloat16).to(tv.device)
    _use_fused(tv, "dare")  # compiled with the preparation, not in the first move
    return {"tv": tv, "draws": draws}


def dare_level(p: float) -> torch.Tensor:
    """The bf16 threshold a draw must reach to be kept at drop rate p (kept with probability
    1 − round(p · _LEVELS) / _LEVELS)."""
    return torch.tensor(_LOWEST + int(round(p * _LEVELS)), dtype=torch.int16).view(torch.bfloat16)


def _dare_keep(prepared: dict, key: str, p: float):
    level = dare_level(p).to(prepared["tv"].device)
    draws = prepared["draws"][key].reshape(prepared["tv"].num_tasks, -1)
    scale = 1.0 / (1.0 - p)

    def keep(chunk, s, e):
        return torch.where(draws[:, s:e] >= level, chunk * scale, 0.0)

    return keep


def _dare_fused(prepared: dict, lam: float, p: float, task_weights, disjoint: bool) -> dict | None:
    tv = prepared["tv"]
    kernel = _use_fused(tv, "dare")
    if kernel is None:
        return None
    w = _weight_column(tv, task_weights)
    # tensors, not Python numbers: a number in the compiled graph is a guard (a recompile per value)
    level = dare_level(p).to(tv.device).repeat(tv.num_tasks, 1)
    scale = torch.tensor(1.0 / (1.0 - p), device=tv.device)
    return {k: kernel(v.reshape(tv.num_tasks, -1), prepared["draws"][k].reshape(tv.num_tasks, -1), level,
                      scale, w, disjoint).mul_(lam).reshape(v.shape[1:]) for k, v in tv.stacked.items()}


def apply_dare_linear(prepared: dict, lam: float, sparsity: float, seed: int | None = None, task_weights=None) -> dict:
    fast = _dare_fused(prepared, lam, sparsity, task_weights, False)
    if fast is not None:
        return fast
    tv = prepared["tv"]
    w = _weight_column(tv, task_weights)
    delta = {}
    for k, v in tv.stacked.items():
        flat = v.reshape(tv.num_tasks, -1)
        keep = _dare_keep(prepared, k, sparsity)
        out = torch.empty(flat.shape[1], device=tv.device)
        for s in range(0, flat.shape[1], CHUNK):
            e = min(flat.shape[1], s + CHUNK)
            kept = keep(flat[:, s:e].float(), s, e)
            out[s:e] = (kept if task_weights is None else kept * w).sum(0)
        delta[k] = out.mul_(lam).reshape(v.shape[1:])
    return delta


def apply_dare_ties(prepared: dict, lam: float, sparsity: float, seed: int | None = None, task_weights=None) -> dict:
    fast = _dare_fused(prepared, lam, sparsity, task_weights, True)
    if fast is not None:
        return fast
    tv = prepared["tv"]
    delta = {}
    for k, v in tv.stacked.items():
        merged = _disjoint_merge(v.reshape(tv.num_tasks, -1), _dare_keep(prepared, k, sparsity), _weights(task_weights))
        delta[k] = merged.mul_(lam).reshape(v.shape[1:])
    return delta


DARE_PAPER = Paper("Language models are Super Mario: absorbing abilities from homologous models "
                   "as a free lunch", "2311.03099")
DARE_P = with_default(SPARSITY, 0.9)

register(Method(
    name="dare_linear",
    display_name="DARE (linear)",
    paper=DARE_PAPER,
    description="Drop each τ entry with probability p = sparsity, rescale by 1/(1 − p), then task arithmetic.",
    params=(with_default(LAM, 0.3), DARE_P, SEED),
    prepare=prepare_dare,
    derive=merged_at(apply_dare_linear),
    derive_params=("sparsity",),
    apply=lam_times("merged"),
    task_weighted=True,
    prepare_params=("seed",),
    tune_grid={"lam": frange(0.1, 1.0, 0.1), "sparsity": (0.5, 0.7, 0.9)},
    weights=sum_weights("sum"),
    mask=lambda tv, sparsity, seed, lam=None: kept_entries(tv, "dare", sparsity, seed),
    conventions="Masks are seeded per task name, so a task's mask does not change with the expert subset.",
))

register(Method(
    name="dare_ties",
    display_name="DARE (TIES)",
    paper=DARE_PAPER,
    description="Drop and rescale as DARE, then TIES' sign election and disjoint mean; θ0 + λ·that.",
    params=(LAM, DARE_P, SEED),
    prepare=prepare_dare,
    derive=merged_at(apply_dare_ties),
    derive_params=("sparsity",),
    apply=lam_times("merged"),
    task_weighted=True,
    prepare_params=("seed",),
    tune_grid={"lam": frange(0.4, 1.5, 0.1), "sparsity": (0.5, 0.7, 0.9)},
    weights=sum_weights("mean"),
    mask=lambda tv, sparsity, seed, lam=None: kept_entries(tv, "dare_ties", sparsity, seed),
    conventions="Masks are seeded per task name, so a task's mask does not change with the expert subset. "
                "After dropping, as TIES. " + MEAN_NOTE + " " + WEIGHTS_NOTE,
))


# ---- the kept entries (seed 000's sparsifying operator M, for the heterogeneity diagnostic) --

def kept_entries(tv: TaskVectors, rule: str, sparsity: float, seed: int | None = None) -> torch.Tensor:
    """Per task, the entries its merge keeps, [T, P] bool over the flattened task vectors: TIES keeps
    the top (1 − sparsity) by magnitude and then only entries whose sign agrees with the elected
    sign(Σ trimmed τ); DARE keeps its seeded draw (dare_ties then elects signs among the kept)."""
    T = tv.num_tasks
    flat = torch.stack([torch.cat([tv.row(k, i).reshape(-1) for k in tv.keys]) for i in range(T)])
    keep = torch.zeros_like(flat, dtype=torch.bool)
    for i in range(T):
        if rule == "ties":
            n = flat.shape[1]
            thr = flat[i].abs().kthvalue(n - _n_keep(n, sparsity) + 1).values
            keep[i] = flat[i].abs() >= thr
        else:  # the very masks DARE merges with (seeded per task name)
            draws = prepare_dare(tv.subset([tv.tasks[i]]), int(seed or 0))["draws"]
            drawn = torch.cat([draws[k][0].reshape(-1) for k in tv.keys])
            keep[i] = drawn >= dare_level(sparsity).to(drawn.device)
    if rule in ("ties", "dare_ties"):
        elected = torch.where(keep, flat, 0.0).sum(0).sign()
        keep &= (flat.sign() == elected) & (flat != 0)
    return keep
