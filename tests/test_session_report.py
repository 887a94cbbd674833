"""The session report: one HTML file that opens offline (no request leaves it, in Chromium), holding
every merge's numbers as the app computes them, the pool's hashes and each merge's replay command; an
empty session gives a report that says so; a bad --out is refused before any work."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import write_pool

import merger
from merger.evaluation.session import session_for
from merger.reports.session import parse_specs, session_report

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    return merger.open_pool(write_pool(tmp_path_factory.mktemp("report"), n_experts=3, demo_data=True))


def test_the_report_holds_every_merge_as_the_app_computes_it(pool):
    specs = parse_specs(pool, ["ties:lam=1:sparsity=0.8", "ta:lam=0.3"])
    text = session_report(session_for(pool), specs, "test")
    assert text.count("<script") >= 1 and len(re.findall(r"plotly\.js v\d", text)) == 1  # plotly.js once
    assert not re.search(r"<script[^>]+src=|<link[^>]+href=", text)  # nothing fetched
    for spec in specs:
        result = merger.evaluate(pool, merger.merge(pool, spec.method, experts=spec.experts, **spec.kwargs), "test")
        assert f"{100 * result.average_accuracy:.1f}" in text
        for task in pool.tasks:
            assert f"<td>{task}</td><td>{100 * result.accuracy[task]:.1f}</td>" in text
    assert "merger merge --pool " in text and "--method ties --lam 1.0 --sparsity 0.8" in text
    hashes = pool.file_hashes()
    assert hashes["base"] in text and all(hashes[t] in text for t in pool.tasks)


def test_an_empty_session_gives_a_report_that_says_so(pool):
    text = session_report(session_for(pool), [], "test")
    assert "pinned no merges" in text and "<script" not in text


def test_the_cli_refuses_a_folder_before_any_work_and_writes_an_offline_file(pool, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-m", "merger", "report", "session", "--pool", pool.source, "--out",
                          str(tmp_path), "--specs", "ta:lam=0.3"], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 2 and f"--out: {tmp_path} is a folder" in res.stderr
    out = tmp_path / "report.html"
    res = subprocess.run([sys.executable, "-m", "merger", "report", "session", "--pool", pool.source, "--out", str(out),
                          "--specs", "ta:lam=0.3", "magmax:lam=0.5"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    from devtools import browser

    if browser.browser_missing():
        if os.environ.get("MERGER_REQUIRE_BROWSER") == "1":
            pytest.fail(f"browser test required but {browser.browser_missing()}")
        return
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=browser.CHROMIUM, headless=True, args=browser.CHROMIUM_FLAGS)
        page = chromium.new_page()
        requests = []
        page.on("request", lambda r: requests.append(r.url))
        page.goto(out.as_uri())
        page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length >= 4", timeout=60_000)
        chromium.close()
    assert [u for u in requests if not u.startswith(("file:", "data:", "blob:"))] == []


def test_the_compare_tabs_export_report_offers_the_pinned_merges(tmp_path):
    from helpers import ui_controller

    from merger.ui.compare_tab import CompareTab

    ctl = ui_controller(tmp_path)
    pins = [ctl.session.spec("task_arithmetic", lam=0.3), ctl.session.spec("ties", lam=1.0, sparsity=0.8)]
    path = Path(CompareTab(ctl).report(pins, "live"))
    text = path.read_text()
    assert path.parent.parent == ctl.downloads.root and path.suffix == ".html"
    for spec in pins:
        assert f"{100 * ctl.session.preview(spec).average_accuracy:.1f}" in text and spec.label() in text
    assert "pinned no merges" in Path(CompareTab(ctl).report([], "live")).read_text()


def test_the_export_report_draws_the_figures_the_page_shows(tmp_path):
    from helpers import ui_controller

    from merger import plots
    from merger.ui.compare_tab import REPORT_VIEWS, CompareTab

    ctl = ui_controller(tmp_path)
    sweep = plots.sweep_curves({"ties": ([0.5, 1.0], [0.4, 0.6])}, "λ", "Sweep of TIES over λ")
    pareto = plots.sweep_curves({"front": ([0.1, 0.2], [0.3, 0.1])}, "colour", "Front of the page")
    shown = {"sweep-plot": {"type": "plotly", "plot": sweep.to_json()},
             "landscape-plot": {"type": "plotly", "plot": "{not json"},  # a page's bad value: left out
             "pareto-plot": {"type": "plotly", "plot": pareto.to_json()}}
    text = Path(CompareTab(ctl).report([], "live", *[shown.get(i) for i in REPORT_VIEWS])).read_text()
    assert "What the session showed" in text and "Sweep of TIES over λ" in text and "Front of the page" in text
    assert REPORT_VIEWS["landscape-plot"] not in text and REPORT_VIEWS["pareto-plot"] in text
    assert len(re.findall(r"plotly\.js v\d", text)) == 1  # still inlined once


def test_the_cli_report_draws_the_historys_lambda_sweeps(pool, tmp_path, capsys):
    import dataclasses

    from merger.cli import main
    from merger.io.export import pool_reference
    from merger.io.history import History

    history = History(tmp_path / "history.sqlite")
    session = session_for(pool)
    for lam in (0.2, 0.6, 1.0):
        spec = session.spec("task_arithmetic", lam=lam)
        history.record(pool_reference(pool), spec, session.preview(spec, "val"))
        history.record(pool_reference(pool), spec, dataclasses.replace(session.preview(spec, "val"), forward="bf16"))
    out = tmp_path / "report.html"
    assert main(["report", "session", "--pool", pool.source, "--out", str(out), "--history",
                 str(tmp_path / "history.sqlite")]) == 0
    text = out.read_text()
    assert "λ sweeps in the history (val split)" in text
    assert '"task_arithmetic()"' in text and '"task_arithmetic() (bf16 forwards)"' in text  # a curve each
    assert "1 sweep figure(s)" in capsys.readouterr().out
    assert main(["report", "session", "--pool", pool.source, "--out", str(out), "--history",
                 str(tmp_path / "nope.sqlite")]) == 2
    assert "--history" in capsys.readouterr().err and not (tmp_path / "nope.sqlite").exists()
    (tmp_path / "notes.sqlite").write_text("not a database")
    assert main(["report", "session", "--pool", pool.source, "--out", str(out), "--history",
                 str(tmp_path / "notes.sqlite")]) == 2
    assert "cannot be used as the history" in capsys.readouterr().err
