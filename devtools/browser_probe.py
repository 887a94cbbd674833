"""Where a slider move's time goes between Chromium and the server: ``python -m devtools.browser_probe``.

The page and the server share this machine's clock: the page marks when it sets λ, posts the move
and shows its summary; the server, started by this module with timers around the Merge tab's
listener, its forwards and Gradio's postprocessing of each frame, writes when each ran. The bench
(``python -m devtools bench browser``) times the whole; this splits it. It also reads, from Linux's
/proc, the CPU time the server and Chromium spend per move above what they spend idle. A dev tool:
it wraps functions of the running server only.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MARK_POSTS = """() => { const f = window.fetch; window.fetch = (...a) => {
  if (String(a[0].url || a[0]).includes('queue/join')) (window.__posts = window.__posts || []).push(performance.timeOrigin + performance.now());
  return f(...a); }; }"""


def serve(log: str, argv: list[str]) -> None:
    """The app (``merger app`` arguments), its listener, forwards and postprocessing timed into ``log``.
    MERGER_PROBE_QUEUE_POLL_MS: how often Gradio's queue looks for new events (its own: 1 ms)."""
    import gradio as gr
    import gradio.queueing
    from gradio.blocks import Blocks

    poll_ms = os.environ.get("MERGER_PROBE_QUEUE_POLL_MS")
    if poll_ms:
        queue_init = gradio.queueing.Queue.__init__

        def polling_queue(self, *args, **kwargs):
            queue_init(self, *args, **kwargs)
            self.sleep_when_free = float(poll_ms) / 1e3

        gradio.queueing.Queue.__init__ = polling_queue

    from merger.cli import run
    from merger.evaluation.evaluator import Evaluator
    from merger.ui.merge_events import MergeTabEvents

    out = open(log, "a", buffering=1)
    listener, forward, postprocess = MergeTabEvents.move_or_restore, Evaluator.forward, Blocks.postprocess_data

    def timed_listener(self, request: gr.Request, land_state, experts, method, *values):
        out.write(f"listener {time.time():.4f}\n")
        for i, frame in enumerate(listener(self, request, land_state, experts, method, *values)):
            out.write(f"frame{i} {time.time():.4f}\n")
            yield frame

    def timed_forward(self, *args, **kwargs):
        t = time.time()
        result = forward(self, *args, **kwargs)
        out.write(f"forward {t:.4f} {time.time() - t:.4f}\n")
        return result

    async def timed_postprocess(self, block_fn, predictions, state):
        t = time.time()
        result = await postprocess(self, block_fn, predictions, state)
        if block_fn.fn is not None and getattr(block_fn.fn, "__name__", "") in ("move_of_control", "move_or_restore"):
            out.write(f"postprocess {t:.4f} {time.time() - t:.4f} {len(block_fn.outputs)}\n")
        return result

    MergeTabEvents.move_or_restore, Evaluator.forward, Blocks.postprocess_data = timed_listener, timed_forward, timed_postprocess
    sys.argv = ["merger", *argv]
    run()


def cpu_seconds(pids) -> float:
    """User and system CPU seconds the processes have used so far (Linux: /proc), every thread."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone
            continue
        total += int(fields[11]) + int(fields[12])
    return total / ticks


def chromium_pids() -> list[int]:
    """Every process of the browsers running here (the probe's is the one)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if "chrom" in (entry / "comm").read_text():
                    out.append(int(entry.name))
            except OSError:
                pass
    return out


def cpu_per_move(page, server_pid: int, make_moves, n: int) -> dict:
    """CPU milliseconds per move of the server and of Chromium over ``make_moves()`` (n moves), above
    what each uses idle (measured for 3 s first)."""
    def spent():
        return cpu_seconds([server_pid]), cpu_seconds(chromium_pids())

    t0, idle0 = time.perf_counter(), spent()
    page.wait_for_timeout(3000)
    idle_s, idle1 = time.perf_counter() - t0, spent()
    t1 = time.perf_counter()
    make_moves()
    busy_s, busy1 = time.perf_counter() - t1, spent()
    return {who: 1e3 * ((busy1[i] - idle1[i]) - (idle1[i] - idle0[i]) * busy_s / idle_s) / n
            for i, who in enumerate(("server", "Chromium"))}


def probe(pool: str, moves: int, forward: str = "auto", queue_poll_ms: float | None = None) -> None:
    from playwright.sync_api import sync_playwright

    from devtools.bench_browser import PAUSE_S
    from devtools.bench_live import SET_AND_WAIT, lambda_values
    from devtools.browser import free_port, open_page, start_server

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "times.log"
        log.write_text("")
        port = free_port()
        if queue_poll_ms is not None:
            os.environ["MERGER_PROBE_QUEUE_POLL_MS"] = str(queue_poll_ms)  # read by serve(), in the server
        proc = start_server(pool, port, str(Path(tmp) / "history.sqlite"),
                            extra=("--forward", forward),
                            launcher=[sys.executable, "-m", "devtools.browser_probe", "--serve", str(log)])
        try:
            with sync_playwright() as p:
                browser, page = open_page(p, f"http://127.0.0.1:{port}/")
                page.evaluate(MARK_POSTS)
                page.evaluate(SET_AND_WAIT, ["0.3", 15000])  # the figures' first render
                marks, values = [], lambda_values(moves, seed=1)

                def make_moves():
                    for v in values:
                        marks.append(page.evaluate(SET_AND_WAIT, [v, 15000]))
                        page.wait_for_timeout(1e3 * PAUSE_S)
                cpu = cpu_per_move(page, proc.pid, make_moves, len(values))
                browser.close()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        lines = [line.split() for line in log.read_text().splitlines()]
    times = {kind: [float(x[1]) for x in lines if x[0] == kind] for kind in ("listener", "frame0")}
    forwards = [(float(x[1]), float(x[2])) for x in lines if x[0] == "forward"]
    phases: dict[str, list[float]] = {k: [] for k in ("page until it posts", "post until the listener starts",
                                                     "listener until its first frame", "  of which the forward",
                                                     "first frame until shown", "slider → shown")}
    for m in marks:
        if m is None or not m["posts"]:
            continue
        t0, post, shown = m["t0"] / 1e3, m["posts"][0] / 1e3, m["shown"] / 1e3
        start = min(t for t in times["listener"] if t >= t0)
        frame = min(t for t in times["frame0"] if t >= start)
        fwd = sum(d for t, d in forwards if start <= t <= frame)
        for k, v in zip(phases, (post - t0, start - post, frame - start, fwd, shown - frame, shown - t0)):
            phases[k].append(1e3 * v)
    print(f"Chromium, {pool} pool, --forward {forward}, {len(phases['slider → shown'])} distinct λ values"
          + (f", Gradio's queue polling every {queue_poll_ms:g} ms" if queue_poll_ms is not None else "")
          + "; ms, p50 (min–max):")
    for k, v in phases.items():
        print(f"  {k:<34}{statistics.median(v):7.1f}  ({min(v):.0f}–{max(v):.0f})")
    pp = [(float(x[2]), x[3]) for x in lines if x[0] == "postprocess"]
    print(f"  Gradio's postprocessing of a frame  {1e3 * statistics.median(d for d, _ in pp):7.1f}  "
          f"(listeners of {', '.join(sorted({n for _, n in pp}))} outputs)")
    print(f"CPU per move above idle, ms: the server {cpu['server']:.0f} (every thread of its forward's), "
          f"Chromium {cpu['Chromium']:.0f} (most of it the figures, drawn after the summary shows); "
          f"{os.cpu_count()} cores here")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        serve(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", default="demo")
    parser.add_argument("--moves", type=int, default=20)
    parser.add_argument("--forward", default="auto", help="the app's --forward (auto, fp32, bf16)")
    parser.add_argument("--queue-poll-ms", type=float, default=None,
                        help="how often Gradio's queue looks for new events in the probed server (its own: 1)")
    args = parser.parse_args()
    probe(args.pool, args.moves, args.forward, args.queue_poll_ms)


if __name__ == "__main__":
    main()
