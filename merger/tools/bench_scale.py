"""``bench scale``: a ViT-B/32-size pool of random experts on the CPU or a GPU: prepare, apply,
slider → result, resident memory, and the first (partial) answer of a move on a slow pool."""
from __future__ import annotations

import gc
import statistics
import time

import torch

from merger.tools.measure import LIVE_METHODS, percentile, random_pool, rss_gb


def bench_scale(args) -> int:
    from merger.evaluation.session import PoolSession
    from merger.pool.pool import pool_from_state_dicts

    device = args.device
    cuda = device.startswith("cuda")
    moves = args.moves if args.moves_given else (30 if cuda else 3)
    images = args.images or 128
    names = args.methods.split(",") if args.methods else list(LIVE_METHODS)
    t0 = time.perf_counter()
    base, experts = random_pool(args.arch, args.experts)
    g = torch.Generator().manual_seed(0)
    from merger._compat import open_clip

    size = (open_clip().get_model_config(args.arch) or {}).get("vision_cfg", {}).get("image_size", 224)
    tasks = {}
    for i, t in enumerate(experts):
        n_cls = 10
        imgs = torch.randint(0, 256, (images, 3, size, size), generator=g, dtype=torch.uint8)
        labels = torch.arange(images) % n_cls
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
          f"{min(images, 128)} synthetic images, device {device}; set-up {setup:.0f} s")
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


def progressive_moves(session, lams=(0.35, 0.45), estimate_lams=(0.25, 0.55)) -> bool:
    """Moves through the Merge tab's listener on a pool whose live forward is slow: time to the
    first (partial) answer and to the complete one; then, once the base's and experts' forwards
    are made, moves whose first answer is the linear estimate, and its error against the exact."""
    from types import SimpleNamespace

    from merger.tools.bench_live import answer_kind, merge_tab_controls
    from merger.ui.merge_events import MergeTabEvents
    from merger.ui.merge_tab import Controller

    forward_s = session.measure_live()
    events = MergeTabEvents(Controller(session), LIVE_METHODS[0])
    person = SimpleNamespace(session_hash="bench")
    print(f"\nprogressive answers: one full live forward {forward_s:.1f} s; partial answers on "
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
