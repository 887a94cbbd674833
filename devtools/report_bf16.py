"""``report bf16``: task vectors stored in bf16 (as pools above 1 GB are) against fp32, per static
method at its defaults: the merged weights' error and the accuracy it costs.

bf16 keeps 8 significant bits: each stored τt entry is within 2⁻⁸ of its value relatively (round
to nearest), so a weighted sum accumulated in fp32 is within 2⁻⁸ · Σ |wₜ τₜ| entrywise. Methods that
threshold (TIES, DARE-TIES: a trim at the k-th magnitude, a sign election) or respread the
spectrum (Iso-C) can move further: entries that tie in bf16 are kept or dropped together."""
from __future__ import annotations

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
