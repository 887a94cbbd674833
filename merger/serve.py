"""The app's server: ``merger-app`` (or ``merger app``, ``python app.py``) ``[--pool demo|POOL.yaml]
[--host 127.0.0.1] [--port 7860]``. Front end: parses the flags, opens the pool, serves the Gradio app."""
from __future__ import annotations

import argparse
import errno
import os
import sys
import threading
import time

from merger import runtime

UPLOAD_LIMIT = 1024  # bytes a browser may upload: the app has no file input
# Gradio kept 10,000 sessions' state by default, about 360 KB each: 2,000 calls took the server from 1.2 to 2.0 GB
MAX_SESSIONS = 100


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1-65535)")
    return port


def parse_args(argv=None, prog: str | None = None):
    from merger.cli_jobs import Parser, add_forward_arg, positive_float, positive_int, user_password, worker_count
    from merger.io.history import DEFAULT_PATH

    ap = Parser(prog=prog, description="merger: interactive model-merging explorer")
    ap.add_argument("--pool", default="demo", help='pool YAML, or "demo" (the built-in pool)')
    ap.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    ap.add_argument("--port", type=_port, default=7860, help="TCP port, 1-65535 (default 7860)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    add_forward_arg(ap)
    ap.add_argument("--history", default=str(DEFAULT_PATH),
                    help="SQLite file of evaluated specs ('' to turn history off)")
    ap.add_argument("--share", action="store_true", help="ask Gradio for a public share link (off by default)")
    ap.add_argument("--auth", type=user_password, default=None, help="user:password required to open the app")
    ap.add_argument("--presenter", type=user_password, default=None,
                    help="user:password of a workshop's presenter (with --auth, the attendees' login): their page "
                    "drives every page that follows")
    ap.add_argument("--ray", default=None, metavar="auto|local|ADDRESS",
                    help="send Sweep / Auto-tune / Landscape jobs to a Ray cluster (the sliders stay here)")
    ap.add_argument("--workers", type=worker_count, default=2, help="with --ray: workers, each opening the pool once")
    ap.add_argument("--max-sessions", type=positive_int, default=MAX_SESSIONS,
                    help=f"browser sessions whose state (pins, landscapes, lab experts) is kept; past it the oldest "
                    f"session's goes (default {MAX_SESSIONS})")
    ap.add_argument("--memory-gb", type=positive_float, default=None,
                    help="the server's memory budget: freed memory goes back to the system, and past the budget "
                    "its caches (results, landscape values, derived states) are dropped (default: 4 GB, or 2x what "
                    "the open pool takes if more)")
    ap.add_argument("--roots", default="", help="comma-separated folders the app may read files from "
                    "(besides the pool's own folder); anything else is refused")
    return ap.parse_args(argv)


def _names_hub(pool: str) -> bool:
    """``hub:NAME``, or a pool YAML with a Hub source (read here only for that: the pool reads it again)."""
    if pool.startswith("hub:"):
        return True
    from merger.pool.hub import names_hub
    from merger.pool.pool import read_pool_yaml

    try:
        return pool != "demo" and names_hub(read_pool_yaml(pool)[0])
    except Exception:  # noqa: BLE001  an unreadable pool is said when the pool opens
        return False


def _estimate_forwards(session) -> None:
    """The base's and experts' live forwards (kept on disk for large pools): from then on a
    weighted-sum move shows its linear estimate at once, before its exact answer."""
    t0 = time.perf_counter()
    try:
        made = session.linear.prepare()
    except Exception as exc:  # the estimate is a convenience: the exact answers go on without it
        print(f"linear estimate unavailable: {exc}", file=sys.stderr, flush=True)
        return
    print(f"linear estimate ready ({made} forwards made, {time.perf_counter() - t0:.1f} s): weighted-sum moves "
          "show it first, then the exact answer", flush=True)


def forward_seconds(evaluator, autocast) -> float:
    """One live forward of the weights in the model, timed with this autocast setting (after a warm-up
    where a forward is short); the evaluator's own setting is kept."""
    setting = evaluator.autocast
    evaluator.autocast = autocast
    try:
        t = time.perf_counter()
        evaluator.forward("live")
        seconds = time.perf_counter() - t
        if seconds < 1.0:
            t = time.perf_counter()
            evaluator.forward("live")
            seconds = time.perf_counter() - t
    finally:
        evaluator.autocast = setting
    return seconds


def bf16_warning(bf16_s: float, fp32_s: float) -> str | None:
    """What --forward bf16 on a CPU gets said when its forward is no faster than fp32's: bf16 matrix
    products are emulated where the CPU lacks the instructions."""
    if bf16_s < fp32_s:
        return None
    return (f"warning: --forward bf16: a live forward took {1e3 * bf16_s:.0f} ms, and {1e3 * fp32_s:.0f} ms in fp32: "
            "this CPU seems to lack bf16 matrix instructions (AVX512-BF16, AMX, Arm's BF16), so its bf16 forwards "
            "are no faster than fp32's, and less precise; --forward auto runs fp32 here")


def main(argv=None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)  # imports no huggingface_hub, which reads HF_HUB_OFFLINE once
    if not _names_hub(args.pool):  # the app reads only what is here, unless its pool is on the Hub
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.presenter and (not args.auth or args.auth[0] == args.presenter[0]):
        print("error: --presenter: " + ("needs --auth, the attendees' login: without it the app cannot tell the "
                                         "presenter from the room" if not args.auth else
                                         f"the presenter's user name must differ from --auth's ({args.auth[0]!r})"),
              file=sys.stderr)
        return 2
    taken = _cannot_bind(args.host, args.port)
    if taken:  # said now, not after the pool's load (seconds to minutes)
        print(f"error: --host {args.host} --port {args.port}: cannot serve there ({taken}); pick another --port, "
              "or --host an address of this machine", file=sys.stderr)
        return 2
    # a kill (SIGTERM) once the server answers stops it as Ctrl+C does, and the process ends as usual: the
    # folder of downloads goes with it; one while the pool opens says "interrupted", as a command does
    return runtime.run_killable(lambda: _open_and_serve(args))


def _open_and_serve(args) -> int:
    import merger
    from merger.cli_jobs import new_folders, set_forward
    from merger.io.history import History

    try:  # the flags' files and folders: said before anything changes in the process
        roots = [r.strip() for r in args.roots.split(",") if r.strip()]
        missing = [r for r in roots if not os.path.isdir(os.path.expanduser(r))]
        if missing:  # a typo would leave the files meant to be read refused, with no hint why
            raise merger.MergerError(f"--roots: {', '.join(missing)}: not a folder")
        new_folders(args, ("history",))
        history = History(args.history) if args.history else None  # named before the pool's minutes
    except merger.MergerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    runtime.configure()  # before Gradio is imported
    from merger.evaluation.memory import limit_arenas

    limit_arenas()  # before the server's threads start (see merger/evaluation/memory.py)
    from merger.ui import build_app

    try:
        pool = merger.open_pool(args.pool, device=args.device, roots=roots)
        session = merger.PoolSession(pool)
        set_forward(session.evaluator, args.forward)
        forward_s = session.measure_live()  # decides whether moves answer progressively
        ev = session.evaluator
        if ev.forwards_in_bf16 and ev.device.type == "cpu":  # asked for: is it faster here? Both timed alike
            with session.queue:  # (measure_live's time may be an earlier run's, from the disk cache)
                bf16_s, fp32_s = forward_seconds(ev, ev.autocast), forward_seconds(ev, False)
            warned = bf16_warning(bf16_s, fp32_s)
            if warned:
                print(warned, file=sys.stderr, flush=True)
        cluster = None
        if args.ray:
            from merger.cluster import Cluster

            # the workers forward as the sliders do, whatever device they are on
            cluster = Cluster(args.ray, pool.source, workers=args.workers, experts=list(pool.experts),
                              autocast=ev.autocast_keeping(ev.forward_precision))
    except merger.MergerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cluster is not None:
        print(f"jobs (Sweep, Auto-tune, Landscape) go to {args.workers} Ray workers ({args.ray})", flush=True)
    from merger.evaluation.memory import MemoryKeeper, default_budget_gb, resident_gb

    held = resident_gb()
    keeper = MemoryKeeper(session, args.memory_gb or default_budget_gb(held))
    if held is not None:
        print(f"memory: {held:.2f} GB held with the pool open; budget {keeper.budget_gb:g} GB (--memory-gb)"
              + ("; over it already: caches will be dropped as they fill" if held > keeper.budget_gb else ""),
              flush=True)
    keeper.start()
    print(f"{pool.name}: one live forward {1e3 * forward_s:.0f} ms"
          f"{' in bf16 autocast' if session.evaluator.forwards_in_bf16 else ''}; " + (
        f"moves answer first on {session.partial_images} images per task, then on all" if session.partial_images
        else "moves answer on the whole live split at once"), flush=True)
    if session.partial_images:  # a slow pool: the linear estimate's forwards, as batch work behind the moves
        threading.Thread(target=_estimate_forwards, args=(session,), name="linear-estimate", daemon=True).start()
    from merger.ui.login import LoginGate
    from merger.ui.plot_draws import PLOT_DRAWS_HEAD

    app = build_app(session, history, cluster=cluster, presenter=args.presenter[0] if args.presenter else None)
    app.queue(default_concurrency_limit=1)
    try:
        try:
            # quiet: Gradio's own lines speak of its Python API (share=True in launch()), not of this app's flags;
            # show_error: an error that is no gr.Error says its message (a short plain-HTTP list got {"error": null})
            # max_file_size: the app takes no file from a browser, so Gradio's upload route takes next to nothing
            auth = LoginGate(dict([args.auth, *([args.presenter] if args.presenter else [])])) if args.auth else None
            app.launch(server_name=args.host, server_port=args.port, share=args.share, auth=auth,
                       footer_links=["api"], css=None, head=PLOT_DRAWS_HEAD, quiet=True, prevent_thread_lock=True,
                       show_error=True, max_file_size=UPLOAD_LIMIT, state_session_capacity=args.max_sessions)
        except OSError:  # taken since the check above
            print(f"error: --host {args.host} --port {args.port}: cannot serve there: the port is taken, or "
                  f"{args.host} is not an address of this machine; pick another --port", file=sys.stderr)
            return 2
        if args.presenter:
            print(f"workshop room: the page signed in as {args.presenter[0]!r} drives every page that follows", flush=True)
        print(f"serving {pool.name} at {app.local_url}" + (f" and {app.share_url}" if args.share and app.share_url else "")
              + " (Ctrl+C stops it)", flush=True)
        app.block_thread()  # Ctrl+C or a kill here closes the server (Gradio's own handling)
    except KeyboardInterrupt:  # one during the launch: the server may already answer, so it is a stop
        app.close()
    return 0


def _cannot_bind(host: str, port: int) -> str | None:
    """Why (host, port) cannot be served, or None (the server binds it a moment later). As the server
    does, an address this machine lacks (::1 with IPv6 off) is skipped where another one binds."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"{host} is not a host name or address here: {exc.strerror or exc}"
    reasons = []
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(address)
            return None
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return "the port is taken" if exc.errno == errno.EADDRINUSE else f"{exc.strerror or exc}"
            reasons.append(exc.strerror or str(exc))
    return "; ".join(dict.fromkeys(reasons)) or f"{host} has no address"


def run() -> None:
    """The ``merger-app`` command."""
    sys.exit(main())
