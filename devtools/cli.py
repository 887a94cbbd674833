"""The workshop's command line: ``python -m devtools {bench,report,screenshot}``, run from a checkout.
Benchmarks, the code and precision reports and the README's screenshot; none of it ships in the
``merger`` package, which never imports this folder."""
from __future__ import annotations

import argparse
import os

from merger import cli
from merger.cli_jobs import FORWARDS, POOL_HELP, Parser, positive_float, positive_int, user_password
from merger.errors import MergerError


def forwards(text: str) -> str:
    """``--forward``: one or two different FORWARDS, comma-separated."""
    given = text.split(",")
    if not 1 <= len(set(given)) == len(given) <= 2 or any(f not in FORWARDS for f in given):
        raise argparse.ArgumentTypeError(f"'{text}': one or two different ones of {', '.join(FORWARDS)}, comma-separated")
    return text


def cmd_report(args) -> int:
    if args.what == "layout":
        from devtools.layout import format_layout, read_layout

        layout = read_layout()
        print(format_layout(layout))
        return 0 if layout.clean() else 1
    if args.what == "precision":
        from devtools.report_precision import report_precision

        return report_precision(args)
    from merger.pool.pool import open_pool

    pool = open_pool(args.pool)
    if args.what == "coefficients":
        from devtools.report_coefficients import report_coefficients

        text, ok = report_coefficients(pool)
        print(text)
        return 0 if ok else 1
    from devtools.report_bf16 import bf16_rows, format_bf16, format_forwards, forward_rows

    print(format_forwards(forward_rows(args.pool)) + "\n")
    print(format_bf16(bf16_rows(args.pool)))
    return 0


def cmd_screenshot(args) -> int:
    from devtools.browser import browser_missing, screenshot

    missing = browser_missing()
    if missing:
        raise MergerError(f"screenshot: {missing}")
    shown = screenshot(args.pool, os.path.expanduser(args.out))
    line = next((x for x in shown["text"].splitlines() if "Average accuracy" in x), "")
    print(f"wrote {args.out}: {line}")
    return 0


def cmd_bench(args) -> int:
    from devtools import bench

    args.moves_given = args.moves is not None
    args.moves = args.moves if args.moves is not None else 30
    return bench.run(args.what, args)


def build_parser() -> Parser:
    ap = Parser(prog="python -m devtools", description="merger's benchmarks and code reports (from a checkout)")
    ap.add_argument("--debug", action="store_true", help="show a traceback when a command fails")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("report", help="layout (import cycles, front-end imports, method-name literals, module "
                                      "sizes of merger/), precision (every static merge against its fp64 "
                                      "definition on a random ViT-B-32 pool), coefficients (weight moves in the "
                                      "Merge tab), bf16 (forwards in bf16 autocast, then task vectors stored in bf16, against fp32)")
    p.add_argument("what", choices=["layout", "precision", "coefficients", "bf16"])
    p.add_argument("--pool", default="demo", help=POOL_HELP)
    p.add_argument("--arch", default="ViT-B-32", help="precision: the random pool's architecture")
    p.add_argument("--experts", type=positive_int, default=8, help="precision: random experts")
    p.add_argument("--tv-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="precision: task-vector storage (auto: bf16 above 1 GB in fp32)")
    p.add_argument("--methods", default=None, help="precision: a comma-separated subset of methods")
    p.add_argument("--all-settings", action="store_true",
                   help="precision: each method's default and two other settings (default: the default)")
    p.add_argument("--reference", action="store_true", help="precision: the reference routes alone (no drop-ins)")
    p.set_defaults(func=cmd_report)


    p = sub.add_parser("screenshot", help="start the app, drag λ in Chromium, save a screenshot of the Merge tab")
    p.add_argument("--pool", default="demo", help=POOL_HELP)
    p.add_argument("--out", default="assets/screenshot-merge.png")
    p.set_defaults(func=cmd_screenshot)

    p = sub.add_parser("bench", help="benchmarks (medians and ratios in one run)")
    p.add_argument("what", choices=["merge", "accel", "live", "browser", "workshop", "api", "landscape", "scale",
                                    "load", "attacks", "open", "hub", "cluster", "soak", "room"],
                   help="merge: prepare/apply per method on ViT-B-32; accel: each speed-up piece off and on "
                        "(what it speeds, the ratio, the difference); live: the Merge tab's listener per move "
                        "(time, forwards, applies); browser: Chromium slider → shown result (a move at a time; a drag, with and without the page's plot script); workshop: 10 clients "
                        "drag while browsers run batch jobs; api: the evaluate endpoint through gradio_client; "
                        "scale: ViT-B-32 pool (first partial answer); open: a ViT-B-32 pool from files, cold and warm "
                        "(disk cache); hub: a ViT-B-32 pool on a local fake Hugging Face hub, fetched, then opened cold and warm; cluster: a sweep and a landscape here and on a local Ray instance "
                        "(--clients workers, 2); attacks: the bad-input catalogue; soak: an hour of a workshop "
                        "compressed (Chromium rounds and 2,000 HTTP calls), the server's memory sampled; room: a workshop room, "
                        "1 presenter and 30 followers (2 Chromium pages, 28 HTTP clients)")
    p.add_argument("--jobs", default="sweep,autotune", help="workshop: batch jobs (sweep, autotune, landscape)")
    p.add_argument("--url", default=None, help="api / load: a running app to target (default: start one)")
    p.add_argument("--auth", type=user_password, default=None,
                   help="api / load: user:password of a --url app started with --auth")
    p.add_argument("--grid", type=positive_int, default=21, help="landscape: grid points per side")
    p.add_argument("--clients", type=positive_int, default=None,
                   help="load (20) / workshop (10): concurrent clients; room (30): followers")
    p.add_argument("--arch", default="ViT-B-32")
    p.add_argument("--pool", default="demo", help=POOL_HELP)
    p.add_argument("--experts", type=positive_int, default=8)
    p.add_argument("--tv-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="merge/scale: task-vector storage (auto: bf16 above 1 GB in fp32)")
    p.add_argument("--repeats", type=positive_int, default=None,
                   help="merge: preparations timed per method, each in a fresh session; the median shown (1)")
    p.add_argument("--moves", type=positive_int, default=None,
                   help="live / api / scale: distinct λ values per method; load: moves per client (50); room: presenter "
                   "moves (15)")
    p.add_argument("--images", type=positive_int, default=None,
                   help="scale: synthetic images per task (128); open: test images per task (32)")
    p.add_argument("--device", default="cpu", help="scale: cpu or cuda")
    p.add_argument("--forward", default="auto", type=forwards,
                   help="browser: the server's --forward (auto, fp32, bf16); two, comma-separated (auto,bf16): a "
                   "move at a time on a server each, in alternation")
    p.add_argument("--tower", default=None,
                   help="scale: image-tower routes timed in turn, comma-separated (a GPU: eager,patches,graphs; "
                        "the CPU: eager); the goals are eager's, the app's route")
    p.add_argument("--naive", type=int, default=30, help="live: how many of them to repeat naively")
    p.add_argument("--methods", default=None, help="comma-separated subset of methods")
    p.add_argument("--rounds", type=positive_int, default=None, help="soak: rounds of a person in Chromium (12)")
    p.add_argument("--calls", type=positive_int, default=None, help="soak: evaluate calls over HTTP (2000)")
    p.add_argument("--memory-gb", type=positive_float, default=None, help="soak: the server's --memory-gb (its default)")
    p.set_defaults(func=cmd_bench)
    for command in sub.choices.values():
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="show a traceback when the command fails")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Exit codes and error lines as ``merger``'s (merger/cli.py)."""
    return cli.main(argv, build_parser())
