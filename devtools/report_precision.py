"""``python -m devtools report precision``: every static method against its fp64 definition
(devtools/definitions.py) on a whole random pool (ViT-B/32 × 8 by default): per method and
setting, the largest relative Frobenius error over the matrices and over the other tensors, as the
app merges (drop-ins included; ``--reference``: the references alone)."""
from __future__ import annotations

import gc
import time

from merger.accel import reference_only
from merger.pool.task_vectors import is_matrix
from devtools.definitions import DEFINITIONS, relative_errors

CONTRACT = 1e-4


def precision_rows(tv, names=None, all_settings: bool = False, progress=print):
    """(method, setting, worst matrix (key, error), worst other tensor error, seconds) per method and setting."""
    rows = []
    for d in DEFINITIONS:
        m = d.method
        if names and m.name not in names:
            continue
        pool = tv.subset(tv.tasks[:m.num_experts]) if m.num_experts else tv
        settings = d.settings(pool.num_tasks)
        prepared, memo = {}, {}
        for params in settings if all_settings else settings[:1]:
            t0 = time.perf_counter()
            resolved = m.resolve(params, pool.num_tasks)
            key = tuple(resolved[k] for k in m.prepare_params)
            if key not in prepared:
                prepared[key] = m.prepare(pool, **{k: resolved[k] for k in m.prepare_params})
            errors = relative_errors(d, pool, params, prepared[key], memo)
            matrices = {k: e for k, e in errors.items() if is_matrix(k, pool.base[k].shape)}
            others = [e for k, e in errors.items() if k not in matrices]
            worst = max(matrices.items(), key=lambda kv: kv[1]) if matrices else ("-", 0.0)
            rows.append((m.name, params, worst, max(others, default=0.0), time.perf_counter() - t0))
            progress(format_row(rows[-1]))
        del prepared, memo
        gc.collect()
    return rows


def format_row(row) -> str:
    name, params, (key, error), other, seconds = row
    setting = ", ".join(f"{k}={v}" for k, v in params.items() if k != "lam") or "-"
    where = ".".join(key.split(".")[-3:]) if key != "-" else "-"
    mark = "ok" if max(error, other) <= CONTRACT else "OVER"
    return f"{name:<17}{setting[:34]:<35}{error:>11.1e}  {where:<30}{other:>11.1e}{seconds:>8.0f}  {mark}"


def report_precision(args) -> int:
    from devtools.measure import random_pool_in_memory

    tv = random_pool_in_memory(args.arch, args.experts, args.tv_dtype, "precision").task_vectors
    names = args.methods.split(",") if args.methods else None
    print(f"{len(tv.matrices)} matrices of {len(tv.keys)} tensors, task vectors in {str(tv.dtype)[6:]}; "
          f"{'references only' if args.reference else 'as the app merges (drop-ins included)'}")
    print(f"\n{'method':<17}{'setting':<35}{'matrices':>11}  {'worst matrix':<30}{'others':>11}{'s':>8}")
    if args.reference:
        with reference_only():
            rows = precision_rows(tv, names, args.all_settings)
    else:
        rows = precision_rows(tv, names, args.all_settings)
    worst = max((max(r[2][1], r[3]) for r in rows), default=0.0)
    print(f"\nlargest relative Frobenius error per tensor against the fp64 definition: {worst:.1e} "
          f"(contract {CONTRACT:g}: {'met' if worst <= CONTRACT else 'MISSED'}). 's' includes the fp64 evaluation.")
    return 0 if worst <= CONTRACT else 1
