"""``python -m devtools bench soak``: an hour of a workshop compressed, with the server's memory
sampled throughout. Rounds of a person in Chromium (a new page each: λ moves, a method switch, a
pin, Compare, a landscape, a lab expert, then the page closes) while plain HTTP clients call the
evaluate endpoint (each call its own Gradio session, as scripts and the attack catalogue make
them). The server runs with ``--memory-gb``; its resident memory is read every second.

Goal: after the warm-up rounds (every first use: figures, landscapes, the lab's optimiser) the
resident memory stays within 10 % of where the warm-up left it, and under the budget."""
from __future__ import annotations

import random
import re
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from merger import methods
from devtools.measure import LIVE_METHODS

WARM_UP_ROUNDS = 2
FLAT = 0.10  # the most the resident memory may grow after the warm-up, as a fraction of it
IDLE_S = 12.0  # between rounds: longer than the server's memory check (every 10 s)


def rss_of(pid: int) -> float:
    """Resident memory of a process in GB: /proc where there is one, else ps (macOS, BSD)."""
    status = Path(f"/proc/{pid}/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 2**20
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return int(out) / 2**20 if out else float("nan")


class Sampler(threading.Thread):
    """The server's resident memory every ``every`` seconds, with the phase it was taken in."""

    def __init__(self, pid: int, every: float = 1.0):
        super().__init__(daemon=True)
        self.pid, self.every = pid, every
        self.samples: list[tuple[float, float, str]] = []
        self.phase = "start"
        self._halt = threading.Event()

    def run(self):
        t0 = time.monotonic()
        while not self._halt.is_set():
            self.samples.append((time.monotonic() - t0, rss_of(self.pid), self.phase))
            self._halt.wait(self.every)

    def stop(self):
        self._halt.set()
        self.join()


def person_round(page, url: str, rng: random.Random) -> None:
    """What one person does in a page: moves, a method switch, a pin, Compare, a landscape, a lab
    expert. Each step waits until the page shows its answer."""
    from devtools.browser import shown

    page.goto(url)
    page.locator("#avg-acc").wait_for(timeout=90_000)
    box = page.locator("#ctl-lam input[type=number]")
    for _ in range(5):
        before = shown(page)["params"]
        box.fill(f"{rng.randint(1, 30) * 0.05:.2f}")
        box.press("Enter")
        _until(lambda: shown(page)["params"] != before, 30)
    switched = LIVE_METHODS[1]  # the second featured method (the page opens on the first)
    page.locator("#ctl-method input").click()
    page.get_by_role("option", name=methods.get(switched).display_name).click()
    _until(lambda: shown(page)["method"] == switched, 60)
    page.locator("#pin").click()
    page.get_by_text("Pinned:").wait_for(timeout=30_000)
    page.get_by_role("tab", name="Compare").click()
    page.get_by_role("button", name="Compare pinned merges").click()
    page.locator("#compare-bars .js-plotly-plot").first.wait_for(timeout=60_000)
    page.get_by_role("tab", name="Landscape").click()
    page.get_by_role("button", name="Compute landscape").click()
    page.locator("#landscape-plot .main-svg").first.wait_for(timeout=300_000)
    page.get_by_role("tab", name="Analysis").click()
    page.get_by_role("tab", name="Expert lab").click()
    page.get_by_role("button", name="Fine-tune and add").click()
    page.get_by_text("added").first.wait_for(timeout=300_000)


def _until(check, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise TimeoutError("the page did not show the answer in time")


def http_clients(url: str, calls: int, done: threading.Event, out: dict) -> None:
    """``calls`` evaluate calls over plain HTTP, each its own session, paced over the soak."""
    from devtools.bench_live import call_endpoint
    from merger.ui.endpoint import endpoint_data

    rng = random.Random(1)
    errors, made = [], 0
    while made < calls and not done.is_set():
        lam = rng.randint(1, 60) * 0.05
        try:
            call_endpoint(url, "evaluate", endpoint_data(LIVE_METHODS[0], lam=round(lam, 2)))
        except Exception as exc:  # counted and reported
            errors.append(str(exc)[:200])
        made += 1
    out.update(made=made, errors=errors)


def bench_soak(args) -> int:
    from playwright.sync_api import sync_playwright

    from devtools.bench_live import _stop
    from devtools.browser import CHROMIUM, CHROMIUM_FLAGS, free_port, server_log, start_server

    rounds = args.rounds or 12
    calls = args.calls or 2000
    budget = args.memory_gb
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        extra = ["--memory-gb", str(budget)] if budget else []
        proc = start_server(args.pool, port, str(Path(tmp) / "history.sqlite"), extra=extra)
        url = f"http://127.0.0.1:{port}/"
        sampler = Sampler(proc.pid)
        sampler.start()
        done, http = threading.Event(), {}
        client = threading.Thread(target=http_clients, args=(url, calls, done, http), daemon=True)
        t0 = time.monotonic()
        failed = []
        try:
            client.start()
            rng = random.Random(0)
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
                for i in range(rounds):
                    sampler.phase = f"round {i + 1}"
                    page = browser.new_page(viewport={"width": 1400, "height": 1000})
                    started = time.monotonic()
                    try:
                        person_round(page, url, rng)
                        print(f"round {i + 1}: {time.monotonic() - started:.0f} s, server RSS "
                              f"{rss_of(proc.pid):.2f} GB", flush=True)
                    except Exception as exc:  # counted; the soak goes on
                        failed.append(f"round {i + 1}: {type(exc).__name__}: {str(exc)[:160]}")
                    finally:
                        page.close()  # the page's session ends (Gradio's unload)
                    sampler.phase = f"idle {i + 1}"
                    time.sleep(IDLE_S)  # a person reads; the server hands freed memory back meanwhile
                browser.close()
            sampler.phase = "HTTP calls left"
            client.join(timeout=600)
        finally:
            done.set()
            wall = time.monotonic() - t0
            time.sleep(2)
            sampler.stop()
            said = re.search(r"budget ([0-9.]+) GB", server_log(proc))
            _stop(proc)
    return report(sampler.samples, rounds, http, failed, wall, float(said.group(1)) if said else budget)


def report(samples, rounds: int, http: dict, failed: list[str], wall: float, budget: float | None) -> int:
    """Per round: the peak while the person worked and the resident memory once idle after it; the
    goal compares both with the warm-up's (the last warm-up round's)."""
    peaks: dict[int, float] = {}
    idle: dict[int, float] = {}
    for _, rss, phase in samples:
        kind, _, n = phase.partition(" ")
        if kind in ("round", "idle") and n.isdigit():
            peaks[int(n)] = max(peaks.get(int(n), 0.0), rss)
            if kind == "idle":
                idle[int(n)] = rss  # the last sample of the pause
    print(f"soak: {rounds} rounds of a person in Chromium (5 λ moves, a method switch, a pin, Compare, a landscape, "
          f"a lab expert; a new page each, closed after it, then {IDLE_S:g} s idle) and {http.get('made', 0)} "
          f"evaluate calls over plain HTTP meanwhile, each its own session; {wall / 60:.1f} min; the server's "
          "resident memory read every second")
    print(f"\n{'round':>5}{'peak GB':>10}{'idle GB':>10}")
    print(f"{'start':>5}{samples[0][1]:10.2f}")
    for n in sorted(peaks):
        print(f"{n:>5}{peaks[n]:10.2f}{idle.get(n, float('nan')):10.2f}" + ("   (warm-up)" if n <= WARM_UP_ROUNDS else ""))
    errors = http.get("errors", [])
    print(f"\n{'HTTP errors':<34}{len(errors):>8}   (goal 0)" + (f"; first: {errors[0]}" if errors else ""))
    print(f"{'rounds that failed':<34}{len(failed):>8}   (goal 0)" + (f"; first: {failed[0]}" if failed else ""))
    later = [n for n in peaks if n > WARM_UP_ROUNDS and n in idle]
    if WARM_UP_ROUNDS not in idle or not later:
        print("goals: MISSED (too few rounds to tell the warm-up from the rest)")
        return 1
    idle_growth = max(idle[n] for n in later) / idle[WARM_UP_ROUNDS] - 1
    peak_growth = max(peaks[n] for n in later) / max(peaks[n] for n in peaks if n <= WARM_UP_ROUNDS) - 1
    print(f"{'idle after the warm-up GB':<34}{idle[WARM_UP_ROUNDS]:8.2f}   later at most "
          f"{max(idle[n] for n in later):.2f}: {100 * idle_growth:+.1f} % (goal <= {100 * FLAT:.0f} %)")
    print(f"{'peak during the warm-up GB':<34}{max(peaks[n] for n in peaks if n <= WARM_UP_ROUNDS):8.2f}   later at "
          f"most {max(peaks[n] for n in later):.2f}: {100 * peak_growth:+.1f} % (goal <= {100 * FLAT:.0f} %)")
    top = max(r for _, r, _ in samples)
    if budget:
        print(f"{'budget (--memory-gb) GB':<34}{budget:8.2f}   peak {top:.2f} (goal: under it)")
    ok = (idle_growth <= FLAT and peak_growth <= FLAT and not errors and not failed and (not budget or top <= budget))
    print("goals: " + ("met" if ok else "MISSED"))
    return 0 if ok else 1
