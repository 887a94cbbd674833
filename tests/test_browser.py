"""Real-browser tests: drag λ in the Merge tab (the numbers shown equal merger.evaluate), reload a
History row, and the Landscape plot after a move made while its tab was hidden."""
import os

import pytest
from helpers import write_pool

import merger
from devtools import browser

REQUIRED = os.environ.get("MERGER_REQUIRE_BROWSER") == "1"  # set by .ci/run: no skipping in CI


def small_pool_server(root, extra=()):
    """Generator: (pool path, url, history) of the app on a 3-expert pool, served until closed;
    skipped (failed in CI) where Chromium is missing."""
    missing = browser.browser_missing()
    if missing:
        if REQUIRED:
            pytest.fail(f"browser test required (MERGER_REQUIRE_BROWSER=1) but {missing}")
        pytest.skip(f"browser test skipped: {missing}")
    pool_path = write_pool(root, n_experts=3, scale=0.2, demo_data=True)
    port = browser.free_port()
    proc = browser.start_server(str(pool_path), port, str(root / "history.sqlite"), extra=extra)
    yield str(pool_path), f"http://127.0.0.1:{port}/", root / "history.sqlite"
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from small_pool_server(tmp_path_factory.mktemp("browserpool"))


def test_dragging_lambda_updates_the_numbers(server, tmp_path):
    from playwright.sync_api import sync_playwright

    pool_path, url, _ = server
    with sync_playwright() as p:
        b, page = browser.open_page(p, url)
        before = browser.shown(page)
        assert before["method"] == "task_arithmetic" and before["params"] == {"lam": 0.3}
        browser.drag_lambda(page, 0.8)
        after = browser.wait_for_change(page, before)
        shot = tmp_path / "merge-tab.png"
        page.screenshot(path=str(shot))
        b.close()
    assert shot.stat().st_size > 10_000
    lam = after["params"]["lam"]
    assert lam != 0.3 and lam > 0.3  # dragged to the right
    pool = merger.open_pool(pool_path)
    expected = merger.evaluate(pool, merger.merge(pool, "task_arithmetic", lam=lam), split="live")
    assert after["average"] == pytest.approx(100 * expected.average_accuracy, abs=0.005)


def test_history_reload_restores_the_row_and_writes_nothing(server):
    """Reload a TIES row while the Merge tab shows task arithmetic: the method change that follows
    must not reset the reloaded values, and no intermediate spec is recorded."""
    import sqlite3
    import time

    from gradio_client import Client
    from playwright.sync_api import sync_playwright

    pool_path, url, history = server
    Client(url, verbose=False).predict("ties", 0.85, None, 0.65, None, None, "live", api_name="/evaluate")
    db = sqlite3.connect(history)
    row_id = db.execute("SELECT id FROM evaluations WHERE method = 'ties' AND params LIKE '%0.85%'").fetchone()[0]
    with sync_playwright() as p:
        b, page = browser.open_page(p, url)
        assert browser.shown(page)["method"] == "task_arithmetic"
        n = db.execute("SELECT COUNT(*) FROM evaluations").fetchone()[0]
        page.get_by_role("tab", name="History").click()
        page.get_by_label("row id to reload into the Merge tab").fill(str(row_id))
        page.get_by_role("button", name="Reload").click()
        page.get_by_role("tab", name="Merge").click()
        deadline = time.time() + 60
        while time.time() < deadline and browser.shown(page)["method"] != "ties":
            time.sleep(0.25)
        time.sleep(3)  # every listener the reload set off has answered
        shown = browser.shown(page)
        b.close()
    assert shown["method"] == "ties" and shown["params"] == {"lam": 0.85, "sparsity": 0.65}
    assert db.execute("SELECT COUNT(*) FROM evaluations").fetchone()[0] == n


def test_the_landscape_fills_its_tab_after_a_move_made_while_it_was_hidden(server):
    """The live marker follows λ moves made in the Merge tab, and plotly lays out a plot redrawn in
    a hidden tab at a default width (700 px): shown again, the plot must fill its tab as before."""
    import time

    from playwright.sync_api import sync_playwright

    _, url, _ = server
    with sync_playwright() as p:
        b, page = browser.open_page(p, url)
        page.get_by_role("tab", name="Landscape").click()
        page.get_by_role("button", name="Compute landscape").click()
        drawn = page.locator("#landscape-plot .main-svg").first
        drawn.wait_for(timeout=120_000)
        width = drawn.bounding_box()["width"]
        page.get_by_role("tab", name="Merge").click()
        before = browser.shown(page)
        browser.drag_lambda(page, 0.7)
        browser.wait_for_change(page, before)
        time.sleep(2)  # the marker's redraw has arrived
        page.get_by_role("tab", name="Landscape").click()
        time.sleep(2)
        again = page.locator("#landscape-plot .main-svg").first.bounding_box()["width"]
        b.close()
    assert width > 900 and again == pytest.approx(width, abs=2)


def test_the_upload_route_takes_no_file(server):
    """The app has no file input: Gradio's /gradio_api/upload, open without --auth, refuses a 2 KB file."""
    import urllib.error
    import urllib.request

    _, url, _ = server
    body = (b"--b\r\nContent-Disposition: form-data; name=\"files\"; filename=\"x.bin\"\r\n"
            b"Content-Type: application/octet-stream\r\n\r\n" + b"x" * 2048 + b"\r\n--b--\r\n")
    request = urllib.request.Request(url + "gradio_api/upload", data=body, method="POST",
                                     headers={"Content-Type": "multipart/form-data; boundary=b"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 413


def test_a_refused_lambda_goes_back_to_the_value_on_screen_with_one_warning(server):
    """λ = 5 typed and the box left at once: one toast, the box back to the λ on screen, and the
    browser's clamp to 3 neither computed nor recorded."""
    import sqlite3
    import time

    from playwright.sync_api import sync_playwright

    _, url, history = server
    with sync_playwright() as p:
        b, page = browser.open_page(p, url)
        shown = browser.shown(page)["params"]["lam"]
        box = page.locator("#ctl-lam input[type=number]")
        box.fill("5")
        page.locator("#summary").click()  # the box loses focus before the answer arrives
        deadline = time.time() + 30
        while time.time() < deadline and float(box.input_value()) != shown:
            time.sleep(0.2)
        time.sleep(2)  # any move the clamp set off has answered
        toasts = page.locator(".toast-body").all_inner_texts()
        after = browser.shown(page)["params"]["lam"], float(box.input_value())
        b.close()
    assert after == (shown, shown)
    assert len(toasts) == 1 and "5 is outside [-3, 3]" in toasts[0]
    rows = sqlite3.connect(history).execute("SELECT params FROM evaluations WHERE params LIKE '%\"lam\": 3%'")
    assert rows.fetchall() == []


# Counts what reaches Plotly's own react: through the page's script where it is, else every call
COUNT_DRAWS = """() => { const [owner, key] = Plotly.react.original ? [Plotly.react, 'original'] : [Plotly, 'react'];
  const own = owner[key]; window.draws = []; let n = 0;
  owner[key] = function (div, ...args) {
    div.drawNumber = div.drawNumber || ++n; window.draws.push(div.drawNumber); return own.call(this, div, ...args); }; }"""


def test_a_move_draws_each_figure_once_in_a_div_on_the_page(server):
    """Gradio re-mounts a Plot on each new value after the old one drew it: the page's script
    (merger/ui/plot_draws.py) lets only the figures on the page draw, each once, the new values."""
    import time

    from playwright.sync_api import sync_playwright

    _, url, _ = server
    with sync_playwright() as p:
        b, page = browser.open_page(p, url)
        page.locator("#acc-plot .main-svg").first.wait_for(timeout=60_000)
        page.evaluate(COUNT_DRAWS)
        before = browser.shown(page)
        browser.type_lambda(page, 0.9)  # one move
        after = browser.wait_for_change(page, before)
        page.wait_for_function("() => window.draws.length >= 3", timeout=60_000)  # the figures' frame, drawn
        time.sleep(1)  # any draw more would have come
        draws = page.evaluate("() => window.draws")
        drawn = page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')].filter(d => d.drawNumber)
            .map(d => [d.drawNumber, d.closest('[id]') && d.closest('[id]').id, d.data[0].y || d.data[0].r])""")
        b.close()
    # accuracy, loss, radar: once each (this small pool answers at once; a slow one would draw a partial answer first)
    assert len(draws) == len(set(draws)) >= 3
    assert sorted(n for n, _, _ in drawn) == sorted(draws)  # every draw in a div still on the page
    bars = next(values for _, where, values in drawn if where == "acc-plot")  # per task, this move's
    assert sum(bars) / len(bars) == pytest.approx(after["average"], abs=1e-3)


def test_the_page_script_draws_the_latest_figure_once_per_frame_where_its_div_is():
    """merger/ui/plot_draws.py against a Plotly that records what it is asked: per div and frame the
    latest figure, none in a div gone from the page, the resize asked with a draw only where the div's
    width is no longer the one drawn, a div named by id drawn the same way, and a draw that fails or
    throws failing the caller's promise."""
    from playwright.sync_api import sync_playwright

    from merger.ui.plot_draws import PLOT_DRAWS_HEAD

    missing = browser.browser_missing()
    if missing:
        if REQUIRED:
            pytest.fail(f"browser test required (MERGER_REQUIRE_BROWSER=1) but {missing}")
        pytest.skip(f"browser test skipped: {missing}")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=browser.CHROMIUM, headless=True, args=browser.CHROMIUM_FLAGS)
        page = b.new_page()
        page.set_content(f"<html><head>{PLOT_DRAWS_HEAD}</head><body><div id=a></div><div id=b></div></body></html>")
        page.evaluate("""() => { window.asked = []; window.Plotly = {  // arrives after the script, as Gradio loads it
            react: (div, figure) => { asked.push(['react', div.id || div, figure]);
                if (figure === 'throws') throw new Error('thrown');
                const width = Math.round(div.getBoundingClientRect().width);
                div._fullLayout = {width: figure === 'drawn narrower' ? width - 15 : width};
                return figure === 'bad' ? Promise.reject(new Error('bad figure')) : Promise.resolve(div); },
            Plots: {resize: (div) => { asked.push(['resize', div.id]); return Promise.resolve(div); }}}; }""")
        same_frame = page.evaluate("""async () => { const [a, b] = [document.getElementById('a'), document.getElementById('b')];
            const first = Plotly.react(a, 'first'); Plotly.Plots.resize(a); Plotly.react(b, 'gone'); b.remove();
            const latest = Plotly.react(a, 'latest'); Plotly.Plots.resize(a);
            const before = asked.length; await first; return [before, first === latest, asked.slice()]; }""")
        later = page.evaluate("""async () => { asked.length = 0; const a = document.getElementById('a');
            await Plotly.Plots.resize(a); await Plotly.react('a', 'by id');
            const drawn = Plotly.react(a, 'drawn narrower'); Plotly.Plots.resize(a); await drawn;
            const failed = await Plotly.react(a, 'bad').then(() => 'drawn', (e) => e.message);
            const thrown = await Plotly.react(a, 'throws').then(() => 'drawn', (e) => e.message);
            return [asked.slice(), failed, thrown, typeof Plotly.react.original, typeof Plotly.Plots.resize.original]; }""")
        b.close()
    assert same_frame == [0, True, [["react", "a", "latest"]]]
    assert later == [[["resize", "a"], ["react", "a", "by id"], ["react", "a", "drawn narrower"], ["resize", "a"],
                      ["react", "a", "bad"], ["react", "a", "throws"]], "bad figure", "thrown", "function", "function"]
