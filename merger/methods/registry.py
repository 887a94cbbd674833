"""The method registry: one record per method drives the API, the CLI flags and the UI controls.

A method has ``prepare(task_vectors, **prepare_params)`` (everything no slider changes: SVDs,
thresholds, masks, sums) and ``apply(prepared, **params) -> {key: Δ}`` (cheap). Merged weights
are θ0 + Δ on the merged keys.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator, Mapping, NoReturn

from merger.errors import Cancelled, MethodError, listed, shown_value
from merger.methods._scaled import Scaled, lam_times  # noqa: F401  (the methods' apply of λ · a state)


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
    label: str = ""  # what the UI calls it ("λ (merge coefficient)"); the name where empty
    sweep: tuple = ()  # the values a sweep against this parameter visits; () = not a sweep axis

    def range_text(self, bounds: tuple[float, float] | None = None) -> str:
        """[min, max] with its open ends; ``bounds``: another range of it (``Method.bounds``: T's cap)."""
        lo, hi = bounds or (self.min, self.max)
        fmt = (lambda v: str(int(v))) if self.kind == "int" else (lambda v: f"{v:g}")
        return f"{'(' if self.min_open else '['}{fmt(lo)}, {fmt(hi)}{')' if self.max_open else ']'}"

    def check(self, value: Any, method: str) -> float | int | str:
        if self.auto is not None and isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        if isinstance(value, bool) or value is None:
            self.refuse(method, value, "is not a number")
        try:
            number = float(value)
        except OverflowError:  # an int beyond a float's range
            self.refuse(method, value, "is not a finite number")
        except (TypeError, ValueError):
            self.refuse(method, value, "is not a number")
        if not math.isfinite(number):
            self.refuse(method, value, "is not a finite number")
        # a number given as text ("ta:lam=9" in a spec) is said as written, unquoted: lam=9, as from a flag
        shown = shown_value(value.strip()).strip("'\"") if isinstance(value, str) else None
        if self.kind == "int":
            if number != int(number):
                self.refuse(method, value, "must be a whole number", shown)
            number = int(number)
        below = number < self.min or (self.min_open and number == self.min)
        above = number > self.max or (self.max_open and number == self.max)
        if below or above:
            self.refuse(method, value, f"is out of range {self.range_text()}", shown)
        return number

    def refuse(self, method: str, value: Any, reason: str, shown: str | None = None) -> NoReturn:
        shown = shown_value(value) if shown is None else shown
        raise MethodError(f"{method}: parameter {self.name}={shown} {reason}", param=self.name,
                          reason=f"{shown} {reason}") from None


@dataclass(frozen=True)
class Paper:
    title: str
    arxiv: str

    def __str__(self) -> str:
        return f"{self.title} (arXiv:{self.arxiv})" if self.arxiv else self.title


@dataclass(frozen=True)
class Published:
    """A number the field reports for a method: average absolute accuracy % over the 8-task CLIP suite (SUN397,
    Cars, RESISC45, EuroSAT, SVHN, GTSRB, MNIST, DTD) on one architecture: a guide line on its real pools."""
    architecture: str
    accuracy: float
    source: str
    verified: bool = True  # False: recalled from a paper, not found in its authors' repository


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
    # Optional middle step, derive(prepared, **derive_params) -> state for apply (TSV-M's direction per rank).
    # Every prepared and derived state is immutable once returned: the session caches them, and a later move,
    # a landscape or an export may read the same one.
    derive: Callable[..., Any] | None = None
    derive_params: tuple[str, ...] = ()
    # derive(prepared, ..., near=[states derived before from the same preparation]): the session passes
    # them on large pools; the reference ignores them, a drop-in may start from one (CART's rank sums).
    derive_near: bool = False
    # A one-line remark for the current setting (e.g. "λ has no effect at full rank"), or None.
    note: Callable[[Mapping[str, Any], Any], str | None] | None = None
    defaults_for: Callable[[int], dict[str, Any]] | None = None  # defaults that depend on T
    # Upper bounds that depend on T, {name: (bound, reason)}: e.g. TSV-M keeps T·k ≤ r.
    limits_for: Callable[[int], dict[str, tuple[float, str]]] | None = None
    # Data-driven methods: run(context, progress, cancel, **params) -> Run (see methods/adaptive.py)
    # instead of sliders; the method is then "data-driven" (``data_driven``).
    run: Callable[..., Any] | None = None
    # The grid auto-tune searches on validation, {param: values}; {} for a method without sliders.
    # None only for data-driven methods (they learn their coefficients instead).
    tune_grid: Mapping[str, tuple] | None = None
    # How Δ weights the experts: weights(params, T, state) -> (one weight per expert, how to read it);
    # state is the prepared state (static) or the Run (data-driven). The Analysis tab, the logit
    # ensemble and cross-task linearity read it.
    weights: Callable[[Mapping[str, Any], int, Any], tuple[list[float], str]] | None = None
    # Which entries of each τt the merge keeps (the sparsifying operator M of arXiv 2601.21690):
    # mask(task_vectors, **params) -> [T, P] bool over the flattened task vectors, or None.
    mask: Callable[..., Any] | None = None
    objective: str = ""  # data-driven: what the run minimises ("entropy", "calibration loss")
    iterate: str = "step"  # data-driven: what one recorded iterate is called ("snapshot", "iteration")
    aliases: tuple[str, ...] = ()  # short names accepted wherever a method is named ("ta")
    featured: bool = False  # ticked by default where the app offers a choice (auto-tune, sweeps, benches)
    # prepare takes seconds or more on a real pool (SVDs, sorts of every entry): it then takes
    # ``progress(fraction, message)`` and ``cancel() -> bool`` keywords (see ``each``), and the app
    # runs it like a data-driven run (progress bar, Cancel) where a move would otherwise stall.
    slow_prepare: bool = False
    extra: dict = field(default_factory=dict)
    # Where the field's tools differ (mergekit, FusionBench, the authors' code): users comparing
    # numbers must be able to tell why they differ.
    conventions: str = ""
    published: tuple[Published, ...] = ()  # the field's numbers for this method (guide lines)
    # Per-task weights wₜ (each τt times wₜ before the method combines them): a method that takes
    # them in apply (``apply(..., task_weights=[w per expert])``: cheap, a move like λ's) says so;
    # any other static method prepares on the weighted task vectors (a preparation per weighting).
    task_weighted: bool = False
    # Δ is exactly Σ wₜτₜ with ``weights`` as the wₜ (times any task weights): cross-task linearity
    # then estimates its result from the experts' forwards with none of its own (the linear estimate).
    # Its ``weights`` read the parameters (static: state is None) or the run, never a preparation.
    weighted_sum: bool = False
    # Exactly this many experts (SLERP interpolates two); None: any number.
    num_experts: int | None = None

    @property
    def data_driven(self) -> bool:
        return self.run is not None

    def prepare_with(self, task_vectors, progress=None, cancel=None, **prepare_params):
        """``prepare``, with progress and cancel where the method reports them (slow_prepare)."""
        if self.slow_prepare:
            return self.prepare(task_vectors, progress=progress, cancel=cancel, **prepare_params)
        return self.prepare(task_vectors, **prepare_params)

    def delta(self, prepared, **params) -> Mapping[str, Any]:
        """Δ for these parameters without any cache (derive, if any, then apply)."""
        state = self.derive(prepared, **self.derive_kwargs(params)) if self.derive else prepared
        return self.apply(state, **params)

    def derive_kwargs(self, params: Mapping[str, Any]) -> dict:
        """What derive takes: its parameters, and the task weights of a task-weighted method (TIES
        and DARE merge at λ = 1 with them; λ is then one scale)."""
        out = {k: params[k] for k in self.derive_params}
        if self.task_weighted and params.get("task_weights") is not None:
            out["task_weights"] = params["task_weights"]
        return out

    def weights_kwargs(self, spec) -> dict:
        """What apply takes of a spec's task weights (nothing unless the method takes them)."""
        return {"task_weights": spec.task_weight_list()} if self.task_weighted and spec.task_weights else {}

    def experts_for(self, experts):
        """What this method merges of ``experts``: all of them, or the first ``num_experts`` (SLERP:
        two), for surfaces that run every method on a whole pool (reports, benches)."""
        return list(experts)[: self.num_experts] if self.num_experts else list(experts)

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise MethodError(f"{self.name}: has no parameter {name}")

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def check_expert_count(self, num_experts: int, alternative: str = "") -> None:
        """Refuse a count of experts other than the one the method merges (SLERP: two)."""
        if self.num_experts is not None and num_experts != self.num_experts:
            chosen = f"{num_experts} {'is' if num_experts == 1 else 'are'} selected"
            raise MethodError(f"{self.name} merges exactly {self.num_experts} experts; {chosen}: "
                              f"pick {self.num_experts}{alternative}")

    def resolve(self, given: Mapping[str, Any], num_experts: int, strict: bool = True) -> dict[str, Any]:
        """Defaults filled in, every value checked; unknown names refused when ``strict``."""
        self.check_expert_count(num_experts)
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
                    p.refuse(self.name, value, f"is above {bound:.6g} with {num_experts} experts: {reason}")
        return out

    def slider_steps(self, name: str, num_experts: int) -> list[float]:
        """Each step of a parameter's slider in its range for T (TSV-M's rank with 8 experts: 0.01 … 0.12)."""
        p, (lo, hi) = self.param(name), self.bounds(name, num_experts)
        steps = range(math.ceil(lo / p.step - 1e-9), math.floor(hi / p.step + 1e-9) + 1)
        return [round(i * p.step, 9) for i in steps if round(i * p.step, 9) > lo or not p.min_open]

    def bounds(self, name: str, num_experts: int) -> tuple[float, float]:
        """The slider range of a parameter for this many experts (T-dependent caps applied)."""
        p = self.param(name)
        limits = self.limits_for(num_experts) if self.limits_for else {}
        return p.min, min(p.max, limits[name][0]) if name in limits else p.max


def inside(value: float, bounds: tuple[float, float]) -> bool:
    """A value within a parameter's range (``Method.bounds``), the top reached: 1/T (TSV-M's cap) is no float."""
    lo, hi = bounds
    return lo <= value <= hi + 1e-12


# Where the published numbers come from (anchors-peer-projects.md, section 1.6): the papers' lineage
# of checkpoints (task_vectors' open_clip experts), not FusionBench's Hugging Face ones.
CART_README = "CART README, Table 1 (task_vectors checkpoints)"
ADAMERGING_LOGS = "AdaMerging repository's committed logs"
RECOLLECTION = "the paper as recalled; not found in its repository"
MATRICES_NOTE = ("Matrices = the 2-D attention and MLP weights (in_proj, out_proj, c_fc, c_proj); "
                 "every other tensor (biases, norms, embeddings, conv1, visual projection) is 'other'.")
FUSIONBENCH = "FusionBench's CLIP table (its Hugging Face checkpoints, not the papers' open_clip ones)"

_REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add a method; what every surface needs is checked here, so that a method missing a piece
    fails at import, not silently in one tab."""
    if method.name in _REGISTRY:
        raise ValueError(f"method {method.name} registered twice")
    problems = []
    if method.weights is None:
        problems.append("weights (how Δ weights the experts)")
    if method.slow_prepare and not {"progress", "cancel"} <= set(inspect.signature(method.prepare).parameters):
        problems.append("prepare(..., progress=None, cancel=None) (slow_prepare reports progress and stops on cancel)")
    if method.data_driven:
        if not method.objective:
            problems.append("objective (the name of what the run minimises)")
    elif method.tune_grid is None:
        problems.append("tune_grid ({} for a method without sliders)")
    else:
        for name, values in method.tune_grid.items():
            p = method.param(name)
            for v in values:
                p.check(v, method.name)
    for p in method.params:
        for other in _REGISTRY.values():
            if p.name in other.param_names and (other.param(p.name).kind != p.kind):
                problems.append(f"parameter {p.name}: {other.name} declares it as {other.param(p.name).kind}")
    if problems:
        raise ValueError(f"method {method.name} lacks " + "; ".join(problems))
    _REGISTRY[method.name] = method
    return method


# The order of the shared parameter records (below); a method's own new parameter comes after them.
SHARED_ORDER = ("lam", "rank_ratio", "sparsity", "seed", "steps", "lr", "init", "samples", "k", "step_size")


def param_names() -> tuple[str, ...]:
    """Every parameter name of the registered methods (the shared ones first, in their order, then
    new ones in order of first use): the UI's controls, the CLI's flags and the endpoint's arguments."""
    seen: dict[str, None] = {n: None for n in SHARED_ORDER if any(n in m.param_names for m in _REGISTRY.values())}
    for m in _REGISTRY.values():
        for p in m.params:
            seen.setdefault(p.name, None)
    return tuple(seen)


def param_record(name: str) -> tuple[Method, Param]:
    """The first method that uses a parameter, and its record (the control's range and label)."""
    for m in _REGISTRY.values():
        if name in m.param_names:
            return m, m.param(name)
    raise MethodError(f"no method has a parameter {name}")


def with_param(name: str, *, sliders_only: bool = True) -> list[Method]:
    """The methods that take a parameter (by default those that evaluate live from sliders)."""
    return [m for m in _REGISTRY.values() if name in m.param_names and not (sliders_only and m.data_driven)]


def get(name: str) -> Method:
    key = str(name).strip().lower().replace("-", "_")
    key = next((m.name for m in _REGISTRY.values() if key in m.aliases), key)
    if key not in _REGISTRY:
        raise MethodError(f"unknown method '{listed([name])}'; known: {', '.join(_REGISTRY)}")
    return _REGISTRY[key]


def names() -> list[str]:
    return list(_REGISTRY)


def all_methods() -> list[Method]:
    return list(_REGISTRY.values())


# Parameter records reused by several methods (same name, range and step everywhere).
LAM = Param("lam", 1.0, -3.0, 3.0, 0.05, help="merge coefficient λ (negative: task negation)",
            label="λ (merge coefficient)", sweep=tuple(round(0.1 * i, 2) for i in range(0, 31)))
SPARSITY = Param(
    "sparsity", 0.8, 0.0, 1.0, 0.01, max_open=True, help="fraction of task-vector entries removed",
    label="sparsity", sweep=tuple(round(0.1 * i, 2) for i in range(0, 10)) + (0.95, 0.99),
)
RANK_RATIO = Param(
    "rank_ratio", 0.08, 0.0, 1.0, 0.01, min_open=True,
    help="kept rank per attention/MLP matrix, r = min(m, n): CART k = ⌈rank_ratio · r⌉ (Algorithm 1); "
         "TSV-M k = ⌊rank_ratio · r⌋ per task, at most 1/T, or auto = ⌊r/T⌋",
    label="rank ratio", sweep=(0.01, 0.02, 0.04, 0.06, 0.08, 0.12, 0.16, 0.24, 0.32, 0.5, 0.75, 1.0),
)
SEED = Param("seed", 0, 0, 2**31 - 1, 1, kind="int", help="random seed of the drop masks", label="seed")
STEPS = Param("steps", 300, 1, 5000, 1, kind="int", help="optimisation steps (iterations)", label="steps")
LR = Param("lr", 1e-3, 0.0, 1.0, 1e-4, min_open=True, help="learning rate of the coefficients (Adam)",
           label="learning rate")
INIT = Param("init", 0.3, 0.0, 3.0, 0.05, help="initial value of every learned coefficient",
             label="initial coefficient")
SAMPLES = Param("samples", 64, 1, 10000, 1, kind="int",
                help="validation images per task used per step (AdaMerging), as calibration set (FW) or for the "
                     "statistics (RegMean's Gram matrices, Fisher information)",
                label="samples per task")
TOP_K = Param("k", 2, 1, 64, 1, kind="int", help="FW-soft: how many LMO vertices to combine",
              label="top-k vertices")
STEP_SIZE = Param("step_size", 1.0, 0.0, 1.0, 0.01, min_open=True,
                  help="FW step factor s: iteration i moves γi = s · 2/(i + 2) of the way to the chosen vertex",
                  label="FW step factor")


def each(items: Iterable, progress=None, cancel=None, what: str = "tensor") -> Iterator:
    """The items of a slow preparation one by one: ``cancel()`` is asked before each (raising
    Cancelled: nothing is cached), ``progress(fraction, message)`` told after each."""
    items = list(items)
    for i, item in enumerate(items):
        if cancel is not None and cancel():
            raise Cancelled(f"cancelled at {what} {i + 1} of {len(items)}: nothing was cached")
        yield item
        if progress is not None:
            progress((i + 1) / len(items), f"{what} {i + 1}/{len(items)}")


def with_default(p: Param, default, **changes) -> Param:
    return replace(p, default=default, **changes)


def frange(lo: float, hi: float, step: float) -> tuple[float, ...]:
    """lo, lo + step, …, hi (rounded: grid values print as typed)."""
    n = int(round((hi - lo) / step))
    return tuple(round(lo + i * step, 4) for i in range(n + 1))


def sum_weights(scale: str):
    """Effective weights of a merge that is a scaled sum (λ per task) or mean (λ/T) of the task
    vectors; exact for sums, a reading for methods that reshape the sum."""
    def weights(params, num_experts: int, state) -> tuple[list[float], str]:
        lam = params.get("lam", 1.0)
        if scale == "sum":
            return [lam] * num_experts, "λ per task"
        if scale == "mean":
            return [lam / num_experts] * num_experts, "λ/T per task (a mean of the task vectors, scaled by λ)"
        return [1.0 / num_experts] * num_experts, "1/T per task (the weight average is the anchor)"
    return weights


def kept_rank(rank_ratio: float, m: int, n: int) -> int:
    """CART's kept rank k = ⌈γ · r⌉ (arXiv 2412.12153, Algorithm 1, line 6), r = min(m, n), γ in (0, 1].

    The tolerance keeps a product that lands on an integer up to rounding (0.08 · 100) from
    being pushed to the next one."""
    r = min(m, n)
    return min(r, max(1, math.ceil(rank_ratio * r - 1e-9)))
