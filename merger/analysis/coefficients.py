"""Coefficients tuned by hand: what a data-driven run learned, read as task and block weights;
the trade-off between two tasks over a grid of their weights; one task's weight turned up; the
Pareto front of the specs a session evaluated. Engine code: batch work through the session."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from merger import methods
from merger.errors import Cancelled, MergerError
from merger.methods.basic import TASK_ARITHMETIC
from merger.pool.blocks import block_groups, block_of
from merger.spec import WEIGHT_RANGE, Spec

MAP_VALUES = tuple(round(0.2 * i, 2) for i in range(11))  # 0, 0.2, …, 2: the two-task map's grid
UP_VALUES = tuple(round(0.1 * i, 2) for i in range(21))  # 0, 0.1, …, 2: "turn one up"


def effective_weights(session, spec: Spec) -> tuple[list[float], str]:
    """How the spec's merge weights each expert (the method's own reading, see the registry)."""
    m = methods.get(spec.method)
    if m.data_driven:
        state = session.cached_run(spec)
        if state is None:
            raise MergerError(f"{m.name}: press Run in the Merge tab first")
    else:
        with session.queue:
            state = session.prepared_for(spec)[1]
    weights, how = m.weights(spec.snap().kwargs, len(spec.experts), state)
    if spec.task_weights:  # the method combines the weighted task vectors wₜτₜ
        weights = [v * w for v, w in zip(weights, spec.task_weight_list())]
        how += ", times each task's weight wₜ"
    return weights, how


@dataclass
class Learned:
    """A run's coefficients as the sliders of task arithmetic at λ = 1: θ0 + Σt wₜ·b_g(k)·τt."""
    task_weights: dict[str, float]
    block_weights: dict[str, float]
    blocks: list[str] = field(default_factory=list)
    matrix: list[list[float]] | None = None  # [task][block]: the run's mean coefficient per block
    fit_error: float = 0.0  # ‖M − w bᵀ‖ / ‖M‖ of the rank-one reading (0: exact)
    note: str = ""

    def spec(self, session, experts) -> Spec:
        return session.spec(TASK_ARITHMETIC.name, experts=list(experts), lam=1.0, task_weights=self.task_weights,
                            block_weights=self.block_weights or None)


def learned(run, pool) -> Learned:
    """A run of θ0 + Σ c·τ (AdaMerging task- or layer-wise, Frank–Wolfe) as task and block weights.

    One coefficient per task (task-wise, FW) is exactly a task weight. Layer-wise runs learn one
    coefficient per tensor and task: they are averaged per block group (plain mean of the group's
    tensors) into a task × block matrix M, read as its best rank-one product wₜ·b_g (the leading
    singular pair, scaled so that the block weights average 1). The sliders reproduce the run
    exactly when M is rank one; ``fit_error`` says how far it is otherwise."""
    comb = run.combination
    if comb is None:
        raise MergerError(f"start from learned: {run.method} learns no coefficients over the task vectors (it solves "
                          "per parameter); load AdaMerging or FW-Merging instead")
    if not getattr(comb, "around_base", False):
        raise MergerError("start from learned: this run's coefficients scale low-rank parts around the weight "
                          "average (AdaMerging+CART), not task vectors; load AdaMerging or FW-Merging instead")
    coef = run.coefficients.float()
    if coef.shape[1] == 1:
        weights = {t: _clip(float(c)) for t, c in zip(run.tasks, coef[:, 0])}
        return Learned(weights, {}, note="one coefficient per task, each a task weight")
    keys = ["visual." + g for g in run.groups]
    blocks = block_groups(keys)
    M = torch.stack([coef[:, [i for i, k in enumerate(keys) if block_of(k) == b]].mean(1) for b in blocks], 1)
    U, S, Vh = torch.linalg.svd(M.double(), full_matrices=False)
    w, b = U[:, 0] * S[0], Vh[0]
    if b.mean() < 0:
        w, b = -w, -b
    w, b = w * b.mean(), b / b.mean()
    error = float(torch.linalg.norm(M.double() - torch.outer(w, b)) / torch.linalg.norm(M.double()).clamp(min=1e-12))
    return Learned({t: _clip(float(x)) for t, x in zip(run.tasks, w)},
                   {g: _clip(float(x)) for g, x in zip(blocks, b)}, blocks, M.tolist(), error,
                   note=f"layer-wise: mean per block, then the best rank-one product wₜ·b_g "
                        f"(relative error {100 * error:.1f} %)")


def _clip(x: float) -> float:
    return round(min(max(x, WEIGHT_RANGE[0]), WEIGHT_RANGE[1]), 4)


def with_weights(session, spec: Spec, **changes: float) -> Spec:
    """The spec with some task weights changed (the others, and the block weights, kept)."""
    weights = {**dict(spec.task_weights), **changes}
    return session.spec(spec.method, experts=list(spec.experts), task_weights=weights,
                        block_weights=dict(spec.block_weights) or None, **spec.kwargs)


def _evaluate_all(session, specs, split, progress, cancel, what: str):
    """Each spec's result (previews of batch work: cached, and waiting moves go first)."""
    out = []
    with session.batch(chunks=len(specs)):
        for i, spec in enumerate(specs):
            if cancel is not None and cancel():
                raise Cancelled(f"{what}: cancelled after {i} of {len(specs)} points")
            out.append(session.preview(spec, split))
            if progress is not None:
                progress((i + 1) / len(specs), f"{what}: {i + 1}/{len(specs)}")
    return out


def _check_static(spec: Spec, *tasks: str) -> None:
    if methods.get(spec.method).data_driven:
        raise MergerError(f"{spec.method} learns its own coefficients: pick a static method (or start from learned)")
    missing = [t for t in tasks if t not in spec.experts]
    if missing:
        raise MergerError(f"task {', '.join(missing)}: not among the ticked experts ({', '.join(spec.experts)})")


def two_task_map(session, spec: Spec, a: str, b: str, values=MAP_VALUES, split: str = "live",
                 progress=None, cancel=None) -> dict:
    """Both tasks' accuracy over a grid of their two weights (the other weights as in ``spec``)."""
    _check_static(spec, a, b)
    if a == b:
        raise MergerError("two-task map: pick two different tasks")
    specs = [with_weights(session, spec, **{a: wa, b: wb}).snap() for wb in values for wa in values]  # as computed
    results = _evaluate_all(session, specs, split, progress, cancel, "two-task map")
    n = len(values)
    grid = lambda t: [[results[j * n + i].accuracy[session.pool.task_of(t)] for i in range(n)]  # noqa: E731
                      for j in range(n)]
    return {"tasks": (a, b), "values": list(values), "accuracy_a": grid(a), "accuracy_b": grid(b), "specs": specs,
            "current": (dict(spec.task_weights).get(a, 1.0), dict(spec.task_weights).get(b, 1.0)), "split": split}


def turn_one_up(session, spec: Spec, task: str, values=UP_VALUES, split: str = "live",
                progress=None, cancel=None) -> dict:
    """Every task's accuracy as one task's weight goes from 0 to 2 (who gains, who pays)."""
    _check_static(spec, task)
    results = _evaluate_all(session, [with_weights(session, spec, **{task: w}) for w in values], split,
                            progress, cancel, f"turn up {task}")
    return {"task": task, "values": list(values), "split": split,
            "accuracy": {t: [r.accuracy[t] for r in results] for t in results[0].tasks}}


def evaluated_points(session, a: str, b: str, split: str = "live", specs=None) -> list[dict]:
    """Every spec evaluated (complete, on ``split``, still cached) with both tasks: its accuracy on
    each. ``specs``: only these (one person's merges), else every result the session holds."""
    ta, tb = session.pool.task_of(a), session.pool.task_of(b)
    if specs is None:
        pairs = session.results(split)
    else:
        pairs = [(spec, session.cached(spec, split)) for spec in specs]
    return [{"label": spec.label(), "a": r.accuracy[ta], "b": r.accuracy[tb]}
            for spec, r in pairs if r is not None and ta in r.accuracy and tb in r.accuracy]


def pareto_front(points: list[dict]) -> list[int]:
    """Indices of the points no other point beats on both tasks (maximising both), by task A."""
    front = [i for i, p in enumerate(points)
             if not any(q["a"] >= p["a"] and q["b"] >= p["b"] and (q["a"] > p["a"] or q["b"] > p["b"])
                        for q in points)]
    return sorted(front, key=lambda i: points[i]["a"])
