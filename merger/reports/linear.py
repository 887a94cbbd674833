"""``report linear``: the linear estimate against the exact forward on a pool:
accuracy points off over task arithmetic's λ grid, weight averaging and random per-task weights,
and what each costs. Every number is computed from both answers, never assumed."""
from __future__ import annotations

import statistics
import time

import torch

from merger.methods import basic


def linear_rows(session, split: str = "live", seed: int = 0, draws: int = 8) -> tuple[float, list[dict]]:
    """(seconds of the base's and experts' forwards, one row per merge): estimate and exact average
    accuracy (%), their difference in points (average, and the largest per task), and the
    milliseconds each took."""
    ta, wa = basic.TASK_ARITHMETIC.name, basic.WEIGHT_AVERAGING.name
    specs = [(f"λ = {lam:.1f}", session.spec(ta, lam=lam)) for lam in [i / 10 for i in range(0, 16)]]
    specs.append(("weight averaging", session.spec(wa)))
    g = torch.Generator().manual_seed(seed)
    for i in range(draws):
        w = (torch.rand(len(session.tasks), generator=g) * 1.5).tolist()
        specs.append((f"wₜ draw {i + 1}, λ = 0.3", session.spec(ta, lam=0.3, task_weights=dict(zip(session.tasks, w)))))
    prepared_s = time.perf_counter()
    session.linear.prepare(split=split)
    prepared_s = time.perf_counter() - prepared_s
    rows = []
    for label, spec in specs:
        t0 = time.perf_counter()
        est = session.linear.estimate(spec, split)
        t1 = time.perf_counter()
        exact = session.evaluate_exact(spec, split)
        t2 = time.perf_counter()
        err = session.linear.error(est, exact)
        rows.append({"setting": label, "estimate": 100 * est.average_accuracy, "exact": 100 * exact.average_accuracy,
                     "error": err["average"], "max_task": err["max_abs"], "estimate_ms": 1e3 * (t1 - t0),
                     "exact_ms": 1e3 * (t2 - t1)})
    return prepared_s, rows


def format_linear(prepared_s: float, rows: list[dict], tasks: int, split: str) -> str:
    lines = [f"linear estimate f(θ0) + Σ wₜ (f(θt) − f(θ0)) against the exact forward, {split} split, {tasks} tasks; "
             f"the base's and experts' forwards once: {prepared_s:.2f} s",
             f"{'merge':<24}{'estimate %':>11}{'exact %':>9}{'error pts':>10}{'max task':>10}{'est ms':>8}{'exact ms':>10}"]
    for r in rows:
        lines.append(f"{r['setting']:<24}{r['estimate']:11.1f}{r['exact']:9.1f}{r['error']:+10.1f}{r['max_task']:10.1f}"
                     f"{r['estimate_ms']:8.1f}{r['exact_ms']:10.1f}")
    grid = [r for r in rows if r["setting"].startswith("λ")]
    usual = [r for r in grid if 0.1 <= float(r["setting"].split("=")[1]) <= 0.5]
    draws = [r for r in rows if r["setting"].startswith("wₜ")]
    lines.append("")
    for name, part in (("λ in [0.1, 0.5]", usual), ("λ grid [0, 1.5]", grid), ("per-task weights", draws)):
        if part:
            lines.append(f"{name:<18} mean |error| {statistics.mean(abs(r['error']) for r in part):.2f} points, "
                         f"largest {max(abs(r['error']) for r in part):.2f}; per task at most "
                         f"{max(r['max_task'] for r in part):.1f}")
    lines.append("error = estimate − exact, in accuracy points; est ms: the estimate (no forward), exact ms: "
                 "one merge and one forward.")
    return "\n".join(lines)


def report_linear(pool, split: str = "live") -> str:
    from merger.evaluation.session import PoolSession

    session = PoolSession(pool)
    return format_linear(*linear_rows(session, split), len(session.tasks), split)
