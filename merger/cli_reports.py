"""Command line, the commands that measure and look after: ``report``, ``cache`` and ``pools``
(``merger/cli.py`` parses and dispatches). Front end."""
from __future__ import annotations

from merger.errors import MergerError


def cmd_report(args) -> int:
    from merger.pool.pool import open_pool

    if args.what == "session":
        return _session_report(args)
    pool = open_pool(args.pool)
    if args.what == "adaptive":
        from merger.reports.adaptive import adaptive_numbers, format_adaptive

        print("data-driven merges on the test split (coefficients learned on the validation split)")
        print(format_adaptive(adaptive_numbers(pool)))
    elif args.what == "methods":
        from merger.reports.methods import format_methods, method_rows

        print(format_methods(method_rows(pool), pool.tasks))
    elif args.what == "linear":
        from merger.reports.linear import report_linear

        print(report_linear(pool))
    else:
        from merger.reports.phenomena import format_phenomena, phenomena

        print(format_phenomena(phenomena(pool)))
    return 0


def _session_report(args) -> int:
    from merger.evaluation.session import session_for
    from merger.io import inputs
    from merger.pool.pool import open_pool
    from merger.reports.session import parse_specs, session_report, write_report

    if not args.out:
        raise MergerError("report session: give --out FILE.html")
    out = inputs.check_path(args.out, "--out", MergerError).expanduser()
    inputs.check_output_file(out, "--out", MergerError)  # a folder or an unwritable place: said before any work
    history, views = None, {}
    if args.history:  # read only: a typo must not leave a new empty history behind
        history = inputs.check_path(args.history, "--history", MergerError).expanduser()
        if not history.is_file():
            raise MergerError(f"--history {args.history}: no such file (the SQLite history the app or "
                              "`merger eval` writes)")
    pool = open_pool(args.pool)
    specs = parse_specs(pool, args.specs or [])
    if history is not None:
        from merger.io.history import History
        from merger.reports.session import history_sweeps

        views = history_sweeps(History(history), pool)  # a file that is no history: History says so
    written = write_report(out, session_report(session_for(pool), specs, args.split, views=views))
    print(f"wrote {written}: {len(specs)} merges on the {args.split} split"
          + (f", {len(views)} sweep figure(s) from {args.history}" if args.history else "") + ", one file that opens offline")
    return 0


def cmd_cache(args) -> int:
    from merger.data.heads import heads_cache_dir
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


def cmd_pools(args) -> int:
    """``merger pools``: the known Hub benchmarks, their sizes and whether they are here; ``pools fetch
    NAME``: fetch one (or a pool YAML's Hub sources) without opening it."""
    from merger.pool import hub, known

    if args.action == "fetch":
        if not args.name:
            raise MergerError("pools fetch: name a pool (merger pools lists them) or a pool YAML")
        from merger.pool.pool import read_pool_yaml

        if args.name.startswith("hub:") or args.name in known.names():
            name = args.name.removeprefix("hub:")
            spec, where = known.pool_spec(name), f"hub:{name}"
        else:
            spec, path = read_pool_yaml(args.name)
            where = str(path)
        _, sources = hub.resolve_sources(spec, where)
        print(hub.describe(sources))
        print(f"{where}: every source is in {hub.cache_dir()}; it opens offline from now on")
        return 0
    ask, rows = True, []  # until the Hub does not answer: then the cache alone says what is here
    for name in known.names():
        spec = known.pool_spec(name)
        try:
            files, size, here = hub.status(hub.sources_of(spec, f"hub:{name}"), ask_hub=ask)
        except MergerError as exc:  # said once, above the table
            print(f"the Hub did not answer ({str(exc).split(': ', 2)[-1][:160]}); listing what the cache holds")
            ask = False
            files, size, here = hub.status(hub.sources_of(spec, f"hub:{name}"), ask_hub=False)
        rows.append((name, spec["architecture"], len(spec["experts"]), files or "?",
                     f"{size / 2**30:.2f}" if size is not None else "?", here))
    width = max(len("architecture"), *(len(r[1]) for r in rows)) + 2
    print(f"{'pool':<22}{'architecture':<{width}}{'experts':>8}{'files':>7}{'GB':>8}  here")
    for name, arch, experts, files, gb, here in rows:
        print(f"{name:<22}{arch:<{width}}{experts:>8}{files:>7}{gb:>8}  {here}")
    print(f"cache: {hub.cache_dir()}" + ("; offline (HF_HUB_OFFLINE=1): sizes need the Hub" if hub.offline() else ""))
    return 0
