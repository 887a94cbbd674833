"""Benchmarks: ``python -m merger bench merge``. Medians and ratios printed in one run."""
from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

import torch

from . import methods
from .task_vectors import TaskVectors

# Five settings per method, spread over the range a user drags (all on slider steps).
MERGE_SETTINGS = {
    "weight_averaging": [{}] * 5,
    "task_arithmetic": [{"lam": v} for v in (0.1, 0.2, 0.3, 0.4, 0.5)],
    "ties": [{"lam": l, "sparsity": s} for l, s in ((1.0, 0.8), (0.9, 0.7), (1.1, 0.9), (0.8, 0.6), (1.2, 0.85))],
    "dare_linear": [{"lam": l, "sparsity": s, "seed": 0} for l, s in ((0.3, 0.9), (0.4, 0.8), (0.2, 0.7), (0.3, 0.85), (0.5, 0.95))],
    "dare_ties": [{"lam": l, "sparsity": s, "seed": 0} for l, s in ((1.0, 0.9), (0.9, 0.8), (1.1, 0.7), (1.0, 0.85), (1.2, 0.95))],
    "cart": [{"lam": l, "rank_ratio": r} for l, r in ((1.5, 0.04), (1.2, 0.06), (1.5, 0.08), (1.8, 0.12), (1.0, 0.16))],
    "tsv_m": [{"lam": l, "rank_ratio": r} for l, r in ((1.0, 0.125), (0.9, 0.06), (1.1, 0.08), (1.0, 0.1), (1.2, 0.16))],
    "iso_c": [{"lam": v} for v in (1.0, 1.2, 1.3, 1.4, 1.5)],
}
GOALS = {"task_arithmetic": 1.5, "ties": 1.5, "cart": 1.5}


def rss_gb() -> tuple[float, float]:
    """(current, peak since the last reset) resident set size in GB, from /proc."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS", "VmHWM")):
            name, value = line.split(":")
            fields[name] = int(value.split()[0]) / 2**20
    return fields.get("VmRSS", float("nan")), fields.get("VmHWM", float("nan"))


def reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def random_pool(arch: str, n_experts: int, relative: float = 1e-3, seed: int = 0):
    """An open_clip model with random weights and experts = base + noise of relative size ``relative``."""
    from ._compat import open_clip

    torch.manual_seed(seed)
    model = open_clip().create_model(arch, pretrained=None)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    del model
    g = torch.Generator().manual_seed(seed + 1)
    experts = {}
    for t in range(n_experts):
        sd = {}
        for k, v in base.items():
            if k.startswith("visual.") and v.is_floating_point():
                scale = relative * float(v.float().pow(2).mean().sqrt()) + 1e-12
                sd[k] = v + scale * torch.randn(v.shape, generator=g)
        experts[f"task{t + 1}"] = sd
    return base, experts


def bench_merge(args) -> int:
    names = args.methods.split(",") if args.methods else methods.names()
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
        settings = MERGE_SETTINGS.get(name, [{}] * 5)[: args.repeats]
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
            delta = m.apply(prepared, **resolved)
            times.append(time.perf_counter() - t0)
            del delta
        _, peak = rss_gb()
        med = statistics.median(times)
        goal = GOALS.get(name)
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
    if what == "live":
        return bench_live(args)
    raise SystemExit(f"unknown benchmark {what}")


# ---- live: slider → result on the demo pool ------------------------------------------------

LIVE_METHODS = ("task_arithmetic", "ties", "cart")


def _percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def naive_evaluation(pool_path, method: str, params: dict, split: str = "live"):
    """What a tool without our caches does per slider move: open the pool, deepcopy a model,
    merge from scratch, re-read and preprocess the inputs, build the heads, forward."""
    import copy

    import torch.nn.functional as F

    from . import data as data_mod
    from .evaluation import tokenizer_for
    from .heads import STANDARD_TEMPLATES, zero_shot_head
    from .merging import merge
    from .pool import open_pool

    data_mod._GENERATED.clear()
    pool = open_pool(pool_path)
    model = copy.deepcopy(pool.build_model())
    model.load_state_dict(merge(pool, method, **params))
    store = data_mod.TaskDataStore(pool)
    tok = tokenizer_for(pool)
    acc = {}
    with torch.inference_mode():
        for t in pool.tasks:
            d = store.split(t, split)
            x = data_mod.preprocess(d.images, pool.preprocess_cfg)
            head = zero_shot_head(model, tok, store.classes(t), pool.task_info[t].get("templates") or STANDARD_TEMPLATES)
            feats = F.normalize(model.encode_image(x).float(), dim=-1)
            logits = model.logit_scale.exp() * feats @ head.T
            acc[t] = float((logits.argmax(-1) == d.labels).float().mean())
    return acc


def bench_live(args) -> int:
    from .explorer import Explorer
    from .pool import open_pool

    pool = open_pool(args.pool)
    t0 = time.perf_counter()
    ex = Explorer(pool)
    ex.base("live")
    ex.experts("live")
    for m in LIVE_METHODS:  # preparations are per method and expert subset, not per slider move
        ex.delta(ex.spec(m))
    setup = time.perf_counter() - t0
    n_images = sum(x.shape[0] for x, _ in ex.evaluator.inputs("live"))
    print(f"demo pool: {len(pool.tasks)} tasks, live split {n_images} distinct images "
          f"({sum(len(m) for _, m in ex.evaluator.inputs('live'))} task evaluations); "
          f"explorer set-up {setup:.1f} s; torch threads {torch.get_num_threads()}")
    lams = [round(0.05 * i, 2) for i in range(1, args.moves + 1)]
    rows, worst = [], 0
    for m in LIVE_METHODS:
        times = []
        for lam in lams:
            spec = ex.spec(m, lam=lam)
            assert ex.cached(spec) is None, "bench must measure cache misses"
            t = time.perf_counter()
            ex.preview(spec)
            times.append(time.perf_counter() - t)
        naive = []
        for lam in lams[: args.naive]:
            t = time.perf_counter()
            naive_evaluation(pool.source, m, {"lam": lam})
            naive.append(time.perf_counter() - t)
        p50, p95, n50 = statistics.median(times), _percentile(times, 0.95), statistics.median(naive)
        rows.append((m, p50, p95, n50, n50 / p50))
    print(f"\n{'method':<18}{'preview p50 ms':>15}{'p95 ms':>9}{'naive p50 ms':>14}{'ratio':>8}")
    ok = True
    for m, p50, p95, n50, ratio in rows:
        print(f"{m:<18}{1e3 * p50:15.1f}{1e3 * p95:9.1f}{1e3 * n50:14.0f}{ratio:7.0f}x")
        ok &= p50 <= 0.150 and p95 <= 0.400 and ratio >= 20
    print(f"\n{args.moves} distinct λ values per method, every one a cache miss (merge + in-place load + "
          f"forward of all tasks); naive = {args.naive} of the same evaluations done from scratch.")
    print("goals: p50 <= 150 ms, p95 <= 400 ms, ratio >= 20x: " + ("met" if ok else "MISSED"))
    return 0 if ok else 1
