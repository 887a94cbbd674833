"""TIES-merging (Yadav et al., arXiv 2306.01708) and DARE (Yu et al., arXiv 2311.03099).

TIES (§3, "Trim, Elect Sign & Merge"), with τt = θt − θ0:

1. trim: keep each τt's top (1 − sparsity) entries by magnitude over its whole flattened task vector
   (a global top-k), zero the rest: τ̂t;
2. elect: γ = sign(Σt τ̂t), entry by entry;
3. disjoint merge: per entry, the mean of the τ̂t that are non-zero and agree with γ.

Merged θ0 + λ · that. DARE: per task a seeded mask m ~ Bernoulli(1 − p), τ̃t = m ⊙ τt / (1 − p), then
task arithmetic on τ̃ (dare_linear) or TIES' steps 2 and 3 on it (dare_ties).

Steps 2–3 and DARE's drop act entry by entry (methods/entries.py). The preparations hold what a
slider move would otherwise recompute over every entry: TIES each task's magnitude threshold at every
sparsity step, DARE one seeded draw per entry (the mask at any p is then a comparison).
"""
from __future__ import annotations

import math
import zlib

import numpy as np
import torch

from merger.accel import accelerable
from merger.methods.entries import entrywise, first_call
from merger.methods.registry import (CART_README, LAM, SEED, SPARSITY, Method, Paper, Published, each, frange,
                                     lam_times, register, sum_weights, with_default)
from merger.pool.task_vectors import TaskVectors

GRID = 100  # sparsity steps whose thresholds are prepared (the slider's 0.01)
# DARE's draws: uniform integers in [FIRST, FIRST + LEVELS). They start at 128 so that a drop-in may read
# each as the positive normal bf16 number with its bits (such numbers order as their bits do, and the last,
# 128 + 32512, stays below bf16's infinity): a compiled compare of bf16 ran 6× one of int16.
FIRST, LEVELS = 0x80, 0x7F00


# ---- the definitions, entry by entry (on slices [T, ...] of a tensor's stack: methods/entries.py) ------

def per_task(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A value per task [T] shaped to broadcast over a slice ``like`` [T, ...]."""
    return x.reshape(-1, *[1] * (like.dim() - 1))


def disjoint_merge(kept: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """TIES' steps 2 and 3 on the trimmed (or dropped) task vectors' entries [T, ...], fp32. With task
    weights wₜ (mergekit's convention) the weighted τ̂ elect the sign and the merge is Σ wₜτ̂ₜ / Σ wₜ over
    the agreeing tasks; all wₜ = 1 is the paper's mean. The sign is elected on an fp64 sum: T stored
    values add up exactly there, so entries that cancel elect no sign, as in exact arithmetic."""
    w = per_task(weights, kept)
    weighted = kept * w
    elected = (kept.double() * w).sum(0).sign().float()  # step 2: γ
    agree = (weighted * elected) > 0  # non-zero and of sign γ
    divisor = torch.where(agree, w, 0.0).sum(0)
    return torch.where(agree, weighted, 0.0).sum(0) / torch.where(divisor == 0, 1.0, divisor)  # step 3


def trimmed(tau: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """TIES' step 1 on entries [T, ...]: τt where |τt| ≥ its task's threshold, else 0."""
    return torch.where(tau.abs() >= per_task(thresholds, tau), tau, 0.0)


def kept_draws(tau: torch.Tensor, draws: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
    """DARE's mask on entries [T, ...]: τt where the draw reaches ``level`` (``dare_level``), else 0. The rescale by the inverse of that probability is applied to the merge (both merges are
    positively homogeneous), so E[τ̃] = τ exactly and the election sees the stored values."""
    return torch.where(draws >= level, tau, 0.0)


def keep_probability(level: torch.Tensor) -> float:
    """P(draw ≥ level): the share of the LEVELS draws at or above it."""
    return (FIRST + LEVELS - int(level)) / LEVELS


def rescale(level: torch.Tensor) -> torch.Tensor:
    """1 / P(keep) at ``level`` (fp32, 0-d)."""
    return torch.tensor(1.0 / keep_probability(level), dtype=torch.float32)


def ties_entries(tau, thresholds, weights):
    return disjoint_merge(trimmed(tau.float(), thresholds), weights)


def dare_linear_entries(tau, draws, level, scale, weights):
    """``scale``: rescale(level), computed once per merge."""
    kept = kept_draws(tau.float(), draws, level)
    return (kept * per_task(weights, kept)).sum(0) * scale


def dare_ties_entries(tau, draws, level, scale, weights):
    return disjoint_merge(kept_draws(tau.float(), draws, level), weights) * scale


# ---- TIES -----------------------------------------------------------------------------------

def kept_count(n: int, sparsity: float) -> int:
    return max(1, math.floor((1.0 - sparsity) * n + 1e-6))


@accelerable
def magnitude_thresholds(rows: list[torch.Tensor], kept: list[int]) -> torch.Tensor:
    """The k-th largest |entry| of one task vector (its tensors ``rows``, flattened together) for each
    count k in ``kept``: step 1 keeps |τt| ≥ that. One selection for every k."""
    mags = torch.cat([r.reshape(-1).abs().float().cpu() for r in rows]).numpy()
    kth = [mags.size - k for k in kept]
    return torch.from_numpy(np.partition(mags, kth)[kth].copy())


def task_thresholds(tv: TaskVectors, i: int, sparsities: list[float]) -> torch.Tensor:
    """Task i's threshold at each sparsity."""
    n = tv.numel()
    return magnitude_thresholds([v[i] for v in tv.stacked.values()], [kept_count(n, s) for s in sparsities])


def prepare_ties(tv: TaskVectors, progress=None, cancel=None) -> dict:
    """Each task's threshold at every sparsity step j/GRID ([GRID, T])."""
    steps = [j / GRID for j in range(GRID)]
    grid = torch.stack([task_thresholds(tv, i, steps)
                        for i in each(range(tv.num_tasks), progress, cancel, "magnitude order of task")], 1)
    first_call(ties_entries, tv.stacked, args=(grid[0].to(tv.device), _weights(tv, None)))
    return {"tv": tv, "grid": grid}


def _thresholds(prepared: dict, sparsity: float) -> torch.Tensor:
    """[T] thresholds: the prepared step, or (a typed value off the slider's steps) computed now."""
    j = sparsity * GRID
    if abs(j - round(j)) < 1e-9:
        return prepared["grid"][int(round(j))]
    tv = prepared["tv"]
    return torch.cat([task_thresholds(tv, i, [sparsity]) for i in range(tv.num_tasks)])


def _weights(tv: TaskVectors, task_weights) -> torch.Tensor:
    w = torch.ones(tv.num_tasks) if task_weights is None else torch.tensor(task_weights, dtype=torch.float32)
    return w.to(tv.device)


def ties_merge(prepared: dict, sparsity: float, task_weights=None) -> dict:
    """TIES' merge at λ = 1 (the derive step: a λ move is then one scale)."""
    tv = prepared["tv"]
    args = (_thresholds(prepared, sparsity).to(tv.device), _weights(tv, task_weights))
    return {"merged": {k: entrywise(ties_entries, v, args=args) for k, v in tv.stacked.items()}}


TRIM_NOTE = ("Top-k over the whole flattened task vector (global, as the paper and FusionBench; mergekit trims "
             "each tensor on its own), k = ⌊(1 − sparsity)·N⌋ of its N entries, as the paper's top (1 − sparsity); "
             "the authors' code (and FusionBench's copy of it) keeps |τ| ≥ its (N − int(N·(1 − sparsity)))-th "
             "smallest magnitude: one entry more. Entries tied with the k-th largest magnitude are all kept, as "
             "that code's ≥ keeps them (bf16 task vectors have many such ties).")
MEAN_NOTE = ("The disjoint MEAN of the entries that agree with the elected sign, as the paper (FusionBench's "
             "default merge_func is a sum: the mean times the number of agreeing tasks).")
WEIGHTS_NOTE = ("Task weights as mergekit: they multiply the trimmed (or dropped and rescaled) τ̂t, the weighted "
                "vectors elect the sign, and the merge divides by the sum of the agreeing tasks' weights "
                "(Σ wₜτ̂ₜ / Σ wₜ over agreeing tasks): scaling every weight alike changes nothing.")

TIES = register(Method(
    name="ties",
    slow_prepare=True,
    featured=True,
    display_name="TIES-merging",
    paper=Paper("TIES-Merging: Resolving interference when merging models", "2306.01708"),
    description="Trim each τt to its top (1 − sparsity) by magnitude, elect signs, disjoint mean; θ0 + λ·that.",
    params=(LAM, SPARSITY),
    prepare=prepare_ties,
    derive=ties_merge,
    derive_params=("sparsity",),
    apply=lam_times("merged"),
    task_weighted=True,
    tune_grid={"lam": frange(0.4, 1.5, 0.1), "sparsity": (0.5, 0.7, 0.8, 0.9)},
    weights=sum_weights("mean"),
    mask=lambda tv, sparsity, lam=None: kept_entries(tv, "ties", sparsity),
    conventions=TRIM_NOTE + " " + MEAN_NOTE + " " + WEIGHTS_NOTE,
    published=(Published("ViT-B-32", 72.4, CART_README),),
))


# ---- DARE -----------------------------------------------------------------------------------

def dare_level(p: float) -> torch.Tensor:
    """The draw an entry must reach to be kept at drop rate p: kept with probability 1 − round(p·L)/L."""
    return torch.tensor(FIRST + int(round(p * LEVELS)), dtype=torch.int32)


def _task_seed(seed: int, task: str) -> int:
    # Seeded by task name, so a task's mask does not change when the expert subset does.
    return (int(seed) * 1_000_003 + zlib.crc32(task.encode())) % (2**63 - 1)


def prepare_dare(tv: TaskVectors, seed: int) -> dict:
    """One uniform draw in [FIRST, FIRST + LEVELS) per entry and task (int16), from a generator seeded by
    the task."""
    gens = [torch.Generator().manual_seed(_task_seed(seed, t)) for t in tv.tasks]
    draws = {k: torch.stack([torch.randint(FIRST, FIRST + LEVELS, v.shape[1:], generator=g, dtype=torch.int16)
                             for g in gens])
             .to(tv.device) for k, v in tv.stacked.items()}
    level = dare_level(DARE_P.default)
    for entries in (dare_linear_entries, dare_ties_entries):  # a compiled drop-in compiles here, not in a move
        first_call(entries, tv.stacked, draws, args=(level.to(tv.device), rescale(level).to(tv.device),
                                                     _weights(tv, None)))
    return {"tv": tv, "draws": draws}


def dare_merge(entries):
    """DARE's merge at λ = 1 for one drop rate (the derive step): ``entries`` over every tensor."""
    def derive(prepared: dict, sparsity: float, task_weights=None) -> dict:
        tv = prepared["tv"]
        level = dare_level(sparsity)
        args = (level.to(tv.device), rescale(level).to(tv.device), _weights(tv, task_weights))
        return {"merged": {k: entrywise(entries, v, prepared["draws"][k], args=args) for k, v in tv.stacked.items()}}
    return derive


DARE_PAPER = Paper("Language models are Super Mario: absorbing abilities from homologous models "
                   "as a free lunch", "2311.03099")
DARE_P = with_default(SPARSITY, 0.9)
DARE_NOTE = ("Masks are seeded per task name, so a task's mask does not change with the expert subset; an entry is "
             f"kept with probability 1 − round(p·{LEVELS})/{LEVELS} and rescaled by its inverse (E[τ̃] = τ exactly).")

DARE_LINEAR = register(Method(
    name="dare_linear",
    display_name="DARE (linear)",
    paper=DARE_PAPER,
    description="Drop each τ entry with probability p = sparsity, rescale by 1/(1 − p), then task arithmetic.",
    params=(with_default(LAM, 0.3), DARE_P, SEED),
    prepare=prepare_dare,
    derive=dare_merge(dare_linear_entries),
    derive_params=("sparsity",),
    apply=lam_times("merged"),
    task_weighted=True,
    prepare_params=("seed",),
    tune_grid={"lam": frange(0.1, 1.0, 0.1), "sparsity": (0.5, 0.7, 0.9)},
    weights=sum_weights("sum"),
    mask=lambda tv, sparsity, seed, lam=None: kept_entries(tv, "dare", sparsity, seed),
    conventions=DARE_NOTE,
))

DARE_TIES = register(Method(
    name="dare_ties",
    display_name="DARE (TIES)",
    paper=DARE_PAPER,
    description="Drop and rescale as DARE, then TIES' sign election and disjoint mean; θ0 + λ·that.",
    params=(LAM, DARE_P, SEED),
    prepare=prepare_dare,
    derive=dare_merge(dare_ties_entries),
    derive_params=("sparsity",),
    apply=lam_times("merged"),
    task_weighted=True,
    prepare_params=("seed",),
    tune_grid={"lam": frange(0.4, 1.5, 0.1), "sparsity": (0.5, 0.7, 0.9)},
    weights=sum_weights("mean"),
    mask=lambda tv, sparsity, seed, lam=None: kept_entries(tv, "dare_ties", sparsity, seed),
    conventions=DARE_NOTE + " After dropping, as TIES. " + MEAN_NOTE + " " + WEIGHTS_NOTE,
))


# ---- the kept entries (the sparsifying operator M of arXiv 2601.21690, for the heterogeneity diagnostic) --

def kept_entries(tv: TaskVectors, rule: str, sparsity: float, seed: int | None = None) -> torch.Tensor:
    """Per task, the entries its merge keeps, [T, P] bool over the flattened task vectors: TIES keeps
    step 1's entries whose sign agrees with the elected one; DARE its draw (dare_ties: then as TIES)."""
    flat = torch.stack([torch.cat([v[i].reshape(-1).float() for v in tv.stacked.values()])
                        for i in range(tv.num_tasks)])
    if rule == "ties":
        thresholds = torch.cat([task_thresholds(tv, i, [sparsity]) for i in range(tv.num_tasks)])
        kept = trimmed(flat, thresholds.to(flat.device))
    else:  # the very draws DARE merges with
        draws = prepare_dare(tv, int(seed or 0))["draws"]
        draws = torch.cat([d.reshape(tv.num_tasks, -1) for d in draws.values()], 1)
        if rule == "dare":
            return draws >= dare_level(sparsity)
        kept = kept_draws(flat, draws, dare_level(sparsity))
    return (kept * kept.sum(0).sign()) > 0  # non-zero and of the elected sign
