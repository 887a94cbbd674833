"""The app's callbacks and plot builders, without a browser."""
import csv
import os
import re
import sqlite3
import time
from pathlib import Path

import gradio as gr
import pytest
import torch
from helpers import controls, ui_controller, with_weights

import merger
from merger import plots
from merger.errors import MergerError
from merger.ui.compare_tab import CompareTab
from merger.ui.endpoint import evaluate_endpoint
from merger.ui.history_tab import HistoryTab


@pytest.fixture(scope="module")
def ctl(tmp_path_factory):
    return ui_controller(tmp_path_factory.mktemp("uipool"))


def shown_average(summary: str) -> float:
    return float(re.search(r"id='avg-acc' title='([0-9.]+)'", summary).group(1))


def by_name(updates):
    from merger.methods import PARAM_NAMES

    return dict(zip(PARAM_NAMES, updates))


def test_method_controls_show_only_the_used_ones(ctl):
    *updates, about = ctl.method_controls("cart", ctl.pool.tasks)
    u = by_name(updates)
    assert u["lam"]["visible"] and u["rank_ratio"]["visible"] and u["rank_ratio"]["value"] == 0.08
    assert u["rank_ratio"]["label"] == "rank ratio"
    assert all(u[n] == {"__type__": "update", "visible": False} for n in u if n not in ("lam", "rank_ratio"))
    assert "CART" in about and "2412.12153" in about
    *updates, _ = ctl.method_controls("tsv_m", ctl.pool.tasks)
    assert by_name(updates)["rank_ratio"]["value"] == 0.3333  # TSV-M's default rank is 1/T, shown to four places


def test_tsv_m_auto_rank_survives_the_slider_and_follows_the_experts(ctl):
    tasks = list(ctl.pool.tasks)
    *updates, about = ctl.method_controls("tsv_m", tasks)
    rank = by_name(updates)["rank_ratio"]
    # capped at 1/T, shown to four places (the box read 0.14285714285714285 for the demo's 7 experts)
    assert rank["value"] == 0.3333 and rank["maximum"] == 0.3333
    assert "Conventions" in about
    for shown_value in (0.3333, 1 / 3):
        spec = ctl.spec_from_controls(*controls(ctl, "tsv_m", rank_ratio=shown_value))
        assert spec.kwargs["rank_ratio"] == "auto" and spec.snap().kwargs["rank_ratio"] == "auto"
    assert ctl.spec_from_controls(*controls(ctl, "tsv_m", rank_ratio=0.33)).kwargs["rank_ratio"] == 0.33
    # unticking an expert: the cap becomes 1/2 and the slider moves from its old auto position
    from merger.methods import PARAM_NAMES

    for old_auto in (0.3333, 1 / 3):
        ups = dict(zip(PARAM_NAMES, ctl.refresh_limits(*controls(ctl, "tsv_m", experts=tasks[:2], rank_ratio=old_auto))))
        assert ups["rank_ratio"]["value"] == 0.5 and ups["rank_ratio"]["maximum"] == 0.5
    from merger import methods
    from merger.ui.controls import _at_auto, slider_top

    tsv = methods.get("tsv_m")
    assert [slider_top(tsv, "rank_ratio", n) for n in (7, 8, 6)] == [0.1428, 0.125, 0.1666]  # down: in range
    assert _at_auto(tsv, "rank_ratio", 0.1428, 7) and not _at_auto(tsv, "rank_ratio", 0.14, 7)
    assert _at_auto(tsv, "rank_ratio", 0.1666, 7)  # the app's auto for 6 experts, off the grid: moves too
    kept = dict(zip(PARAM_NAMES, ctl.refresh_limits(*controls(ctl, "tsv_m", experts=tasks[:2], rank_ratio=0.2))))
    assert kept["rank_ratio"]["value"] == 0.2  # an explicit ratio under the new cap stays
    before_update = ctl.spec_from_controls(*controls(ctl, "tsv_m", experts=tasks[:2], rank_ratio=1 / 3))
    assert before_update.kwargs["rank_ratio"] == "auto"
    *_, summary = ctl.preview(*controls(ctl, "tsv_m", rank_ratio=0.4))
    assert "rank ratio: 0.4 is above 0.333333 with 3 experts" in summary  # named as the page names it


def test_preview_shows_what_evaluate_computes(ctl):
    acc, loss, radar, summary = ctl.preview(*controls(ctl, "ties", lam=0.7, sparsity=0.6))
    expected = merger.evaluate(ctl.pool, merger.merge(ctl.pool, "ties", lam=0.7, sparsity=0.6))
    assert shown_average(summary) == pytest.approx(100 * expected.average_accuracy, abs=0.005)
    bars = acc.data[0]
    assert list(bars.x) == ctl.pool.tasks
    assert list(bars.y) == pytest.approx([100 * expected.accuracy[t] for t in ctl.pool.tasks])
    assert {t.name for t in acc.data} == {"merged", "base", "expert"}
    assert list(loss.data[0].y) == pytest.approx([expected.loss[t] for t in ctl.pool.tasks])


def test_cart_says_lambda_has_no_effect_at_full_rank(ctl):
    *_, summary = ctl.preview(*controls(ctl, "cart", lam=2.0, rank_ratio=1.0))
    assert "λ has no effect" in summary
    one = [ctl.pool.tasks[0]]
    *_, summary = ctl.preview(*controls(ctl, "cart", experts=one, lam=0.5, rank_ratio=0.1))
    assert "λ has no effect: with one expert" in summary
    *_, summary = ctl.preview(*controls(ctl, "cart", lam=0.5, rank_ratio=0.1))
    assert "λ has no effect" not in summary


def test_a_value_typed_between_slider_steps_is_named_with_the_value_computed(ctl):
    *_, summary = ctl.preview(*controls(ctl, lam=0.73))
    assert "computed on the sliders' steps: lam=0.75 (typed 0.73)" in summary
    assert "lam=0.75" in summary.split("\n\n")[1]  # the label the result is for
    tasks = ctl.weight_experts
    *_, weighted = ctl.preview(*with_weights(ctl, controls(ctl, lam=0.75), tasks={tasks[0]: 0.504}))
    assert f"w.{tasks[0]}=0.5 (typed 0.504)" in weighted and "lam=" not in weighted.split("ℹ️")[-1]
    *_, on_step = ctl.preview(*controls(ctl, lam=0.75))
    assert "sliders' steps" not in on_step


@pytest.mark.parametrize("bad, message", [
    (dict(method="ties", sparsity=1.0), "sparsity: 1.0 is out of range [0, 1)"),
    (dict(method="cart", rank_ratio="x"), "rank ratio: 'x' is not a number"),
    # by the control's label, not the API's name ("consensus_ta: parameter agree=2.5 …")
    (dict(method="consensus_ta", agree=2.5), "tasks that must agree (k): 2.5 must be a whole number"),
    # an emptied box: neither its default nor the value before, unseen
    (dict(method="consensus_ta", agree=None), "tasks that must agree (k): empty; type a whole number in [1, 64]"),
    (dict(method="ties", sparsity=None), "sparsity: empty; type a number in [0, 1)"),
    (dict(experts=[]), "empty subset"),
    (dict(method="nope"), "unknown method 'nope'"),
])
def test_preview_bad_input_is_a_message(ctl, bad, message):
    *figs, summary = ctl.preview(*controls(ctl, **bad))
    assert message in summary and summary.startswith("⚠️")
    *_, ok = ctl.preview(*controls(ctl))  # the next valid request works
    assert "Average accuracy" in ok


def test_pin_and_compare(ctl):
    pins, _ = ctl.pin([], *controls(ctl, lam=0.3))
    pins, _ = ctl.pin(pins, *controls(ctl, lam=0.3))
    pins, text = ctl.pin(pins, *controls(ctl, "cart", lam=1.5, rank_ratio=0.1))
    assert len(pins) == 2 and "cart" in text
    assert ctl.clear_pins() == ([], "No pinned merges yet.")  # pins no longer only pile up
    table, bars, radar = CompareTab(ctl).compare(pins, "live")
    assert len(table) == 2 and len(bars.data) == 2 and len(radar.data) == 2
    ref = merger.evaluate(ctl.pool, merger.merge(ctl.pool, "cart", lam=1.5, rank_ratio=0.1))
    assert table[1][4] == pytest.approx(round(100 * ref.average_accuracy, 2))
    assert table[1][3] == "live" and "(live split)" in bars.layout.title.text and "live split" in radar.layout.title.text
    # the method by its name and the parameters apart, each broken only between words
    assert table[1][:2] == ["CART (centred low-rank)", "lam=1.5, rank_ratio=0.1"]
    tab = CompareTab(ctl)
    widths = dict(zip(tab.compare_headers(), (float(w[:-1]) for w in tab.compare_widths())))
    per_char = widths["loss"] / (6 + 4)  # a number column: six characters and the cell padding
    assert widths["method"] >= per_char * (len("AdaMerging") + 4) * 0.99
    assert widths["parameters"] >= per_char * (len("rank_ratio=0.08,") + 4) * 0.99
    # two pins that differ only in their experts: two rows and two bars, each with its own numbers
    two = [ctl.session.spec("task_arithmetic", lam=0.3, experts=ctl.pool.tasks[:n]) for n in (2, 3)]
    table, bars, _ = CompareTab(ctl).compare(two, "live")
    assert len(table) == 2 and len(bars.data) == 2 and bars.data[0].name.endswith(f"[{', '.join(ctl.pool.tasks[:2])}]")
    for row, spec in zip(table, two):
        ref = merger.evaluate(ctl.pool, merger.merge(ctl.pool, "task_arithmetic", lam=0.3, experts=spec.experts))
        assert row[2] == ", ".join(spec.experts) and row[4] == pytest.approx(round(100 * ref.average_accuracy, 2))


def test_export_offers_the_cli_files(ctl):
    paths, msg = ctl.export(*controls(ctl, "ties", lam=1.0, sparsity=0.8))
    weights, spec, card = paths
    assert weights.endswith(".safetensors") and spec.endswith(".yaml") and card.endswith("README.md")
    live = ctl.session.preview(ctl.session.spec("ties", lam=1.0, sparsity=0.8))  # the result on screen
    assert f"| average | {100 * live.average_accuracy:.1f} |" in Path(card).read_text() and "live split" in msg + \
        Path(card).read_text()
    from safetensors.torch import load_file
    sd = load_file(weights)
    ref = merger.merge(ctl.pool, "ties", lam=1.0, sparsity=0.8)
    assert all((sd[k] == ref[k]).all() for k in ref)


def test_a_data_driven_export_writes_the_run_on_screen(ctl, monkeypatch):
    """It once trained the settings' run again, silently, for tens of seconds (or a run never shown)."""
    from merger.io import export

    ada = controls(ctl, "adamerging_task", steps=4, samples=8)
    paths, msg = ctl.export(*ada)
    assert paths is None and "no AdaMerging" in msg and "press Run" in msg
    run = ctl.session.run(ctl.spec_from_controls(*ada))
    monkeypatch.setattr(export, "merge_delta", lambda *a: pytest.fail("the export ran the method again"))
    paths, msg = ctl.export(*ada)
    from safetensors.torch import load_file
    sd = load_file(paths[0])
    base = ctl.pool.task_vectors.base
    assert all(torch.equal(sd[k], (base[k].float() + run.delta[k].float()).to(sd[k].dtype)) for k in run.delta)


def test_failed_export_leaves_no_partial_file(ctl, monkeypatch, tmp_path):
    from merger.io import export

    written = []

    def boom(*args):  # the disk fills up after a few tensors of the streamed write
        if len(written) == 3:
            raise OSError("disk full")
        written.append(args[-1])
        return real(*args)

    real = export.merged_tensor
    monkeypatch.setattr(export, "merged_tensor", boom)
    before = {p for p in ctl.downloads.root.rglob("*") if p.is_file()}  # earlier exports (the newest two)
    files, msg = ctl.export(*controls(ctl))
    assert files is None and "export failed: disk full" in msg
    assert {p for p in ctl.downloads.root.rglob("*") if p.is_file()} <= before


def test_auto_tune_picks_the_best_on_validation(ctl, monkeypatch):

    import dataclasses

    from merger.methods import registry

    ta = registry.get("task_arithmetic")
    monkeypatch.setitem(registry._REGISTRY, "task_arithmetic", dataclasses.replace(ta, tune_grid={"lam": (0.1, 0.5, 1.0)}))
    (table, bars, radar), = CompareTab(ctl).auto_tune(None, ["task_arithmetic"], ctl.pool.tasks,
                                                       progress=lambda *a, **k: None)
    ex = ctl.session
    vals = {lam: ex.preview(ex.spec("task_arithmetic", lam=lam), "val").average_accuracy for lam in (0.1, 0.5, 1.0)}
    best = max(vals, key=vals.get)
    assert table[0][1] == f"lam={best:g}" + (" (at the grid's edge: lam)" if best in (0.1, 1.0) else "")
    assert table[0][4] == pytest.approx(round(100 * ex.preview(ex.spec("task_arithmetic", lam=best), "test").average_accuracy, 2))


def test_auto_tune_shows_each_methods_best_as_it_finishes_on_one_progress_bar(ctl, monkeypatch):
    """Three grids showed nothing for eight minutes and drew the bar three times."""
    import dataclasses

    from merger.methods import registry

    for name, grid in (("task_arithmetic", {"lam": (0.2, 0.6)}), ("ties", {"lam": (0.5, 1.0), "sparsity": (0.8,)})):
        monkeypatch.setitem(registry._REGISTRY, name, dataclasses.replace(registry.get(name), tune_grid=grid))
    reports = []
    tab = CompareTab(ctl)
    frames = list(tab.auto_tune(None, ["task_arithmetic", "ties"], ctl.pool.tasks,
                                progress=lambda f, desc="": reports.append((f, desc))))
    (first, bars1, _), (final, bars2, _) = frames
    assert [r[0] for r in first] == ["task_arithmetic", "ties"] and first[1][1:] == ["tuning now…", 2, None, None, None]
    assert first[0][3] is not None and "1 of 2 methods tuned" in bars1.layout.title.text
    assert [r[0] for r in final] == ["task_arithmetic", "ties"] and final[1][3] is not None
    assert final[0] == first[0] and "(tuned)" in bars2.layout.title.text
    fractions = [f for f, _ in reports]
    assert fractions == sorted(fractions) and fractions[-1] == pytest.approx(1.0) and len(fractions) == 6
    assert any("left" in d for _, d in reports[:-1]) and all(d.startswith(("task_arithmetic: ", "ties: ")) for _, d in reports)
    from merger.ui.app import build_app

    listener = next(bf for bf in build_app(ctl.session).fns.values() if bf.name == "auto_tune")
    assert [type(c) for c in listener.show_progress_on] == [gr.Dataframe]  # the bar drawn once, on the table


def test_a_best_setting_at_the_edge_of_its_grid_is_named():
    from types import SimpleNamespace

    from merger.evaluation.tuning import grid_edges

    specs = [SimpleNamespace(kwargs={"lam": lam, "rank_ratio": r, "seed": 0}) for lam in (0.5, 1.0, 3.0) for r in (0.04, 0.08)]
    assert grid_edges(specs, 5) == ["lam", "rank_ratio"]  # λ 3.0 and rank 0.08: both the largest tried
    assert grid_edges(specs, 2) == ["rank_ratio"]  # λ 1.0 inside; rank 0.04 the smallest; one seed: no range
    assert grid_edges(specs[2:3], 0) == []


def test_sweeps(ctl):
    fig = CompareTab(ctl).sweep(None, "lam", ["task_arithmetic", "ties"], "live", ctl.pool.tasks, progress=lambda *a, **k: None)
    names = [t.name for t in fig.data]
    assert "task_arithmetic (average)" in names and "ties (average)" in names
    ta = next(t for t in fig.data if t.name == "task_arithmetic (average)")
    ex = ctl.session
    assert ta.y[3] == pytest.approx(100 * ex.preview(ex.spec("task_arithmetic", lam=ta.x[3])).average_accuracy)
    fig = CompareTab(ctl).sweep(None, "rank_ratio", ["task_arithmetic", "cart"], "live", ctl.pool.tasks, progress=lambda *a, **k: None)
    assert [t.name for t in fig.data][0] == "cart (average)"
    fig = CompareTab(ctl).sweep(None, "tasks", ["task_arithmetic"], "live", ctl.pool.tasks, progress=lambda *a, **k: None)
    assert list(fig.data[0].x) == [1, 2, 3]
    # refused: a warning, and the plot shown stays (an error would put a badge over it)
    with pytest.warns(UserWarning, match="none of the ticked methods has sparsity"):
        out = CompareTab(ctl).sweep(None, "sparsity", ["cart"], "live", ctl.pool.tasks, progress=lambda *a, **k: None)
    assert out == gr.skip()  # one output: the value itself (a 1-tuple would be that plot's value)
    with pytest.warns(UserWarning, match="tick at least one method to auto-tune"):
        assert list(CompareTab(ctl).auto_tune(None, [], ctl.pool.tasks, progress=lambda *a, **k: None)) == [
            (gr.skip(),) * 3]
    # Cancel stops a sweep and an auto-tune at their next point; auto-tune's plots stay, the sweep's curve
    # goes (the previous sweep's would stand under the new choices)
    from types import SimpleNamespace

    tab, me, reports = CompareTab(ctl), SimpleNamespace(session_hash="me"), []

    def press_cancel(fraction, desc=""):
        reports.append(fraction)
        tab.cancel(me)

    with pytest.warns(UserWarning, match=r"sweep cancelled after \d+ % of its points; those it evaluated are cached"):
        fig = tab.sweep(me, "lam", ["ties"], "val", ctl.pool.tasks, progress=press_cancel)
    assert fig.layout.annotations[0].text == "Sweep cancelled: no curve for these choices"
    assert len(reports) == 1  # one point, then stopped (a sweep of ties' λ values on val: 16 points)
    with pytest.warns(UserWarning, match=r"auto-tune cancelled after \d+ %"):
        assert list(tab.auto_tune(me, ["ties"], ctl.pool.tasks, progress=press_cancel)) == [(gr.skip(),) * 3]
    pin = ctl.session.spec("task_arithmetic", lam=0.3, experts=ctl.pool.tasks[:2])
    with pytest.warns(UserWarning, match="unknown split 'dev'"):
        assert CompareTab(ctl).compare([pin], "dev") == (gr.skip(),) * 3


def test_history_records_filters_reloads_and_exports(ctl, tmp_path, monkeypatch):
    ctl.preview(*controls(ctl, "iso_c", lam=1.25))
    rows = HistoryTab(ctl).history_rows("iso_c", "")
    assert rows and rows[0][2] == "iso_c" and '"lam": 1.25' in rows[0][3]
    assert rows[0][4] == ", ".join(ctl.pool.tasks)  # a space after each comma: the table can wrap there
    # the summary's notation finds the stored one; % and _ are the characters themselves, not wildcards
    assert [r[0] for r in HistoryTab(ctl).history_rows("", "lam=1.25")] == [rows[0][0]]
    assert HistoryTab(ctl).history_rows("iso_c", "lam=1.2") == []  # that value, not every λ it begins
    t0 = ctl.weight_experts[0]
    ctl.preview(*with_weights(ctl, controls(ctl, "iso_c", lam=1.25), tasks={t0: 0.0}))
    assert len(HistoryTab(ctl).history_rows("iso_c", f"{t0}=0")) == 1  # the summary's w[t0=0], stored as 0.0
    assert HistoryTab(ctl).history_rows("", "%") == [] and HistoryTab(ctl).history_rows("", "iso_") != []
    assert HistoryTab(ctl).history_rows("", "is_c") == []  # '_' once matched any character
    # a click anywhere on a row fills the reload box with that row's id
    click = gr.SelectData(None, {"index": [0, 3], "value": rows[0][3], "row_value": rows[0]})
    assert HistoryTab.picked_id(click) == str(rows[0][0])
    experts, method, *values = ctl.reload(rows[0][0])
    from merger.methods import PARAM_NAMES
    by_name = dict(zip(PARAM_NAMES, values))
    assert method["value"] == "iso_c" and by_name["lam"]["value"] == 1.25 and by_name["rank_ratio"]["visible"] is False
    # a row that merged a lab expert gone with its server: refused by name (the checkbox took the name it
    # does not offer, and every later event of the page failed)
    gone = ctl.session.spec("task_arithmetic", lam=0.3)
    ctl.history.record("elsewhere", gone, ctl.session.preview(gone))
    with sqlite3.connect(ctl.history.path) as db:  # as another program would edit the file
        db.execute("UPDATE evaluations SET experts = ? WHERE pool = 'elsewhere'", (",".join([*ctl.pool.tasks[:1], "gd2"]),))
    gone_id = ctl.history.rows(pool="elsewhere")[0]["id"]
    with pytest.raises(gr.Error, match=f"history: row {gone_id} merges gd2, not an expert of this pool now"):
        ctl.reload(gone_id)
    with pytest.raises(gr.Error, match="no row with id 999999"):
        ctl.reload(999999)
    # From the History tab: a warning, and every Merge-tab input as it was (an error would put a
    # badge in place of each of them)
    from types import SimpleNamespace

    from merger.ui.merge_events import MergeTabEvents

    events, inputs = MergeTabEvents(ctl, "task_arithmetic"), controls(ctl, lam=0.4)
    for row_id, message in ((999999, "no row with id 999999"), ("", "type the id of a row"),
                            (" 2.5", "row id '2.5' is not a row's id"), ("-1", "a positive whole number"),
                            ("9" * 23, f"no row with id {'9' * 23}")):  # past SQLite's integers
        with pytest.warns(UserWarning, match=message):
            out = events.reload(SimpleNamespace(session_hash="me"), row_id, *inputs)
        assert len(out) == len(inputs) and all(u == gr.skip() for u in out)
    path = HistoryTab(ctl).history_csv("iso_c", "")
    with open(path) as fh:
        data = list(csv.DictReader(fh))
    assert data and all(r["method"] == "iso_c" for r in data)
    # the table shows percent, the file fractions: its header says so
    assert 0 <= float(data[0]["average_accuracy (fraction)"]) <= 1 and "normalized_accuracy (fraction)" in data[0]


def test_a_radar_of_two_tasks_is_bars(ctl):
    """A radar over two tasks collapses to a line: below three tasks the normalised accuracy is bars."""
    import dataclasses

    from merger import plots

    res = ctl.session.preview(ctl.session.spec("task_arithmetic", lam=0.3))
    two = dataclasses.replace(res, accuracy={t: res.accuracy[t] for t in res.tasks[:2]})
    fig = plots.radar({"merged": two})
    assert [t.type for t in fig.data] == ["bar"] and list(fig.data[0].x) == res.tasks[:2]
    assert [t.type for t in plots.radar({"merged": res}).data] == ["scatterpolar"]


def test_a_row_evaluated_again_keeps_its_id_and_the_next_row_takes_the_next_one(ctl, tmp_path):
    """An upsert that found its row still spent an id: three of the same and one more were ids 1 and 4."""
    from merger.io.history import History

    history = History(tmp_path / "again.sqlite")
    a, b = (ctl.session.spec("task_arithmetic", lam=lam) for lam in (0.3, 0.4))
    for spec in (a, a, a, b):
        history.record("p", spec, ctl.session.preview(spec))
    assert sorted((r["id"], r["params"]) for r in history.rows()) == [(1, '{"lam": 0.3}'), (2, '{"lam": 0.4}')]


def test_api_evaluate(ctl):
    out = evaluate_endpoint(ctl)("cart", lam=1.5, rank_ratio=0.25, experts=ctl.pool.tasks[:2], split="live")
    ref = merger.evaluate(ctl.pool, merger.merge(ctl.pool, "cart", lam=1.5, rank_ratio=0.25, experts=ctl.pool.tasks[:2]))
    assert out["average_accuracy"] == pytest.approx(ref.average_accuracy)
    assert out["spec"]["experts"] == ctl.pool.tasks[:2]
    for kwargs, message in [
        (dict(method="nope"), "unknown method"),
        (dict(method="ties", sparsity=1.5), "out of range"),
        (dict(method="task_arithmetic", lam="abc"), "is not a number"),
        (dict(method="task_arithmetic", experts=[]), "empty subset"),
        (dict(method="task_arithmetic", experts=["ghost"]), "unknown task"),
        (dict(method="task_arithmetic", split="dev"), r"split 'dev': the endpoint evaluates live, val, test"),
        (dict(method="task_arithmetic", split="train"), r"other splits: python -m merger eval"),
    ]:
        with pytest.raises(gr.Error, match=message):
            evaluate_endpoint(ctl)(**kwargs)
    plain = evaluate_endpoint(ctl)("task_arithmetic", lam=0.3)
    assert plain["average_accuracy"] >= 0 and "snapped" not in plain and "note" not in plain
    # a value off its slider's step is computed on it, and the answer says so
    out = evaluate_endpoint(ctl)("task_arithmetic", lam=0.333, task_weights={ctl.pool.tasks[0]: 1.234})
    assert out["spec"]["params"]["lam"] == 0.35 and out["snapped"] == {"lam": 0.35, f"w.{ctl.pool.tasks[0]}": 1.23}
    ref = merger.evaluate(ctl.pool, merger.merge(ctl.pool, "task_arithmetic", lam=0.35,
                                                 task_weights={ctl.pool.tasks[0]: 1.23}))
    assert out["average_accuracy"] == pytest.approx(ref.average_accuracy)
    # the page's note comes with the answer: k above the experts merged keeps nothing
    out = evaluate_endpoint(ctl)("consensus_ta", agree=5)
    assert "no entry can be kept, the merge is the base" in out["note"]
    # val and test wait for the room's slider moves: batch work
    chunks = ctl.session.queue.counts["chunks"]
    evaluate_endpoint(ctl)("task_arithmetic", lam=0.45, split="val")
    assert ctl.session.queue.counts["chunks"] > chunks


def test_radar_closes_polygons():
    r = merger.Result("live", {"a": 0.5, "b": 1.0, "c": 0.2}, {"a": 1, "b": 2, "c": 3}, {"a": 1.0, "b": 0.5, "c": 0.4})
    fig = plots.radar({"x": r})
    assert list(fig.data[0].r) == [50.0, 200.0, 50.0, 50.0]
    assert list(fig.data[0].theta) == ["a", "b", "c", "a"]


def test_landscape_tab_is_progressive_and_the_live_marker_moves(ctl):
    from merger.ui.landscape_tab import LandscapeController

    lc = LandscapeController(ctl)
    frames = list(lc.compute(None, [], "pca", None, None, "", "loss", "all tasks (mean)", 11, "contour",
                             ["λ path (current method)"], *controls(ctl, lam=0.3), progress=lambda *a, **k: None))
    assert len(frames) == 2
    (coarse_state, _), (state, fig) = frames
    assert len(coarse_state["surface"].xs) == 6 and len(state["surface"].xs) == 11
    live = next(t for t in fig.data if t.name == "live merge")
    n = lc.land.cached_points()
    moved = lc.move_live(state, *controls(ctl, lam=0.9))
    live2 = next(t for t in moved.data if t.name == "live merge")
    assert (live.x[0], live.y[0]) != (live2.x[0], live2.y[0])
    assert lc.land.cached_points() == n  # the surface was not recomputed
    x, y, _ = lc.plane_of(state).coords(lc.land.spec_point(ctl.session.spec("task_arithmetic", lam=0.9)))
    assert (live2.x[0], live2.y[0]) == pytest.approx((x, y))
    # another metric or view: the surface shown is redrawn at once, with no point computed
    restyled, fig = lc.restyle(None, state, "accuracy", ctl.pool.tasks[0], "contour", *controls(ctl, lam=0.9))
    assert lc.land.cached_points() == n and (restyled["metric"], restyled["task"]) == ("accuracy", ctl.pool.tasks[0])
    assert fig.layout.title.text.startswith(f"{ctl.pool.tasks[0]} accuracy")
    assert lc.restyle(None, None, "accuracy", None, "contour", *controls(ctl)) == (gr.skip(), gr.skip())
    # chosen while a Compute goes: its later frames are drawn so (its last one went back to loss)
    chosen = lambda *a, **k: lc.restyle(None, None, "accuracy", None, "contour", *controls(ctl))  # noqa: E731
    *_, (last, fig) = lc.compute(None, [], "pca", None, None, "", "loss", "all tasks (mean)", 11, "contour", [],
                                 *controls(ctl), progress=chosen)
    assert last["metric"] == "accuracy" and fig.layout.title.text.startswith("mean accuracy")
    # three points are three: never filled up with pins (it once drew a plane through base, a task and a pin)
    pin = ctl.session.spec("task_arithmetic", lam=0.7)
    for three in ("base," + ctl.pool.tasks[0], "", f"base,base,{ctl.pool.tasks[0]}"):
        with pytest.warns(UserWarning, match="three points: .* type three, separated by commas"):
            assert list(lc.compute(None, [pin], "points", None, None, three, "loss", "all tasks (mean)", 5, "contour", [],
                                   *controls(ctl), progress=lambda *a, **k: None)) == [(gr.skip(), gr.skip())]
    # thousands typed into the box: refused by their count before any is merged, the text echoed cut
    typed = ",".join(f"task_arithmetic:lam={i / 10000}" for i in range(6000))
    with pytest.warns(UserWarning, match=r"three points: 6000 named in '.{120}' \(cut\); type three") as said:
        list(lc.compute(None, [], "points", None, None, typed, "loss", "all tasks (mean)", 5, "contour", [],
                        *controls(ctl), progress=lambda *a, **k: None))
    assert len(str(said[0].message)) < 400
    with pytest.warns(UserWarning, match="landscape paths: 65 named; at most 64"):
        list(lc.compute(None, [], "pca", None, None, "", "loss", "all tasks (mean)", 5, "contour",
                        ["λ path (current method)"] * 65, *controls(ctl), progress=lambda *a, **k: None))
    # Cancel stops it at the next row; the landscape shown stays (the coarse one, here), and its points are cached
    from types import SimpleNamespace

    me = SimpleNamespace(session_hash="me")
    with pytest.warns(UserWarning, match="landscape cancelled at row 2 of 11; the points computed are cached"):
        frames = list(lc.compute(me, [], "tasks", ctl.pool.tasks[0], ctl.pool.tasks[1], "", "loss", "all tasks (mean)",
                                 11, "contour", [], *controls(ctl), progress=lambda *a, **k: lc.cancel(me)))
    assert len(frames) == 2 and frames[0][0]["surface"].xs and frames[1] == (gr.skip(), gr.skip())
    # a PCA of many pinned merges: its title fits (plotly neither wraps nor cuts it: it ran off both edges)
    pins = [ctl.session.spec("task_arithmetic", lam=x, task_weights={ctl.pool.tasks[0]: 0.35}) for x in (0.3, 0.5, 0.9)]
    *_, (_, fig) = lc.compute(None, pins, "pca", None, None, "", "loss", "all tasks (mean)", 5, "contour", [],
                              *controls(ctl), progress=lambda *a, **k: None)
    title = fig.layout.title.text
    assert title.endswith("(probe split)") and title.startswith("mean loss on PCA of base")
    assert all(len(line) <= 72 for line in title.split("<br>")) and "…" not in title  # wrapped, not cut
    # a data-driven merge never run: drawn without its marker, and never run here unseen
    never_run = controls(ctl, "adamerging_task", steps=2, samples=5, seed=7)  # no other test runs it
    with pytest.warns(UserWarning, match=r"Not drawn: the live merge ★: no AdaMerging \(task-wise\) run"):
        *_, (_, fig) = lc.compute(None, [], "pca", None, None, "", "loss", "all tasks (mean)", 5, "contour", [], *never_run,
                                  progress=lambda *a, **k: None)
    assert not any(t.name == "live merge" for t in fig.data)
    # a move to it takes the marker away (it stayed on the previous merge, with that merge's label)
    assert not any(t.name == "live merge" for t in lc.move_live(state, *never_run).data)
    # nor after a move the Merge tab answers without a result (a refused value): no marker left behind
    from merger.ui.merge_events import MergeTabEvents

    events = MergeTabEvents(ctl, "task_arithmetic", lc)
    *_, last = events.move(None, state, *with_weights(ctl, controls(ctl, "ties", sparsity=None)))
    assert last[3].startswith("⚠️ sparsity: empty") and not any(t.name == "live merge" for t in last[7].data)
    # nor does a point typed as METHOD:param=value run it
    with pytest.warns(UserWarning, match="landscape point 'adamerging_task:steps=2:samples=5:seed=7': no AdaMerging"):
        list(lc.compute(None, [], "points", None, None, f"base,{ctl.pool.tasks[0]},adamerging_task:steps=2:samples=5:seed=7",
                        "loss", "all tasks (mean)", 5, "contour", [], *controls(ctl), progress=lambda *a, **k: None))
    assert ctl.session.cached_run(ctl.spec_from_controls(*never_run)) is None
    curves = lc.curves(["λ path (current method)"], "accuracy", "live", "all tasks (mean)", *controls(ctl))
    assert len(curves.data) == 1 and len(curves.data[0].x) == 16
    # the path goes through the current merge: its experts and weights (it once took every expert, weights 1)
    two = ctl.pool.tasks[:2]
    inputs = with_weights(ctl, controls(ctl, experts=two, lam=0.3), {two[0]: 1.5})
    spec = ctl.spec_from_controls(*inputs).snap()
    (path,), problems = lc.paths(["λ path (current method)"], spec.method, spec.kwargs, spec)
    assert not problems and path.steps[3] == 0.3
    assert torch.equal(path.points[3], lc.land.spec_point(spec))


def test_data_driven_run_from_the_merge_tab(ctl):
    from merger.ui.landscape_tab import ITERATES, LandscapeController
    from merger.ui.runs import RunController

    *_, summary = ctl.preview(*controls(ctl, "adamerging_task", steps=6))
    assert "press **Run**" in summary
    runs = RunController(ctl)
    frames = list(runs.run(None, *controls(ctl, "adamerging_task", steps=6)))
    status, objective, heat, fw, acc, loss, radar, summary = frames[-1]
    assert status.startswith("✓") and len(objective.data[0].y) == 6
    run = ctl.session.cached_run(ctl.spec_from_controls(*controls(ctl, "adamerging_task", steps=6)))
    assert list(heat.data[0].y) == ctl.pool.tasks
    expected = merger.evaluate(ctl.pool, merger.merge(ctl.pool, "adamerging_task", steps=6, lr=1e-3, init=0.3,
                                                      samples=16, seed=0))
    assert shown_average(summary) == pytest.approx(100 * expected.average_accuracy, abs=0.005)
    # FW: barycentric weights and gap are drawn
    *_, last = runs.run(None, *controls(ctl, "fw_hard", steps=3))
    assert last[0].startswith("✓") and any(t.name == "FW gap" for t in last[3].data)
    # the iterates are a trajectory on the landscape
    lc = LandscapeController(ctl)
    frames = list(lc.compute(None, [], "pca", None, None, "", "loss", "all tasks (mean)", 5, "contour", [ITERATES],
                             *controls(ctl, "fw_hard", steps=3), progress=lambda *a, **k: None))
    assert any(t.name == "fw_hard iterates" for t in frames[-1][1].data)
    assert len(run.iterates) >= 2


def test_two_pages_pressing_run_on_the_same_settings_share_one_run(ctl, monkeypatch):
    """A workshop's pages (or one page again after a reload) pressing Run on the same settings while
    it goes: one run, and each page shows its whole objective curve and its result."""
    from types import SimpleNamespace

    from merger.ui.runs import RunController

    session = ctl.session
    computed, seen = [], {}
    compute_run = session.compute_run

    def counted(m, key, *args):  # the run starts once both pages follow it (it takes 0.6 s: B came later)
        computed.append(1)
        for _ in range(1000):
            if session.followers(key) == 2:
                break
            time.sleep(0.01)
        seen["under way"] = runs.under_way()  # what a page loaded now says
        try:  # and what Pin, Export and the Analysis views say meanwhile
            ctl.run_on_screen(ctl.spec_from_controls(*inputs).snap())
        except MergerError as exc:
            seen["on screen"] = str(exc)
        return compute_run(m, key, *args)

    monkeypatch.setattr(session, "compute_run", counted)
    runs = RunController(ctl)
    inputs = controls(ctl, "adamerging_task", steps=40)
    page_a = runs.run(SimpleNamespace(session_hash="a"), *inputs)
    page_b = runs.run(SimpleNamespace(session_hash="b"), *inputs)
    frames_a, frames_b = [next(page_a)], [next(page_b)]
    last_a, last_b = [*frames_a, *page_a][-1], [*frames_b, *page_b][-1]
    assert computed == [1]
    for last in (last_a, last_b):
        assert last[0].startswith("✓ AdaMerging") and len(last[1].data[0].y) == 40
    assert session.cached_run(ctl.spec_from_controls(*inputs)) is not None
    assert seen["on screen"].startswith("the AdaMerging (task-wise) run for these settings is still under way")
    line, timer, chooser, button, offered = seen["under way"]
    assert line.startswith("◷ Under way on this server: `adamerging_task(") and "steps=40" in line and timer.active
    label = line.split("`")[1]
    assert chooser["choices"] == [label] and chooser["value"] == label and chooser["visible"] and button["visible"]
    assert offered == {label: ctl.spec_from_controls(*inputs).snap()}
    assert runs.under_way()[0] == gr.skip()  # nothing under way now
    # the page loaded during the run follows it on a timer, and says when it has ended; its chooser stays
    after, timer, *chooser = runs.still_under_way(line, offered)
    assert after.startswith("The work under way when this page opened has ended: `adamerging_task(") and not timer.active
    assert after.endswith("set the controls to it (below) and it shows at once. A cancelled one left nothing.")
    assert chooser == [gr.skip()] * 3
    assert runs.still_under_way("✓ AdaMerging: 40 steps in 1.0 s.", offered)[0] == gr.skip()  # its own Run's line stays
    # a page reloaded after it ended sets its controls to it, and the finished run shows
    from merger.ui.merge_events import MergeTabEvents

    events = MergeTabEvents(ctl, "task_arithmetic")
    page_c, fresh = SimpleNamespace(session_hash="c"), controls(ctl, lam=0.4)
    values = [u.get("value") for u in events.set_to_work(page_c, label, offered, *fresh)]
    assert ctl.spec_from_controls(*values).snap() == offered[label]
    assert len(ctl.learned(*values)[0].data[0].y) == 40 and computed == [1]  # its objective curve: no second run


def test_the_first_pages_cancel_is_acknowledged_while_another_page_follows_its_run(ctl, monkeypatch):
    """Page A pressed Run, page B follows the same run, A presses Cancel: the run goes on for B (by
    design), and A's status line says so instead of ignoring the Cancel."""
    import threading
    from types import SimpleNamespace

    from merger.ui.runs import GOES_ON, RunController

    session = ctl.session
    compute_run, a_cancelled = session.compute_run, threading.Event()

    def slow(m, key, *args):  # A leads; it computes once B follows and A has cancelled
        for _ in range(1000):
            if session.followers(key) == 2:
                break
            time.sleep(0.01)
        a_cancelled.wait(30)
        time.sleep(1.2)  # two of the status line's ticks after the Cancel
        return compute_run(m, key, *args)

    monkeypatch.setattr(session, "compute_run", slow)
    runs = RunController(ctl)
    inputs = controls(ctl, "adamerging_task", steps=7)
    page_a, page_b = runs.run(SimpleNamespace(session_hash="a"), *inputs), runs.run(SimpleNamespace(session_hash="b"), *inputs)
    frames_a = [next(page_a)]
    for _ in range(1000):  # A leads: its run is under way before B asks (on a loaded machine too)
        if session.under_way():
            break
        time.sleep(0.01)
    frames_b = [next(page_b)]
    assert runs.cancel(SimpleNamespace(session_hash="a")) == "Cancelling…"
    a_cancelled.set()
    frames_a += list(page_a)
    frames_b += list(page_b)
    assert any(f[0].endswith(GOES_ON) for f in frames_a[1:-1])
    assert frames_a[-1][0].startswith("✓ AdaMerging (task-wise): 7 steps") and "went on after your Cancel" in frames_a[-1][0]
    assert frames_b[-1][0].startswith("✓ AdaMerging (task-wise): 7 steps") and "Cancel" not in frames_b[-1][0]
    assert not any(GOES_ON in f[0] for f in frames_b)



def test_a_run_asked_for_while_holding_the_model_runs_there(ctl):
    """session.lock holds the model; a run asked for inside it runs on that thread (a run shared on
    another thread would wait for the model this one holds)."""
    import threading

    spec = ctl.session.spec("adamerging_task", steps=2, seed=11)
    box = {}

    def held():
        with ctl.session.lock:
            box["run"] = ctl.session.run(spec)

    thread = threading.Thread(target=held, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive() and box["run"] is ctl.session.cached_run(spec)

def test_cancelled_run_reports_and_caches_nothing(ctl, monkeypatch):
    from merger.ui.runs import RunController

    runs = RunController(ctl)
    gen = runs.run(None, *controls(ctl, "adamerging_layer", steps=5000, samples=8))
    first = next(gen)
    assert first[0].startswith("◷")
    assert runs.cancel() == "Cancelling…"
    last = list(gen)[-1]
    assert "cancelled" in last[0]
    assert runs.cancel() == gr.skip()  # nothing runs now: the status line keeps "cancelled"
    assert ctl.session.cached_run(ctl.spec_from_controls(*controls(ctl, "adamerging_layer", steps=5000, samples=8))) is None


def test_pin_and_export_refuse_values_the_page_never_computed(ctl):
    """A λ typed out of range is refused; the browser puts it back in range (5 → 3; an emptied box
    → 0) as the box loses focus to the Pin or Export button, whose click then arrives before that
    value's move: they once saved task_arithmetic(lam=-3), never shown."""
    from types import SimpleNamespace

    from merger.ui.merge_events import MergeTabEvents

    me, events = SimpleNamespace(session_hash="me"), MergeTabEvents(ctl, "task_arithmetic")
    shown, clamped = with_weights(ctl, controls(ctl, lam=0.3)), with_weights(ctl, controls(ctl, lam=3.0))
    events.load(me, *shown)  # the page's first answer: λ 0.3; then 5 typed, refused, put back at 3
    with pytest.warns(UserWarning, match="Pin: the controls hold"):
        assert events.pin(me, [], *clamped)[0] == []
    list(events.move(me, None, *shown))
    with pytest.warns(UserWarning, match=r"Pin: the controls hold `task_arithmetic\(lam=3\)`, but the merge on "
                                         r"screen is `task_arithmetic\(lam=0.3\)`"):
        assert events.pin(me, [], *clamped)[0] == []
    files, msg = events.export(me, *clamped)
    assert files is None and "export refused" in msg and "`task_arithmetic(lam=0.3)`" in msg
    pins, _ = events.pin(me, [], *shown)
    assert [p.kwargs["lam"] for p in pins] == [0.3]
    files, msg = events.export(me, *shown)
    assert len(files) == 3 and msg == "Exported `task_arithmetic(lam=0.3)` with its model card."
    other = SimpleNamespace(session_hash="someone else")  # another page's moves are not mine
    assert events.not_on_screen(other, clamped[0], clamped[1], clamped[2:]) is None


def test_a_run_that_ends_after_the_settings_changed_shows_nothing_as_theirs(ctl):
    """A run's result replaces the Merge tab's only where the controls still show its settings: it
    once drew AdaMerging's 81 % under a TIES dropdown, and Export then wrote the TIES model."""
    from types import SimpleNamespace

    from merger.ui.merge_events import MergeTabEvents
    from merger.ui.runs import RunController

    me = SimpleNamespace(session_hash="me")
    events = MergeTabEvents(ctl, "task_arithmetic")
    runs = RunController(ctl, events)
    ada = with_weights(ctl, controls(ctl, "adamerging_task", steps=7, samples=8))
    list(events.move(me, None, *ada))  # the person picks AdaMerging ...
    gen = runs.run(me, *ada)  # ... presses Run ...
    assert next(gen)[0].startswith("◷")
    list(events.move(me, None, *with_weights(ctl, controls(ctl, "ties"))))  # ... and moves on to TIES
    *_, last = gen
    assert "the controls had changed by then" in last[0] and all(x == gr.skip() for x in last[1:])
    spec = ctl.spec_from_controls(*ada)
    assert ctl.session.cached_run(spec) is not None  # kept: setting them again shows it
    # back on the run's settings, a new run of them shows its result, and the panel knows it
    list(events.move(me, None, *ada))
    steps9 = with_weights(ctl, controls(ctl, "adamerging_task", steps=9, samples=8))
    list(events.move(me, None, *steps9))
    *_, last = runs.run(me, *steps9)
    assert last[0].startswith("✓") and last[1] != gr.skip() and last[-1] != gr.skip()
    # a cancelled run leaves the panel as for its settings (no run), not its stopped curve beside an
    # earlier run's coefficients
    steps5000 = with_weights(ctl, controls(ctl, "adamerging_task", steps=5000, samples=8))
    list(events.move(me, None, *steps5000))
    gen = runs.run(me, *steps5000)
    next(gen)
    runs.cancel(me)
    *_, last = gen
    assert "cancelled" in last[0] and all("no data-driven run" in fig.layout.annotations[0].text for fig in last[1:4])


def test_analysis_tab_callbacks(ctl):
    from merger.ui.analysis_tab import AnalysisController

    ac = AnalysisController(ctl)
    norms, layers, cos, sc, kept = ac.weights(*controls(ctl, "ties", sparsity=0.7))
    assert list(norms.data[0].x) == ctl.pool.tasks and len(cos.data[0].z) == 3
    title = kept.layout.title.text
    assert "<sub>sparsity 0.7</sub><br><sub>a random drop (DARE) keeps about 30% of it</sub>" in title
    # three lines, each short enough for a third of the page's width, and a top margin that holds them
    assert kept.layout.margin.t >= 24 + 22 * 3 and max(map(len, re.sub("</?sub>", "", title).split("<br>"))) <= 62
    # the sparsity the merge reads: on the slider's step, and refused where the Merge tab refuses it
    assert "<sub>sparsity 0.99</sub>" in ac.weights(*controls(ctl, "ties", sparsity=0.999))[-1].layout.title.text
    with pytest.warns(UserWarning, match=r"out of range \[0, 1\)"):
        ac.weights(*controls(ctl, "ties", sparsity=1.0))
    # a method without sparsity: the default, said so (not the hidden control's value)
    *_, kept = ac.weights(*controls(ctl, "task_arithmetic", sparsity=0.6))
    assert "default sparsity 0.8 (Task arithmetic has none)" in kept.layout.title.text
    *_, kept = ac.weights(*controls(ctl, "cart"))
    assert "<sub>default sparsity 0.8 (CART has none)</sub>" in kept.layout.title.text
    with pytest.warns(UserWarning, match=r"sparsity: empty; type a number in \[0, 1\)"):
        ac.weights(*controls(ctl, "ties", sparsity=None))
    spectra, ri = ac.lowrank(ctl.pool.tasks, "all matrices (summed)")
    assert {t.name for t in ri.data} >= {"R(k) centred", "I(k) uncentred"}
    # I(k) (tens) on its own axis: beside it R(k) (units) read as flat at zero
    assert {t.name: t.yaxis for t in ri.data} == {"R(k) centred": "y", "R(k) uncentred": "y", "I(k) centred": "y2",
                                                  "I(k) uncentred": "y2"}
    fig, text = ac.heterogeneity(*controls(ctl, "task_arithmetic", lam=0.3))
    assert "Σλ = 0.9 ≠ 1" in text and "χ²" in text
    fig, text = ac.heterogeneity(*controls(ctl, "weight_averaging"))
    assert "⚠️" not in text
    fig, _ = ac.heterogeneity(*controls(ctl, "ties", sparsity=0.7, lam=1.0))
    assert any("δt(M)" in t.name for t in fig.data)
    lin = ac.linearity(*controls(ctl, "task_arithmetic", lam=0.3))
    assert [t.name for t in lin.data][1:] == ["baseline: 1 − cos(θi, θj), expert pairs",
                                              "baseline: 1 − cos(merge, each endpoint)"]
    assert " validation images, the first of every task, all tokens)" in lin.layout.title.text
    lin = ac.linearity(*controls(ctl, "task_arithmetic", lam=0.3, experts=ctl.pool.tasks[:1]))
    assert [t.name for t in lin.data][1:] == ["baseline: 1 − cos(merge, each endpoint)"]  # no pair of experts
    with pytest.warns(UserWarning, match="epoch dynamics need per-epoch checkpoints"):
        assert ac.dynamics(ctl.pool.tasks[0]) == (gr.skip(),) * 4
    _, method, *values = controls(ctl, "task_arithmetic", lam=0.3)
    for compute, outputs in ((lambda: ac.weights([], method, *values), 5),
                             (lambda: ac.lowrank([], "all matrices (summed)"), 2),
                             (lambda: ac.linearity([], method, *values), 1)):  # nothing ticked: refused, not all of them
        with pytest.warns(UserWarning, match="experts: empty subset, tick at least one expert"):
            assert compute() == (gr.skip() if outputs == 1 else (gr.skip(),) * outputs)  # the plots shown stay
    with pytest.warns(UserWarning, match="tick at least two experts for an expert-to-expert path"):
        ac.interpolation("first two ticked experts", *controls(ctl, "task_arithmetic", experts=ctl.pool.tasks[:1]))


def test_reference_guides_for_real_architectures():
    from merger.reference import guides

    g = guides("ViT-B-32", "cart")
    assert g["paper ViT-B-32 8 tasks: cart"] == pytest.approx(0.847)
    assert "paper ViT-B-32 8 tasks: tsv_m (unverified)" in guides("ViT-B-32", "tsv_m")
    assert guides(None, "cart") == {}
    r = merger.Result("live", {"a": 0.5}, {"a": 1.0}, {"a": 1.0})
    fig = plots.accuracy_bars(r, guides=g)
    assert any("cart: 84.7" in a.text for a in fig.layout.annotations)


def test_interpolation_and_ensemble_views(ctl):
    from merger.ui.analysis_tab import AnalysisController

    ac = AnalysisController(ctl)
    fig = ac.interpolation("base → current merge", *controls(ctl, "task_arithmetic", lam=0.3))
    assert len(fig.data) == 3 and len(fig.data[0].x) == 11
    # one panel per quantity: the accuracy in % (as everywhere else), not a fraction beside a loss
    assert fig.layout.yaxis.title.text == "accuracy % (avg)" and max(fig.data[0].y) > 1
    assert "accuracy and loss: the live split" in fig.layout.title.text  # which images each panel is over
    assert "1 − cos: the first validation images" in fig.layout.title.text
    fig = ac.interpolation("first two ticked experts", *controls(ctl, "task_arithmetic"))
    assert fig.data[2].y[0] == pytest.approx(0.0, abs=1e-6)
    fig = ac.ensemble(*controls(ctl, "weight_averaging"))
    assert {t.name.split(" ")[0] for t in fig.data} == {"merged", "logit"}


def test_analysis_holds_the_model_for_its_features_and_never_runs_a_merge_unseen(ctl, monkeypatch):
    """Linearity's and Interpolate's feature passes swap the resident model's parameters
    (functional_call): unheld, two of them side by side (two buttons pressed together) left the model
    on one call's tensors, and every later move showed the base's numbers. And an AdaMerging never
    run was run here, for minutes, without progress or Cancel."""
    from merger.analysis import diagnostics
    from merger.ui.analysis_tab import AnalysisController

    features, held = diagnostics.block_features, []

    def checked(*args):
        held.append(ctl.session.queue.held_here())
        return features(*args)

    monkeypatch.setattr(diagnostics, "block_features", checked)
    ac = AnalysisController(ctl)
    ac.linearity(*controls(ctl, "task_arithmetic", lam=0.3))
    ac.interpolation("base → current merge", *controls(ctl, "task_arithmetic", lam=0.3))
    assert len(held) == 5 + 13 and all(held)  # merged, 3 experts, base; both ends and 11 points
    never_run = controls(ctl, "adamerging_task", steps=2, samples=5, seed=8)  # no other test runs it
    for view in (lambda: ac.linearity(*never_run), lambda: ac.interpolation("base → current merge", *never_run),
                 lambda: ac.heterogeneity(*never_run), lambda: ac.ensemble(*never_run)):
        with pytest.warns(UserWarning, match=r"no AdaMerging \(task-wise\) run for these settings yet: press Run"):
            view()
    assert ctl.session.cached_run(ctl.spec_from_controls(*never_run)) is None
    # the path between two experts needs no run of the merge
    assert len(ac.interpolation("first two ticked experts", *never_run).data) == 3


def test_the_app_offers_one_api_endpoint(ctl):
    """Scripts see `evaluate` only: every listener of the page is private (the method switch's was
    listed as /method_controls, and Gradio's own error reached the server's log)."""
    from merger.ui.app import build_app

    info = build_app(ctl.session).get_api_info()
    assert list(info["named_endpoints"]) == ["/evaluate"] and not info.get("unnamed_endpoints")


def test_every_kept_refusal_fits_its_listeners_outputs(ctl):
    """A handler marked keeps_outputs(n) is wired to n outputs, and Gradio takes its refusal (a skip
    per output) without an error: a 1-tuple for one output once became that plot's value, and Gradio
    then showed its error badge anyway."""
    import asyncio

    from merger.ui.app import build_app
    from merger.ui.errors import kept

    app = build_app(ctl.session)
    marked = [bf for bf in app.fns.values() if getattr(bf.fn, "keeps_outputs", None) is not None]
    assert {bf.name for bf in marked} >= {"compare", "auto_tune", "sweep", "weights", "lowrank", "heterogeneity",
                                         "dynamics", "linearity", "interpolation", "ensemble", "curves"}
    for bf in marked:
        assert bf.fn.keeps_outputs == len(bf.outputs), bf.name
        with pytest.warns(UserWarning, match="refused"):
            refusal = kept("refused", len(bf.outputs))
        asyncio.run(app.postprocess_data(bf, refusal, None))  # raises for a value that fits no output
    # Run streams its progress in its status line: a control's refused value is then a toast alone (with
    # Gradio's progress overlay it was an error badge over every output of the Merge tab)
    run = next(bf for bf in app.fns.values() if bf.name == "run" and len(bf.outputs) == 8)
    assert run.show_progress == "hidden"


def test_pin_refuses_a_data_driven_merge_that_was_never_run(ctl):
    """A pin is a merge on screen: an AdaMerging spec never run was pinned, and Compare then ran it
    unseen for minutes, with no progress and no Cancel."""
    inputs = controls(ctl, "adamerging_task", steps=3, seed=21)
    with pytest.warns(UserWarning, match="Pin: no AdaMerging \\(task-wise\\) run for these settings yet: press Run"):
        pins, _ = ctl.pin([], *inputs)
    assert pins == [] and ctl.session.cached_run(ctl.spec_from_controls(*inputs)) is None
    ctl.session.run(ctl.spec_from_controls(*inputs))
    pins, text = ctl.pin([], *inputs)
    assert len(pins) == 1 and "adamerging_task" in text


def test_a_history_that_cannot_be_written_is_refused_at_start_and_one_that_stops_costs_no_result(ctl, tmp_path,
                                                                                                 monkeypatch, capsys):
    """An existing database needed no write to open, so a read-only one (another user's file, a
    read-only mount) was taken, and then every evaluate call and every sweep failed on its first
    result."""
    import sqlite3

    from merger.io import history as history_module
    from merger.io.history import History

    path = tmp_path / "h.sqlite"
    History(path).close()
    connect = sqlite3.connect
    monkeypatch.setattr(history_module.sqlite3, "connect",
                        lambda p, **kw: connect(f"file:{p}?mode=ro", uri=True, **kw))
    with pytest.raises(MergerError, match=f"--history {path}: cannot be used as the history "
                                          r"\(attempt to write a readonly database\)"):
        History(path)
    monkeypatch.undo()
    # a disk that fills up later: the result is shown, recording stops, said once (stderr, summary)
    history = History(path)
    history._db.execute("PRAGMA query_only = ON")  # a full disk, from now on: no public way to fill one
    monkeypatch.setattr(ctl, "history", history)
    acc, loss, radar, summary = ctl.preview(*controls(ctl, lam=0.45))
    assert shown_average(summary) > 0
    said = f"--history {path}: cannot record results any more (attempt to write a readonly database)"
    assert f"⚠️ {said}" in summary
    ctl.preview(*controls(ctl, lam=0.55))
    assert capsys.readouterr().err.count(said) == 1
    out = evaluate_endpoint(ctl)("task_arithmetic", lam=0.65)
    assert out["average_accuracy"] > 0


def test_downloads_keep_the_newest_two_in_a_private_folder(ctl):
    import stat

    paths = [ctl.export(*controls(ctl))[0][0] for _ in range(4)]
    folders = [p for p in ctl.downloads.root.iterdir()]
    assert len(folders) == 2 and {str(f) for f in folders} == {os.path.dirname(p) for p in paths[-2:]}
    if hasattr(os, "getuid"):
        assert stat.S_IMODE(ctl.downloads.root.stat().st_mode) == 0o700


def test_wrong_passwords_wait_longer_each_time_and_a_right_one_still_opens():
    from merger.ui.login import LoginGate

    waits, now = [], [0.0]
    gate = LoginGate({"ana": "s3cret"}, sleep=lambda s: (waits.append(s), now.__setitem__(0, now[0] + s)),
                     clock=lambda: now[0])
    assert gate("ana", "s3cret") and waits == []  # no failure yet: no wait
    assert not any(gate("ana", f"guess{i}") for i in range(8))
    assert waits == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 8.0]  # before each check after a failure
    assert gate("ana", "s3cret") and waits[-1] == 8.0  # the user gets in, after the same wait
    now[0] += LoginGate.WINDOW_S
    waits.clear()
    assert gate("ana", "s3cret") and waits == []  # the failures aged out


def test_while_a_run_goes_the_headline_says_so_instead_of_asking_for_one(ctl, monkeypatch):
    spec = ctl.session.spec("adamerging_task")
    inputs = controls(ctl, method="adamerging_task")
    assert "press **Run**" in ctl.answer(*inputs).message  # nothing under way: it asks for a run
    monkeypatch.setattr(ctl.session, "under_way", lambda: {"AdaMerging (task-wise)": spec})
    ans = ctl.answer(*inputs)
    assert ans.result is None and "is learning for these experts now: its progress is under" in ans.message


def test_a_cancelled_sweep_leaves_no_earlier_curve_under_the_new_choices(ctl, monkeypatch):
    from types import SimpleNamespace

    from merger.errors import Cancelled
    from merger.ui.compare_tab import CompareTab

    tab = CompareTab(ctl)

    def cancelled(*args, **kwargs):
        raise Cancelled("cancelled")
    monkeypatch.setattr(tab, "_sweep", cancelled)
    with pytest.warns(UserWarning, match="cancelled"):
        fig = tab.sweep(SimpleNamespace(session_hash="me"), "lam", ["task_arithmetic"], "live", None,
                        progress=lambda *a, **k: None)
    assert fig.layout.annotations[0].text == "Sweep cancelled: no curve for these choices"


def test_the_method_text_shows_this_pools_own_best_setting_once_known(tmp_path):
    """"λ ≈ 0.3 for 8 tasks" stood beside a 7-task pool whose best is 0.55: the pool's own best on
    val, from the history, for the ticked experts."""
    c = ui_controller(tmp_path)
    *_, about = c.method_controls("task_arithmetic", c.pool.tasks)
    assert "best setting is not known yet" in about and "Auto-tune" in about and "≈ 0.3 for 8" not in about
    results = {}
    for lam in (0.3, 0.55, 0.9):
        spec = c.session.spec("task_arithmetic", lam=lam)
        results[lam] = c.session.preview(spec, "val")
        c.history.record(c.pool_ref, spec, results[lam])
    c.history.record(c.pool_ref, c.session.spec("task_arithmetic", lam=0.7), c.session.preview(
        c.session.spec("task_arithmetic", lam=0.7), "test"))  # another split: not a tuning result
    best = max(results, key=lambda lam: (results[lam].average_accuracy, -lam))
    *_, about = c.method_controls("task_arithmetic", c.pool.tasks)
    assert f"`lam={best:g}`, {100 * results[best].average_accuracy:.1f} % (of 3 val evaluations" in about
    *_, about = c.method_controls("task_arithmetic", c.pool.tasks[:2])  # other experts: not theirs
    assert "not known yet" in about


def test_a_pages_landscape_state_holds_no_weights_and_its_3d_view_makes_them_again(ctl):
    """Each page's landscape state held every point's and path step's weights (a model's worth each:
    gigabytes per page on ViT-B/32, kept an hour after the page closed)."""
    from types import SimpleNamespace

    import torch

    from merger.ui.landscape_tab import LandscapeController

    lc = LandscapeController(ctl)
    pin = ctl.session.spec("task_arithmetic", lam=0.7)
    *_, (state, contour) = lc.compute(None, [pin], "pca", None, None, "", "loss", "all tasks (mean)", 5, "contour",
                                      ["λ path (current method)"], *controls(ctl, lam=0.3),
                                      progress=lambda *a, **k: None)
    size = ctl.pool.task_vectors.numel()

    def tensors(value):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, dict):
            for v in value.values():
                yield from tensors(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                yield from tensors(v)

    assert not any(t.numel() >= size // 2 for v in state.values() for t in tensors(v))
    # the plane (three models' worth) is shared by the pages that computed it, a few kept
    *_, (other, _) = lc.compute(SimpleNamespace(session_hash="another page"), [pin], "pca", None, None, "", "loss",
                                "all tasks (mean)", 5, "contour", ["λ path (current method)"],
                                *controls(ctl, lam=0.3), progress=lambda *a, **k: None)
    assert other["plane_key"] == state["plane_key"] and lc.planes_kept() == [state["plane_key"]]
    lc.forget_planes()  # gone (other planes computed since): the marker's move makes it again
    moved = lc.move_live(state, *controls(ctl, lam=0.9))
    assert any(t.name == "live merge" for t in moved.data) and lc.planes_kept() == [state["plane_key"]]
    _, surface = lc.restyle(None, state, "loss", "all tasks (mean)", "surface", *controls(ctl, lam=0.3))
    heights = {t.name: t.z[0] for t in surface.data if t.type == "scatter3d" and t.name == "base"}
    base = ctl.session.landscape.point_values(ctl.session.landscape.base_point(), state["surface"].split)[1]
    assert heights["base"] == pytest.approx(sum(base.values()) / len(base))
    names = {t.name for t in contour.data}
    assert pin.label() in {text for t in contour.data if t.text for text in t.text} and "task_arithmetic lam path" in names
