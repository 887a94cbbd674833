"""Consensus task arithmetic (TALL masks; Wang et al., arXiv 2405.07813): keep the entries that at
least k tasks call important, then task arithmetic on the masked sum."""
from __future__ import annotations

import torch

from merger.methods.entries import entrywise, first_call
from merger.methods.registry import (CART_README, LAM, Method, Paper, Param, Published, frange, lam_times, register,
                                     sum_weights, with_default)
from merger.pool.task_vectors import TaskVectors

MASK_LAMBDA = Param("mask_lambda", 0.4, 0.0, 5.0, 0.05, label="λ_mask (TALL mask threshold)",
                    help="task t calls entry p important when |τt| ≥ λ_mask · |τ_MTL − τt|, τ_MTL = Σ τ")
AGREE = Param("agree", 2, 1, 64, 1, kind="int", label="tasks that must agree (k)",
              help="Consensus keeps the entries that at least k tasks' TALL masks keep")


def tall_votes(tau: torch.Tensor, mask_lambda: torch.Tensor) -> torch.Tensor:
    """How many TALL masks mₜ = |τₜ| ≥ λ_mask · |τ_MTL − τₜ| keep each entry of a slice [T, ...]. In fp64:
    T stored values add up exactly there, so an entry's vote does not hang on a rounding."""
    tau = tau.double()
    return (tau.abs() >= (tau.sum(0) - tau).abs() * mask_lambda).sum(0)


def consensus_entries(tau: torch.Tensor, mask_lambda: torch.Tensor, agree: torch.Tensor) -> torch.Tensor:
    """τ_MTL = Σ τ on the entries of a slice that at least ``agree`` masks keep, zero elsewhere."""
    return torch.where(tall_votes(tau, mask_lambda) >= agree, tau.float().sum(0), 0.0)


def prepare_consensus(tv: TaskVectors) -> dict:
    first_call(consensus_entries, tv.stacked, args=_args(tv, MASK_LAMBDA.default, AGREE.default))
    return {"tv": tv}


def _args(tv: TaskVectors, mask_lambda: float, agree: int) -> tuple:
    # 0-d tensors, not numbers: a compiled drop-in then takes any value without compiling again
    return (torch.tensor(float(mask_lambda), dtype=torch.float64, device=tv.device),
            torch.tensor(int(agree), device=tv.device))


def consensus_sum(prepared: dict, mask_lambda: float, agree: int) -> dict:
    """Σ τ on the entries at least ``agree`` TALL masks keep (zero elsewhere): λ is then one scale."""
    tv = prepared["tv"]
    args = _args(tv, mask_lambda, agree)
    return {k: entrywise(consensus_entries, v, args=args) for k, v in tv.stacked.items()}


def kept_by_consensus(tv: TaskVectors, mask_lambda: float, agree: int, lam=None) -> torch.Tensor:
    """[T, P]: the consensus mask (the same entries for every task)."""
    level, _ = _args(tv, mask_lambda, agree)
    keep = torch.cat([(tall_votes(v, level) >= agree).reshape(-1) for v in tv.stacked.values()])
    return keep[None, :].expand(tv.num_tasks, -1)


def consensus_note(params, prepared) -> str | None:
    if prepared is not None and params.get("agree", 1) > prepared["tv"].num_tasks:
        return (f"k = {params['agree']} is more than the {prepared['tv'].num_tasks} experts merged: no entry can be "
                "kept, the merge is the base.")
    return None


CONSENSUS_TA = register(Method(
    name="consensus_ta",
    aliases=("consensus",),
    display_name="Consensus TA (TALL masks)",
    paper=Paper("Localizing task information for improved model merging and compression", "2405.07813"),
    description="TALL masks mₜ = |τₜ| ≥ λ_mask·|τ_MTL − τₜ| (τ_MTL = Σ τ); keep the entries at least k masks keep; "
                "θ0 + λ · (kept ⊙ Σ τ).",
    params=(with_default(LAM, 0.3), MASK_LAMBDA, AGREE),
    prepare=prepare_consensus,
    derive=consensus_sum,
    derive_params=("mask_lambda", "agree"),
    apply=lam_times(),
    note=consensus_note,
    tune_grid={"lam": frange(0.1, 1.0, 0.1), "mask_lambda": (0.2, 0.4, 0.6)},
    weights=sum_weights("sum"),
    mask=kept_by_consensus,
    conventions="One λ_mask for every task (the authors pick λ_t per task on validation from 0.2–0.6); the mask is "
                "|τt| ≥ λ_mask·|τ_MTL − τt| as the paper writes (the authors' code compares with >); every "
                "floating-point tensor of the image tower, entry by entry. λ grid 0.1–1.0 as the authors' eval.",
    published=(Published("ViT-B-32", 75.2, CART_README),),
))
