"""TIES-merging and DARE (linear and TIES variants).

Both reduce over the task axis entry by entry. The reductions run over chunks of a few
thousand entries so every temporary stays in cache: a [T, n] temporary the size of a ViT-B/32
task-vector stack costs more in page faults than in arithmetic.
"""
from __future__ import annotations

import math
import zlib

import numpy as np
import torch

from merger.methods.registry import (CART_README, LAM, SEED, SPARSITY, Method, Paper, Published, each, frange, register,
                                     sum_weights, with_default)
from merger.pool.task_vectors import TaskVectors

CHUNK = 1 << 14
GRID = 100  # sparsity thresholds precomputed at steps of 1/GRID (the slider step)
_U16 = 1 << 16


def _n_keep(numel: int, sparsity: float) -> int:
    return max(1, math.floor((1.0 - sparsity) * numel + 1e-6))


def _thresholds_on_grid(magnitudes: torch.Tensor) -> torch.Tensor:
    """Exact keep-thresholds for sparsity j/GRID, j = 0..GRID-1 (one multi-k selection)."""
    n = magnitudes.numel()
    kth = np.array([n - _n_keep(n, j / GRID) for j in range(GRID)])
    part = np.partition(magnitudes.numpy(), kth)
    return torch.from_numpy(part[kth].copy())


def prepare_ties(tv: TaskVectors, progress=None, cancel=None) -> dict:
    """Thresholds at every slider step of sparsity, and a per-entry segment table.

    An entry's merged value depends on which tasks survive trimming. Task t survives at grid
    step j iff its level (how many step thresholds its |τ| clears) is ≥ j, so sorting the tasks
    of each entry by level makes "the survivors at step j" a suffix of that order. The table
    holds the disjoint mean of every suffix; a sparsity change is then a count and a gather.
    """
    # Progress counts the magnitude order of each task (a sort of every entry), then each tensor's table.
    steps = [("task", i) for i in range(tv.num_tasks)] + [("tensor", k) for k in tv.stacked]
    thresholds, grid, tables = [], None, {}
    for kind, item in each(steps, progress, cancel, "step (a sort per task, then a table per tensor)"):
        if kind == "task":
            mags = torch.cat([v[item].reshape(-1).abs().cpu() for v in tv.stacked.values()])
            thresholds.append(_thresholds_on_grid(mags))
            continue
        if grid is None:
            grid = torch.stack(thresholds, 1).to(tv.device)  # [GRID, T]
        flat = tv.stacked[item].reshape(tv.num_tasks, -1)
        levels = torch.empty(flat.shape, dtype=torch.uint8, device=tv.device)
        for i in range(tv.num_tasks):
            levels[i] = torch.bucketize(flat[i].abs(), grid[1:, i].contiguous(), right=True)
        tables[item] = _segment_table(flat, levels)
    return {"tv": tv, "grid": grid.cpu(), "tables": tables}


def _segment_table(flat: torch.Tensor, levels: torch.Tensor):
    """(levels sorted per entry [T, n] uint8, disjoint mean of each suffix [T + 1, n])."""
    T, n = flat.shape
    sorted_levels = torch.empty_like(levels)
    table = torch.zeros((T + 1, n), dtype=flat.dtype, device=flat.device)
    step = 1 << 18
    for s in range(0, n, step):
        e = min(n, s + step)
        lv, order = levels[:, s:e].sort(dim=0, stable=True)
        sorted_levels[:, s:e] = lv
        vals = flat[:, s:e].gather(0, order)
        suffix = lambda x: x.flip(0).cumsum(0).flip(0)  # noqa: E731  Σ over the kept tasks r ≥ d
        pos, neg = suffix(vals.clamp(min=0)), suffix(vals.clamp(max=0))
        n_pos, n_neg = suffix((vals > 0).to(flat.dtype)), suffix((vals < 0).to(flat.dtype))
        total = pos + neg
        table[:T, s:e] = torch.where(total > 0, pos / n_pos.clamp(min=1),
                                     torch.where(total < 0, neg / n_neg.clamp(min=1), 0.0))
    return sorted_levels, table


def _grid_step(sparsity: float) -> int | None:
    j = sparsity * GRID
    return int(round(j)) if abs(j - round(j)) < 1e-9 else None


def _thresholds(prepared: dict, sparsity: float) -> torch.Tensor:
    """Per-task magnitude threshold: keep entries with |τ| ≥ threshold (TIES' top-k rule)."""
    j = _grid_step(sparsity)
    if j is not None:
        return prepared["grid"][j]
    # Off the slider grid (a typed value): computed each time; prepared state is never written.
    tv = prepared["tv"]
    out = []
    for i in range(tv.num_tasks):
        mags = torch.cat([v[i].reshape(-1).abs().cpu() for v in tv.stacked.values()])
        n = mags.numel()
        out.append(mags.kthvalue(n - _n_keep(n, sparsity) + 1).values)
    return torch.stack(out)


def _disjoint_merge(tau: torch.Tensor, keep=None, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Elect s = sign(Σ τ̂t), then average the τ̂t whose sign is s (zeros excluded).

    ``tau`` is [T, n]; ``keep(chunk, start, stop)`` returns the trimmed/dropped chunk. With task
    ``weights`` [T], as mergekit: the weighted τ̂ elect the sign and the merge is
    Σ wₜτ̂ₜ·agree / Σ wₜ·agree (a zero divisor read as 1).
    """
    T, n = tau.shape
    out = torch.empty(n, dtype=tau.dtype, device=tau.device)
    w = None if weights is None else weights.to(tau.device, tau.dtype)[:, None]
    for s in range(0, n, CHUNK):
        e = min(n, s + CHUNK)
        t = tau[:, s:e] if keep is None else keep(tau[:, s:e], s, e)
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


def _weights(task_weights) -> torch.Tensor | None:
    return None if task_weights is None else torch.tensor(task_weights, dtype=torch.float32)


def _lookup(sorted_levels: torch.Tensor, table: torch.Tensor, j: int) -> torch.Tensor:
    """The table row for the number of tasks trimmed at grid step j (level < j)."""
    n = table.shape[1]
    out = torch.empty(n, dtype=table.dtype, device=table.device)
    step = 1 << 18
    for s in range(0, n, step):
        e = min(n, s + step)
        # a uint8 count is several times faster than the default int64 reduction of bools
        dropped = (sorted_levels[:, s:e] < j).sum(0, keepdim=True, dtype=torch.uint8)
        out[s:e] = table[:, s:e].gather(0, dropped.long())[0]
    return out


def apply_ties(prepared: dict, lam: float, sparsity: float, task_weights=None) -> dict:
    tv = prepared["tv"]
    j = _grid_step(sparsity)
    delta = {}
    if j is not None and task_weights is None:  # on the slider grid: a lookup in the segment table
        for k, v in tv.stacked.items():
            delta[k] = _lookup(*prepared["tables"][k], j).mul_(lam).reshape(v.shape[1:])
        return delta
    thr = _thresholds(prepared, sparsity).to(tv.device)[:, None]
    for k, v in tv.stacked.items():
        flat = v.reshape(tv.num_tasks, -1)
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
    apply=apply_ties,
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
    """One uniform draw per entry (16-bit): the drop mask for rate p is draw < p · 2¹⁶."""
    draws = {}
    gens = [torch.Generator().manual_seed(_task_seed(seed, t)) for t in tv.tasks]
    for k, v in tv.stacked.items():
        d = torch.empty(v.shape, dtype=torch.int32)
        for i, g in enumerate(gens):
            d[i] = torch.randint(0, _U16, v.shape[1:], generator=g, dtype=torch.int32)
        draws[k] = d.to(torch.uint16).to(tv.device)
    return {"tv": tv, "draws": draws}


def _dare_keep(prepared: dict, key: str, p: float):
    level = int(round(p * _U16))
    draws = prepared["draws"][key].reshape(prepared["tv"].num_tasks, -1)
    scale = 1.0 / (1.0 - p)

    def keep(chunk, s, e):
        return torch.where(draws[:, s:e].to(torch.int32) >= level, chunk * scale, 0.0)

    return keep


def apply_dare_linear(prepared: dict, lam: float, sparsity: float, seed: int, task_weights=None) -> dict:
    tv = prepared["tv"]
    w = torch.ones(tv.num_tasks) if task_weights is None else _weights(task_weights)
    w = w.to(tv.device)[:, None]
    delta = {}
    for k, v in tv.stacked.items():
        flat = v.reshape(tv.num_tasks, -1)
        keep = _dare_keep(prepared, k, sparsity)
        out = torch.empty(flat.shape[1], device=tv.device)
        for s in range(0, flat.shape[1], CHUNK):
            e = min(flat.shape[1], s + CHUNK)
            kept = keep(flat[:, s:e], s, e)
            out[s:e] = (kept if task_weights is None else kept * w).sum(0)
        delta[k] = out.mul_(lam).reshape(v.shape[1:])
    return delta


def apply_dare_ties(prepared: dict, lam: float, sparsity: float, seed: int, task_weights=None) -> dict:
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
    apply=apply_dare_linear,
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
    apply=apply_dare_ties,
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
    flat = torch.stack([torch.cat([tv.stacked[k][i].reshape(-1) for k in tv.keys]) for i in range(T)])
    keep = torch.zeros_like(flat, dtype=torch.bool)
    for i in range(T):
        if rule == "ties":
            n = flat.shape[1]
            thr = flat[i].abs().kthvalue(n - _n_keep(n, sparsity) + 1).values
            keep[i] = flat[i].abs() >= thr
        else:  # the very masks DARE merges with (seeded per task name)
            draws = prepare_dare(tv.subset([tv.tasks[i]]), int(seed or 0))["draws"]
            drawn = torch.cat([draws[k][0].reshape(-1).to(torch.int32) for k in tv.keys])
            keep[i] = drawn >= int(round(sparsity * _U16))
    if rule in ("ties", "dare_ties"):
        elected = torch.where(keep, flat, 0.0).sum(0).sign()
        keep &= (flat.sign() == elected) & (flat != 0)
    return keep
