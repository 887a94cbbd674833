"""Specs: a method, its resolved parameters and an expert subset (canonical, hashable: the cache
key), and how merged weights are assembled from Δ."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch

from merger import methods
from merger.errors import MergerError, MethodError, listed, shown_value
from merger.methods.registry import inside
from merger.pool.task_vectors import TaskVectors, check_subset


def parse_experts(experts: str | Iterable[str] | None, names: Sequence[str],
                  default: Sequence[str] | None = None) -> tuple[str, ...]:
    """An expert subset from a list or "a,b,c"; None means ``default`` (else every name). Unknown
    names refused; the order is canonical (that of ``names``)."""
    if experts is None:
        return tuple(default if default is not None else names)
    if isinstance(experts, str):
        experts = [e.strip() for e in experts.split(",") if e.strip()]
    chosen = [str(e) for e in experts]
    check_subset(chosen, names)
    return tuple(t for t in names if t in chosen)


WEIGHT_RANGE = (-3.0, 3.0)  # per-task and per-block weights
WEIGHT_STEP = 0.01  # their sliders' step (a preview's cache key snaps to it, as λ does)


def snap_weight(w: float) -> float:
    """A weight on its sliders' step (what a preview computes, and what the sliders show)."""
    return round(round(w / WEIGHT_STEP) * WEIGHT_STEP, 10)


def parse_weights(given, field: str, allowed: Sequence[str], why: str) -> tuple[tuple[str, float], ...]:
    """Weights {name: w} (or "a=1.2,b=0") checked and made canonical: in ``allowed`` order, the
    ones equal to 1 left out (all-ones is the plain method, the same cache entry and tensors)."""
    if given is None:
        return ()
    if isinstance(given, str):
        pairs = []
        for item in (x.strip() for x in given.split(",") if x.strip()):
            name, sep, value = item.partition("=")
            if not sep:
                raise MergerError(f"{field}: {item[:60]!r} is not name=weight")
            pairs.append((name.strip(), value.strip()))
        given = pairs
    if isinstance(given, (list, tuple)):  # pairs [(name, w), ...]
        if not all(isinstance(x, (list, tuple)) and len(x) == 2 for x in given):
            raise MergerError(f"{field}: expected {{name: weight}}, 'name=w,...' or (name, weight) pairs, got "
                              f"{str(given)[:80]}")
        if not all(isinstance(n, str) for n, _ in given):  # over HTTP a name may be a list or a dict
            raise MergerError(f"{field}: every name must be a string, got {str(given)[:80]}")
        twice = [n for n, count in Counter(n for n, _ in given).items() if count > 1]
        if twice:  # a dict would keep the last silently
            raise MergerError(f"{field}: given twice: {listed(twice)}")
        given = dict(given)
    if not isinstance(given, Mapping):
        raise MergerError(f"{field}: expected a mapping of name to weight, got {type(given).__name__}")
    lo, hi = WEIGHT_RANGE
    out = {}
    for name, value in given.items():
        name = str(name)
        if not name.strip():
            raise MergerError(f"{field}: a weight without a name ('=w'); known: {', '.join(allowed) or 'none'}")
        if name not in allowed:
            raise MergerError(f"{field}.{name[:60]}: {why}; known: {', '.join(allowed) or 'none'}")
        try:
            if isinstance(value, bool):  # False would silently drop the task
                raise TypeError
            w = float(value)
        except OverflowError:  # an int beyond a float's range
            w = math.inf
        except (TypeError, ValueError):
            raise MergerError(f"{field}.{name}: {str(value)[:40]!r} is not a number") from None
        if not math.isfinite(w) or not lo <= w <= hi:
            raise MergerError(f"{field}.{name}: {shown_value(value)} is outside [{lo:g}, {hi:g}] (or not finite)")
        out[name] = w
    return tuple((n, out[n]) for n in allowed if n in out and out[n] != 1.0)


def on_experts(text: str, experts: Sequence[str], tasks: Sequence[str]) -> str:
    """A run's or a preparation's name as a page shows it: its experts named where not all the pool's."""
    return text if set(experts) == set(tasks) else f"{text} on {', '.join(experts)}"


def _on_step(m, param, value: float, num_experts: int) -> float:
    """The slider step nearest a valid value, inside the parameter's range for this many experts: a
    step that rounds past an end the method refuses (sparsity 0.995 → 1.0, rank ratio 0.001 → 0,
    TSV-M's 0.166 → 0.17 above its 1/6 with 6 experts) is taken one step in (0.99, 0.01, 0.16); a
    range narrower than a step keeps the value as given."""
    step = param.step
    on = round(round(value / step) * step, 10)
    for candidate in (on, round(on - step if on > value else on + step, 10)):
        try:
            param.check(candidate, m.name)
        except MethodError:
            continue
        if inside(candidate, m.bounds(param.name, num_experts)):
            return candidate
    return value


def assignments(texts, where: str) -> dict[str, str]:
    """``param=value`` texts as {param: value} (values as typed: the method's check reads them)."""
    params = {}
    for a in texts:
        k, sep, v = a.partition("=")
        if not sep:
            raise MergerError(f"{where}: expected METHOD:param=value:… (e.g. ties:lam=1:sparsity=0.8)")
        params[k.strip()] = v.strip()
    return params


def arguments_text(params) -> str:
    """(name, value) pairs as a spec's label writes them: "lam=0.3, sparsity=0.8"."""
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params)


@dataclass(frozen=True)
class Spec:
    """A method, its resolved parameter values and the expert subset: canonical and hashable.
    ``task_weights`` multiply each expert's task vector before the method combines them;
    ``block_weights`` multiply the method's Δ per block group (only the weights ≠ 1 are kept)."""

    method: str
    params: tuple[tuple[str, Any], ...]
    experts: tuple[str, ...]
    task_weights: tuple[tuple[str, float], ...] = ()
    block_weights: tuple[tuple[str, float], ...] = ()

    @classmethod
    def make(cls, method: str, params: Mapping[str, Any], experts, names: Sequence[str], strict: bool = True,
             default: Sequence[str] | None = None, task_weights=None, block_weights=None,
             blocks: Sequence[str] = ()) -> "Spec":
        m = methods.get(method)
        chosen = parse_experts(experts, names, default)
        resolved = m.resolve(params, len(chosen), strict=strict)
        tw = parse_weights(task_weights, "task_weights", chosen,
                           "not a ticked expert (weights apply to the experts merged)")
        bw = parse_weights(block_weights, "block_weights", list(blocks), "not a block group of this pool")
        if (tw or bw) and m.data_driven:
            raise MergerError(f"task_weights/block_weights: {m.name} learns its own coefficients; the weights "
                              "are for static methods (an AdaMerging or FW-Merging run's coefficients load into "
                              "them with 'start from learned', under task arithmetic)")
        return cls(m.name, tuple(sorted(resolved.items())), chosen, tw, bw)

    def task_weight_list(self) -> list[float]:
        """One weight per expert, in the spec's expert order."""
        given = dict(self.task_weights)
        return [given.get(e, 1.0) for e in self.experts]

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.params)

    def snap(self) -> "SnappedSpec":
        """The spec on its sliders' steps (what a slider move computes, λ 0.333 at 0.35): made once where
        slider values come in. Only static methods' sliders snap: a data-driven method runs with exactly
        the values it was given (a typed lr = 4e-5 must not become 0), and "auto" stays "auto"."""
        m = methods.get(self.method)
        if m.data_driven:
            return SnappedSpec(self.method, self.params, self.experts, self.task_weights, self.block_weights, given=self)
        out = [(name, _on_step(m, m.param(name), value, len(self.experts)) if isinstance(value, float) else value)
               for name, value in self.params]

        def snap(weights):
            snapped = ((n, snap_weight(w)) for n, w in weights)
            return tuple((n, w) for n, w in snapped if w != 1.0)

        return SnappedSpec(self.method, tuple(out), self.experts, snap(self.task_weights), snap(self.block_weights),
                           given=self)

    def label(self) -> str:
        return f"{self.method}({self.arguments()})" + self.weights_text()

    def arguments(self) -> str:
        """The parameters as ``label`` writes them: "lam=0.3, sparsity=0.8"."""
        return arguments_text(self.params)

    def weights_text(self) -> str:
        """The set task and block weights as ``label`` writes them (" w[a=0.5] b[block0=2]"), or ""."""
        return "".join(f" {tag}[" + ", ".join(f"{n}={w:g}" for n, w in weights) + "]"
                       for tag, weights in (("w", self.task_weights), ("b", self.block_weights)) if weights)

    def as_dict(self) -> dict:
        out = {"method": self.method, "params": self.kwargs, "experts": list(self.experts)}
        if self.task_weights:
            out["task_weights"] = dict(self.task_weights)
        if self.block_weights:
            out["block_weights"] = dict(self.block_weights)
        return out


@dataclass(frozen=True)
class SnappedSpec(Spec):
    """A spec on its sliders' steps (``Spec.snap``): the one type a slider move computes and every cache of
    slider results (results, partial answers, estimates, the history) is keyed by. ``given``: the spec as
    typed, to say what was snapped; not part of its identity."""

    given: Spec | None = field(default=None, compare=False, repr=False)

    def snap(self) -> "SnappedSpec":
        return self

    def snapping(self) -> dict:
        """The parameters and weights computed at another value than typed: {name: (typed, computed)};
        task and block weights as "w.NAME" and "b.NAME" (a weight snapped to 1 is left out of a spec)."""
        if self.given is None:
            return {}
        out = {}
        for tag, given, computed in (("", self.given.params, self.params),
                                     ("w.", self.given.task_weights, self.task_weights),
                                     ("b.", self.given.block_weights, self.block_weights)):
            computed = dict(computed)
            out.update({tag + n: (g, computed.get(n, 1.0)) for n, g in given if g != computed.get(n, 1.0)})
        return out


def with_block_weights(delta: Mapping[str, torch.Tensor], spec: "Spec") -> Mapping[str, torch.Tensor]:
    """Δ with each block group's tensors multiplied by its weight (a new dict; Δ itself unchanged)."""
    if not spec.block_weights:
        return delta
    from merger.pool.blocks import block_of

    weights = dict(spec.block_weights)
    return {k: d * weights[block_of(k)] if block_of(k) in weights else d for k, d in delta.items()}


def assemble(base: Mapping[str, torch.Tensor], tv: TaskVectors, delta: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """θ0 + Δ on the merged keys, every other tensor of the base as it is (on the CPU)."""
    return {k: merged_tensor(base, tv, delta, k) for k in base}


def merged_tensor(base: Mapping[str, torch.Tensor], tv: TaskVectors, delta: Mapping[str, torch.Tensor],
                  key: str) -> torch.Tensor:
    """One tensor of θ0 + Δ (an export streams them one at a time)."""
    if key not in delta:
        return base[key]
    return (tv.base[key] + delta[key]).to(device="cpu", dtype=base[key].dtype)
