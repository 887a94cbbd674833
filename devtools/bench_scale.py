"""``bench scale``: a ViT-B/32-size pool of random experts on the CPU or a GPU: prepare, apply,
slider → result, resident memory, and the first (partial) answer of a move on a slow pool."""
from __future__ import annotations

import contextlib
import gc
import statistics
import time

import torch

from merger import methods
from devtools.measure import LIVE_METHODS, percentile, random_pool, rss_gb

APP_ROUTE = "eager"  # the image tower's route in the app (Evaluator.tower_route's default)


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
    from merger.accel.tower import ROUTES

    routes = args.tower.split(",") if args.tower else list(ROUTES if cuda else ROUTES[:1])
    if not routes or any(r not in ROUTES for r in routes):
        raise SystemExit(f"--tower {args.tower}: routes are {', '.join(ROUTES)}")
    app_route = APP_ROUTE if APP_ROUTE in routes else routes[-1]
    t0 = time.perf_counter()
    ex = scale_session(args.arch, args.experts, images, device)
    setup = time.perf_counter() - t0
    gc.collect()
    release_freed_memory()  # the random experts it built the pool from are gone
    rss, _ = rss_gb()
    print(f"{args.arch} (pretrained=None), {args.experts} random experts, {args.experts} tasks × "
          f"{min(images, 128)} synthetic images, device {device}; set-up {setup:.0f} s")
    print(f"resident memory after set-up (pool, live images, experts' accuracies): {rss:.2f} GB")
    print(f"\n{'method':<18}{'tower':<10}{'prepare s':>10}{'apply median s':>16}{'slider→result p50 s':>21}"
          f"{'p95 s':>8}{'resident GB':>13}")
    goal_move = (0.020 if args.arch == "ViT-B-32" else 0.400) if cuda else 0.150
    ok_apply = ok_move = True
    prepared = set()
    for k, route in enumerate(routes):
        said = ex.evaluator.use_tower(route)  # the compile: once per route, before its moves
        print(f"{'':<18}{route:<10}{said or 'the reference: model.encode_image as written'}", flush=True)
        for m in names:
            ok = time_moves(ex, m, route, moves, (k, len(routes)), cuda, prepared)
            if route == app_route and ok is not None:  # the goals are the app's route's
                ok_apply &= ok[0]
                ok_move &= ok[1] <= goal_move
    rss, peak = rss_gb()
    line = f"\nresident memory: {rss:.2f} GB (peak {peak:.2f} GB)"
    if cuda:
        line += f"; GPU allocated {torch.cuda.memory_allocated() / 2**30:.2f} GB (peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GB)"
    print(line)
    print(f"apply = one parameter change ({moves} λ values per route); slider→result = apply + in-place load + forward "
          f"of every task's live images + scores (cache misses).")
    print(f"goals (static methods, tower {app_route}): apply <= {'30 ms' if cuda else '1.5 s'}: "
          + ("met" if ok_apply else "MISSED") + (f"; slider→result p50 <= {goal_move * 1e3:.0f} ms: "
                                                 + ("met" if ok_move else "MISSED") if cuda else ""))
    forward_precision(ex, **({} if cuda else {"lams": (0.3, 0.5)}))  # a CPU forward takes seconds
    ex.evaluator.use_tower(APP_ROUTE)  # the progressive moves as the app makes them
    ex.shrink()  # the table's results go: the progressive moves' λ values are computed again
    ok_partial = progressive_moves(ex, first_goal=0.150 if cuda else 5.0, complete_goal=0.400 if cuda else None)
    return 0 if ok_apply and ok_partial and (ok_move or not cuda) else 1


def time_moves(ex, m: str, route: str, moves: int, part: tuple, cuda: bool, prepared: set):
    """One method's moves on one tower route, printed as a row: (apply goal met, slider→result p50)
    for a static method, else None."""
    method = methods.get(m)
    spec0 = ex.spec(m, experts=method.experts_for(ex.tasks))  # SLERP: two
    t1 = time.perf_counter()
    ex.delta(spec0)  # prepare (cached per method and expert subset) + one apply
    if cuda:
        torch.cuda.synchronize()
    prep = f"{time.perf_counter() - t1:10.2f}" if m not in prepared else f"{'(kept)':>10}"
    prepared.add(m)
    applies, lat = [], []
    # Fisher's only sliders (samples, seed) re-run it: two moves show what one costs
    reruns = method.data_driven and method.params[0].name in ("samples", "seed")
    for spec in move_specs(ex, m, min(moves, 2) if reruns else moves, *part):
        if cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        ex.delta(spec)
        if cuda:
            torch.cuda.synchronize()
        applies.append(time.perf_counter() - t2)
        ex.preview(spec)  # the Δ just made (cached): what the app does after the apply
        lat.append(time.perf_counter() - t2)
    from merger.evaluation.memory import release_freed_memory

    release_freed_memory()  # as the app's MemoryKeeper does every 10 s
    med, p50 = statistics.median(applies), statistics.median(lat)
    print(f"{m:<18}{route:<10}{prep}{med:16.3f}{p50:21.3f}{percentile(lat, 0.95):8.3f}{rss_gb()[0]:13.2f}", flush=True)
    return None if method.data_driven else (med <= (0.030 if cuda else 1.5), p50)


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


def move_specs(session, name: str, n: int, part: int = 0, parts: int = 1) -> list:
    """n slider moves of a method: its first slider across its range (λ, SLERP's t, ...), or for a
    method without sliders (weight averaging, Model Stock) the first expert's task weight. ``part``
    of ``parts``: every parts-th of n × parts distinct values on the slider's steps, so each part's
    moves are new to the caches (fewer, said, where the range has fewer steps)."""
    m = methods.get(name)
    experts = m.experts_for(session.tasks)
    total = n * parts
    if not m.params:
        values = [round(0.5 + i / total, 2) for i in range(total)]
        make = lambda w: session.spec(name, experts=experts, task_weights={experts[0]: w})  # noqa: E731
    elif m.params[0].name == "lam":  # the range people use (0.1 to 1.55), as earlier tables; then further out
        lams = [round(0.05 * (i + 2), 2) for i in range(57)]
        values = lams + [-x for x in lams]
        make = lambda lam: session.spec(name, experts=experts, lam=lam)  # noqa: E731
    else:
        p = m.params[0]
        lo, hi = p.min + (p.step if p.min_open else 0), p.max - (p.step if p.max_open else 0)
        values = [round(round((lo + (hi - lo) * (i + 1) / (total + 1)) / p.step) * p.step, 6) for i in range(total)]
        make = lambda v: session.spec(name, experts=experts, **{p.name: v})  # noqa: E731
    values = list(dict.fromkeys(values))[:total]  # distinct: a repeat would be a cache hit
    if len(values) < total:
        print(f"({name}: {len(values)} distinct values on the slider's steps for {total} moves)", flush=True)
    return [make(v) for v in values[part::parts]]


def forward_precision(session, lams=(0.3, 0.4, 0.5, 0.6, 0.7)) -> None:
    """The live forward under bf16 autocast (a GPU's default; ``--forward bf16`` on the CPU), through the
    eager tower (the app's) and the route last chosen, against fp32 forwards: exact evaluations of the
    same Δs (no result cache), time per move and accuracy difference."""
    from merger.accel import reference_only

    ev = session.evaluator
    deltas = [session.delta(session.spec(LIVE_METHODS[0], lam=lam)) for lam in lams]
    bf16, cuda = ev.EVERYWHERE, ev.device.type == "cuda"
    variants = {"fp32": (False, False), "bf16 autocast, eager tower": (bf16, True)}
    if ev.routed_tower is not None:
        variants[f"bf16 autocast, tower {ev.routed_tower.route}"] = (bf16, False)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times, accs = {}, {}
    before = ev.autocast
    try:
        for name, (autocast, eager) in variants.items():
            ev.autocast = autocast
            with session.queue, (reference_only("tower") if eager else contextlib.nullcontext()):
                ev.evaluate(delta=deltas[0], split="live")  # warm-up: kernels chosen for this precision
                times[name], accs[name] = [], []
                for d in deltas:
                    sync()
                    t = time.perf_counter()
                    r = ev.evaluate(delta=d, split="live")
                    sync()
                    times[name].append(time.perf_counter() - t)
                    accs[name].append(r.accuracy)
    finally:
        ev.autocast = before  # the session's later moves in its own precision
    tf32 = torch.backends.cuda.matmul.allow_tf32
    print(f"\nforward precision ({LIVE_METHODS[0]}, {len(lams)} λ values, load + forward of the live images + scores):")
    for name in variants:
        line = f"  {name:<30} p50 {statistics.median(times[name]) * 1e3:7.1f} ms"
        if name == "fp32":
            line += f" (TF32 {'on' if tf32 else 'off'})" if cuda else ""
        else:
            diffs = [100 * abs(a[t] - b[t]) for a, b in zip(accs[name], accs["fp32"]) for t in a]
            line += (f" ({statistics.median(times['fp32']) / statistics.median(times[name]):.2f}x); accuracy − fp32: "
                     f"mean {statistics.mean(diffs):.2f}, max {max(diffs):.2f} points per task")
        print(line, flush=True)


def progressive_moves(session, lams=(0.35, 0.45, 0.65, 0.75), estimate_lams=(0.25, 0.55), *,
                      first_goal: float = 5.0, complete_goal: float | None = None) -> bool:
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
        if lam != lams[0]:  # the goals are a move's, once the first has set up what moves share
            ok &= t_first <= first_goal and (complete_goal is None or t_all <= complete_goal)
        err = ""
        if kind == "estimate":
            spec = session.spec(LIVE_METHODS[0], lam=lam)
            e = session.linear.error(session.linear.shown(spec), session.cached(spec))
            err = f"  estimate − exact {e['average']:+.1f} points (per task at most {e['max_abs']:.1f})"
        print(f"{'λ = ' + str(lam):<24}{t_first:15.3f}{kind:>10}{t_all:12.3f}{err}", flush=True)

    for lam in lams:
        move(lam)
    t_prep = time.perf_counter()
    session.linear.prepare()  # what the app does in the background after opening a slow pool
    t_prep = time.perf_counter() - t_prep
    for lam in estimate_lams:
        move(lam)
    print(f"(the linear estimate's forwards, base and {len(session.tasks)} experts: {t_prep:.1f} s, once per pool; "
          "on disk for pools read from files)")
    print(f"goal: the first answer within {first_goal:g} s of a move"
          + (f", the complete one within {complete_goal:g} s (forwards of the move)" if complete_goal else "")
          + " (moves after the first): " + ("met" if ok else "MISSED"))
    return ok
