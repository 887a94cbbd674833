"""Command line, the commands that measure and look after: ``report``, ``screenshot``, ``bench``,
``cache`` (``merger/cli.py`` parses and dispatches). Front end."""
from __future__ import annotations

import os

from merger.errors import MergerError


def cmd_report(args) -> int:
    if args.what == "layout":
        from merger.tools.layout import format_layout, read_layout

        layout = read_layout()
        print(format_layout(layout))
        clean = not (layout.cycles() or layout.engine_imports_of_front_ends() or layout.method_name_literals())
        return 0 if clean else 1
    if args.what == "precision":
        from merger.tools.report_precision import report_precision

        return report_precision(args)
    from merger.pool.pool import open_pool
    from merger.tools.reports import adaptive_numbers, format_adaptive

    pool = open_pool(args.pool)
    if args.what == "adaptive":
        print("data-driven merges on the test split (coefficients learned on the validation split)")
        print(format_adaptive(adaptive_numbers(pool)))
        return 0
    if args.what == "coefficients":
        from merger.tools.report_coefficients import report_coefficients

        text, ok = report_coefficients(pool)
        print(text)
        return 0 if ok else 1
    if args.what == "bf16":
        from merger.tools.report_bf16 import bf16_rows, format_bf16

        print(format_bf16(bf16_rows(args.pool)))
        return 0
    if args.what == "methods":
        from merger.tools.report_methods import format_methods, method_rows

        print(format_methods(method_rows(pool), pool.tasks))
        return 0
    if args.what == "linear":
        from merger.tools.report_linear import report_linear

        print(report_linear(pool))
        return 0
    from merger.tools.phenomena import format_phenomena, phenomena

    print(format_phenomena(phenomena(pool)))
    return 0


def cmd_screenshot(args) -> int:
    from merger.tools.browser import browser_missing, screenshot

    missing = browser_missing()
    if missing:
        raise MergerError(f"screenshot: {missing}")
    shown = screenshot(args.pool, os.path.expanduser(args.out))
    line = next((x for x in shown["text"].splitlines() if "Average accuracy" in x), "")
    print(f"wrote {args.out}: {line}")
    return 0


def cmd_bench(args) -> int:
    from merger.tools import bench

    args.moves_given = args.moves is not None
    args.moves = args.moves if args.moves is not None else 30
    return bench.run(args.what, args)


def cmd_cache(args) -> int:
    from merger.evaluation.evaluator import heads_cache_dir
    from merger.io.disk_cache import DiskCache

    cache, heads = DiskCache(), DiskCache(heads_cache_dir())
    if args.action == "clear":  # heads: rebuilt from the text tower on the next open
        n, _ = heads.clear()
        print(f"{heads.root}: removed {n} zero-shot heads")
    if not cache.enabled:
        why = "MERGER_DISK_CACHE=off" if cache.root is None else "the warning above says why"
        print(f"the disk cache of prepared methods is off ({why})")
        return 0
    if args.action == "clear":
        n, size = cache.clear()
        print(f"{cache.root}: removed {n} entries ({size / 2**30:.2f} GB) and the remembered file hashes")
        return 0
    entries, head_entries = cache.entries(), heads.entries()
    total = sum(e["bytes"] for e in entries)
    print(f"{cache.root}: {len(entries)} entries, {total / 2**30:.2f} GB of a {cache.cap / 2**30:.1f} GB cap "
          "(MERGER_CACHE_GB); least recently used first")
    print(f"{heads.root}: {len(head_entries)} zero-shot heads, {sum(e['bytes'] for e in head_entries) / 2**20:.1f} MB "
          "(keyed by text tower, classes, templates and tokenizer)")
    for e in entries:
        print(f"  {e['bytes'] / 2**20:9.1f} MB  {e['path'].name[:16]}  {cache.describe(e['path'])}")
    return 0
