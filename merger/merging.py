"""Specs and the merge entry points of the public API."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch

from . import checkpoints, methods
from .errors import MergerError
from .task_vectors import TaskVectors


def parse_experts(experts: str | Iterable[str] | None, names: Sequence[str],
                  default: Sequence[str] | None = None) -> tuple[str, ...]:
    """An expert subset from a list or "a,b,c"; None means ``default`` (else every name). Unknown
    names refused; the order is canonical (that of ``names``)."""
    if experts is None:
        return tuple(default if default is not None else names)
    if isinstance(experts, str):
        experts = [e.strip() for e in experts.split(",") if e.strip()]
    chosen = [str(e) for e in experts]
    if not chosen:
        raise MergerError("experts: empty subset, pick at least one expert")
    unknown = [e for e in chosen if e not in names]
    if unknown:
        raise MergerError(f"experts: unknown task(s) {', '.join(unknown)}; known: {', '.join(names)}")
    if len(set(chosen)) != len(chosen):
        raise MergerError(f"experts: a task is named twice in {', '.join(chosen)}")
    return tuple(t for t in names if t in chosen)


@dataclass(frozen=True)
class Spec:
    """A method, its resolved parameter values and the expert subset: canonical and hashable."""

    method: str
    params: tuple[tuple[str, Any], ...]
    experts: tuple[str, ...]

    @classmethod
    def make(cls, method: str, params: Mapping[str, Any], experts, names: Sequence[str], strict: bool = True,
             default: Sequence[str] | None = None) -> "Spec":
        m = methods.get(method)
        chosen = parse_experts(experts, names, default)
        resolved = m.resolve(params, len(chosen), strict=strict)
        return cls(m.name, tuple(sorted(resolved.items())), chosen)

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.params)

    def rounded(self) -> "Spec":
        """Parameters snapped to their slider steps: the cache key of a slider preview.

        Only static methods' sliders snap. A data-driven method runs with exactly the values it
        was given (a typed lr = 4e-5 must not become 0), and "auto" stays "auto"."""
        m = methods.get(self.method)
        if m.data_driven:
            return self
        out = []
        for name, value in self.params:
            step = m.param(name).step
            snap = isinstance(value, float)
            out.append((name, round(round(value / step) * step, 10) if snap else value))
        return Spec(self.method, tuple(out), self.experts)

    def label(self) -> str:
        args = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.params)
        return f"{self.method}({args})"

    def as_dict(self) -> dict:
        return {"method": self.method, "params": self.kwargs, "experts": list(self.experts)}


def assemble(base: Mapping[str, torch.Tensor], tv: TaskVectors, delta: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """θ0 + Δ on the merged keys, every other tensor of the base as it is (on the CPU)."""
    out = {k: v for k, v in base.items()}
    for k, d in delta.items():
        out[k] = (tv.base[k] + d).to(device="cpu", dtype=base[k].dtype)
    return out


def merge(pool, method: str, *, experts=None, **params) -> dict[str, torch.Tensor]:
    """Merge a pool's experts; returns the full state dict (image tower merged, rest = base)."""
    return merge_spec(pool, pool.make_spec(method, params, experts))


def merge_spec(pool, spec: Spec) -> dict[str, torch.Tensor]:
    """Static methods merge the spec exactly as given; data-driven ones learn their coefficients on
    the pool's validation data (both through the pool's session and its caches)."""
    from .session import session_for

    m = methods.get(spec.method)
    session = session_for(pool)
    if m.data_driven:
        return assemble(pool.base, pool.task_vectors, session.delta(spec))
    _, prepared = session.prepared(m, spec.experts, {k: spec.kwargs[k] for k in m.prepare_params})
    return assemble(pool.base, pool.task_vectors, m.delta(prepared, **spec.kwargs))


def merge_state_dicts(
    base_sd: Mapping[str, torch.Tensor],
    expert_sds: Sequence[Mapping[str, torch.Tensor]] | Mapping[str, Mapping[str, torch.Tensor]],
    method: str,
    *,
    experts=None,
    device: str | torch.device = "cpu",
    **params,
) -> dict[str, torch.Tensor]:
    """Merge plain state dicts (experts as a list, or a dict task -> state dict)."""
    if isinstance(expert_sds, Mapping):
        named = {str(k): v for k, v in expert_sds.items()}
    else:
        named = {f"expert_{i + 1}": sd for i, sd in enumerate(expert_sds)}
    if not named:
        raise MergerError("no experts: merging needs at least one expert")
    m = methods.get(method)
    if m.data_driven:
        raise MergerError(f"{m.name} learns from data: open a pool with tasks and use merger.merge(pool, ...)")
    spec = Spec.make(m.name, params, experts, list(named))
    base = checkpoints.strip_prefixes(base_sd)
    checkpoints.validate_base(base, "base")
    aligned = {t: checkpoints.validate_expert(named[t], base, t) for t in spec.experts}
    tv = TaskVectors(base, aligned, device=device)
    prepared = m.prepare(tv, **{k: spec.kwargs[k] for k in m.prepare_params})
    return assemble(base, tv, m.delta(prepared, **spec.kwargs))
