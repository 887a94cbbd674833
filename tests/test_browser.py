"""One real-browser test: drag λ in the Merge tab; the numbers shown equal merger.evaluate."""
import os

import pytest

import merger
from merger.ui import browser
from helpers import write_pool

REQUIRED = os.environ.get("MERGER_REQUIRE_BROWSER") == "1"  # set by .ci/run: no skipping in CI


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    missing = browser.browser_missing()
    if missing:
        if REQUIRED:
            pytest.fail(f"browser test required (MERGER_REQUIRE_BROWSER=1) but {missing}")
        pytest.skip(f"browser test skipped: {missing}")
    root = tmp_path_factory.mktemp("browserpool")
    pool_path = write_pool(root, n_experts=3, scale=0.2, demo_data=True)
    port = browser.free_port()
    proc = browser.start_server(str(pool_path), port, str(root / "history.sqlite"))
    yield str(pool_path), f"http://127.0.0.1:{port}/"
    proc.terminate()
    proc.wait(timeout=30)


def test_dragging_lambda_updates_the_numbers(server, tmp_path):
    from playwright.sync_api import sync_playwright

    pool_path, url = server
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
