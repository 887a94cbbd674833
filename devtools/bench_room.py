"""``python -m devtools bench room``: a workshop room on the demo pool. One presenter (Chromium)
moves λ; 30 pages follow: two Chromium pages and 28 HTTP clients of the ``room`` endpoint. Per
move: the time from the presenter's Enter to the number shown on each follower (p50 / p95), and
the server's forwards (one per move, whatever the followers); the server's memory before and after.
"""
from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from http.cookiejar import CookieJar
from pathlib import Path

from devtools.bench_live import event_stream
from devtools.bench_soak import rss_of
from devtools.measure import percentile

ROOM, ROOM_PW, HOST, HOST_PW = "workshop", "room-pw", "host", "host-pw"
MOVES = (0.35, 0.5, 0.65, 0.8, 0.95, 0.2, 0.45, 0.6, 0.75, 0.9, 0.25, 0.4, 0.55, 0.7, 0.85)  # on λ's step


def signed_in(url: str, user: str, password: str) -> urllib.request.OpenerDirector:
    """An HTTP client holding the login cookie of an app started with --auth."""
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(CookieJar()))
    opener.open(f"{url}login", data=urllib.parse.urlencode({"username": user, "password": password}).encode(),
                timeout=30)
    return opener


def room_states(opener, url: str, since: int = -1, timeout: float = 30.0):
    """Generator: the room's state (the ``room`` endpoint's JSON) each time it changes."""
    req = urllib.request.Request(f"{url}gradio_api/call/room", data=json.dumps({"data": [since]}).encode(),
                                 headers={"Content-Type": "application/json"})
    event = json.loads(opener.open(req, timeout=timeout).read())["event_id"]
    with opener.open(f"{url}gradio_api/call/room/{event}", timeout=timeout) as stream:
        for kind, data in event_stream(stream):
            if kind == "generating":
                yield json.loads(data)[0]


class Watcher(threading.Thread):
    """An HTTP follower: the time each merge label reached it."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.seen, self.errors = url, [], []

    def run(self):
        try:
            for state in room_states(signed_in(self.url, ROOM, ROOM_PW), self.url, timeout=120):
                self.seen.append((time.time(), state))
        except Exception as exc:  # noqa: BLE001  counted and printed
            self.errors.append(str(exc)[:200])


SEEN_JS = """() => { window.__seen = []; let last = null;
  setInterval(() => { const m = (document.querySelector('#summary') || {}).innerText?.match(/lam=([0-9.]+)/);
    const acc = document.querySelector('#avg-acc');
    if (m && acc && m[1] !== last) { last = m[1]; window.__seen.push([m[1], Date.now() / 1000, acc.title]); } }, 10); }"""


def bench_room(args) -> int:
    from playwright.sync_api import sync_playwright

    from devtools import browser

    http_followers = (args.clients or 30) - 2
    with tempfile.TemporaryDirectory() as tmp:
        port = browser.free_port()
        url = f"http://127.0.0.1:{port}/"
        proc = browser.start_server(args.pool, port, str(Path(tmp) / "history.sqlite"),
                                    extra=["--auth", f"{ROOM}:{ROOM_PW}", "--presenter", f"{HOST}:{HOST_PW}"])
        try:
            with sync_playwright() as p:
                b = p.chromium.launch(executable_path=browser.CHROMIUM, headless=True, args=browser.CHROMIUM_FLAGS)
                presenter = browser.signed_in_page(b, url, HOST, HOST_PW)
                before_mb = 1024 * rss_of(proc.pid)
                pages = [browser.signed_in_page(b, url, ROOM, ROOM_PW) for _ in range(2)]
                watchers = [Watcher(url) for _ in range(http_followers)]
                for w in watchers:
                    w.start()
                for page in (presenter, *pages):
                    page.evaluate(SEEN_JS)
                time.sleep(3)  # every follower is in the room
                rows = []
                for lam in MOVES[:args.moves or len(MOVES)]:
                    t0 = time.time()
                    browser.type_lambda(presenter, lam)
                    label = f"{lam:g}"
                    deadline = time.time() + 10
                    while time.time() < deadline:
                        got = [_arrival(w.seen, label) for w in watchers] + [_page_arrival(pg, label) for pg in pages]
                        if all(t is not None for t in got):
                            break
                        time.sleep(0.05)
                    time.sleep(0.5)  # anything a follower's page would compute has been computed
                    rows.append({"lam": lam, "presenter": _page_arrival(presenter, label), "t0": t0, "http": got[:-2],
                                 "chromium": got[-2:]})
                browser.type_lambda(presenter, 0.15)  # one more move (a λ no move had): the forwards the last one set off count
                time.sleep(2)
                averages = {pg.locator("#avg-acc").get_attribute("title") for pg in (presenter, *pages)}
                after_mb = 1024 * rss_of(proc.pid)
                b.close()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    _count_forwards(rows, watchers[0].seen)
    return _print(rows, http_followers, before_mb, after_mb, averages, [e for w in watchers for e in w.errors])


def _count_forwards(rows, seen) -> None:
    """The server's forwards from one version of the room to the next, as a follower saw them: the
    presenter's move and whatever the followers' pages computed after the previous one."""
    states = [state for _, state in seen]
    for row in rows:
        at = next((i for i, st in enumerate(states) if st.get("merge") and f"lam={row['lam']:g})" in st["merge"]), None)
        following = at is not None and at + 1 < len(states)
        row["forwards"] = states[at + 1]["forwards"] - states[at]["forwards"] if following else None
        row["followers"] = states[at]["followers"] if at is not None else 0


def _arrival(seen, label: str):
    return next((t for t, state in seen if state.get("merge") and f"lam={label})" in state["merge"]), None)


def _page_arrival(page, label: str):
    return next((t for lam, t, _ in page.evaluate("window.__seen") if lam == label), None)


def _print(rows, http_followers, before_mb, after_mb, averages, errors) -> int:
    def lag(times, t0):
        return [t - t0 for t in times if t is not None]

    http = [x for r in rows for x in lag(r["http"], r["t0"])]
    chromium = [x for r in rows for x in lag(r["chromium"], r["t0"])]
    own = [x for r in rows for x in lag([r["presenter"]], r["t0"])]
    missed = sum(t is None for r in rows for t in r["http"] + r["chromium"])
    every = http + chromium
    print(f"room: 1 presenter (Chromium) + {len(rows[0]['chromium'])} Chromium followers + {http_followers} HTTP "
          f"followers (the room endpoint); {len(rows)} presenter moves of λ typed + Enter; demo pool, this machine")
    print(f"\n{'presenter Enter → shown':<34}{'p50 ms':>8}{'p95 ms':>8}{'n':>6}")
    for name, xs in (("on the presenter's own page", own), ("on a Chromium follower", chromium),
                     ("on an HTTP follower", http), ("on any follower", every)):
        if xs:
            print(f"{name:<34}{1e3 * statistics.median(xs):8.0f}{1e3 * percentile(xs, 0.95):8.0f}{len(xs):6d}")
    forwards = [r["forwards"] for r in rows]
    print(f"\nforwards per presenter move: {', '.join(map(str, forwards))} (goal: 1 each, with "
          f"{rows[-1]['followers']} pages following and {http_followers} HTTP watchers)")
    print(f"follower arrivals missed (none within 10 s): {missed}; errors: {len(errors)}")
    print(f"average accuracy on the three Chromium pages at the end: {', '.join(sorted(averages))} "
          f"({'equal' if len(averages) == 1 else 'DIFFERENT'})")
    print(f"server memory: {before_mb:.0f} MB with the presenter alone, {after_mb:.0f} MB after the run "
          f"(+{after_mb - before_mb:.0f} MB)")
    for e in errors[:3]:
        print("  error:", e)
    ok = every and percentile(every, 0.95) <= 1.0 and all(f == 1 for f in forwards) and not missed \
        and not errors and len(averages) == 1
    print("goals (p95 ≤ 1 s, one forward per move, every follower reached): " + ("met" if ok else "MISSED"))
    return 0 if ok else 1
