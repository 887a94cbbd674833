"""`python -m devtools bench cluster`: the same jobs here and on a local Ray instance of N workers,
on one pool: a 3-method × 31-point λ sweep and a 21 × 21 landscape. Wall time of each (Ray's
start and the workers' pool opening counted separately), and whether the results are identical."""
from __future__ import annotations

import time

import torch

from merger import methods
from merger.evaluation.session import PoolSession
from merger.evaluation.tuning import sweep
from merger.methods.registry import LAM
from merger.pool.pool import open_pool

# the featured methods that take λ (task arithmetic, TIES, CART): three curves of 31 points
SWEEP_METHODS = tuple(m.name for m in methods.all_methods() if m.featured and "lam" in m.param_names)[:3]


def _landscape(session, grid: int, cluster=None):
    land = session.landscape
    from merger.landscape.surface import extent_of, pca_plane

    points = land.named_points(["base", "experts"])
    plane = pca_plane(points)
    extent = extent_of([plane.coords(v)[:2] for v in points.values()])
    return land.surface(plane, extent, grid, "probe", cluster=cluster)


def bench_cluster(args) -> int:
    from merger.cluster import Cluster

    workers = args.clients or 2
    grid = args.grid
    pool = open_pool(args.pool)
    values = list(LAM.sweep)
    rows, same = [], []

    t0 = time.perf_counter()
    here = sweep(PoolSession(pool), SWEEP_METHODS, "lam", values)
    label = f"sweep {len(SWEEP_METHODS)} × {len(values)}"
    rows.append((label, "here", time.perf_counter() - t0))
    t0 = time.perf_counter()
    surface_here = _landscape(PoolSession(pool), grid)
    rows.append((f"landscape {grid}×{grid}", "here", time.perf_counter() - t0))

    t0 = time.perf_counter()
    cluster = Cluster("local", pool.source, workers=workers)
    cluster.worker_pids()  # every worker has opened the pool
    start = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        there = sweep(PoolSession(pool), SWEEP_METHODS, "lam", values, cluster=cluster)
        rows.append((label, f"Ray × {workers}", time.perf_counter() - t0))
        t0 = time.perf_counter()
        surface_there = _landscape(PoolSession(pool), grid, cluster)
        rows.append((f"landscape {grid}×{grid}", f"Ray × {workers}", time.perf_counter() - t0))
    finally:
        cluster.close()
        import ray

        ray.shutdown()
    same.append(("sweep", all(here[m]["average"] == there[m]["average"] for m in SWEEP_METHODS)))
    diff = max(float((torch.tensor(surface_here.loss[t]) - torch.tensor(surface_there.loss[t])).abs().max())
               for t in pool.tasks)
    same.append(("landscape", diff <= 1e-5))

    print(f"pool {pool.name}: {len(pool.tasks)} tasks; {workers} Ray workers on a local instance "
          f"({torch.get_num_threads()} torch threads here)")
    print(f"Ray start + workers opening the pool: {start:.1f} s (once per job)")
    print(f"{'job':<18}{'where':<12}{'wall s':>8}{'per point ms':>14}")
    counts = {label: len(SWEEP_METHODS) * len(values), f"landscape {grid}×{grid}": grid * grid}
    for job, where, s in rows:
        print(f"{job:<18}{where:<12}{s:8.2f}{1e3 * s / counts[job]:14.1f}")
    for job, ok in same:
        print(f"{job}: results {'identical' if ok else 'DIFFER'} to the local run"
              + (f" (landscape max |Δloss| {diff:.1e})" if job == "landscape" else ""))
    return 0 if all(ok for _, ok in same) else 1
