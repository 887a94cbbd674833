"""The public entry points: merge a pool's experts or plain state dicts, evaluate merged weights.
Both go through the pool's session, so the API shares the app's caches."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

import torch

from merger import methods
from merger.errors import MergerError
from merger.evaluation.evaluator import Result
from merger.evaluation.session import session_for
from merger.io import checkpoints
from merger.pool.blocks import block_groups
from merger.pool.devices import resolve_device
from merger.pool.pool import require_open
from merger.pool.task_vectors import TaskVectors
from merger.spec import Spec, assemble, with_block_weights


def merge(pool, method: str, *, experts=None, task_weights=None, block_weights=None,
          **params) -> dict[str, torch.Tensor]:
    """Merge a pool's experts; returns the full state dict (image tower merged, rest = base).
    ``task_weights`` {expert: wₜ} multiply each task vector before the method combines them;
    ``block_weights`` {block group: b_g} multiply the method's Δ per block (``pool.blocks``)."""
    return merge_spec(require_open(pool, "merge"), pool.make_spec(method, params, experts, task_weights, block_weights))


def merge_spec(pool, spec: Spec) -> dict[str, torch.Tensor]:
    """Static methods merge the spec exactly as given; data-driven ones learn their coefficients on
    the pool's validation data (both through the pool's session and its caches)."""
    return assemble(pool.base, pool.task_vectors, merge_delta(pool, spec))


def merge_delta(pool, spec: Spec) -> Mapping[str, torch.Tensor]:
    """Δ of the spec exactly as given, on the merged keys (what ``merge_spec`` adds to θ0)."""
    m = methods.get(spec.method)
    session = session_for(pool)
    if m.data_driven:
        return session.delta(spec)
    _, prepared = session.prepared_for(spec, snapped=False)
    return with_block_weights(m.delta(prepared, **spec.kwargs, **m.weights_kwargs(spec)), spec)


def _state_dict(value, where: str) -> tuple[Mapping[str, torch.Tensor], tuple, str]:
    """(state dict, keys an expert may lack that the base fills, its name in messages): as given, or
    read from a checkpoint path (safetensors or a weights-only torch file) as a pool reads its
    experts: a Hugging Face CLIP vision model has no visual.proj, which the base gives."""
    if isinstance(value, (str, os.PathLike)):  # open_clip or Hugging Face CLIP weights, as a pool's
        sd, form = checkpoints.load_weights(value)
        return sd, ("visual.proj",) if form == "hf_clip_vision" else (), f"{value} ({where})"
    if not isinstance(value, Mapping):
        raise MergerError(f"merge_state_dicts: {where}: expected a state dict (name → tensor) or a checkpoint path, "
                          f"got {type(value).__name__}")
    return value, (), where


def _names(experts: Sequence) -> list[str]:
    """The names of a list of experts (what ``experts=`` and ``task_weights`` take) where each is a
    path: their file names without the suffix where those differ (shape.safetensors → shape), else
    their folders' (mnist/pytorch_model.bin → mnist); else expert_1, expert_2, …"""
    if all(isinstance(e, (str, os.PathLike)) for e in experts):
        paths = [Path(e) for e in experts]
        for names in ([p.stem for p in paths], [p.parent.name if p.is_file() else p.name for p in paths]):
            if all(names) and len(set(names)) == len(names):
                return names
    return [f"expert_{i + 1}" for i in range(len(experts))]


def merge_state_dicts(
    base_sd: Mapping[str, torch.Tensor],
    expert_sds: Sequence[Mapping[str, torch.Tensor]] | Mapping[str, Mapping[str, torch.Tensor]],
    method: str,
    *,
    experts=None,
    device: str | torch.device = "cpu",
    task_weights=None,
    block_weights=None,
    **params,
) -> dict[str, torch.Tensor]:
    """Merge plain state dicts (experts as a list, or a dict task -> state dict; each may be a
    checkpoint path, read as a pool reads its experts); weights as in ``merge``, by the experts'
    names: the dict's keys, a list's file names without the suffix (shape.safetensors → shape), or
    expert_1, expert_2, … for state dicts."""
    if isinstance(expert_sds, (str, os.PathLike)):
        raise MergerError("merge_state_dicts: experts: expected a list (or dict) of state dicts or checkpoint "
                          "paths, got one path")
    if isinstance(expert_sds, Mapping):
        named = {str(k): _state_dict(v, f"experts.{k}") for k, v in expert_sds.items()}
    else:
        expert_sds = list(expert_sds)
        named = {name: _state_dict(sd, f"experts[{i}]") for i, (name, sd) in enumerate(zip(_names(expert_sds), expert_sds))}
    base_sd = _state_dict(base_sd, "base")[0]
    if not named:
        raise MergerError("no experts: merging needs at least one expert")
    m = methods.get(method)
    if m.data_driven:
        raise MergerError(f"{m.name} learns from data: open a pool with tasks and use merger.merge(pool, ...)")
    base = checkpoints.strip_prefixes(base_sd)
    checkpoints.validate_base(base, "base")
    spec = Spec.make(m.name, params, experts, list(named), task_weights=task_weights, block_weights=block_weights,
                     blocks=block_groups(checkpoints.merge_scope(base)))
    aligned = {t: checkpoints.validate_expert(named[t][0], base, named[t][2], named[t][1]) for t in spec.experts}
    tv = TaskVectors(base, aligned, device=resolve_device(device))
    scale = () if m.task_weighted else spec.task_weights
    prepared = m.prepare(tv.scaled(dict(scale)) if scale else tv,
                         **{k: spec.kwargs[k] for k in m.prepare_params})
    return assemble(base, tv, with_block_weights(m.delta(prepared, **spec.kwargs, **m.weights_kwargs(spec)), spec))


def evaluate(pool, merged: Mapping[str, torch.Tensor] | None, split: str = "live") -> Result:
    """Public entry: evaluate a merged state dict (as returned by ``merger.merge``) on a split. Weights
    from elsewhere are checked against the base first (missing, unexpected, mis-shaped and non-finite
    keys are named), as an expert is."""
    pool = require_open(pool, "evaluate")
    if merged is not None:
        if not isinstance(merged, Mapping):
            raise MergerError(f"evaluate: expected a state dict (name → tensor), got {type(merged).__name__}")
        # the merged keys alone are enough (floats: what a merge changes); integer buffers come from the base
        buffers = tuple(k for k in checkpoints.merge_scope(pool.base) if not pool.base[k].is_floating_point())
        merged = checkpoints.validate_expert(merged, pool.base, "evaluate: the weights", fill_from_base=buffers)
    return session_for(pool).evaluate_weights(merged, split)
