"""Command line: ``python -m merger {methods,merge,bench,...}``. Parses, calls, prints."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import methods
from .errors import MergerError
from .methods.registry import PARAM_NAMES


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_method_args(p: argparse.ArgumentParser) -> None:
    """Method and parameter flags, generated from the registry."""
    p.add_argument("--method", help=f"one of: {', '.join(methods.names())}")
    for name in PARAM_NAMES:
        users = [m for m in methods.all_methods() if name in m.param_names]
        if not users:
            continue
        rec = users[0].param(name)
        # Values stay strings here so the registry gives the one error message for bad numbers.
        p.add_argument(_flag(name), dest=name, default=None,
                       help=f"{rec.help}; range {rec.range_text()}; used by {', '.join(m.name for m in users)}")
    p.add_argument("--experts", default=None, help="comma-separated task names (default: all)")


def method_params(args) -> dict:
    return {n: getattr(args, n) for n in PARAM_NAMES if getattr(args, n, None) is not None}


def cmd_methods(args) -> int:
    for m in methods.all_methods():
        print(f"{m.name}  ({m.display_name}; {m.kind})")
        print(f"    paper: {m.paper}")
        print(f"    {m.description}")
        for p in m.params:
            default = "1/T" if p.default is None else f"{p.default:g}"
            print(f"    --{p.name.replace('_', '-'):<11} range {p.range_text():<14} step {p.step:g}  default {default}  {p.help}")
    return 0


def cmd_merge(args) -> int:
    from .export import check_hashes, export_merge, read_spec_file
    from .merging import Spec
    from .pool import open_pool

    if args.spec:
        record = read_spec_file(args.spec)
        pool = open_pool(record["pool"], device=args.device)
        check_hashes(pool, record, args.spec)
        params = dict(record.get("params") or {})
        params.update(method_params(args))
        spec = Spec.make(args.method or record["method"], params, args.experts or record.get("experts"), pool.tasks)
    else:
        if not args.pool or not args.method:
            raise MergerError("merge: give --pool and --method, or --spec FILE")
        pool = open_pool(args.pool, device=args.device)
        spec = Spec.make(args.method, method_params(args), args.experts, pool.tasks)
    weights, yaml_path = export_merge(pool, spec, args.out)
    print(f"wrote {weights} and {yaml_path}: {spec.label()} over {', '.join(spec.experts)}")
    return 0


def cmd_bench(args) -> int:
    from . import bench

    return bench.run(args.what, args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m merger", description="Model merging explorer")
    sub = ap.add_subparsers(dest="command", required=True)

    sub.add_parser("methods", help="list the registered merge methods").set_defaults(func=cmd_methods)

    p = sub.add_parser("merge", help="merge a pool's experts and write safetensors + spec YAML")
    p.add_argument("--pool", help='pool YAML (or "demo")')
    p.add_argument("--spec", help="replay a spec YAML written by an earlier merge")
    add_method_args(p)
    p.add_argument("--out", required=True, help="output .safetensors (the spec goes beside it as .yaml)")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=cmd_merge)

    p = sub.add_parser("bench", help="benchmarks (medians and ratios in one run)")
    p.add_argument("what", choices=["merge"], help="merge: prepare/apply per method on ViT-B-32")
    p.add_argument("--arch", default="ViT-B-32")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--methods", default=None, help="comma-separated subset of methods")
    p.set_defaults(func=cmd_bench)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MergerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
