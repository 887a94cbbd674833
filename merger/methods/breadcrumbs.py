"""Model Breadcrumbs (Davari & Belilovsky, arXiv 2312.06795): per task and row of each tensor, drop
the largest β fraction of |τt| (outliers) and the smallest 1 − γ fraction (noise), then task arithmetic."""
from __future__ import annotations

import math

import torch

from merger.methods.registry import LAM, Method, Paper, Param, frange, register, sum_weights, with_default
from merger.pool.task_vectors import TaskVectors

BETA = Param("beta", 0.01, 0.0, 1.0, 0.01, max_open=True, label="β (largest entries dropped)",
             help="fraction of the largest |τt| entries of each row dropped (outliers)")
GAMMA = Param("gamma", 0.16, 0.0, 1.0, 0.01, min_open=True, label="γ (entries kept from the bottom)",
              help="the smallest 1 − γ fraction of each row's |τt| entries is dropped (γ − β is about the kept "
                   "density); β = 0, γ = 1 keeps all")


def _counts(n: int, beta: float, gamma: float) -> tuple[int, int]:
    """(entries dropped from the top, entries dropped from the bottom) of a tensor of n entries."""
    top = math.floor(beta * n + 1e-6)
    bottom = math.floor((1.0 - gamma) * n + 1e-6)
    return top, bottom


def breadcrumb_mask(stack: torch.Tensor, beta: float, gamma: float) -> torch.Tensor:
    """[T, ...] bool: per task and row (along the last dimension, as the authors' code), the entries
    ranked by |τt|, largest first, in [⌊βn⌋, n − ⌊(1 − γ)n⌋); a scalar tensor is kept whole."""
    if stack.dim() == 1:
        return torch.ones_like(stack, dtype=torch.bool)
    n = stack.shape[-1]
    rows = stack.reshape(stack.shape[0], -1, n).abs()
    top, bottom = _counts(n, beta, gamma)
    keep = torch.zeros_like(rows, dtype=torch.bool)
    if top < n - bottom:
        order = rows.argsort(dim=-1, descending=True, stable=True)
        keep.scatter_(-1, order[..., top:n - bottom], True)
    return keep.reshape(stack.shape)


def prepare_breadcrumbs(tv: TaskVectors) -> dict:
    return {"tv": tv}


def breadcrumb_sum(prepared: dict, beta: float, gamma: float) -> dict:
    """Σ of the masked task vectors: λ is then one scale."""
    return {k: torch.where(breadcrumb_mask(v, beta, gamma), v, 0.0).sum(0) for k, v in prepared["tv"].items32()}


def apply_breadcrumbs(masked: dict, lam: float, beta: float, gamma: float) -> dict:
    return {k: v * lam for k, v in masked.items()}


def kept_by_breadcrumbs(tv: TaskVectors, beta: float, gamma: float, lam=None) -> torch.Tensor:
    return torch.cat([breadcrumb_mask(v, beta, gamma).reshape(tv.num_tasks, -1) for _, v in tv.items32()], dim=1)


def breadcrumbs_note(params, prepared) -> str | None:
    if prepared is None:
        return None
    rows = {v.shape[-1] for v in prepared["tv"].base.values() if v.dim() > 0}
    empty = [n for n in rows if sum(_counts(n, params.get("beta", 0), params.get("gamma", 1))) >= n]
    if empty and len(empty) == len(rows):
        return "β and γ drop every entry of every row: the merge is the base."
    if empty:
        return f"β and γ drop every entry of rows of length {', '.join(map(str, sorted(empty)))}."
    return None


register(Method(
    name="breadcrumbs",
    display_name="Model Breadcrumbs",
    paper=Paper("Model Breadcrumbs: scaling multi-task model merging with sparse masks", "2312.06795"),
    description="Per task and row of each tensor, drop the largest β and the smallest 1 − γ fraction of |τt|; "
                "θ0 + λ Σ masked τt.",
    params=(with_default(LAM, 0.3), BETA, GAMMA),
    prepare=prepare_breadcrumbs,
    derive=breadcrumb_sum,
    derive_params=("beta", "gamma"),
    apply=apply_breadcrumbs,
    note=breadcrumbs_note,
    tune_grid={"lam": frange(0.1, 1.0, 0.1), "beta": (0.0, 0.01), "gamma": (0.1, 0.16, 0.3)},
    weights=sum_weights("sum"),
    mask=kept_by_breadcrumbs,
    conventions="Rows along each tensor's last dimension, every floating-point tensor of the image tower (the "
                "authors' code; mergekit ranks whole tensors): ⌊β·n⌋ largest and ⌊(1 − γ)·n⌋ smallest entries of a "
                "row of n dropped, ties broken by position. The authors' (top_k_remove, top_k_keep) are (β, γ − β); "
                "the defaults are their search's start, (0.006, 0.15), on the slider's 0.01 steps.",
))
