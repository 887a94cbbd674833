"""Command line: ``python -m merger {methods,merge,bench,...}``. Parses, calls, prints."""
from __future__ import annotations

import argparse
import math
import os
import sys

from merger import methods, runtime
from merger.cli_jobs import (POOL_HELP, Parser, add_forward_arg, add_job_args, add_job_commands, cmd_landscape,
                             new_folders, positive_float, positive_int, progress_bar, set_forward, user_password)
from merger.cli_reports import cmd_cache, cmd_pools, cmd_report
from merger.errors import DataError, MergerError
from merger.methods import PARAM_NAMES


def _run_data_driven(pool, spec) -> None:
    """A data-driven merge learns first, with a progress bar (the run is cached for what follows)."""
    from merger.evaluation.session import session_for

    if methods.get(spec.method).data_driven:
        with progress_bar(spec.method) as update:
            session_for(pool).run(spec, progress=update)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_method_args(p: argparse.ArgumentParser) -> None:
    """Method and parameter flags, generated from the registry."""
    aliases = ", ".join(f"{a}={m.name}" for m in methods.all_methods() for a in m.aliases)
    p.add_argument("--method", help=f"one of: {', '.join(methods.names())}; or an alias ({aliases}); '-' for '_'")
    for name in PARAM_NAMES:
        users = [m for m in methods.all_methods() if name in m.param_names]
        if not users:
            continue
        rec = users[0].param(name)
        # Values stay strings here (read as numbers in method_params) so the registry gives the one
        # error message for bad numbers.
        p.add_argument(_flag(name), dest=name, default=None,
                       help=f"{rec.help}; range {rec.range_text()}; used by {', '.join(m.name for m in users)}")
    p.add_argument("--experts", default=None, help="comma-separated task names (default: all)")
    p.add_argument("--task-weights", dest="task_weights", default=None,
                   help="per-task weights, e.g. shape=1.4,dots=0.5: each task vector times its weight before "
                        "the method combines them (range [-3, 3]; default 1; static methods)")
    p.add_argument("--block-weights", dest="block_weights", default=None,
                   help="per-block weights of the method's Δ, e.g. block0=0,projection=0.5 (groups: embeddings, "
                        "block0..block{L-1}, projection; range [-3, 3]; default 1)")


def method_params(args) -> dict:
    """The parameter flags given, a number read as one (a refusal then says lam=5, as the API and
    the endpoint do, not lam='5'); other text ("auto", a typo) as typed, for the method's check."""
    return {n: _number(getattr(args, n)) for n in PARAM_NAMES if getattr(args, n, None) is not None}


def _number(text):
    for kind in (int, float):
        try:
            return kind(text)
        except (TypeError, ValueError):
            pass
    return text


def weights_args(args, record: dict | None = None) -> dict:
    """task_weights / block_weights from the flags, else from a replayed spec record."""
    record = record or {}
    return {f: getattr(args, f, None) if getattr(args, f, None) is not None else record.get(f)
            for f in ("task_weights", "block_weights")}


def cmd_methods(args) -> int:
    if args.markdown:
        from merger.catalogue import methods_markdown

        print(methods_markdown(), end="")
        return 0
    for m in methods.all_methods():
        print(f"{m.name}  ({m.display_name}; {'data-driven' if m.data_driven else 'sliders'})")
        print(f"    paper: {m.paper}")
        print(f"    {m.description}")
        if m.conventions:
            print(f"    conventions: {m.conventions}")
        if m.num_experts:
            print(f"    merges exactly {m.num_experts} experts (--experts a,b)")
        for p in m.params:
            default = {None: "depends on T", "auto": f"auto ({p.auto})"}.get(p.default, p.default)
            default = f"{default:g}" if isinstance(default, (int, float)) else default
            print(f"    --{p.name.replace('_', '-'):<11} range {p.range_text():<14} step {p.step:g}  default {default}  {p.help}")
    return 0


def cmd_merge(args) -> int:
    from merger.io.export import check_export_target, check_hashes, export_merge, hub_pins, read_spec_file, spec_pool
    from merger.pool.pool import open_pool

    if args.spec:
        record = read_spec_file(args.spec)
        # --pool: the same files opened from elsewhere (a moved pool); the hashes must still match.
        # A relative pool in the spec is read from the spec's folder, as a pool's paths from its own.
        pool = open_pool(args.pool or spec_pool(record, args.spec), device=args.device,
                         pins=hub_pins(record, args.spec))
        check_hashes(pool, record, args.spec)
        params = dict(record.get("params") or {})
        params.update(method_params(args))
        try:
            spec = pool.make_spec(args.method or record["method"], params, args.experts or record.get("experts"),
                                  **weights_args(args, record))
        except MergerError as exc:  # a value that came from the file: name it
            overridden = method_params(args) or args.method or args.experts or any(weights_args(args).values())
            raise MergerError(f"{args.spec}{' with the flags given' if overridden else ''}: {exc}") from exc
    else:
        if not args.pool or not args.method:
            raise MergerError("merge: give --pool and --method, or --spec FILE")
        pool = open_pool(args.pool, device=args.device)
        spec = pool.make_spec(args.method, method_params(args), args.experts, **weights_args(args))
    check_export_target(pool, args.out, reads=(args.spec,) if args.spec else ())  # before minutes of learning
    _run_data_driven(pool, spec)
    weights, yaml_path = export_merge(pool, spec, args.out)
    print(f"wrote {weights} and {yaml_path}: {spec.label()} over {', '.join(spec.experts)}")
    if args.card_split != "none":  # the model card's table: an evaluation of the merge just written
        from merger.evaluation.session import session_for
        from merger.io.model_card import card_text, write_card

        try:
            session = session_for(pool)
            set_forward(session.evaluator, args.forward)  # its data: a pool without any raises DataError here
            result, why = session.evaluate_exact(spec, args.card_split), ""
        except DataError as exc:  # a pool without task data merges all the same: its card says so
            result, why = None, str(exc)
        card = write_card(weights, card_text(pool, spec, read_spec_file(yaml_path), result, why))
        said = f"average {100 * result.average_accuracy:.1f} %" if result else "no accuracy table: no task data"
        print(f"wrote {card}: the model card ({args.card_split} split: {said})")
    return 0


def cmd_eval(args) -> int:
    import json

    from merger.evaluation.session import PoolSession
    from merger.pool.pool import open_pool

    if not args.method:
        raise MergerError(f"eval: give --method (one of {', '.join(methods.names())})")
    pool = open_pool(args.pool, device=args.device)
    ex = PoolSession(pool)
    spec = ex.spec(args.method, experts=args.experts, **weights_args(args), **method_params(args))
    set_forward(ex.evaluator, args.forward)  # after the spec's checks: the evaluator reads the pool's data
    _run_data_driven(pool, spec)
    # Exact parameters (not snapped to slider steps): merge, then evaluate.
    result = ex.evaluate_exact(spec, args.split)
    note = ex.note(spec)  # what the page says beside it
    if args.json:
        print(json.dumps({"spec": spec.as_dict(), **result.to_dict(), **({"note": note} if note else {})}, indent=2))
        return 0
    print(f"{spec.label()} over {', '.join(spec.experts)}; {args.split} split"
          + ("; forwards in bf16 autocast" if result.forward == "bf16" else "; forwards in fp32"))
    print(f"{'task':<14}{'accuracy %':>11}{'loss':>9}{'normalised %':>14}")

    def ratio(v):  # no ratio over an expert at 0 % on its own task (a tiny split can do that)
        return f"{100 * v:14.1f}" if math.isfinite(v) else f"{'n/a':>14}"

    for t in result.tasks:
        print(f"{t:<14}{100 * result.accuracy[t]:11.1f}{result.loss[t]:9.3f}{ratio(result.normalized[t])}")
    print(f"{'average':<14}{100 * result.average_accuracy:11.1f}{result.average_loss:9.3f}"
          f"{ratio(result.normalized_accuracy)}")
    zero = [t for t in result.tasks if not math.isfinite(result.normalized[t])]
    if zero:
        print(f"normalised n/a: the expert of {', '.join(zero)} scores 0 % on its own task on the {args.split} split "
              f"({', '.join(f'{result.counts[t]} images' for t in zero)})")
    if note:
        print(f"note: {note}")
    return 0


def cmd_demo(args) -> int:
    if args.action == "export":
        from merger.demo.export import export_demo

        if not args.out:
            raise MergerError("demo export: give --out DIR (a new or empty folder)")
        pool = export_demo(args.out, args.images)
        print(f"wrote {pool} with its base, experts and image folders: copy and edit them "
              "(docs/formats.md)")
        return 0
    if args.action == "build":
        from merger.demo.build import DemoConfig, build
        from merger.pool.pool import DEMO_DIR

        out = build(args.out or DEMO_DIR, DemoConfig.small() if args.small else DemoConfig())
        print(f"built the demo pool in {out}")
        return 0
    from merger.pool.pool import open_pool
    from merger.reports.demo import demo_numbers, format_demo_report

    with progress_bar("demo report") as update:
        numbers = demo_numbers(open_pool(args.pool), split=args.split, progress=update)
    print(format_demo_report(numbers))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="merger", description="Model merging explorer (also: python -m merger)")
    ap.add_argument("--debug", action="store_true", help="show a traceback when a command fails")
    sub = ap.add_subparsers(dest="command", required=True)

    sub.add_parser("app", help="start the app (merger app --help; the same as merger-app)")
    p = sub.add_parser("methods", help="list the registered merge methods")
    p.add_argument("--markdown", action="store_true", help="print the methods page (docs/methods.md) instead")
    p.set_defaults(func=cmd_methods)

    p = sub.add_parser("merge", help="merge a pool's experts and write safetensors + spec YAML")
    p.add_argument("--pool", help='pool YAML (or "demo"); with --spec, the same files opened from there')
    p.add_argument("--spec", help="replay a spec YAML written by an earlier merge")
    add_method_args(p)
    p.add_argument("--out", required=True, help="output .safetensors (the spec goes beside it as .yaml)")
    p.add_argument("--card-split", default="test", choices=["test", "val", "live", "none"],
                   help="the split the model card (README.md beside the weights) reports; none: no card")
    p.add_argument("--device", default="cpu")
    add_forward_arg(p)
    p.set_defaults(func=cmd_merge)

    p = sub.add_parser("eval", help="merge and evaluate per task")
    p.add_argument("--pool", default="demo", help=POOL_HELP)
    add_method_args(p)
    p.add_argument("--split", default="test", help="test (default), train, val, live or probe")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--device", default="cpu")
    add_forward_arg(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("demo", help="build, report or export the built-in demo pool")
    p.add_argument("action", choices=["build", "report", "export"])
    p.add_argument("--out", default=None, help="build: output folder (default: the shipped assets/demo); export: "
                   "a new or empty folder for the pool as files and image folders")
    p.add_argument("--images", type=positive_int, default=100, help="export: images per task and split")
    p.add_argument("--small", action="store_true", help="build: the reduced configuration used in CI")
    p.add_argument("--pool", default="demo", help="report: which pool")
    p.add_argument("--split", default="test", help="report: test (default), train, val, live or probe")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("landscape", help="loss/accuracy surface on a plane, as standalone HTML + JSON grid")
    add_job_args(p, history=False)
    p.add_argument("--plane", default="pca", help="pca (default: of --points), tasks (base + two task vectors), "
                                                   "points (three)")
    p.add_argument("--points", default="base,experts",
                   help="comma list: base, experts, a task, file:PATH (relative to this folder), METHOD:param=value "
                        "(ta = task_arithmetic); default base,experts")
    p.add_argument("--tasks", default=None, help="the two tasks of --plane tasks")
    p.add_argument("--grid", type=positive_int, default=21, help="points per side of the grid (default 21)")
    p.add_argument("--metric", default="loss", choices=["loss", "accuracy"])
    p.add_argument("--task", default=None, help="one task's metric (default: mean over tasks)")
    p.add_argument("--split", default="probe", help="probe (default: 48 test images per task), live, val, test or train")
    p.add_argument("--paths", default=None, help="comma list: TASK (fine-tuning path) or METHOD@lam|rank_ratio|sparsity")
    p.add_argument("--view", default="contour", choices=["contour", "surface"])
    p.add_argument("--out", required=True, help="output .html (the grid goes beside it as .json)")
    p.set_defaults(func=cmd_landscape)
    add_job_commands(sub)

    p = sub.add_parser("report", help="measured reports on a pool: methods (every method tuned on validation, "
                                      "scored on test, with its prepare and move times), adaptive (the "
                                      "data-driven merges against task arithmetic), linear (the linear "
                                      "estimate's error), phenomena (the papers' phenomena on the demo pool), "
                                      "session (merges as one self-contained HTML report)")
    p.add_argument("what", choices=["methods", "adaptive", "linear", "phenomena", "session"])
    p.add_argument("--pool", default="demo", help=POOL_HELP)
    p.add_argument("--out", default=None, help="session: the report's .html file (self-contained, opens offline)")
    p.add_argument("--specs", "--pins", nargs="*", default=None,
                   help="session: the merges, each METHOD:param=value:… (e.g. ties:lam=1:sparsity=0.8)")
    p.add_argument("--split", default="test", help="session: the split the merges are evaluated on (test)")
    p.add_argument("--history", default=None, help="session: a history file (the app's --history); its λ sweeps "
                   "of this pool are drawn in the report")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("pools", help="the known CLIP benchmarks on the Hugging Face Hub (hub:NAME): their sizes and "
                                     "whether they are here; fetch NAME (or a pool YAML's Hub sources) fetches one")
    p.add_argument("action", nargs="?", choices=["list", "fetch"], default="list")
    p.add_argument("name", nargs="?", default=None, help="fetch: a known pool's name, or a pool YAML")
    p.set_defaults(func=cmd_pools)

    p = sub.add_parser("cache", help="the disk cache of prepared methods and task vectors: info (entries, size, "
                                     "cap) or clear")
    p.add_argument("action", choices=["info", "clear"])
    p.set_defaults(func=cmd_cache)

    for command in sub.choices.values():  # --debug also after the command's name
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="show a traceback when the command fails")
    return ap


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    """Exit 0 on success; 2 and one line on stderr for bad input (a MergerError names the file,
    key or parameter); 1 and one line for an operation that failed (a disk, a bug); 130 for Ctrl+C
    and 143 for SIGTERM, as a shell counts them (one line: interrupted); 141, quietly, when the
    reader of the output went away (``| head``). ``--debug`` shows the traceback instead.
    ``merger app ...`` is the app's own command line (merger/serve.py); ``parser``: another command
    line run the same way (devtools/cli.py)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if parser is None and argv[:1] == ["app"]:
        from merger.serve import main as serve

        return serve(argv[1:], prog="merger app")
    args = (parser or build_parser()).parse_args(argv)
    runtime.configure()
    return runtime.run_killable(lambda: _run(args))  # a kill removes temporary files and half-built folders too


def run() -> None:
    """The ``merger`` command."""
    sys.exit(main())


def _run(args) -> int:
    try:
        new_folders(args)
        return args.func(args)
    except MergerError as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError as exc:
        if not _output_gone():  # another pipe broke (a socket, a worker's): a failed operation
            return _failed(args, exc)
        # the reader stopped reading (`| head`): no message; stdout goes to devnull so the
        # interpreter's last flush at exit does not raise it again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as exc:  # noqa: BLE001  anything else is a failed operation, said in one line
        return _failed(args, exc)


def _output_gone() -> bool:
    """stdout is a pipe whose reader has closed it (poll says POLLERR on its write end)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no poll here, or stdout is no file
        return False


def _failed(args, exc: Exception) -> int:
    if args.debug:
        raise exc
    detail = f"{exc.filename}: {exc.strerror}" if isinstance(exc, OSError) and exc.filename else str(exc)
    print(f"error: {args.command} failed: {type(exc).__name__}: {detail.splitlines()[0] if detail else ''} "
          "(--debug shows the traceback)", file=sys.stderr)
    return 1
