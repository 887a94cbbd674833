"""The method registry: one record per method drives the API, the CLI flags and the UI controls.

A method has ``prepare(task_vectors, **prepare_params)`` (everything no slider changes: SVDs,
thresholds, masks, sums) and ``apply(prepared, **params) -> {key: Δ}`` (cheap). Merged weights
are θ0 + Δ on the merged keys.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from ..errors import MethodError

# The parameter vocabulary shared by every method, the CLI and the UI.
PARAM_NAMES = ("lam", "rank_ratio", "sparsity", "seed", "steps", "lr", "init", "samples", "k", "step_size")


@dataclass(frozen=True)
class Param:
    name: str
    default: float | int | None  # None: resolved from the number of experts (see Method.defaults)
    min: float
    max: float
    step: float
    kind: str = "float"  # "float" or "int"
    min_open: bool = False  # True: the minimum itself is not allowed
    max_open: bool = False
    help: str = ""
    # When set, the value "auto" is allowed and means this rule (e.g. TSV-M's k = ⌊r/T⌋), which a
    # number cannot always express exactly (1/3 of 768 is not a float times 768 rounded down).
    auto: str | None = None

    def range_text(self) -> str:
        lo = "(" if self.min_open else "["
        hi = ")" if self.max_open else "]"
        fmt = (lambda v: str(int(v))) if self.kind == "int" else (lambda v: f"{v:g}")
        return f"{lo}{fmt(self.min)}, {fmt(self.max)}{hi}"

    def check(self, value: Any, method: str) -> float | int | str:
        if self.auto is not None and isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        if isinstance(value, bool) or value is None:
            raise MethodError(f"{method}: parameter {self.name}={value!r} is not a number")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise MethodError(f"{method}: parameter {self.name}={value!r} is not a number") from None
        if not math.isfinite(number):
            raise MethodError(f"{method}: parameter {self.name}={value!r} is not a finite number")
        if self.kind == "int":
            if number != int(number):
                raise MethodError(f"{method}: parameter {self.name}={value!r} must be a whole number")
            number = int(number)
        below = number < self.min or (self.min_open and number == self.min)
        above = number > self.max or (self.max_open and number == self.max)
        if below or above:
            raise MethodError(
                f"{method}: parameter {self.name}={value!r} is out of range {self.range_text()}"
            )
        return number


@dataclass(frozen=True)
class Paper:
    title: str
    arxiv: str

    def __str__(self) -> str:
        return f"{self.title} (arXiv:{self.arxiv})" if self.arxiv else self.title


@dataclass(frozen=True)
class Method:
    name: str
    display_name: str
    paper: Paper
    description: str
    params: tuple[Param, ...]
    prepare: Callable[..., Any]
    apply: Callable[..., Mapping[str, Any]]
    prepare_params: tuple[str, ...] = ()  # parameters that change prepare's result (e.g. seed)
    # Optional middle step, derive(prepared, **derive_params) -> state for apply (TSV-M's direction
    # per rank): prepared state stays immutable, the session caches what is derived from it.
    derive: Callable[..., Any] | None = None
    derive_params: tuple[str, ...] = ()
    # A one-line remark for the current setting (e.g. "λ has no effect at full rank"), or None.
    note: Callable[[Mapping[str, Any], Any], str | None] | None = None
    defaults_for: Callable[[int], dict[str, Any]] | None = None  # defaults that depend on T
    # Upper bounds that depend on T, {name: (bound, reason)}: e.g. TSV-M keeps T·k ≤ r.
    limits_for: Callable[[int], dict[str, tuple[float, str]]] | None = None
    kind: str = "static"  # "static" (sliders) or "data" (learns coefficients: run(...) instead)
    # Data-driven methods: run(context, progress, cancel, **params) -> Run (see methods/adaptive.py)
    run: Callable[..., Any] | None = None
    extra: dict = field(default_factory=dict)
    # Where the field's tools differ (mergekit, FusionBench, the authors' code): users comparing
    # numbers must be able to tell why they differ.
    conventions: str = ""

    def delta(self, prepared, **params) -> Mapping[str, Any]:
        """Δ for these parameters without any cache (derive, if any, then apply)."""
        state = self.derive(prepared, **{k: params[k] for k in self.derive_params}) if self.derive else prepared
        return self.apply(state, **params)

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise MethodError(f"{self.name}: has no parameter {name}")

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def resolve(self, given: Mapping[str, Any], num_experts: int, strict: bool = True) -> dict[str, Any]:
        """Defaults filled in, every value checked; unknown names refused when ``strict``."""
        given = {k: v for k, v in given.items() if v is not None}
        unknown = [k for k in given if k not in self.param_names]
        if unknown and strict:
            takes = ", ".join(self.param_names) or "no parameters"
            raise MethodError(f"{self.name}: does not take {', '.join(unknown)} (it takes {takes})")
        auto = self.defaults_for(num_experts) if self.defaults_for else {}
        limits = self.limits_for(num_experts) if self.limits_for else {}
        out = {}
        for p in self.params:
            value = given.get(p.name, auto.get(p.name, p.default))
            out[p.name] = p.check(value, self.name)
            if p.name in limits and not isinstance(out[p.name], str):
                bound, reason = limits[p.name]
                if out[p.name] > bound + 1e-12:
                    raise MethodError(f"{self.name}: parameter {p.name}={value!r} is above {bound:.6g} "
                                      f"with {num_experts} experts: {reason}")
        return out

    def bounds(self, name: str, num_experts: int) -> tuple[float, float]:
        """The slider range of a parameter for this many experts (T-dependent caps applied)."""
        p = self.param(name)
        limits = self.limits_for(num_experts) if self.limits_for else {}
        return p.min, min(p.max, limits[name][0]) if name in limits else p.max


_REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    if method.name in _REGISTRY:
        raise ValueError(f"method {method.name} registered twice")
    for p in method.params:
        if p.name not in PARAM_NAMES:
            raise ValueError(f"{method.name}: parameter {p.name} is not in the shared vocabulary")
    _REGISTRY[method.name] = method
    return method


def get(name: str) -> Method:
    key = str(name).strip().lower().replace("-", "_")
    if key not in _REGISTRY:
        raise MethodError(f"unknown method '{name}'; known: {', '.join(_REGISTRY)}")
    return _REGISTRY[key]


def names() -> list[str]:
    return list(_REGISTRY)


def all_methods() -> list[Method]:
    return list(_REGISTRY.values())


# Parameter records reused by several methods (same name, range and step everywhere).
LAM = Param("lam", 1.0, -3.0, 3.0, 0.05, help="merge coefficient λ (negative: task negation)")
SPARSITY = Param(
    "sparsity", 0.8, 0.0, 1.0, 0.01, max_open=True, help="fraction of task-vector entries removed"
)
RANK_RATIO = Param(
    "rank_ratio", 0.08, 0.0, 1.0, 0.01, min_open=True,
    help="kept rank per attention/MLP matrix, r = min(m, n): CART k = ⌈rank_ratio · r⌉ (Algorithm 1); "
         "TSV-M k = ⌊rank_ratio · r⌋ per task, at most 1/T, or auto = ⌊r/T⌋",
)
SEED = Param("seed", 0, 0, 2**31 - 1, 1, kind="int", help="random seed of the drop masks")
STEPS = Param("steps", 300, 1, 5000, 1, kind="int", help="optimisation steps (iterations)")
LR = Param("lr", 1e-3, 0.0, 1.0, 1e-4, min_open=True, help="learning rate of the coefficients (Adam)")
INIT = Param("init", 0.3, 0.0, 3.0, 0.05, help="initial value of every learned coefficient")
SAMPLES = Param("samples", 64, 1, 10000, 1, kind="int",
                help="validation images per task used per step (AdaMerging) or as calibration set (FW)")
TOP_K = Param("k", 2, 1, 64, 1, kind="int", help="FW-soft: how many LMO vertices to combine")
STEP_SIZE = Param("step_size", 1.0, 0.0, 1.0, 0.01, min_open=True,
                  help="FW step factor s: iteration i moves γi = s · 2/(i + 2) of the way to the chosen vertex")


def with_default(p: Param, default, **changes) -> Param:
    return replace(p, default=default, **changes)


def kept_rank(rank_ratio: float, m: int, n: int) -> int:
    """CART's kept rank k = ⌈γ · r⌉ (seed 002, Algorithm 1, line 6), r = min(m, n), γ in (0, 1].

    The tolerance keeps a product that lands on an integer up to rounding (0.08 · 100) from
    being pushed to the next one."""
    r = min(m, n)
    return min(r, max(1, math.ceil(rank_ratio * r - 1e-9)))
