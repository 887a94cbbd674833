"""Benchmarks: ``python -m merger bench merge``. Medians and ratios printed in one run."""
from __future__ import annotations

import gc
import statistics
import time

import torch

from merger import methods
from merger.pool.task_vectors import TaskVectors
from merger.tools.measure import merge_settings, random_pool, reset_peak_rss, rss_gb

GOAL_APPLY_S = 1.5  # one parameter change of a featured method on ViT-B-32 (CPU)


def bench_merge(args) -> int:
    names = args.methods.split(",") if args.methods else [m.name for m in methods.all_methods() if not m.data_driven]
    print(f"building {args.arch} (pretrained=None) and {args.experts} random experts (relative size 1e-3)...", flush=True)
    base, experts = random_pool(args.arch, args.experts)
    tv = TaskVectors(base, experts)
    del experts
    gc.collect()
    print(f"merged tensors: {len(tv.keys)} ({tv.numel() / 1e6:.1f} M parameters), task vectors {tv.nbytes() / 2**30:.2f} GB; "
          f"torch threads {torch.get_num_threads()}")
    print(f"\n{'method':<18}{'prepare s':>10}{'apply median s':>16}{'apply min..max s':>19}{'peak RSS GB':>13}{'goal':>12}")
    failed = []
    for name in names:
        m = methods.get(name)
        settings = merge_settings(name)[: args.repeats]
        gc.collect()
        reset_peak_rss()
        prep_args = {k: settings[0].get(k, 0) for k in m.prepare_params}
        t0 = time.perf_counter()
        prepared = m.prepare(tv, **prep_args)
        prepare_s = time.perf_counter() - t0
        times = []
        for params in settings:
            resolved = m.resolve(params, tv.num_tasks)
            t0 = time.perf_counter()
            delta = m.delta(prepared, **resolved)
            times.append(time.perf_counter() - t0)
            del delta
        _, peak = rss_gb()
        med = statistics.median(times)
        goal = GOAL_APPLY_S if methods.get(name).featured else None
        verdict = "" if goal is None else (f"<= {goal} ok" if med <= goal else f"<= {goal} MISS")
        if goal is not None and med > goal:
            failed.append(name)
        print(f"{name:<18}{prepare_s:>10.2f}{med:>16.3f}{min(times):>10.3f}..{max(times):<7.3f}{peak:>13.2f}{verdict:>12}", flush=True)
        del prepared
    print("\napply = θ0-relative Δ for one parameter setting (λ and the rank/sparsity change across the five);")
    print("prepare = the work no slider changes (sums, SVDs, thresholds, masks), done once per method and expert subset.")
    return 1 if failed else 0


def run(what: str, args) -> int:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if what == "merge":
        return bench_merge(args)
    if what in ("live", "browser", "workshop"):
        from merger.tools import bench_live

        return getattr(bench_live, f"bench_{what}")(args)
    if what in ("api", "load"):
        from merger.tools import bench_http

        return getattr(bench_http, f"bench_{what}")(args)
    if what == "landscape":
        return bench_landscape(args)
    if what == "scale":
        from merger.tools.bench_scale import bench_scale

        return bench_scale(args)
    if what == "attacks":
        from merger.tools.attacks import format_outcomes, run_catalogue

        outcomes, peak = run_catalogue()
        print(format_outcomes(outcomes, peak))
        return 0 if all(o.verdict in ("refused", "accepted") for o in outcomes) else 1
    raise SystemExit(f"unknown benchmark {what}")


# ---- landscape: progressive surface vs a naive per-point clone loop ------------------------

def bench_landscape(args) -> int:
    import copy

    import torch.nn.functional as F

    from merger.evaluation.session import PoolSession
    from merger.landscape.surface import coarse_size, extent_of, pca_plane
    from merger.pool.pool import open_pool

    pool = open_pool(args.pool)
    ex = PoolSession(pool)
    land = ex.landscape
    split = "probe"  # the landscape's default split
    ex.evaluator.inputs(split)
    points = land.named_points(["base", "experts", "ta:lam=0.3"])
    plane = pca_plane(points)
    extent = extent_of([plane.coords(v)[:2] for v in points.values()])
    n = args.grid
    t0 = time.perf_counter()
    frames = land.progressive(plane, extent, n)
    coarse = next(frames)
    t_coarse = time.perf_counter() - t0
    full = next(frames, coarse)
    t_full = time.perf_counter() - t0

    # Naive: per grid point, clone the model, load a state dict, forward every task's inputs.
    model = ex.evaluator.model
    tasks = [(t, x, y) for x, members in ex.evaluator.inputs(split) for t, y in members]
    heads, scale = ex.evaluator.heads, ex.evaluator.logit_scale
    sample = [(x, y) for y in full.ys[:: max(1, n // 7)][:7] for x in full.xs[:: max(1, n // 7)][:7]]
    t1 = time.perf_counter()
    for x, y in sample:
        clone = copy.deepcopy(model)
        sd = clone.state_dict()
        sd.update(land.space.unflatten(plane.point(x, y).clone()))
        clone.load_state_dict(sd)
        with torch.inference_mode():
            for t, inputs, labels in tasks:
                logits = scale * F.normalize(clone.encode_image(inputs).float(), dim=-1) @ heads[t].T
                float(F.cross_entropy(logits, labels))
    per_naive = (time.perf_counter() - t1) / len(sample)
    naive_full = per_naive * n * n
    c = coarse_size(n) if n > 7 else n
    print(f"demo pool, {len(pool.tasks)} tasks, {split} split ({sum(x.shape[0] for x, _ in ex.evaluator.inputs(split))} "
          f"distinct images), PCA plane of base + experts + TA(λ=0.3)")
    print(f"\n{'step':<34}{'seconds':>10}{'goal':>10}")
    print(f"{'coarse view (' + str(c) + '×' + str(c) + ')':<34}{t_coarse:10.2f}{'<= 3':>10}")
    print(f"{'full grid (' + str(n) + '×' + str(n) + ', coarse reused)':<34}{t_full:10.2f}{'<= 20':>10}")
    print(f"{'naive loop, per grid point':<34}{per_naive:10.3f}")
    print(f"{'naive loop, ' + str(n) + '×' + str(n) + ' (projected)':<34}{naive_full:10.1f}")
    ratio = naive_full / t_full
    print(f"{'ratio naive / ours':<34}{ratio:9.1f}x{'>= 5x':>10}")
    print(f"\nnaive = deepcopy the model, load a state dict and forward each task's inputs separately, per "
          f"grid point; timed on {len(sample)} grid points and projected to {n * n}.")
    if len(ex.evaluator.inputs(split)) == len(tasks):
        print("every task has its own images (the demo's tasks each come from their own domain), so one grid "
              "point costs one forward per task either way: what is saved is the clone and the state-dict copy.")
    ok = t_coarse <= 3 and t_full <= 20 and ratio >= 5
    print("goals: " + ("met" if ok else "MISSED"))
    return 0 if ok else 1


