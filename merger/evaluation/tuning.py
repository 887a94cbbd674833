"""Auto-tuning (grid search on validation, report on test) and sweeps. Engine code: no UI."""
from __future__ import annotations

import itertools
import math
import random
import time
from typing import Callable, Sequence

from merger import methods
from merger.errors import MergerError
from merger.methods.registry import inside

Progress = Callable[[float, str], None] | None


def tunable_methods() -> list[str]:
    """The methods auto-tune can search (those with a grid in the registry)."""
    return [m.name for m in methods.all_methods() if m.tune_grid is not None]


MAX_GRID_POINTS = 400  # a sweep or grid larger than this is refused (it would hold the queue)


def grid_points(method: str) -> list[dict]:
    m = methods.get(method)
    if m.tune_grid is None:
        raise MergerError(f"{m.name} learns its coefficients from data: it has no grid to search "
                          f"(auto-tune takes {', '.join(tunable_methods())})")
    grid = m.tune_grid
    names = list(grid)
    return [dict(zip(names, values)) for values in itertools.product(*grid.values())] or [{}]


def distinct_methods(method_names: Sequence[str]) -> list[str]:
    """The methods named, each once (an alias counts as its method), in the order first named: a job is
    as large as the methods it names, whatever the list a client sends (["ties"] × 100,000 once held
    the queue for hours)."""
    if isinstance(method_names, str):
        method_names = [method_names]
    seen: dict[str, None] = {}
    every = len(methods.names())
    for name in method_names:
        if len(seen) == every:
            break  # every method named: the rest repeats them
        seen.setdefault(methods.get(name).name)
    return list(seen)


def _check_expert_counts(session, method_names, experts) -> None:
    """Refuse a batch before its first point when a method cannot merge this many experts (SLERP: two),
    rather than after the methods before it ran."""
    n = len(experts) if experts else len(session.tasks)
    for name in method_names:
        m = methods.get(name)
        m.check_expert_count(n, f", or leave {m.display_name} out")


def evaluate_all(session, items: Sequence[tuple], progress: Progress = None, what: str = "point", *,
                 cluster=None, on_result: Callable | None = None, known: Callable | None = None,
                 eta: bool = True) -> list:
    """The results of (spec, split) items, in order: each from ``known(spec, split)`` where it gives
    one (a resumed job), else evaluated here (previews of this session) or on a ``cluster``.
    ``on_result(spec, result)`` is called once per evaluated item as it finishes (the one writer).
    ``eta``: progress messages say the time left at this call's pace (off where a caller says the
    whole job's)."""
    items = [(spec.snap(), split) for spec, split in items]  # what each point computes, as its result is keyed
    out: list = [None] * len(items)
    todo = []
    for i, (spec, split) in enumerate(items):
        hit = known(spec, split) if known else None
        if hit is not None:
            out[i] = hit
        else:
            todo.append(i)
    done = len(items) - len(todo)
    started, computed = time.monotonic(), 0

    def finished(j, result):
        nonlocal done, computed
        i = todo[j]
        out[i] = result
        done += 1
        computed += 1
        if on_result:
            on_result(items[i][0], result)
        if progress:
            left = (time.monotonic() - started) / computed * (len(items) - done)  # at this job's pace so far
            said = f" · about {_duration(left)} left" if eta and done < len(items) else ""
            progress(done / max(1, len(items)), f"{what} {done}/{len(items)}: {items[i][0].label()}{said}")

    # a spec naming an expert the workers lack (one added in the app's lab) is evaluated here
    remote = [j for j, i in enumerate(todo) if cluster is not None and cluster.serves(items[i][0])]
    if remote:
        cluster.evaluate([items[todo[j]] for j in remote], lambda k, result: finished(remote[k], result))
    for j in sorted(set(range(len(todo))) - set(remote)):
        spec, split = items[todo[j]]
        finished(j, session.preview(spec, split=split))
    return out


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def auto_tune(session, method_names: Sequence[str], experts=None, progress: Progress = None, *,
              cluster=None, on_result=None, known=None) -> list[dict]:
    """For each method: best parameters on the validation split, then that setting on test. Batch
    work: each grid point is a chunk, and waiting previews go first (or a cluster's workers run them)."""
    return list(tune_rows(session, method_names, experts, progress, cluster=cluster, on_result=on_result,
                          known=known))


def tune_rows(session, method_names: Sequence[str], experts=None, progress: Progress = None, *,
              cluster=None, on_result=None, known=None):
    """``auto_tune``'s rows, yielded one per method as soon as its grid and its test point are done
    (a page shows each best as it finishes, not all after many minutes); one progress over every
    method, its time left at the whole job's pace. Batch work is marked per method: a caller may
    resume the generator on another thread."""
    method_names = distinct_methods(method_names)
    _check_expert_counts(session, method_names, experts)
    plans = [(m, [session.spec(m, experts=experts, **p) for p in grid_points(m)]) for m in method_names]
    total = sum(len(specs) + 1 for _, specs in plans)
    started, before = time.monotonic(), 0
    run = dict(cluster=cluster, on_result=on_result, known=known, eta=False)

    def stage(method, offset, n):  # the method's part of the one bar
        def report(f, msg):
            whole = (offset + f * n) / total
            left = (time.monotonic() - started) * (1 - whole) / whole if 0 < whole < 1 else 0
            progress(whole, f"{method}: {msg}" + (f" · about {_duration(left)} left" if left else ""))
        return report if progress else None

    for m, specs in plans:
        with session.batch(chunks=len(specs) + 1):
            scores = evaluate_all(session, [(s, "val") for s in specs], stage(m, before, len(specs)), "grid point",
                                  **run)
            best = max(range(len(specs)), key=lambda i: (scores[i].average_accuracy, -i))  # the first of equals
            row = {"method": m, "spec": specs[best], "params": specs[best].kwargs, "grid_points": len(specs),
                   "val_accuracy": scores[best].average_accuracy, "at_edge": grid_edges(specs, best)}
            (test,) = evaluate_all(session, [(row["spec"], "test")], stage(m, before + len(specs), 1), "test", **run)
        before += len(specs) + 1
        row.update(test_accuracy=test.average_accuracy, test_normalized=test.normalized_accuracy, test=test)
        yield row


def grid_edges(specs: Sequence, best: int) -> list[str]:
    """The parameters whose best value is the smallest or largest the grid tried: the optimum may
    lie beyond the grid (or at a bound of the parameter's range, where the slider stops too)."""
    out = []
    for name, value in specs[best].kwargs.items():
        tried = sorted({s.kwargs[name] for s in specs if isinstance(s.kwargs.get(name), (int, float))})
        if len(tried) > 1 and value in (tried[0], tried[-1]):
            out.append(name)
    return out


def sweep_axes() -> dict[str, tuple[str, list[str]]]:
    """{parameter: (label, the slider methods that take it)} for every parameter with sweep values."""
    out = {}
    for name in methods.PARAM_NAMES:
        users = [m for m in methods.registry.with_param(name) if m.param(name).sweep]
        if users:
            out[name] = (users[0].param(name).label or name, [m.name for m in users])
    return out


def sweep_values(axis: str, method: str) -> list[float]:
    """The values a sweep of ``method`` along ``axis`` visits (the parameter's own, in its range)."""
    p = methods.get(method).param(axis)
    return [v for v in p.sweep if p.min <= v <= p.max and not (p.min_open and v == p.min)
            and not (p.max_open and v == p.max)]


def sweep(session, method_names: Sequence[str], axis: str, values: Sequence[float], split: str = "live",
          experts=None, fixed: dict | None = None, progress: Progress = None, *, cluster=None, on_result=None,
          known=None) -> dict:
    """Accuracy against one parameter: {method: {"x": [...], "average": [...], "per_task": {task: [...]},
    "forward": [...]}}, ``forward`` each point's forwards' precision (``Result.forward``). Batch work (a
    chunk per point), or a cluster's."""
    method_names = distinct_methods(method_names)
    _check_expert_counts(session, method_names, experts)
    with session.batch(chunks=len(values) * len(method_names)):
        plan = sweep_plan(session, method_names, axis, values, experts, fixed)
        results = evaluate_all(session, [(spec, split) for _, _, spec in plan], progress, "point", cluster=cluster,
                               on_result=on_result, known=known)
    out = {m: {"x": [], "average": [], "per_task": {t: [] for t in session.tasks}, "forward": []}
           for m in method_names}
    for (m, v, _), res in zip(plan, results):
        out[m]["x"].append(v)
        out[m]["average"].append(res.average_accuracy)
        out[m]["forward"].append(res.forward)
        for t in res.tasks:
            out[m]["per_task"][t].append(res.accuracy[t])
    return out


def sweep_plan(session, method_names, axis, values, experts=None, fixed=None) -> list[tuple[str, float, object]]:
    """(method, value, spec) of every point a sweep visits (values outside a method's range skipped),
    the value as computed (``computed_at``)."""
    axes = sweep_axes()
    if axis not in axes:
        raise MergerError(f"sweep axis '{axis}' unknown; one of {', '.join(axes)}")
    if len(values) * len(method_names) > MAX_GRID_POINTS:
        raise MergerError(f"sweep of {len(values) * len(method_names)} points is too large (at most {MAX_GRID_POINTS})")
    n_experts = len(experts) if experts else len(session.tasks)
    plan = []
    for m in method_names:
        rec = methods.get(m)
        if axis not in rec.param_names:
            raise MergerError(f"{m} has no parameter {axis}: it cannot be swept along {axes[axis][0]}")
        bounds = rec.bounds(axis, n_experts)  # e.g. TSV-M's rank ratio stops at 1/T
        seen = set()
        for v in values:
            if inside(v, bounds):
                params = {k: val for k, val in (fixed or {}).get(m, {}).items() if k != axis}
                params[axis] = v
                spec = session.spec(m, experts=experts, **params).snap()
                computed = computed_at(spec, axis)
                if computed not in seen:  # 0.333 and 0.35 are one point: λ = 0.35
                    seen.add(computed)
                    plan.append((m, computed, spec))
    return plan


def computed_at(spec, axis: str) -> float:
    """The value of ``axis`` a sweep point computes (evaluated as a preview: a static method's on
    its slider's step, λ 0.333 at 0.35), which its curve and the history show."""
    return dict(spec.snap().params)[axis]


def sweep_num_tasks(session, method: str, params: dict | None = None, subsets: int = 5, split: str = "live",
                    seed: int = 0, progress: Progress = None) -> dict:
    """Average accuracy over the merged tasks against how many are merged (random subsets). Batch work."""
    with session.batch():
        return _sweep_num_tasks(session, method, params, subsets, split, seed, progress)


def _sweep_num_tasks(session, method, params, subsets, split, seed, progress) -> dict:
    tasks = list(session.tasks)
    rng = random.Random(seed)
    xs, means, ses = [], [], []
    for n in range(1, len(tasks) + 1):
        combos = list(itertools.combinations(tasks, n))
        chosen = combos if len(combos) <= subsets else rng.sample(combos, subsets)
        scores = []
        for subset in chosen:
            res = session.preview(session.spec(method, experts=list(subset), **(params or {})), split=split)
            scores.append(sum(res.accuracy[t] for t in subset) / n)
        mean = sum(scores) / len(scores)
        var = sum((s - mean) ** 2 for s in scores) / (len(scores) - 1) if len(scores) > 1 else 0.0
        xs.append(n)
        means.append(mean)
        ses.append(math.sqrt(var / len(scores)))
        if progress:
            progress(n / len(tasks), f"{n} tasks")
    return {"x": xs, "mean": means, "se": ses}


# ---- per-task weights: a seeded TPE search (Optuna) -----------------------------------------

WEIGHT_SEARCH = (0.0, 2.0, 0.05)  # each wₜ searched in [0, 2] on the weight sliders' step


def weight_range() -> str:
    lo, hi, _ = WEIGHT_SEARCH
    return f"[{lo:g}, {hi:g}]"


def _whole(name: str, value, lo: int, hi: int, hi_text: str) -> int:
    """A count or seed: a whole number in [lo, hi] (2.5 was truncated to 2 trials unseen)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise MergerError(f"{name}: {value!r} is not a number") from None
    if number != number or number % 1:
        raise MergerError(f"{name}: {number:g} is not a whole number")
    if not lo <= number <= hi:
        raise MergerError(f"{name}: {int(number)} is outside [{lo}, {hi_text}]")
    return int(number)


def tune_weights(session, method: str, params: dict | None = None, experts=None, budget: int = 100, seed: int = 0,
                 with_lam: bool = False, progress: Progress = None, cancel=None, *, cluster=None,
                 on_result=None, known=None, block_weights: dict | None = None) -> dict:
    """Per-task weights (and λ, when ``with_lam``) that maximise the average validation accuracy:
    Optuna's TPE sampler, seeded (the same seed gives the same trials), ``budget`` evaluations;
    the best on the test split. ``block_weights`` stay as given in every trial (the merge the search
    starts from). Batch work: a chunk per trial, waiting moves go first. A resumed search
    (``known``) replays the seeded study: the trials it already answered are read back, so it asks
    the same ones again and evaluates only past where it stopped. ``at_edge``: the weights found at
    an end of the search range, where the best may lie beyond it."""
    import optuna

    from merger.errors import Cancelled

    m = methods.get(method)
    if m.data_driven:
        raise MergerError(f"{m.name} learns its own coefficients: tune the weights of a static method")
    if with_lam and "lam" not in m.param_names:
        raise MergerError(f"{m.name} has no λ to tune with the weights")
    budget = _whole("budget (evaluations)", budget, 1, MAX_GRID_POINTS, str(MAX_GRID_POINTS))
    seed = _whole("seed", seed, 0, 2**32 - 1, "2^32 − 1")  # Optuna's sampler would refuse it in its own words, mid-job
    chosen = session.spec(m.name, experts=experts, block_weights=block_weights or None, **(params or {}))
    blocks = dict(chosen.block_weights) or None
    lo, hi, step = WEIGHT_SEARCH
    lam_lo, lam_hi = (min(m.tune_grid["lam"]), max(m.tune_grid["lam"])) if with_lam else (None, None)
    history = []

    def trial_spec(trial):
        weights = {e: trial.suggest_float(e, lo, hi, step=step) for e in chosen.experts}
        kw = dict(chosen.kwargs)
        if with_lam:
            kw["lam"] = trial.suggest_float("lam", lam_lo, lam_hi, step=0.05)
        return session.spec(m.name, experts=list(chosen.experts), task_weights=weights, block_weights=blocks, **kw)

    def scored(spec, result):
        acc = result.average_accuracy
        history.append(acc)
        if progress:
            progress(len(history) / budget, f"trial {len(history)}/{budget}: val {100 * acc:.1f} % "
                                             f"(best {100 * max(history):.1f} %)")
        return acc

    def objective(trial):
        if cancel is not None and cancel():
            raise Cancelled(f"weight search cancelled after {len(history)} of {budget} trials")
        spec = trial_spec(trial)
        return scored(spec, evaluate_all(session, [(spec, "val")], on_result=on_result, known=known)[0])

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=int(seed)))
    with session.batch(chunks=int(budget) + 1):
        if cluster is None:
            study.optimize(objective, n_trials=int(budget), catch=())
        else:  # as many trials at once as there are workers, told as a batch (ask/tell)
            while len(study.trials) < int(budget):
                if cancel is not None and cancel():
                    raise Cancelled(f"weight search cancelled after {len(history)} of {budget} trials")
                trials = [study.ask() for _ in range(min(len(cluster.workers), int(budget) - len(study.trials)))]
                specs = [trial_spec(t) for t in trials]
                results = evaluate_all(session, [(s, "val") for s in specs], cluster=cluster, on_result=on_result,
                                       known=known)
                for trial, spec, result in zip(trials, specs, results):
                    study.tell(trial, scored(spec, result))
        best = dict(study.best_params)
        lam = best.pop("lam", None)
        kw = {**chosen.kwargs, **({"lam": lam} if lam is not None else {})}
        spec = session.spec(m.name, experts=list(chosen.experts), task_weights=best, block_weights=blocks, **kw)
        test = evaluate_all(session, [(spec, "test")], cluster=cluster, on_result=on_result, known=known)[0]
    at_edge = [e for e in chosen.experts if best[e] in (lo, hi)] + (["lam"] if with_lam and lam in (lam_lo, lam_hi) else [])
    return {"spec": spec, "task_weights": best, "val_accuracy": study.best_value, "test_accuracy": test.average_accuracy,
            "test": test, "trials": len(study.trials), "history": history, "seed": int(seed), "at_edge": at_edge}
