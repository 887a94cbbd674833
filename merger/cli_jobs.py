"""Command line jobs: ``python -m merger {sweep,tune,landscape}``, here or on a Ray cluster
(``--ray auto|local|ADDRESS``). Parses, calls, prints; results go into the SQLite history as they
finish (this process is its one writer), and ``--resume`` skips what the history already holds."""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path

from merger import methods, runtime
from merger.errors import MergerError
from merger.io import inputs


def user_password(text: str) -> tuple[str, str]:
    """An argparse type: ``user:password`` (the password may hold colons)."""
    user, sep, password = text.partition(":")
    if not sep or not user or not password:
        raise argparse.ArgumentTypeError("expected user:password")
    return user, password


def worker_count(text: str) -> int:
    """An argparse type: a number of Ray workers, 1 to ``cluster.MAX_WORKERS``."""
    from merger.cluster import MAX_WORKERS

    value = positive_int(text)
    if value > MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"{text!r}: at most {MAX_WORKERS} workers")
    return value


class Parser(argparse.ArgumentParser):
    """argparse with a bad flag said in one line (the usage block buried it): the command line's
    and app.py's parsers, and their subcommands' (argparse makes those of the parent's class)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the flags)\n")


def new_folders(args, flags=("out", "history")) -> None:
    """Say which folder a file flag will create (a typo in a path otherwise makes a folder tree
    unseen): one line on stderr per flag whose folder does not exist yet."""
    from merger.io.history import DEFAULT_PATH

    for flag in flags:
        value = getattr(args, flag, None)
        if flag == "out" and getattr(args, "command", None) == "demo":
            continue  # demo build --out names the folder itself, which the build makes
        if flag == "history" and value and Path(value).expanduser() == Path(DEFAULT_PATH).expanduser():
            continue  # the default place (~/.merger), not a path a person typed
        if value:
            folder = Path(value).expanduser().parent
            if not folder.exists():
                print(f"note: --{flag} {value}: the folder {folder} does not exist; it is created when the file is "
                      "written", file=sys.stderr)


def positive_int(text: str, least: int = 1) -> int:
    """An argparse type: a whole number ≥ ``least`` (1: a count of clients, moves, repeats, grid points)."""
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number ≥ {least}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (a budget in GB)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number > 0")
    return value


def seed_int(text: str) -> int:
    """An argparse type: a seed, 0 to 2^32 − 1 (Optuna's and NumPy's range)."""
    value = positive_int(text, least=0)
    if value >= 2**32:
        raise argparse.ArgumentTypeError(f"{text!r} is above 2^32 − 1")
    return value


@contextlib.contextmanager
def progress_bar(desc: str):
    """A tqdm bar on stderr for a long command, drawn from the first progress report on (so an
    error found before any work is a clean single line); yields ``update(fraction, message, ...)``,
    the callback shape the engine's long operations take."""
    from tqdm import tqdm

    bar = None

    def update(fraction, message="", *_):
        nonlocal bar
        runtime.stop_if_killed()  # a kill whose exception was lost stops the command at its next report
        if bar is None:
            bar = tqdm(total=1000, desc=desc, file=sys.stderr, leave=True, dynamic_ncols=True,
                       bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}<{remaining} {postfix}")
        bar.n = min(1000, int(round(1000 * fraction)))
        bar.set_postfix_str(str(message)[:70])  # (and redraws)

    try:
        yield update
    finally:
        if bar is not None:
            bar.close()


POOL_HELP = 'pool YAML, or "demo" (the default: the built-in demo pool)'
FORWARDS = ("auto", "fp32", "bf16")


def add_forward_arg(p) -> None:
    p.add_argument("--forward", default="auto", choices=FORWARDS,
                   help="the forwards' precision: auto (bf16 autocast on a GPU, fp32 on the CPU), fp32, or bf16 "
                   "autocast on the CPU too (faster where it has AMX or AVX512-BF16; its accuracies then differ "
                   "from fp32 forwards' by about an image a task: docs/performance.md). Merges stay fp32")


def autocast_of(forward: str) -> bool | str:
    """``--forward`` as an ``Evaluator.autocast`` setting."""
    from merger.evaluation.evaluator import Evaluator

    return {"auto": True, "fp32": False, "bf16": Evaluator.EVERYWHERE}[forward]


def set_forward(evaluator, forward: str) -> None:
    """``--forward`` on an Evaluator (before its first forward)."""
    evaluator.autocast = autocast_of(forward)


def precision_said(args) -> str:  # what a job's last line adds about its forwards' precision
    return "; forwards in bf16 autocast" if job_precision(args) == "bf16" else ""


def job_precision(args) -> str:
    """A job's forwards' precision, here or on its Ray workers: from the flags (no model built here)."""
    import torch

    from merger.evaluation.evaluator import Evaluator

    return Evaluator.precision_of(autocast_of(args.forward), torch.device(args.device).type)


def add_job_args(p, history: bool = True) -> None:
    p.add_argument("--pool", default="demo", help=POOL_HELP)
    p.add_argument("--ray", default=None, metavar="auto|local|ADDRESS",
                   help="run on a Ray cluster: auto (the one this machine belongs to), local (start one here), "
                        "or host:port / ray://host:port; absent: run here")
    p.add_argument("--workers", type=worker_count, default=2, help="with --ray: workers, each opening the pool once")
    p.add_argument("--device", default="cpu", help="without --ray: where this process evaluates")
    add_forward_arg(p)
    if history:
        from merger.io.history import DEFAULT_PATH

        p.add_argument("--history", default=str(DEFAULT_PATH), help="SQLite history the results go into ('' : none)")
        p.add_argument("--resume", action="store_true", help="skip the points the history already holds")


def add_job_commands(sub) -> None:
    p = sub.add_parser("sweep", help="accuracy against one parameter for some methods (into the history)")
    add_job_args(p)
    p.add_argument("--methods", default=None, help="comma list (default: the featured methods that take --axis)")
    p.add_argument("--axis", default="lam", help="a parameter with sweep values (lam, rank_ratio, sparsity, t, ...)")
    p.add_argument("--values", default=None, help="comma list (default: the parameter's sweep values)")
    p.add_argument("--split", default="live", help="live (default: the split the app's sliders show), val, test, "
                                                     "train or probe")
    p.add_argument("--experts", default=None, help="comma-separated task names (default: all)")
    p.add_argument("--out", default=None, help="also write the curves as JSON here")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("tune", help="grid auto-tune: best setting on validation, reported on test (into the history)")
    add_job_args(p)
    p.add_argument("--methods", default=None, help="comma list (default: the featured methods)")
    p.add_argument("--experts", default=None, help="comma-separated task names (default: all)")
    p.add_argument("--weights", default=None, metavar="METHOD",
                   help="instead of the grid: search METHOD's per-task weights (Optuna TPE, seeded) at its defaults")
    p.add_argument("--budget", type=positive_int, default=100, help="--weights: trials")
    p.add_argument("--seed", type=seed_int, default=0, help="--weights: the sampler's seed")
    p.add_argument("--with-lam", action="store_true", help="--weights: search λ too")
    p.set_defaults(func=cmd_tune)


def _cluster(args, session):
    """The job's Ray workers, forwarding in ``job_precision`` wherever they run; None without --ray,
    where this process's evaluator forwards in it."""
    if not args.ray:
        set_forward(session.evaluator, args.forward)
        return None
    from merger.cluster import Cluster, connect
    from merger.evaluation.evaluator import Evaluator

    connect(args.ray)  # an unreachable address is refused before anything is said about workers
    print(f"starting {args.workers} Ray workers ({args.ray}); each opens the pool once...", file=sys.stderr, flush=True)
    pool = session.pool
    return Cluster(args.ray, pool.source, workers=args.workers, experts=list(pool.experts),
                   autocast=Evaluator.autocast_keeping(job_precision(args)))


def _recording(args, session, counts: dict, cluster=None):
    """(on_result, known) for the history of a job: one writer (this process), and a resumed job's
    lookups; ``counts`` says how many points were evaluated and how many came from the history."""
    counts.update(evaluated=0, reused=0)

    def evaluated(spec, result):
        counts["evaluated"] += 1

    if not args.history:
        if args.resume:
            raise MergerError("--resume needs a --history to resume from")
        return evaluated, None
    from merger.evaluation.evaluator import Result
    from merger.io.export import pool_reference
    from merger.io.history import History

    history, ref, precision = History(args.history), pool_reference(session.pool), job_precision(args)

    def on_result(spec, result):
        history.record(ref, spec, result)  # evaluate_all's: snapped
        evaluated(spec, result)

    def known(spec, split):  # a row of another precision is no answer of this job's
        row = history.find(ref, spec, split, precision)
        if row is None:
            return None
        counts["reused"] += 1
        experts = cluster.expert_accuracy(split) if cluster is not None else session.expert_accuracy(split)
        return Result(split, json.loads(row["accuracy"]), json.loads(row["loss"]), expert_accuracy=experts,
                      forward=row["forward"])

    return on_result, (known if args.resume else None)


def _methods(args, axis: str | None = None) -> list[str]:
    if args.methods:
        from merger.evaluation.tuning import distinct_methods

        return distinct_methods([m for m in args.methods.split(",") if m.strip()])
    chosen = [m.name for m in methods.all_methods() if m.featured and not m.data_driven
              and (axis is None or axis in m.param_names)]
    if not chosen:
        raise MergerError(f"no featured method takes {axis}; name some with --methods")
    return chosen


def _open(args):
    from merger.evaluation.session import PoolSession
    from merger.pool.pool import open_pool

    return PoolSession(open_pool(args.pool, device=args.device))


def cmd_sweep(args) -> int:
    from merger.evaluation.tuning import sweep, sweep_values

    session = _open(args)
    names = _methods(args, args.axis)
    experts = args.experts.split(",") if args.experts else None
    if args.values:
        values = _given_values(args.values, names, args.axis, len(experts) if experts else len(session.tasks))
    else:
        values = sorted({v for m in names for v in sweep_values(args.axis, m)})
    out_path = None
    if args.out:  # before a sweep that may take minutes
        out_path = inputs.check_output_file(args.out, "--out", MergerError,
                                            keep=(*session.pool.input_files(), args.history or None))
    counts: dict = {}
    cluster = _cluster(args, session)
    on_result, known = _recording(args, session, counts, cluster)
    t0 = time.perf_counter()
    with progress_bar("sweep") as update:
        out = sweep(session, names, args.axis, values, args.split, experts, progress=update, cluster=cluster,
                    on_result=on_result, known=known)
    moved = _moved_to_steps(session, names, args.axis, values, experts)
    if moved:
        print("computed on the sliders' steps: " + ", ".join(f"{args.axis}={v:g} at {x:g}" for v, x in moved))
    print(f"average accuracy % on the {args.split} split, against {args.axis}:")
    for m, curve in out.items():
        print(f"{m}: " + "  ".join(f"{x:g}→{100 * a:.1f}" for x, a in zip(curve["x"], curve["average"])))
    where = f"on {args.workers} Ray workers ({args.ray})" if cluster else "here"
    n = sum(len(c['x']) for c in out.values())
    print(f"{n} point{'s' if n != 1 else ''} ({counts['evaluated']} evaluated, {counts['reused']} from "
          f"the history) {where} in {time.perf_counter() - t0:.1f} s{precision_said(args)}"
          + (f"; history: {args.history}" if args.history else ""))
    if out_path is not None:
        from merger.io.checkpoints import write_text_atomic

        write_text_atomic(out_path, json.dumps(out))
    return 0


def _moved_to_steps(session, names, axis: str, values, experts) -> list[tuple[float, float]]:
    """(given, computed) of each value a sweep computes elsewhere: a point is a preview, so a static
    method's value sits on its slider's step (λ 0.333 at 0.35)."""
    from merger.evaluation.tuning import computed_at
    from merger.methods.registry import inside

    n = len(experts or session.tasks)
    moved = set()
    for m in names:
        if axis in methods.get(m).param_names:
            for v in values:
                if inside(v, methods.get(m).bounds(axis, n)):
                    computed = computed_at(session.spec(m, experts=experts, **{axis: v}), axis)
                    if computed != v:
                        moved.add((v, computed))
    return sorted(moved)


def _given_values(text: str, names, axis: str, n_experts: int) -> list[float]:
    """--values as numbers, each inside at least one swept method's range; a value outside some
    methods' ranges is named for them (those points are skipped), not dropped unsaid."""
    import math

    from merger.methods.registry import inside

    values = []
    for item in text.split(","):
        try:
            v = float(item)
        except ValueError:
            raise MergerError(f"--values: {item.strip()!r} is not a number") from None
        if not math.isfinite(v):
            raise MergerError(f"--values: {item.strip()} is not a finite number")
        values.append(v)
    ranges = {m: methods.get(m).bounds(axis, n_experts) for m in names if axis in methods.get(m).param_names}
    nowhere = [v for v in values if ranges and not any(inside(v, bounds) for bounds in ranges.values())]
    if nowhere:
        raise MergerError(f"--values: {', '.join(f'{v:g}' for v in nowhere)} outside every swept method's {axis} "
                          f"range ({'; '.join(f'{m}: [{lo:g}, {hi:g}]' for m, (lo, hi) in ranges.items())})")
    for m, (lo, hi) in ranges.items():
        skipped = [v for v in values if not inside(v, (lo, hi))]
        if skipped:
            print(f"{m}: {', '.join(f'{v:g}' for v in skipped)} skipped (its {axis} lies in [{lo:g}, {hi:g}] "
                  f"with {n_experts} experts)")
    return values


def cmd_tune(args) -> int:
    from merger.evaluation.tuning import auto_tune

    session = _open(args)
    experts = args.experts.split(",") if args.experts else None
    counts: dict = {}
    cluster = _cluster(args, session)
    on_result, known = _recording(args, session, counts, cluster)
    if args.weights:
        from merger.evaluation.tuning import tune_weights, weight_range

        with progress_bar("weight search") as update:
            out = tune_weights(session, methods.get(args.weights).name, None, experts, args.budget, args.seed,
                               args.with_lam, update, cluster=cluster, on_result=on_result, known=known)
        print(f"{out['spec'].label()}: val {100 * out['val_accuracy']:.1f} %, test "
              f"{100 * out['test_accuracy']:.1f} % after {out['trials']} trials (seed {out['seed']})"
              + (f" on {args.workers} Ray workers ({args.ray})" if cluster else "")
              + f"; {counts['evaluated']} evaluated, {counts['reused']} from the history" + precision_said(args))
        # every weight, those left at 1 too (the label names only the others)
        print("weights: " + ", ".join(f"{e}={w:g}" for e, w in out["task_weights"].items()))
        if out["at_edge"]:
            print(f"{', '.join(out['at_edge'])} at an end of its search range (weights {weight_range()}; λ its tune "
                  "grid's): the best may lie beyond it")
        return 0
    with progress_bar("tune") as update:
        rows = auto_tune(session, _methods(args), experts, update, cluster=cluster, on_result=on_result, known=known)
    print(f"{'method':<18}{'best on validation':<44}{'grid':>5}{'val %':>7}{'test %':>8}")
    for r in rows:
        setting = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["params"].items())
        print(f"{r['method']:<18}{setting[:43]:<44}{r['grid_points']:5d}{100 * r['val_accuracy']:7.1f}"
              f"{100 * r['test_accuracy']:8.1f}")
    for r in rows:
        if r["at_edge"]:
            print(f"{r['method']}: {', '.join(r['at_edge'])} at the edge of its grid: the best may lie beyond it")
    print(f"{counts['evaluated']} points evaluated, {counts['reused']} from the history"
          + (f" (on {args.workers} Ray workers, {args.ray})" if cluster else "") + precision_said(args))
    return 0


def cmd_landscape(args) -> int:
    from merger.landscape.figure import write_landscape

    t0, session = time.perf_counter(), _open(args)
    cluster = _cluster(args, session)
    with progress_bar("landscape") as update:
        html, js = write_landscape(session.landscape, args.out, args.plane, args.points.split(","), args.grid,
                                   args.metric, task=args.task, tasks=[t for t in (args.tasks or "").split(",") if t],
                                   split=args.split, path_names=(args.paths or "").split(","), view=args.view,
                                   progress=update, cluster=cluster, files_relative_to=Path.cwd(),
                                   forward=job_precision(args))
    where = f" on {args.workers} Ray workers ({args.ray})" if cluster else ""
    print(f"wrote {html} and {js} ({args.grid}×{args.grid}{where}, {time.perf_counter() - t0:.1f} s){precision_said(args)}")
    return 0
