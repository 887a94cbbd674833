"""Benchmarks: ``python -m merger bench merge``. Medians and ratios printed in one run."""
from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

import torch

from . import methods
from .task_vectors import TaskVectors

def merge_settings(method: str, n: int = 5) -> list[dict]:
    """``n`` settings spread over a method's tune grid (what a user drags through)."""
    from .tuning import grid_points

    points = grid_points(method)
    return [points[(i * len(points)) // n] for i in range(n)]


GOAL_APPLY_S = 1.5  # one parameter change of a featured method on ViT-B-32 (CPU)


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
        from . import bench_live

        return getattr(bench_live, f"bench_{what}")(args)
    if what == "api":
        return bench_api(args)
    if what == "landscape":
        return bench_landscape(args)
    if what == "scale":
        return bench_scale(args)
    if what == "load":
        return bench_load(args)
    if what == "attacks":
        from .attacks import format_outcomes, run_catalogue

        outcomes, peak = run_catalogue()
        print(format_outcomes(outcomes, peak))
        return 0 if all(o.verdict in ("refused", "accepted") for o in outcomes) else 1
    raise SystemExit(f"unknown benchmark {what}")


# ---- the demo pool (live, browser, workshop: bench_live.py) -----------------------------------

LIVE_METHODS = tuple(m.name for m in methods.all_methods() if m.featured)


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def naive_evaluation(pool_path, method: str, params: dict, split: str = "live"):
    """What a tool without our caches does per slider move: open the pool, deepcopy a model,
    merge from scratch, re-read and preprocess the inputs, build the heads, forward."""
    import copy

    import torch.nn.functional as F

    from . import data as data_mod
    from .evaluation import tokenizer_for
    from .heads import zero_shot_head
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
            head = zero_shot_head(model, tok, store.classes(t), store.templates(t))
            feats = F.normalize(model.encode_image(x).float(), dim=-1)
            logits = model.logit_scale.exp() * feats @ head.T
            acc[t] = float((logits.argmax(-1) == d.labels).float().mean())
    return acc


# ---- api: the evaluate endpoint through gradio_client ------------------------------------

def bench_api(args) -> int:
    """p50/p95 of /evaluate from a client outside the server: 30 misses, then the same 30 as hits."""
    import tempfile

    from gradio_client import Client

    from .ui.browser import free_port, start_server

    proc = None
    url = args.url
    tmp = tempfile.TemporaryDirectory()
    if not url:
        port = free_port()
        t0 = time.perf_counter()
        proc = start_server(args.pool, port, str(Path(tmp.name) / "history.sqlite"))
        url = f"http://127.0.0.1:{port}/"
        print(f"started the app on {url} in {time.perf_counter() - t0:.1f} s")
    try:
        client = Client(url, verbose=False)
        client.predict(method=LIVE_METHODS[0], split="live", api_name="/evaluate")  # warm-up
        rows = []
        for m in LIVE_METHODS:
            lams = [round(0.05 * i, 2) for i in range(1, args.moves + 1)]
            for phase in ("miss", "hit"):
                times = []
                for lam in lams:
                    t = time.perf_counter()
                    client.predict(m, lam, None, None, None, None, "live", api_name="/evaluate")
                    times.append(time.perf_counter() - t)
                rows.append((m, phase, statistics.median(times), percentile(times, 0.95)))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
        tmp.cleanup()
    print(f"\n{'method':<18}{'cache':>6}{'p50 ms':>9}{'p95 ms':>9}")
    for m, phase, p50, p95 in rows:
        print(f"{m:<18}{phase:>6}{1e3 * p50:9.1f}{1e3 * p95:9.1f}")
    misses = [p50 for _, phase, p50, _ in rows if phase == "miss"]
    ok = max(misses) <= 0.250
    print(f"\n{args.moves} distinct λ per method through gradio_client (HTTP round trip, queue, merge, "
          "evaluate all tasks), then the same values again (result cache hits).")
    print("goal: p50 <= 250 ms for misses: " + ("met" if ok else "MISSED"))
    return 0 if ok else 1


# ---- landscape: progressive surface vs a naive per-point clone loop ------------------------

def bench_landscape(args) -> int:
    import copy

    import torch.nn.functional as F

    from .session import PoolSession
    from .landscape import coarse_size, extent_of, pca_plane
    from .pool import open_pool

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


# ---- scale: ViT-B/32-size pool, CPU or CUDA ------------------------------------------------

def bench_scale(args) -> int:
    from .session import PoolSession
    from .pool import pool_from_state_dicts

    device = args.device
    cuda = device.startswith("cuda")
    moves = args.moves if args.moves_given else (30 if cuda else 3)
    names = args.methods.split(",") if args.methods else list(LIVE_METHODS)
    t0 = time.perf_counter()
    base, experts = random_pool(args.arch, args.experts)
    g = torch.Generator().manual_seed(0)
    from ._compat import open_clip

    size = (open_clip().get_model_config(args.arch) or {}).get("vision_cfg", {}).get("image_size", 224)
    tasks = {}
    for i, t in enumerate(experts):
        n_cls = 10
        imgs = torch.randint(0, 256, (args.images, 3, size, size), generator=g, dtype=torch.uint8)
        labels = torch.arange(args.images) % n_cls
        tasks[t] = {"classes": [f"{t} class {c}" for c in range(n_cls)], "templates": ["a photo of a {}."],
                    "data": {"memory": {"train": (imgs, labels), "test": (imgs, labels)}}}
    pool = pool_from_state_dicts("scale", args.arch, base, experts, tasks, device=device)
    del experts
    gc.collect()
    ex = PoolSession(pool)
    ex.evaluator.inputs("live")
    ex.expert_accuracy("live")
    setup = time.perf_counter() - t0
    rss, _ = rss_gb()
    print(f"{args.arch} (pretrained=None), {args.experts} random experts, {args.experts} tasks × "
          f"{min(args.images, 128)} synthetic images, device {device}; set-up {setup:.0f} s")
    print(f"\n{'method':<18}{'prepare s':>10}{'apply median s':>16}{'slider→result p50 s':>21}{'p95 s':>8}")
    ok_apply = True
    for m in names:
        spec0 = ex.spec(m)
        t1 = time.perf_counter()
        ex.delta(spec0)  # prepare (cached per method and expert subset) + one apply
        prep = time.perf_counter() - t1
        applies, lat = [], []
        for i in range(moves):
            spec = ex.spec(m, lam=round(0.05 * (i + 2), 2))
            if cuda:
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            ex.delta(spec)
            if cuda:
                torch.cuda.synchronize()
            applies.append(time.perf_counter() - t2)
            t3 = time.perf_counter()
            ex.preview(spec)
            lat.append(time.perf_counter() - t3)
        med = statistics.median(applies)
        ok_apply &= med <= (0.030 if cuda else 1.5)
        print(f"{m:<18}{prep:10.2f}{med:16.3f}{statistics.median(lat):21.3f}{percentile(lat, 0.95):8.3f}", flush=True)
    rss, peak = rss_gb()
    line = f"\nresident memory: {rss:.2f} GB (peak {peak:.2f} GB)"
    if cuda:
        line += f"; GPU allocated {torch.cuda.memory_allocated() / 2**30:.2f} GB (peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GB)"
    print(line)
    print(f"apply = one parameter change ({moves} λ values); slider→result = apply + in-place load + forward of "
          f"every task's live images (cache misses).")
    print(f"goals: apply <= {'30 ms' if cuda else '1.5 s'}" + (", slider→result p50 <= 150 ms, resident <= 4 GB" if cuda else "")
          + ": apply " + ("met" if ok_apply else "MISSED"))
    ok_partial = progressive_moves(ex)
    return 0 if ok_apply and ok_partial else 1


def progressive_moves(session, lams=(0.35, 0.45)) -> bool:
    """Moves through the Merge tab's listener on a pool whose live forward is slow: time to the
    first (partial) answer and to the complete one."""
    from types import SimpleNamespace

    from .bench_live import _controls
    from .ui.merge_tab import Controller
    from .ui.merge_events import MergeTabEvents

    forward_s = session.measure_live()
    events = MergeTabEvents(Controller(session), LIVE_METHODS[0])
    person = SimpleNamespace(session_hash="bench")
    print(f"\nprogressive answers: one full live forward {forward_s:.1f} s; partial answers on "
          f"{session.partial_images or 'no'} images per task")
    print(f"{'move (task arithmetic)':<24}{'first answer s':>15}{'kind':>10}{'complete s':>12}")
    ok = True
    for lam in lams:
        t = time.perf_counter()
        frames = events.move(person, None, *_controls(session.pool, LIVE_METHODS[0], lam))
        first = next(frames)
        t_first = time.perf_counter() - t
        list(frames)
        t_all = time.perf_counter() - t
        kind = "partial" if "partial" in first[3] else "complete"
        ok &= t_first <= 5.0
        print(f"{'λ = ' + str(lam):<24}{t_first:15.2f}{kind:>10}{t_all:12.1f}", flush=True)
    print("goal: the first answer within 5 s of a move: " + ("met" if ok else "MISSED"))
    return ok


# ---- load: many concurrent clients on one server -----------------------------------------

def bench_load(args) -> int:
    """N gradio_client clients, M slider moves each, against one local server (loopback only)."""
    import random
    import tempfile
    import threading

    from gradio_client import Client

    from . import evaluate, merge
    from .pool import open_pool
    from .tuning import grid_points
    from .ui.browser import free_port, start_server

    clients, moves = args.clients or 20, (args.moves if args.moves_given else 50)
    tmp = tempfile.TemporaryDirectory()
    proc, url = None, args.url
    if not url:
        port = free_port()
        proc = start_server(args.pool, port, str(Path(tmp.name) / "history.sqlite"))
        url = f"http://127.0.0.1:{port}/"
    if not url.startswith(("http://127.0.0.1", "http://localhost")):
        raise SystemExit("bench load targets loopback servers only")
    lams = [round(0.05 * i, 2) for i in range(1, 31)]
    results: dict[int, dict] = {}
    lock = threading.Lock()

    def client(cid: int):
        rng = random.Random(cid)
        c = Client(url, verbose=False)
        lat, errors, last = [], [], None
        for _ in range(moves):
            m = rng.choice(LIVE_METHODS)
            params = {**rng.choice(grid_points(m)), "lam": rng.choice(lams)}
            t = time.perf_counter()
            try:
                out = c.predict(method=m, split="live", **params, api_name="/evaluate")
                last = (m, params, out)
            except Exception as exc:  # counted, reported
                errors.append(str(exc)[:200])
            lat.append(time.perf_counter() - t)
        with lock:
            results[cid] = {"lat": lat, "errors": errors, "last": last}

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        wall = time.perf_counter() - t0
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
        tmp.cleanup()
    lat = [x for r in results.values() for x in r["lat"]]
    errors = [e for r in results.values() for e in r["errors"]]
    pool = open_pool(args.pool)
    same = 0
    for r in results.values():
        if r["last"] is None:
            continue
        m, params, out = r["last"]
        ref = evaluate(pool, merge(pool, m, **params), split="live")
        same += int(out["accuracy"] == ref.accuracy and _close(out["loss"], ref.loss))
    print(f"{clients} clients × {moves} slider moves on {url} ({len(lat)} requests in {wall:.1f} s, "
          f"{len(lat) / wall:.1f} req/s)")
    print(f"\n{'errors':<34}{len(errors):>8}   (goal 0)")
    print(f"{'latency p50 s':<34}{statistics.median(lat):8.3f}")
    print(f"{'latency p95 s':<34}{percentile(lat, 0.95):8.3f}   (goal <= 2 s)")
    print(f"{'latency max s':<34}{max(lat):8.3f}")
    print(f"{'last result == merger.evaluate':<34}{same:>5}/{len(results)}")
    for e in errors[:5]:
        print("  error:", e)
    ok = not errors and percentile(lat, 0.95) <= 2.0 and same == len(results)
    print("goals: " + ("met" if ok else "MISSED"))
    return 0 if ok else 1


def _close(a: dict, b: dict, rel: float = 1e-9) -> bool:
    """Equal dicts of floats up to rounding through JSON."""
    return set(a) == set(b) and all(abs(a[k] - b[k]) <= rel * max(1.0, abs(b[k])) for k in b)
