"""Specs: a method, its resolved parameters and an expert subset (canonical, hashable: the cache
key), and how merged weights are assembled from Δ."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch

from merger import methods
from merger.errors import MergerError
from merger.pool.task_vectors import TaskVectors


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
