"""Benchmarks of what a person feels: ``python -m devtools bench {live,workshop}`` (and the page's
tools that ``bench browser``, in devtools/bench_browser.py, shares).

live: the Merge tab's listener in process (spec → plots, landscape marker), with the forwards and
method applies each move costs. workshop: ten clients drag while two browsers run batch jobs.
"""
from __future__ import annotations

import math
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from merger.errors import MergerError, listed
from devtools.measure import LIVE_METHODS, naive_evaluation, percentile


def answer_kind(summary: str) -> str:
    """What a Merge-tab summary shows: the linear estimate, a partial answer, or the complete one."""
    return "estimate" if "linear estimate" in summary else "partial" if "partial" in summary else "complete"


def merge_tab_controls(pool, method, lam):
    """The Merge tab's inputs for ``method`` at its defaults, λ = ``lam``."""
    from merger import methods
    from merger.ui.controls import control_values, default_params

    m = methods.get(method)
    params = {**default_params(m, len(pool.tasks)), "lam": lam}
    return [list(pool.tasks), method, *control_values(m, params, len(pool.tasks))]


# ---- live: the listener in process -----------------------------------------------------------

def bench_live(args) -> int:
    from merger.evaluation.session import PoolSession
    from merger.pool.pool import open_pool
    from merger.ui.landscape_tab import LandscapeController
    from merger.ui.merge_events import MergeTabEvents
    from merger.ui.merge_tab import Controller

    pool = open_pool(args.pool)
    t0 = time.perf_counter()
    session = PoolSession(pool)
    forward_s = session.measure_live()
    ctl = Controller(session)
    lc = LandscapeController(ctl)
    events = MergeTabEvents(ctl, LIVE_METHODS[0], lc)
    noop = lambda *a, **k: None  # noqa: E731
    *_, (state, _) = lc.compute(None, [], "pca", None, None, "", "loss", "all tasks (mean)", 7, "contour", [],
                                *merge_tab_controls(pool, LIVE_METHODS[0], 0.3), progress=noop)
    person = SimpleNamespace(session_hash="bench")
    for m in LIVE_METHODS:  # preparations are per method and expert subset, not per move
        list(events.move(person, state, *merge_tab_controls(pool, m, 0.3)))
    setup = time.perf_counter() - t0
    print(f"{pool.name}: {len(pool.tasks)} tasks; one full live forward {1e3 * forward_s:.0f} ms "
          f"(progressive answers {'on: ' + str(session.partial_images) + ' images first' if session.partial_images else 'off'}); "
          f"set-up {setup:.1f} s; torch threads {torch.get_num_threads()}")
    moves = args.moves if args.moves_given else 20
    lams = [round(0.05 * i, 2) for i in range(1, moves + 2) if round(0.05 * i, 2) != 0.3][:moves]
    rows, ok = [], True
    for m in LIVE_METHODS:
        times, fwd, app = [], [], []
        for lam in lams:
            f0, a0 = session.evaluator.forwards, session.counts["applies"]
            t = time.perf_counter()
            list(events.move(person, state, *merge_tab_controls(pool, m, lam)))
            times.append(time.perf_counter() - t)
            fwd.append(session.evaluator.forwards - f0)
            app.append(session.counts["applies"] - a0)
        f0, a0 = session.evaluator.forwards, session.counts["applies"]
        t = time.perf_counter()
        list(events.move(person, state, *merge_tab_controls(pool, m, lams[0])))  # a value seen before
        hit = time.perf_counter() - t
        hit_work = (session.evaluator.forwards - f0, session.counts["applies"] - a0)
        naive = []
        for lam in lams[: args.naive]:
            t = time.perf_counter()
            naive_evaluation(pool.source, m, {"lam": lam})
            naive.append(time.perf_counter() - t)
        p50 = statistics.median(times)
        rows.append((m, p50, percentile(times, 0.95), statistics.mean(fwd), statistics.mean(app), hit, hit_work,
                     statistics.median(naive) if naive else float("nan")))
        ok &= max(fwd) == 1 and max(app) <= 1 and hit_work == (0, 0)
    print(f"\n{'method':<18}{'move p50 ms':>12}{'p95 ms':>8}{'forwards':>10}{'applies':>9}{'hit ms':>8}"
          f"{'hit work':>10}{'naive ms':>10}{'ratio':>7}")
    for m, p50, p95, f, a, hit, hw, naive in rows:
        print(f"{m:<18}{1e3 * p50:12.1f}{1e3 * p95:8.1f}{f:10.2f}{a:9.2f}{1e3 * hit:8.1f}{str(hw):>10}"
              f"{1e3 * naive:10.0f}{naive / p50:6.0f}x")
        ok &= p50 <= 0.150
    print(f"\nmove = MergeTabEvents.move, the listener every Merge control fires: spec → merge → forward → "
          f"accuracy/loss/radar figures, summary, data-driven panel and the landscape marker ({len(lams)} distinct λ "
          f"per method, all cache misses); hit = the same move again; naive = open, merge, preprocess, forward from scratch.")
    print("goals: 1 forward and <= 1 apply per move, 0 on a hit, p50 <= 150 ms: " + ("met" if ok else "MISSED"))
    return 0 if ok else 1


# ---- browser: Chromium like a person ---------------------------------------------------------

SET_AND_WAIT = """async ([value, timeout]) => {
  const slider = document.querySelector('#ctl-lam input[type=range]');
  const summary = document.querySelector('#summary');
  const want = '(lam=' + value + ')';
  window.__posts = [];
  const t0 = performance.timeOrigin + performance.now();
  return await new Promise((resolve) => {
    const done = () => { if (summary.innerText.includes(want)) { obs.disconnect();
      resolve({t0, shown: performance.timeOrigin + performance.now(), posts: window.__posts}); } };
    const obs = new MutationObserver(done);
    obs.observe(summary, {subtree: true, childList: true, characterData: true, attributes: true});
    slider.value = value;
    slider.dispatchEvent(new Event('input', {bubbles: true}));
    slider.dispatchEvent(new Event('change', {bubbles: true}));
    setTimeout(() => { obs.disconnect(); resolve(null); }, timeout);
  });
}"""  # page clock (ms since the epoch): when λ was set and when the summary showed it; null: not shown


def lambda_values(moves: int, seed: int = 0, negative: bool = False) -> list[str]:
    """Distinct λ values on the slider's steps (not its 0.3 start), in a shuffled order: each a cache miss.
    ``negative``: from −0.05 to −3 (task negation), none of which the positive ones (0.05 to 2) repeat."""
    values = [f"{(-0.05 if negative else 0.05) * i:.2f}".rstrip("0").rstrip(".") for i in range(1, 61 if negative else 41)]
    values = [v for v in values if v != "0.3"]
    random.Random(seed).shuffle(values)
    return values[:moves]


def _server(pool: str, tmp: str, forward: str = "auto"):
    from devtools.browser import free_port, start_server

    port = free_port()
    proc = start_server(pool, port, str(Path(tmp) / f"history-{port}.sqlite"), extra=("--forward", forward))
    return proc, f"http://127.0.0.1:{port}/"


def _stop(proc) -> None:
    from devtools.browser import server_log

    proc.terminate()
    proc.wait(timeout=30)
    problems = [line for line in server_log(proc).splitlines() if "Error" in line or "Traceback" in line]
    if problems:
        print(f"the server logged {len(problems)} error line(s); first: {problems[0][:300]}")


# ---- workshop: a room of people --------------------------------------------------------------

JOBS = {  # what a batch job clicks, and what shows it is done
    "sweep": ("Compare", "Sweep", "#sweep-plot .js-plotly-plot"),
    "autotune": ("Compare", "Auto-tune", "#tune-bars .js-plotly-plot"),
    "landscape": ("Landscape", "Compute landscape", "#landscape-plot .js-plotly-plot"),
}


def _job(p, url: str, name: str, out: dict, started: threading.Event | None = None, timeout_s: float = 600) -> None:
    from devtools.browser import open_page

    tab, button, done = JOBS[name]
    browser, page = open_page(p, url)
    try:
        page.get_by_role("tab", name=tab).click()
        if started is not None:
            started.wait()
        t = time.perf_counter()
        page.get_by_role("button", name=button, exact=True).click()
        try:
            page.locator(done).first.wait_for(timeout=1000 * timeout_s)
            out[name] = time.perf_counter() - t
        except Exception:  # reported as not finished
            out[name] = math.inf
    finally:
        browser.close()


def _jobs(url: str, names, started=None, timeout_s: float = 600) -> dict:
    """Each job in its own browser (and thread: Playwright's sync API is per thread)."""
    from playwright.sync_api import sync_playwright

    out: dict = {}

    def one(name):
        with sync_playwright() as p:
            _job(p, url, name, out, started, timeout_s)

    threads = [threading.Thread(target=one, args=(n,)) for n in names]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return out


def call_endpoint(url: str, api_name: str, data: list, timeout: float = 120.0):
    """One call of a Gradio endpoint over plain HTTP (POST, then read the event's stream): a light
    client, so ten of them do not eat the CPU the server needs."""
    import json
    import urllib.request

    req = urllib.request.Request(f"{url}gradio_api/call/{api_name}", data=json.dumps({"data": data}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        event = json.loads(r.read())["event_id"]
    with urllib.request.urlopen(f"{url}gradio_api/call/{api_name}/{event}", timeout=timeout) as r:
        for kind, data in event_stream(r):
            if kind == "complete":
                return json.loads(data)
    raise RuntimeError("the event stream ended without a result")


def event_stream(lines):
    """(event, data) of each message of a Gradio call's event stream; an error event raises."""
    kind = None
    for raw in lines:
        line = raw.decode().strip()
        if line.startswith("event:"):
            kind = line[6:].strip()
        elif line.startswith("data:"):
            if kind == "error":
                raise RuntimeError(line[5:].strip()[:200])
            yield kind, line[5:]


WARM_UP_S = 20.0  # the room drags before anyone starts a batch job


def bench_workshop(args) -> int:
    from merger.evaluation.tuning import grid_points
    from merger.ui.endpoint import endpoint_data

    names = [n.strip() for n in args.jobs.split(",") if n.strip()]
    unknown = [n for n in names if n not in JOBS]
    if unknown or not names:
        raise MergerError(f"--jobs {args.jobs!r}: " + (f"unknown {listed(unknown)}" if unknown else "no job named")
                          + f"; known: {', '.join(JOBS)}")
    draggers = args.clients or 10
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = _server(args.pool, tmp)
        try:
            solo = {}
            for n in names:  # each alone (different splits and grids: no job reuses another's results)
                solo.update(_jobs(url, [n]))
        finally:
            _stop(proc)
        proc, url = _server(args.pool, tmp)  # a fresh server: nothing cached
        stop, started = threading.Event(), threading.Event()
        lat, during, errors, lock = [], [], [], threading.Lock()

        def dragger(i):
            rng = random.Random(i)
            m = LIVE_METHODS[i % len(LIVE_METHODS)]
            while not stop.is_set():
                lam = round(0.05 + 0.1 * rng.randrange(0, 20), 2)  # odd slider steps: never a sweep point
                params = {**rng.choice(grid_points(m)), "lam": lam}
                data = endpoint_data(m, **params)
                t = time.perf_counter()
                try:
                    call_endpoint(url, "evaluate", data)
                    with lock:
                        (during if started.is_set() else lat).append(time.perf_counter() - t)
                except Exception as exc:  # counted and reported
                    with lock:
                        errors.append(str(exc)[:200])
                time.sleep(rng.uniform(0.5, 1.5))  # a person looks at the result before the next move

        try:
            threads = [threading.Thread(target=dragger, args=(i,), daemon=True) for i in range(draggers)]
            for th in threads:
                th.start()
            loaded = {}
            job = threading.Thread(target=lambda: loaded.update(_jobs(url, names, started, timeout_s=900)))
            job.start()
            time.sleep(WARM_UP_S)
            started.set()
            job.join()
            stop.set()
            for th in threads:
                th.join(timeout=60)
        finally:
            _stop(proc)
    p50, p95 = statistics.median(during), percentile(during, 0.95)
    print(f"{draggers} people dragging (the evaluate endpoint over HTTP; each looks 0.5-1.5 s at a result before "
          f"the next move, over the slider grid of {', '.join(LIVE_METHODS)}); after {WARM_UP_S:.0f} s "
          f"{len(names)} browsers start {', '.join(names)} at once; demo pool, this machine")
    print(f"\n{'while the jobs ran':<26}{'':>8}")
    print(f"{'  slider p50 ms':<26}{1e3 * p50:8.0f}")
    print(f"{'  slider p95 ms':<26}{1e3 * p95:8.0f}   (goal <= 800)")
    print(f"{'  moves answered':<26}{len(during):8d}")
    if lat:
        print(f"{'before (warm-up) p95 ms':<26}{1e3 * percentile(lat, 0.95):8.0f}   ({len(lat)} moves)")
    print(f"{'errors':<26}{len(errors):8d}   (goal 0)")
    print(f"\n{'batch job':<12}{'alone s':>9}{'in the room s':>15}{'ratio':>8}   (goal <= 2.0)")
    ok = p95 <= 0.800 and not errors
    for n in names:
        ratio = loaded[n] / solo[n]
        ok &= ratio <= 2.0
        print(f"{n:<12}{solo[n]:9.1f}{loaded[n]:15.1f}{ratio:8.2f}")
    for e in errors[:5]:
        print("  error:", e)
    print("goals: " + ("met" if ok else "MISSED"))
    return 0 if ok else 1
