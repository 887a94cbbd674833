"""Weight averaging and task arithmetic."""
from __future__ import annotations

import torch

from merger.methods.registry import (CART_README, LAM, Method, Paper, Published, frange, register, sum_weights,
                                     with_default)
from merger.pool.task_vectors import TaskVectors


def prepare_sum(tv: TaskVectors) -> dict:
    return {"sum": {k: v.sum(0, dtype=torch.float32) for k, v in tv.stacked.items()}, "T": tv.num_tasks, "tv": tv}


def _weighted_sum(prepared: dict, task_weights, scale: float) -> dict:
    """scale · Σ wₜ τₜ (the plain sum when no weights are given)."""
    if task_weights is None:
        return {k: s * scale for k, s in prepared["sum"].items()}
    tv = prepared["tv"]
    w = torch.tensor(task_weights, dtype=torch.float32, device=tv.device) * scale
    return {k: torch.tensordot(w, v, dims=1) for k, v in tv.items32()}


def apply_average(prepared: dict, task_weights=None) -> dict:
    return _weighted_sum(prepared, task_weights, 1.0 / prepared["T"])


def apply_task_arithmetic(prepared: dict, lam: float, task_weights=None) -> dict:
    return _weighted_sum(prepared, task_weights, lam)


WEIGHT_AVERAGING = register(Method(
    name="weight_averaging",
    aliases=("wa",),
    display_name="Weight averaging",
    paper=Paper("Model soups: averaging weights of multiple fine-tuned models improves accuracy "
                "without increasing inference time", "2203.05482"),
    description="θavg = mean of the experts (task arithmetic with λ = 1/T); with task weights θ0 + Σ wₜτₜ / T.",
    params=(),
    prepare=prepare_sum,
    apply=apply_average,
    task_weighted=True,
    weighted_sum=True,
    tune_grid={},
    weights=sum_weights("average"),
    published=(Published("ViT-B-32", 65.9, CART_README),),
))

TASK_ARITHMETIC = register(Method(
    name="task_arithmetic",
    aliases=("ta",),
    featured=True,
    display_name="Task arithmetic",
    paper=Paper("Editing models with task arithmetic", "2212.04089"),
    description="θ0 + λ Σ wₜτₜ (wₜ = 1 unless set); the paper tunes λ on validation (0.3 for its 8 ViT "
                "tasks); negative λ negates tasks.",
    params=(with_default(LAM, 0.3),),
    prepare=prepare_sum,
    apply=apply_task_arithmetic,
    task_weighted=True,
    weighted_sum=True,
    tune_grid={"lam": frange(0.05, 1.5, 0.05)},
    weights=sum_weights("sum"),
    published=(Published("ViT-B-32", 69.1, CART_README), Published("ViT-L-14", 84.5, CART_README)),
))
