"""``bench scale``: a ViT-B/32-size pool of random experts on the CPU or a GPU: prepare, apply,
slider → result, resident memory, and the first (partial) answer of a move on a slow pool."""
from __future__ import annotations

import gc
import statistics
import time

import torch

from merger import methods
from devtools.measure import LIVE_METHODS, percentile, random_pool, rss_gb


def bench_scale(args) -> int:
    from merger.evaluation.memory import limit_arenas, release_freed_memory
    from merger.pool.devices import resolve_device

    limit_arenas()  # as the app does at start

    device = args.device
    resolve_device(device)  # before minutes of building a pool for a device that is not there
    cuda = device.startswith("cuda")
    moves = args.moves if args.moves_given else (30 if cuda else 3)
    images = args.images or 128
    names = args.methods.split(",") if args.methods else list(LIVE_METHODS)
    t0 = time.perf_counter()
    ex = scale_session(args.arch, args.experts, images, device)
    setup = time.perf_counter() - t0
    gc.collect()
    release_freed_memory()  # the random experts it built the pool from are gone
    rss, _ = rss_gb()
    print(f"{args.arch} (pretrained=None), {args.experts} random experts, {args.experts} tasks × "
          f"{min(images, 128)} synthetic images, device {device}; set-up {setup:.0f} s")
    print(f"resident memory after set-up (pool, live images, experts' accuracies): {rss:.2f} GB")
    print(f"\n{'method':<18}{'prepare s':>10}{'apply median s':>16}{'slider→result p50 s':>21}{'p95 s':>8}"
          f"{'resident GB':>13}")
    ok_apply = ok_move = True
    for m in names:
        method = methods.get(m)
        spec0 = ex.spec(m, experts=method.experts_for(ex.tasks))  # SLERP: two
        t1 = time.perf_counter()
        ex.delta(spec0)  # prepare (cached per method and expert subset) + one apply
        if cuda:
            torch.cuda.synchronize()
        prep = time.perf_counter() - t1
        applies, lat = [], []
        # Fisher's only sliders (samples, seed) re-run it: two moves show what one costs
        reruns = method.data_driven and method.params[0].name in ("samples", "seed")
        for spec in move_specs(ex, m, min(moves, 2) if reruns else moves):
            if cuda:
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            ex.delta(spec)
            if cuda:
                torch.cuda.synchronize()
            applies.append(time.perf_counter() - t2)
            ex.preview(spec)  # the Δ just made (cached): what the app does after the apply
            lat.append(time.perf_counter() - t2)
        med = statistics.median(applies)
        if not method.data_driven:  # the goals are the static methods'; a run's move re-solves
            ok_apply &= med <= (0.030 if cuda else 1.5)
            ok_move &= statistics.median(lat) <= 0.150
        release_freed_memory()  # as the app's MemoryKeeper does every 10 s
        print(f"{m:<18}{prep:10.2f}{med:16.3f}{statistics.median(lat):21.3f}{percentile(lat, 0.95):8.3f}"
              f"{rss_gb()[0]:13.2f}", flush=True)
    rss, peak = rss_gb()
    line = f"\nresident memory: {rss:.2f} GB (peak {peak:.2f} GB)"
    if cuda:
        line += f"; GPU allocated {torch.cuda.memory_allocated() / 2**30:.2f} GB (peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GB)"
    print(line)
    print(f"apply = one parameter change ({moves} λ values); slider→result = apply + in-place load + forward of "
          f"every task's live images (cache misses).")
    print(f"goals (static methods): apply <= {'30 ms' if cuda else '1.5 s'}: " + ("met" if ok_apply else "MISSED")
          + ("; slider→result p50 <= 150 ms: " + ("met" if ok_move else "MISSED") if cuda else ""))
    if cuda:
        forward_precision(ex)
    from merger.evaluation.session import PoolSession

    ok_partial = progressive_moves(PoolSession(ex.pool))  # a fresh one: the table cached λ 0.1 to 1.55
    return 0 if ok_apply and ok_partial and (ok_move or not cuda) else 1


def scale_session(arch: str, n_experts: int, images: int, device: str):
    """A session over a random ``arch`` pool of ``n_experts`` experts, each task with ``images``
    synthetic images (10 classes), its live inputs read and the experts' accuracies computed."""
    from merger._compat import open_clip
    from merger.evaluation.session import PoolSession
    from merger.pool.pool import pool_from_state_dicts

    base, experts = random_pool(arch, n_experts)
    g = torch.Generator().manual_seed(0)
    size = (open_clip().get_model_config(arch) or {}).get("vision_cfg", {}).get("image_size", 224)
    tasks = {}
    for t in experts:
        n_cls = 10
        imgs = torch.randint(0, 256, (images, 3, size, size), generator=g, dtype=torch.uint8)
        labels = torch.arange(images) % n_cls
        tasks[t] = {"classes": [f"{t} class {c}" for c in range(n_cls)], "templates": ["a photo of a {}."],
                    "data": {"memory": {"train": (imgs, labels), "test": (imgs, labels)}}}
    pool = pool_from_state_dicts("scale", arch, base, experts, tasks, device=device)
    del experts
    gc.collect()
    session = PoolSession(pool)
    session.evaluator.inputs("live")
    session.expert_accuracy("live")
    return session


def move_specs(session, name: str, n: int) -> list:
    """n slider moves of a method: its first slider across its range (λ, SLERP's t, ...), or for a
    method without sliders (weight averaging, Model Stock) the first expert's task weight."""
    m = methods.get(name)
    experts = m.experts_for(session.tasks)
    if not m.params:
        return [session.spec(name, experts=experts, task_weights={experts[0]: round(0.5 + i / n, 2)})
                for i in range(n)]
    p = m.params[0]
    if p.name == "lam":  # the range people use (0.1 to 1.55), as earlier tables
        return [session.spec(name, experts=experts, lam=round(0.05 * (i + 2), 2)) for i in range(n)]
    lo, hi = p.min + (p.step if p.min_open else 0), p.max - (p.step if p.max_open else 0)
    values = [lo + (hi - lo) * (i + 1) / (n + 1) for i in range(n)]
    return [session.spec(name, experts=experts, **{p.name: round(round(v / p.step) * p.step, 6)}) for v in values]


def forward_precision(session, lams=(0.3, 0.4, 0.5, 0.6, 0.7)) -> None:
    """GPU: the live forward under bf16 autocast (the default) against fp32 forwards: exact
    evaluations of the same Δs (no result cache), time per move and accuracy difference."""
    ev = session.evaluator
    deltas = [session.delta(session.spec(LIVE_METHODS[0], lam=lam)) for lam in lams]
    times, accs = {}, {}
    before = ev.autocast
    try:
        for autocast in (True, False):
            ev.autocast = autocast
            with session.queue:
                ev.evaluate(delta=deltas[0], split="live")  # warm-up: kernels chosen for this precision
                times[autocast], accs[autocast] = [], []
                for d in deltas:
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    r = ev.evaluate(delta=d, split="live")
                    torch.cuda.synchronize()
                    times[autocast].append(time.perf_counter() - t)
                    accs[autocast].append(r.accuracy)
    finally:
        ev.autocast = before  # the session's later moves in its own precision
    diffs = [100 * abs(a[t] - b[t]) for a, b in zip(accs[True], accs[False]) for t in a]
    tf32 = torch.backends.cuda.matmul.allow_tf32
    print(f"\nforward precision ({LIVE_METHODS[0]}, {len(lams)} λ values, load + forward of the live images):")
    print(f"  bf16 autocast p50 {statistics.median(times[True]) * 1e3:.1f} ms, fp32 (TF32 {'on' if tf32 else 'off'}) "
          f"p50 {statistics.median(times[False]) * 1e3:.1f} ms; accuracy bf16 − fp32: mean "
          f"{statistics.mean(diffs):.2f}, max {max(diffs):.2f} points per task", flush=True)


def progressive_moves(session, lams=(0.35, 0.45), estimate_lams=(0.25, 0.55)) -> bool:
    """Moves through the Merge tab's listener on a pool whose live forward is slow: time to the
    first (partial) answer and to the complete one; then, once the base's and experts' forwards
    are made, moves whose first answer is the linear estimate, and its error against the exact."""
    from types import SimpleNamespace

    from devtools.bench_live import answer_kind, merge_tab_controls
    from merger.ui.merge_events import MergeTabEvents
    from merger.ui.merge_tab import Controller

    forward_s = session.measure_live()
    events = MergeTabEvents(Controller(session), LIVE_METHODS[0])
    person = SimpleNamespace(session_hash="bench")
    print(f"\nprogressive answers: one full live forward {forward_s * 1e3:.0f} ms; partial answers on "
          f"{session.partial_images or 'no'} images per task")
    print(f"{'move (task arithmetic)':<24}{'first answer s':>15}{'kind':>10}{'complete s':>12}")
    ok = True

    def move(lam) -> None:
        nonlocal ok
        t = time.perf_counter()
        frames = events.move(person, None, *merge_tab_controls(session.pool, LIVE_METHODS[0], lam))
        first = next(frames)
        t_first = time.perf_counter() - t
        list(frames)
        t_all = time.perf_counter() - t
        kind = answer_kind(first[3])
        ok &= t_first <= 5.0
        err = ""
        if kind == "estimate":
            spec = session.spec(LIVE_METHODS[0], lam=lam)
            e = session.linear.error(session.linear.shown(spec), session.cached(spec))
            err = f"  estimate − exact {e['average']:+.1f} points (per task at most {e['max_abs']:.1f})"
        print(f"{'λ = ' + str(lam):<24}{t_first:15.2f}{kind:>10}{t_all:12.1f}{err}", flush=True)

    for lam in lams:
        move(lam)
    t_prep = time.perf_counter()
    session.linear.prepare()  # what the app does in the background after opening a slow pool
    t_prep = time.perf_counter() - t_prep
    for lam in estimate_lams:
        move(lam)
    print(f"(the linear estimate's forwards, base and {len(session.tasks)} experts: {t_prep:.1f} s, once per pool; "
          "on disk for pools read from files)")
    print("goal: the first answer within 5 s of a move: " + ("met" if ok else "MISSED"))
    return ok
