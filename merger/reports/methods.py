"""`python -m merger report methods`: every registered method on one pool at its tuned setting
(static methods: the registry's auto-tune grid on validation, then test; data-driven ones: their
run at its defaults, learned on validation), with the time of its preparation and of a move, in
one run. Methods that take a fixed number of experts (SLERP) run on the first ones, beside task
arithmetic on the same experts."""
from __future__ import annotations

import statistics
import time

from merger import methods
from merger.evaluation.session import PoolSession
from merger.evaluation.tuning import auto_tune
from merger.methods.basic import TASK_ARITHMETIC


def _timings(pool, spec) -> tuple[float, float, float | None]:
    """(prepare s, first move ms, median λ move ms) of a static spec in a fresh session, as the app
    meets it: the preparation, the first Δ at the tuned setting, then three λ moves."""
    session = PoolSession(pool)
    m = methods.get(spec.method)
    t0 = time.perf_counter()
    session.prepare(spec)
    prepared = time.perf_counter() - t0
    t1 = time.perf_counter()
    session.delta(spec)
    first = 1e3 * (time.perf_counter() - t1)
    if "lam" not in m.param_names:
        return prepared, first, None
    moves = []
    lam = spec.kwargs["lam"]
    for step in (0.05, 0.1, 0.15):  # towards the middle of λ's range
        moved = session.spec(spec.method, experts=list(spec.experts), **{**spec.kwargs, "lam": lam + (step if lam < 1 else -step)})
        t2 = time.perf_counter()
        session.delta(moved)
        moves.append(1e3 * (time.perf_counter() - t2))
    return prepared, first, statistics.median(moves)


def method_rows(pool, names=None, progress=print) -> list[dict]:
    session = PoolSession(pool)
    rows = []
    for m in [methods.get(n) for n in (names or methods.names())]:
        experts = m.experts_for(pool.tasks)
        if m.data_driven:
            spec = session.spec(m.name, experts=experts)
            seconds = session.run(spec).seconds
            val, test = session.preview(spec, "val"), session.preview(spec, "test")
            tuned = {"spec": spec, "val_accuracy": val.average_accuracy, "test_accuracy": test.average_accuracy,
                     "test_normalized": test.normalized_accuracy, "grid_points": 0}
        else:
            tuned = auto_tune(session, [m.name], experts)[0]
        if m.num_experts:  # its reference: task arithmetic, tuned, on the same experts
            tuned["ta_same"] = auto_tune(session, [TASK_ARITHMETIC.name], experts)[0]["test_accuracy"]
        if m.data_driven:
            prepare_s, first_ms, move_ms = seconds, float("nan"), None
        else:
            prepare_s, first_ms, move_ms = _timings(pool, tuned["spec"])
        rows.append({"method": m.name, "experts": experts, "spec": tuned["spec"], "val": tuned["val_accuracy"],
                     "test": tuned["test_accuracy"], "normalized": tuned["test_normalized"],
                     "grid": tuned["grid_points"], "prepare_s": prepare_s, "first_ms": first_ms, "move_ms": move_ms,
                     "ta_same": tuned.get("ta_same"), "published": next((p.accuracy for p in m.published if p.architecture == "ViT-B-32"), None)})
        if progress:
            progress(f"  {m.name}: test {100 * tuned['test_accuracy']:.1f} %")
    return rows


def _setting(row) -> str:
    params = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in row["spec"].kwargs.items())
    return params or "-"


def format_methods(rows: list[dict], pool_tasks) -> str:
    lines = [f"{'method':<18}{'tuned setting':<44}{'grid':>5}{'val %':>7}{'test %':>8}{'norm %':>8}"
             f"{'prepare s':>10}{'1st move ms':>12}{'λ move ms':>10}{'B/32 paper %':>13}"]
    for r in sorted(rows, key=lambda r: -r["test"]):
        move = f"{r['move_ms']:10.1f}" if r["move_ms"] is not None else f"{'-':>10}"
        first = f"{r['first_ms']:12.1f}" if r["first_ms"] == r["first_ms"] else f"{'(run)':>12}"
        pub = f"{r['published']:13.1f}" if r["published"] is not None else f"{'-':>13}"
        name = r["method"] + ("*" if len(r["experts"]) != len(pool_tasks) else "")
        lines.append(f"{name:<18}{_setting(r)[:43]:<44}{r['grid']:5d}{100 * r['val']:7.1f}{100 * r['test']:8.1f}"
                     f"{100 * r['normalized']:8.1f}{r['prepare_s']:10.2f}{first}{move}{pub}")
    by_name = {r["method"]: r for r in rows}
    ta = by_name.get(TASK_ARITHMETIC.name)
    if ta is not None:
        full = [r for r in rows if len(r["experts"]) == len(pool_tasks) and r["method"] != ta["method"]]
        beat = sorted((r for r in full if r["test"] > ta["test"]), key=lambda r: -r["test"])
        lines += ["", f"beat task arithmetic ({100 * ta['test']:.1f} %) on test: "
                      + (", ".join(f"{r['method']} ({100 * (r['test'] - ta['test']):+.1f})" for r in beat) or "none")]
    partial = [r for r in rows if len(r["experts"]) != len(pool_tasks)]
    for r in partial:
        lines.append(f"* {r['method']} merges {len(r['experts'])} experts ({', '.join(r['experts'])}), averaged over "
                     f"every task's test set: {100 * r['test']:.1f} %; task arithmetic tuned on the same experts: "
                     f"{100 * r['ta_same']:.1f} %.")
    lines.append("prepare s: preparation (static) or the whole run (data-driven) in a fresh session; 1st move: the first "
                 "Δ at the tuned setting (what it derives, then apply); λ move: the median of three λ moves after it. B/32 paper: "
                 "the number the registry shows as a guide line for ViT-B/32 × 8 (its source per method: `python -m "
                 "merger methods`), not comparable with this pool's numbers, only their order.")
    return "\n".join(lines)
