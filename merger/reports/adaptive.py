"""``merger report adaptive``: the data-driven merges on the test split, their coefficients learned
on the validation split, beside task arithmetic at its best λ on validation."""
from __future__ import annotations

from merger import methods
from merger.evaluation.session import PoolSession
from merger.methods.basic import TASK_ARITHMETIC
from merger.reports.demo import TA_GRID


def adaptive_numbers(pool, progress=print) -> list[dict]:
    """TA at its best λ (chosen on validation) and every data-driven method at its defaults:
    test-split average accuracy and wall time, in one run."""
    import time

    ex = PoolSession(pool)
    ex.expert_accuracy("test")
    rows = []
    t0 = time.perf_counter()
    val = {lam: ex.preview(ex.spec(TASK_ARITHMETIC.name, lam=lam), "val").average_accuracy for lam in TA_GRID}
    best = max(val, key=val.get)
    ta = ex.preview(ex.spec(TASK_ARITHMETIC.name, lam=best), "test")
    rows.append({"method": f"{TASK_ARITHMETIC.name} (λ={best:g}, best on val)", "test": ta.average_accuracy,
                 "normalized": ta.normalized_accuracy, "seconds": time.perf_counter() - t0})
    for m in [m.name for m in methods.all_methods() if m.data_driven]:
        t1 = time.perf_counter()
        spec = ex.spec(m)
        run = ex.run(spec, progress=(lambda f, msg, v=None: None))
        res = ex.preview(spec, "test")
        rows.append({"method": f"{m} ({spec.label().split('(', 1)[1][:-1]})", "test": res.average_accuracy,
                     "normalized": res.normalized_accuracy, "seconds": time.perf_counter() - t1,
                     "objective": (run.trace["objective"][0], run.trace["objective"][-1])
                     if run.trace["objective"] else None})
        if progress:
            progress(f"  {m}: {100 * res.average_accuracy:.1f} % in {time.perf_counter() - t1:.1f} s")
    return rows


def format_adaptive(rows: list[dict]) -> str:
    width = max([19] + [len(r["method"]) for r in rows]) + 1  # the whole label: it was cut mid-word at 77
    lines = [f"{'method (parameters)':<{width}}{'test acc %':>11}{'normalised %':>14}{'wall s':>8}"]
    for r in rows:
        lines.append(f"{r['method']:<{width}}{100 * r['test']:11.1f}{100 * r['normalized']:14.1f}{r['seconds']:8.1f}")
    ta = rows[0]["test"]
    lines.append("")
    for r in rows[1:]:
        verdict = "beats" if r["test"] > ta else "does not beat"
        obj = r.get("objective")
        moved = f"; objective {obj[0]:.4f} → {obj[1]:.4f}" if obj else ""
        lines.append(f"{r['method'].split(' ')[0]:<18} {verdict} TA ({100 * (r['test'] - ta):+.1f} points){moved}")
    return "\n".join(lines)
