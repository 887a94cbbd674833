"""``report bf16``: task vectors stored in bf16 (as pools above 1 GB are) against fp32, per static
method at its defaults: the merged weights' error and the accuracy it costs.

bf16 keeps 8 significant bits: each stored τt entry is within 2⁻⁸ of its value relatively (round
to nearest), so a weighted sum accumulated in fp32 is within 2⁻⁸ · Σ |wₜ τₜ| entrywise. Methods that
threshold (TIES, DARE-TIES: a trim at the k-th magnitude, a sign election) or respread the
spectrum (Iso-C) can move further: entries that tie in bf16 are kept or dropped together."""
from __future__ import annotations

import statistics

from merger import methods

ROUNDING = 2.0 ** -8  # bf16: 8 significant bits, round to nearest: |x − bf16(x)| ≤ 2⁻⁸ |x|


def bf16_rows(pool_path: str = "demo", split: str = "test") -> list[dict]:
    from merger.evaluation.session import PoolSession
    from merger.pool.pool import open_pool

    full, half = (PoolSession(open_pool(pool_path, tv_dtype=d)) for d in ("float32", "bfloat16"))
    rows = []
    for m in methods.all_methods():
        if m.data_driven:
            continue
        experts = m.experts_for(full.tasks)
        a, b = full.delta(full.spec(m.name, experts=experts)), half.delta(half.spec(m.name, experts=experts))
        diff = sum(float(((a[k] - b[k]) ** 2).sum()) for k in a) ** 0.5
        norm = sum(float((a[k] ** 2).sum()) for k in a) ** 0.5
        acc_a = full.evaluate_exact(full.spec(m.name, experts=experts), split).average_accuracy
        acc_b = half.evaluate_exact(half.spec(m.name, experts=experts), split).average_accuracy
        rows.append({"method": m.name, "relative": diff / norm if norm else 0.0,
                     "max_abs": max(float((a[k] - b[k]).abs().max()) for k in a),
                     "fp32": 100 * acc_a, "bf16": 100 * acc_b, "points": 100 * (acc_b - acc_a)})
    return rows


def format_bf16(rows: list[dict], split: str = "test") -> str:
    lines = [f"task vectors in bf16 against fp32 (merge arithmetic in fp32 both ways), each method at its defaults, "
             f"{split} split",
             f"{'method':<20}{'‖ΔBF−ΔFP‖/‖ΔFP‖':>16}{'max |ΔBF−ΔFP|':>15}{'acc fp32 %':>12}{'acc bf16 %':>12}{'points':>8}"]
    for r in rows:
        lines.append(f"{r['method']:<20}{r['relative']:16.2e}{r['max_abs']:15.2e}{r['fp32']:12.2f}{r['bf16']:12.2f}"
                     f"{r['points']:+8.2f}")
    lines.append(f"bound for weighted sums: |ΔBF − ΔFP| ≤ 2⁻⁸ · Σ |wₜ τₜ| entrywise ({ROUNDING:.2e} relative)")
    return "\n".join(lines)


def forward_rows(pool_path: str = "demo", split: str = "live", times: int = 7) -> list[dict]:
    """Forwards under bf16 autocast on the CPU (``--forward bf16``) against fp32 forwards, each static
    method at its defaults, task vectors and merges as stored: accuracy, predictions that change, and
    the evaluation's median time each way (the first of each left out: a warm-up)."""
    from merger.cli_jobs import set_forward
    from merger.evaluation.session import PoolSession
    from merger.pool.pool import open_pool

    fp32, bf16 = PoolSession(open_pool(pool_path)), PoolSession(open_pool(pool_path))
    set_forward(fp32.evaluator, "fp32")
    set_forward(bf16.evaluator, "bf16")
    rows = []
    for m in methods.all_methods():
        if m.data_driven:
            continue
        spec = fp32.spec(m.name, experts=m.experts_for(fp32.tasks))
        delta = fp32.delta(spec)
        runs = {fp32: [], bf16: []}
        for _ in range(times):  # in alternation, so that the machine's noise falls on both
            for s in runs:
                runs[s].append(s.evaluator.evaluate(delta=delta, split=split))
        a, b = runs[fp32][0], runs[bf16][0]
        flips = sum(int((a.per_image[t][0] != b.per_image[t][0]).sum()) for t in a.per_image)
        rows.append({"method": m.name, "fp32": 100 * a.average_accuracy, "bf16": 100 * b.average_accuracy,
                     "points": 100 * (b.average_accuracy - a.average_accuracy),
                     "task_points": max(100 * abs(b.accuracy[t] - a.accuracy[t]) for t in a.accuracy),
                     "flips": flips, "images": sum(a.counts.values()),
                     "loss": max(abs(b.loss[t] - a.loss[t]) for t in a.loss),
                     "ms_fp32": 1e3 * statistics.median(r.seconds for r in runs[fp32][1:]),
                     "ms_bf16": 1e3 * statistics.median(r.seconds for r in runs[bf16][1:])})
    return rows


def format_forwards(rows: list[dict], split: str = "live") -> str:
    lines = [f"forwards under bf16 autocast on the CPU (--forward bf16) against fp32 forwards, each method at its "
             f"defaults, {split} split ({rows[0]['images']} images); evaluation ms: load, forward, scores (median)",
             f"{'method':<20}{'acc fp32 %':>11}{'acc bf16 %':>11}{'points':>8}{'max task':>9}{'changed':>8}"
             f"{'max |Δloss|':>12}{'ms fp32':>9}{'ms bf16':>9}{'ratio':>7}"]
    for r in rows:
        lines.append(f"{r['method']:<20}{r['fp32']:11.2f}{r['bf16']:11.2f}{r['points']:+8.2f}{r['task_points']:9.2f}"
                     f"{r['flips']:8d}{r['loss']:12.1e}{r['ms_fp32']:9.0f}{r['ms_bf16']:9.0f}"
                     f"{r['ms_fp32'] / r['ms_bf16']:6.2f}x")
    a, b = (statistics.median(r[k] for r in rows) for k in ("ms_fp32", "ms_bf16"))
    lines.append(f"{'median of the methods':<20}{'':>59}{a:9.0f}{b:9.0f}{a / b:6.2f}x")
    return "\n".join(lines)
