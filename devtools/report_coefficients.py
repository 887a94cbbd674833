"""``python -m devtools report coefficients``: the figures of hand-tuned coefficients.

1. A per-task (and per-block) weight move against a λ move: the Merge tab's listener in process,
   with the forwards and applies each move costs.
2. The two-task map (11 × 11 weights) on a fresh session: its wall time.
3. The TPE search of the per-task weights (100 evaluations on validation) beside the best single
   λ (task arithmetic's grid) and AdaMerging task-wise (no labels), all on the test split.
"""
from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

from merger.methods.adaptive import ADAMERGING_TASK
from merger.methods.basic import TASK_ARITHMETIC
from merger.methods.ties import TIES
from devtools.measure import percentile

TA = TASK_ARITHMETIC.name


def _moves(pool) -> tuple[list[str], bool]:
    from merger.evaluation.session import PoolSession
    from devtools.bench_live import merge_tab_controls
    from merger.ui.landscape_tab import LandscapeController
    from merger.ui.merge_events import MergeTabEvents
    from merger.ui.merge_tab import Controller

    session = PoolSession(pool)
    session.measure_live()
    ctl = Controller(session)
    lc = LandscapeController(ctl)
    events = MergeTabEvents(ctl, TA, lc)
    person = SimpleNamespace(session_hash="report")
    noop = lambda *a, **k: None  # noqa: E731
    *_, (state, _) = lc.compute(None, [], "pca", None, None, "", "loss", "all tasks (mean)", 7, "contour", [],
                                *merge_tab_controls(pool, TA, 0.3), progress=noop)
    first, last = ctl.weight_experts[0], ctl.weight_blocks[-1]

    def inputs(method, lam=0.3, w=1.0, b=1.0):
        tail = [w if e == first else 1.0 for e in ctl.weight_experts]
        tail += [b if g == last else 1.0 for g in ctl.weight_blocks]
        return [*merge_tab_controls(pool, method, lam), *tail]

    lines, ok = [], True
    header = f"{'method':<18}{'slider':<14}{'move p50 ms':>12}{'p95 ms':>8}{'forwards':>10}{'applies':>9}"
    lines.append(header)
    for method in (TA, TIES.name):
        list(events.move(person, state, *inputs(method)))  # its preparation, once
        p50s = {}
        for label, make in (("λ", lambda v: inputs(method, lam=v)),
                            (f"w · {first}", lambda v: inputs(method, w=v)),
                            (f"b · {last}", lambda v: inputs(method, b=v))):
            times, fwd, app = [], [], []
            for i in range(20):
                value = round(0.35 + 0.05 * i, 2) if label == "λ" else round(0.11 + 0.09 * i, 2)
                f0, a0 = session.evaluator.forwards, session.counts["applies"]
                t = time.perf_counter()
                list(events.move(person, state, *make(value)))
                times.append(time.perf_counter() - t)
                fwd.append(session.evaluator.forwards - f0)
                app.append(session.counts["applies"] - a0)
            p50s[label] = statistics.median(times)
            lines.append(f"{method:<18}{label:<14}{1e3 * p50s[label]:12.1f}{1e3 * percentile(times, 0.95):8.1f}"
                         f"{statistics.mean(fwd):10.2f}{statistics.mean(app):9.2f}")
            ok &= max(fwd) == 1 and max(app) <= 1
        ratio = max(v for k, v in p50s.items() if k != "λ") / p50s["λ"]
        lines.append(f"{'':<18}{'weight / λ':<14}{ratio:11.2f}x")
        ok &= ratio <= 1.25
    return lines, ok


def report_coefficients(pool) -> tuple[str, bool]:
    from merger.analysis.coefficients import two_task_map
    from merger.evaluation.session import PoolSession
    from merger.evaluation.tuning import auto_tune, tune_weights

    out = [f"{pool.name}: {len(pool.tasks)} experts ({', '.join(pool.tasks)}); block groups: {', '.join(pool.blocks)}",
           "", "1. A weight move against a λ move (MergeTabEvents.move, 20 distinct values each, all cache misses)"]
    lines, ok = _moves(pool)
    out += lines

    session = PoolSession(pool)
    spec = session.spec(TA, lam=0.3)
    session.preview(spec)  # the base and the experts' references: once per split
    a, b = pool.tasks[:2]
    t = time.perf_counter()
    grid = two_task_map(session, spec, a, b)
    map_s = time.perf_counter() - t
    n = len(grid["values"])
    ok &= map_s <= 10
    out += ["", f"2. Two-task map ({a} × {b}, {n} × {n} weights, live split, fresh session): {map_s:.1f} s (goal <= 10 s)"]

    t = time.perf_counter()
    tuned = tune_weights(session, TA, {"lam": 0.3}, budget=100, seed=0)
    tune_s = time.perf_counter() - t
    ok &= tune_s <= 60
    single = auto_tune(session, [TA])[0]
    t = time.perf_counter()
    ada = session.preview(session.spec(ADAMERGING_TASK.name), "test")
    ada_s = time.perf_counter() - t
    rows = [("TPE per-task weights (λ = 0.3)", ", ".join(f"{e}={w:g}" for e, w in tuned["task_weights"].items()),
             tuned["trials"], tuned["val_accuracy"], tuned["test_accuracy"], tune_s),
            ("best single λ (TA grid)", f"λ={single['params']['lam']:g}", single["grid_points"],
             single["val_accuracy"], single["test_accuracy"], None),
            ("AdaMerging task-wise", "learned λt (entropy, no labels)", "-", None, ada.average_accuracy, ada_s)]
    out += ["", f"3. Tuned search of {len(pool.tasks)} per-task weights (Optuna TPE, seed 0, 100 evaluations on "
                f"validation; goal <= 60 s) and what it is compared with, on the test split",
            f"{'search':<32}{'evaluations':>12}{'val %':>8}{'test %':>8}{'seconds':>9}  what it sets"]
    for name, what, evals, val, test, secs in rows:
        out.append(f"{name:<32}{str(evals):>12}{'' if val is None else f'{100 * val:.1f}':>8}{100 * test:8.1f}"
                   f"{'' if secs is None else f'{secs:.1f}':>9}  {what}")
    out += ["", "goals: a weight move costs one forward and at most one apply, and at most 1.25x a λ move; "
                "map <= 10 s; 100 TPE evaluations <= 60 s: " + ("met" if ok else "MISSED")]
    return "\n".join(out), ok
