"""Drive the app in a real browser (Debian's Chromium through Playwright).

Used by the browser test and by ``python -m devtools screenshot``, so the README's picture comes
from the same code path the test checks. Never downloads a browser: it uses /usr/bin/chromium.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CHROMIUM = os.environ.get("MERGER_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
INSTALL_HINT = ("install it with `apt-get install -y chromium` and `pip install playwright` "
                "(never `playwright install`)")


def browser_missing() -> str | None:
    """Why no browser test can run here, or None."""
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        return f"Chromium not found at {CHROMIUM}: {INSTALL_HINT}"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return f"the playwright package is missing: {INSTALL_HINT}"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(pool: str, port: int, history: str, timeout: float = 120.0, extra=(), launcher=None) -> subprocess.Popen:
    """``merger app`` on a loopback port; returns once the page answers. Its output goes to a
    log next to the history (``server_log(proc)``): a pipe nobody reads would block the server once
    its buffer is full. ``launcher``: the command that takes ``app``'s arguments (``python -m merger``)."""
    log = Path(history).with_suffix(".log")
    with open(log, "w") as out:
        proc = subprocess.Popen([*(launcher or [sys.executable, "-m", "merger"]), "app", "--pool", pool, "--port", str(port),
                                 "--history", history, *extra],
                                stdout=out, stderr=subprocess.STDOUT, text=True)
    proc.log = log
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"app exited with {proc.returncode}: {server_log(proc)[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"app did not answer on port {port} within {timeout:.0f} s")


def server_log(proc) -> str:
    """What a server started by ``start_server`` printed so far."""
    try:
        return Path(proc.log).read_text(errors="replace")
    except OSError:
        return ""


def shown(page) -> dict:
    """The numbers and spec the Merge tab shows."""
    text = page.locator("#summary").inner_text()
    avg = float(page.locator("#avg-acc").get_attribute("title"))  # the exact value (the shown one is rounded)
    label = re.search(r"(\w+)\(([^)]*)\)", text)
    params = dict(kv.split("=") for kv in label.group(2).split(", ") if kv) if label else {}
    return {"average": avg, "method": label.group(1) if label else None,
            "params": {k: float(v) for k, v in params.items()}, "text": text}


def drag_lambda(page, fraction: float) -> None:
    """Press on the λ slider's thumb area and drag to ``fraction`` of its width, like a user."""
    track = page.locator("#ctl-lam input[type=range]")
    box = track.bounding_box()
    y = box["y"] + box["height"] / 2
    value = float(track.input_value())
    lo, hi = float(track.get_attribute("min")), float(track.get_attribute("max"))
    x0 = box["x"] + box["width"] * (value - lo) / (hi - lo)
    page.mouse.move(x0, y)
    page.mouse.down()
    for i in range(1, 11):
        page.mouse.move(x0 + (box["x"] + box["width"] * fraction - x0) * i / 10, y)
        time.sleep(0.03)
    page.mouse.up()


def wait_for_change(page, before: dict, timeout: float = 60.0) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        now = shown(page)
        if now["params"] != before["params"]:
            # the label moved; wait until the numbers for it are in (no request still in flight)
            time.sleep(1.0)
            again = shown(page)
            if again["params"] == now["params"]:
                return again
        time.sleep(0.25)
    raise TimeoutError("the Merge tab did not update after dragging λ")


def open_page(playwright, url: str):
    browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(url)
    page.locator("#avg-acc").wait_for(timeout=90_000)
    return browser, page


def signed_in_page(browser, url: str, user: str, password: str):
    """A page of its own (own cookies) signed in to an app started with --auth, once the Merge tab
    shows its first answer."""
    page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
    page.goto(url)
    page.get_by_label("username").fill(user)
    page.get_by_label("password").fill(password)
    page.get_by_role("button", name="Login").click()
    page.locator("#avg-acc").wait_for(timeout=90_000)
    return page


def type_lambda(page, value: float) -> None:
    """Type λ into its box and press Enter, as a presenter does."""
    box = page.locator("#ctl-lam input[type=number]")
    box.fill(f"{value:g}")
    box.press("Enter")


def screenshot(pool: str, out: str | Path, fraction: float = 0.6) -> dict:
    """Start the app, drag λ, and save a screenshot of the Merge tab."""
    from playwright.sync_api import sync_playwright

    port = free_port()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        proc = start_server(pool, port, str(Path(tmp) / "history.sqlite"))
        try:
            with sync_playwright() as p:
                browser, page = open_page(p, f"http://127.0.0.1:{port}/")
                before = shown(page)
                drag_lambda(page, fraction)
                after = wait_for_change(page, before)
                Path(out).parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(out), full_page=False)
                browser.close()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return after
