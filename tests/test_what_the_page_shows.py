"""What a new user hit in the browser, checked through the callbacks: stale results,
precision, trajectories, sweeps, 3-D paths, lab experts per session, method changes, reloads."""
import math
from types import SimpleNamespace

import helpers
import pytest
from helpers import ui_controller

import merger
from merger.methods import PARAM_NAMES
from merger.ui.compare_tab import CompareTab
from merger.ui.endpoint import evaluate_endpoint
from merger.ui.history_tab import HistoryTab


@pytest.fixture(scope="module")
def ctl(tmp_path_factory):
    return ui_controller(tmp_path_factory.mktemp("findings"))


def controls(ctl, method="task_arithmetic", experts=None, **values):
    return helpers.controls(ctl, method, experts, **{"steps": 3, "samples": 8, **values})


def annotation(fig) -> str:
    return " ".join(a.text for a in fig.layout.annotations)


def test_no_stale_result_is_shown_as_current(ctl):
    ctl.preview(*controls(ctl, lam=0.5))  # a result is on screen
    acc, loss, radar, summary = ctl.preview(*controls(ctl, "adamerging_task"))
    assert "press **Run**" in summary
    assert all("no run yet" in annotation(f) and not f.data for f in (acc, loss, radar))
    acc, loss, radar, summary = ctl.preview(*controls(ctl, experts=[]))
    assert summary.startswith("⚠️") and all(not f.data and "no result" in annotation(f) for f in (acc, loss, radar))
    # the "what a run learned" panel follows the settings: a run shows, other settings clear it
    assert all("no data-driven run" in annotation(f) for f in ctl.learned(*controls(ctl, "adamerging_task")))
    ctl.session.run(ctl.spec_from_controls(*controls(ctl, "adamerging_task")))
    objective, heat, _ = ctl.learned(*controls(ctl, "adamerging_task"))
    assert len(objective.data[0].y) == 3 and list(heat.data[0].y) == ctl.pool.tasks
    assert all(not f.data for f in ctl.learned(*controls(ctl, "adamerging_task", steps=4)))


def test_live_numbers_carry_a_binomial_interval(ctl):
    acc, _, _, summary = ctl.preview(*controls(ctl, lam=0.4))
    res = ctl.session.preview(ctl.session.spec("task_arithmetic", lam=0.4))
    expected = 1.96 * math.sqrt(sum(a * (1 - a) / res.counts[t] for t, a in res.accuracy.items())) / len(res.accuracy)
    assert f"± {100 * expected:.1f} %" in summary and "95 % binomial" in summary
    margins = [100 * 1.96 * math.sqrt(res.accuracy[t] * (1 - res.accuracy[t]) / res.counts[t]) for t in res.tasks]
    assert list(acc.data[0].error_y.array) == pytest.approx(margins)


def test_one_unavailable_trajectory_does_not_fail_the_plot_and_a_task_can_be_picked(ctl):
    from merger.ui.landscape_tab import LandscapeController

    lc = LandscapeController(ctl)
    t = ctl.pool.tasks[1]
    fig = lc.curves([f"fine-tuning: {ctl.pool.tasks[0]}", "λ path (current method)"], "accuracy", "live", t,
                    *controls(ctl))
    assert [tr.name for tr in fig.data] == ["task_arithmetic lam path"]
    assert "not drawn" in fig.layout.title.text and "no trajectory" in fig.layout.title.text
    lam = fig.data[0].x[5]
    ref = merger.evaluate(ctl.pool, merger.merge(ctl.pool, "task_arithmetic", lam=lam), "live")
    assert fig.data[0].y[5] == pytest.approx(100 * ref.accuracy[t])  # that task's accuracy, not the mean
    assert "no trajectory" in annotation(lc.curves([f"fine-tuning: {ctl.pool.tasks[0]}"], "accuracy", "live",
                                                   "all tasks (mean)", *controls(ctl)))


def test_trajectories_that_count_different_things_get_their_own_x_axis(ctl):
    """Epochs, λ and rank ratios on one x axis read as the same places: one panel per axis title."""
    from merger.ui.landscape_tab import LandscapeController

    lc = LandscapeController(ctl)
    fig = lc.curves(["λ path (current method)", "rank path (CART / TSV-M)"], "accuracy", "live", "all tasks (mean)",
                    *controls(ctl))
    axes = {tr.name: (tr.xaxis or "x") for tr in fig.data}
    assert axes["task_arithmetic lam path"] != axes["cart rank_ratio path"]
    titles = {name: fig.layout["xaxis" + axis[1:]].title.text for name, axis in axes.items()}
    assert titles == {"task_arithmetic lam path": "λ", "cart rank_ratio path": "rank ratio"}
    one = lc.curves(["λ path (current method)"], "loss", "live", "all tasks (mean)", *controls(ctl))
    assert fig.layout.height > one.layout.height and one.layout.xaxis.title.text == "λ"


def test_sweeps_say_which_methods_they_skipped(ctl):
    fig = CompareTab(ctl).sweep(None, "sparsity", ["ties", "cart"], "live", None, progress=lambda *a, **k: None)
    assert "not swept: cart (no sparsity)" in fig.layout.title.text
    fig = CompareTab(ctl).sweep(None, "rank_ratio", ["cart", "tsv_m"], "live", None, progress=lambda *a, **k: None)
    assert "tsv_m stops at rank ratio 0.333" in fig.layout.title.text


def test_3d_landscape_draws_the_trajectories_at_their_values(ctl):
    from merger.ui.landscape_tab import LandscapeController

    lc = LandscapeController(ctl)
    *_, (state, fig) = lc.compute(None, [], "pca", None, None, "", "loss", "all tasks (mean)", 5, "surface",
                                  ["λ path (current method)"], *controls(ctl), progress=lambda *a, **k: None)
    path = next(t for t in fig.data if t.type == "scatter3d" and t.name == "task_arithmetic lam path")
    ref = merger.evaluate(ctl.pool, merger.merge(ctl.pool, "task_arithmetic", lam=0.5), "probe")
    assert path.z[5] == pytest.approx(ref.average_loss, rel=1e-5)


def test_a_refused_landscape_keeps_the_one_shown_and_3d_markers_keep_their_shapes(ctl):
    """A point that names nothing: a warning naming it, and the landscape on screen stays (raised as
    an error, Gradio would cover the plot with an error badge). In 3-D the markers keep the shapes
    of the caption (■ base, ◆ experts), the live merge a cross (3-D has no star)."""
    import gradio as gr

    from merger.ui.landscape_tab import LandscapeController

    lc = LandscapeController(ctl)
    with pytest.warns(UserWarning, match="landscape point 'nosuch': not a task or a method: 'nosuch'; a point is base"):
        frames = list(lc.compute(None, [], "points", None, None, "base, nosuch, ta:lam=0.3", "loss", "all tasks (mean)", 5,
                                 "contour", [], *controls(ctl), progress=lambda *a, **k: None))
    assert frames == [(gr.skip(), gr.skip())]
    *_, (_, fig) = lc.compute(None, [], "pca", None, None, "", "loss", "all tasks (mean)", 5, "surface", [], *controls(ctl),
                              progress=lambda *a, **k: None)
    symbols = {t.name: t.marker.symbol for t in fig.data if t.type == "scatter3d"}
    assert symbols == {"base": "square", **{t: "diamond" for t in ctl.pool.tasks}, "live merge": "x"}


def test_lab_experts_belong_to_their_session(ctl):
    import gradio as gr

    from merger.analysis import lab
    from merger.ui.lab_tab import LabController

    lc = LabController(ctl)
    b = SimpleNamespace(session_hash="person-b")
    t = ctl.pool.tasks[0]
    tasks = list(ctl.pool.tasks)
    sd, traj, hp = lab.finetune(ctl.session, t, lab.check_settings(1e-3, 1, 64, 0.5, 0))
    lab.add_expert(ctl.session, "mine", t, sd, hp, traj, owner="person-a")
    assert ctl.offered.to("person-a") == tasks + ["mine"] and ctl.offered.to("person-b") == tasks
    # a History row that merges it: the page that is not offered it is told how, and nothing changes
    ctl.answer(*controls(ctl, experts=[t, "mine"]), session="person-a")
    row = ctl.history.rows(limit=1)[0]["id"]
    assert ctl.reload(row, "person-a")[0]["value"] == [t, "mine"]
    with pytest.raises(gr.Error, match=f"row {row} merges mine, made in the Expert lab by another page: tick "
                                       "\"also offer the lab experts other sessions made\""):
        ctl.reload(row, "person-b")
    # the checkbox and the opt-in answer from the same record
    choices, _ = lc.opt_in(b, True)
    assert choices["choices"] == ctl.offered.to("person-b") == tasks + ["mine"]
    assert ctl.reload(row, "person-b")[0]["value"] == [t, "mine"]
    assert ctl.pool.tasks == tasks  # nobody's tasks changed
    # Analysis' ensemble: per task (a KeyError on 'mine' was a bare Error badge)
    from merger.ui.analysis_tab import AnalysisController

    assert [list(bars.x) for bars in AnalysisController(ctl).ensemble(*controls(ctl, experts=[t, "mine"])).data] == [[t]] * 2
    out = evaluate_endpoint(ctl)("task_arithmetic", lam=0.3)  # experts=None: the pool's experts, not the lab's
    assert out["spec"]["experts"] == tasks and list(out["accuracy"]) == tasks
    with pytest.raises(Exception, match="mine belong.* to a browser session's expert lab"):
        evaluate_endpoint(ctl)("task_arithmetic", lam=0.3, experts=["mine"])


def test_changing_method_keeps_what_was_set_and_follows_defaults_otherwise(ctl):
    def switch(to, frm, **values):
        ups = ctl.method_controls(to, ctl.pool.tasks, *controls(ctl, **values)[2:], previous=frm)[:-1]
        return {k: u.get("value") for k, u in zip(PARAM_NAMES, ups)}

    assert switch("ties", "task_arithmetic", lam=0.3)["lam"] == 1.0  # λ untouched: TIES' own default
    assert switch("ties", "task_arithmetic", lam=0.7)["lam"] == 0.7  # λ the person set: kept
    assert switch("tsv_m", "cart", lam=1.5, rank_ratio=0.08)["rank_ratio"] == 0.3333  # CART's defaults → auto
    fw = switch("fw_hard", "adamerging_task", steps=300, samples=64, lam=0.3)
    assert (fw["steps"], fw["samples"], fw["lam"]) == (10, 100, 0.0)  # λ was not AdaMerging's: FW's default
    assert switch("fw_hard", "adamerging_task", steps=40, samples=64)["steps"] == 40  # set there: kept


def test_changing_method_keeps_the_values_it_can(ctl):
    values = controls(ctl, lam=0.7, sparsity=0.6)[2:]
    ups = dict(zip(PARAM_NAMES, ctl.method_controls("ties", ctl.pool.tasks, *values)[:-1]))
    assert ups["lam"]["value"] == 0.7 and ups["sparsity"]["value"] == 0.6
    ups = dict(zip(PARAM_NAMES, ctl.method_controls("cart", ctl.pool.tasks, *controls(ctl, rank_ratio=0.0)[2:])[:-1]))
    assert ups["rank_ratio"]["value"] == 0.08  # 0 is outside CART's (0, 1]: the default instead


def test_a_reload_in_steps_restores_the_row_and_writes_nothing(ctl):
    """The browser applies a reload in steps, each change event reading some stale values: the
    session's events neither compute nor record those in-between specs (see test_browser.py)."""
    import gradio as gr

    from merger.ui.merge_events import MergeTabEvents

    events, me = MergeTabEvents(ctl, "task_arithmetic"), SimpleNamespace(session_hash="reloader")
    ctl.preview(*controls(ctl, "ties", lam=0.85, sparsity=0.65))
    row = next(r for r in HistoryTab(ctl).history_rows("ties", "") if '"lam": 0.85' in r[3])
    n = len(HistoryTab(ctl).history_rows())
    shown = controls(ctl, lam=0.45)  # what the Merge tab shows: task arithmetic
    experts, method, *updates = events.reload(me, row[0], *shown)
    assert method["value"] == "ties"
    # the method change arrives with the old values: the reloaded ones are kept, not reset
    kept = dict(zip(PARAM_NAMES, events.method_controls(me, "ties", shown[0], *shown[2:])[:-1]))
    assert kept["lam"]["value"] == 0.85 and kept["sparsity"]["value"] == 0.65
    # a move of ties with the stale λ is a step of the reload: skipped
    assert list(events.move(me, None, shown[0], "ties", *shown[2:])) == [(gr.skip(),) * 8]
    final = [experts["value"], "ties"] + [u.get("value") for u in updates]
    out, _ = events.move(me, None, *final)
    assert "ties(lam=0.85, sparsity=0.65)" in out[3]
    # the method change may come after the row's own move: it still keeps the row's values
    kept = dict(zip(PARAM_NAMES, events.method_controls(me, "ties", shown[0], *shown[2:])[:-1]))
    assert kept["lam"]["value"] == 0.85
    assert len(HistoryTab(ctl).history_rows()) == n  # nothing written
    out, _ = events.move(me, None, *controls(ctl, lam=0.55))  # the person moves on: the session is free
    assert "task_arithmetic(lam=0.55)" in out[3] and len(HistoryTab(ctl).history_rows()) == n + 1
    assert events.reload(me, row[0], *final) == (gr.skip(),) * len(final)  # reloading what is shown: no-op


def test_results_are_plain_json_even_with_infinite_losses():
    import json

    from merger.evaluation.evaluator import Result

    res = Result("live", {"a": 0.0, "b": 0.5}, {"a": float("inf"), "b": 0.7}, {"a": 0.0, "b": 1.0}, {"a": 10, "b": 10})
    out = json.loads(json.dumps(res.to_dict(), allow_nan=False))  # what the endpoint's encoder demands
    assert out["loss"]["a"] is None and out["average_loss"] is None and out["normalized"]["a"] is None
    assert out["accuracy"] == {"a": 0.0, "b": 0.5}


def test_a_method_change_replaces_the_previous_message_before_its_merge_is_made(ctl):
    """SLERP's two-expert message stayed on screen while the next method prepared: the move says
    what it computes at once, then answers."""
    from merger.ui.merge_events import MergeTabEvents

    events, me = MergeTabEvents(ctl, "slerp"), SimpleNamespace(session_hash="switcher")
    *_, (said,) = [frame[3:4] for frame in events.move(me, None, *controls(ctl, "slerp"))]
    assert "two" in said.lower() or "2" in said  # three experts ticked: SLERP's message, no result
    frames = list(events.move(me, None, *controls(ctl, "tsv_m", rank_ratio=0.31)))
    assert frames[0][3].startswith("**TSV-M") and "preparing and merging `tsv_m(" in frames[0][3]
    assert "tsv_m(" in frames[-2][3] and "%" in frames[-2][3]  # then its numbers
    # a move of the same method, its preparation cached: no status line in between
    again = list(events.move(me, None, *controls(ctl, "tsv_m", rank_ratio=0.29, lam=0.9)))
    assert len(again) == len(frames) - 1 and "lam=0.9" in again[0][3]


def test_a_refused_value_goes_back_to_the_one_on_screen_and_the_browsers_clamp_computes_nothing(ctl):
    """λ = 5 stayed in the box, and the browser's clamp to 3 when it lost focus computed and pinned
    λ = 3 unseen: one warning, the box back to the value on screen, nothing computed."""
    import gradio as gr

    from merger.methods import PARAM_NAMES
    from merger.ui.merge_events import MergeTabEvents

    events, me = MergeTabEvents(ctl, "task_arithmetic"), SimpleNamespace(session_hash="typist")
    lam_at = PARAM_NAMES.index("lam")
    n_controls = len(PARAM_NAMES) + len(ctl.weight_experts) + len(ctl.weight_blocks)

    def move(**values):
        inputs = helpers.with_weights(ctl, controls(ctl, **{k: v for k, v in values.items() if k != "w"}),
                                      tasks=values.get("w"))
        return list(events.move_or_restore(me, None, *inputs))

    list(move(lam=0.4))  # on screen: λ = 0.4
    work = ctl.session.evaluator.forwards
    with pytest.warns(UserWarning, match=r"λ \(merge coefficient\): 5 is outside \[-3, 3\]") as said:
        (frame,) = move(lam=5)
    assert len(said) == 1 and len(frame) == events.MOVE_OUTPUTS + n_controls
    assert frame[:events.MOVE_OUTPUTS] == (gr.skip(),) * events.MOVE_OUTPUTS  # the result on screen stays
    restored = frame[events.MOVE_OUTPUTS:]
    assert restored[lam_at] == gr.update(value=0.4) and all(u == gr.skip() for i, u in enumerate(restored) if i != lam_at)
    (echo,) = move(lam=3)  # the browser's clamp, sent when the box lost focus: silent, restored again
    assert echo[events.MOVE_OUTPUTS + lam_at] == gr.update(value=0.4)
    assert ctl.session.evaluator.forwards == work  # nothing computed at 5 or at 3
    assert "lam=3" in move(lam=3)[-2][3]  # λ = 3 set again by the person: computed
    first = ctl.weight_experts[0]
    with pytest.warns(UserWarning, match=f"w · {first}: 7 is outside"):
        (frame,) = move(lam=3, w={first: 7})
    assert frame[events.MOVE_OUTPUTS + len(PARAM_NAMES)] == gr.update(value=1.0)
    with pytest.warns(UserWarning, match="empty or not a number"):  # an emptied box
        (frame,) = move(lam=None)
    assert frame[events.MOVE_OUTPUTS + lam_at] == gr.update(value=3)
    # what the page never sends (a client of the queue's own): one message naming the field, nothing done
    for bad, field in (([["shape"]], "experts"), ("shape", "experts"), ({"a": 1}, "method")):
        inputs = helpers.with_weights(ctl, controls(ctl))
        inputs[0 if field == "experts" else 1] = bad
        with pytest.warns(UserWarning, match=f"{field}: expected"):
            (frame,) = list(events.move_or_restore(me, None, *inputs))
        assert all(u == gr.skip() for u in frame)


def test_a_value_controls_listener_carries_the_move_and_that_control_alone(ctl):
    """Gradio builds a component for every output of every frame, a skipped one too: with every
    control an output of every move, each frame of numbers waited on 29 of them. A value control's
    listener restores itself only; the experts' and the method's restore every control."""
    import asyncio

    import gradio as gr

    from merger.ui.app import build_app
    from merger.ui.merge_events import MergeTabEvents

    app = build_app(ctl.session)
    moves = [bf for bf in app.fns.values() if bf.name in ("move_or_restore", "move_of_control")]
    n_controls = len(moves[0].inputs) - 3  # the app's own (lab experts of earlier tests have weights too)
    assert n_controls >= len(PARAM_NAMES) + len(ctl.weight_experts) + len(ctl.weight_blocks)
    assert sorted(len(bf.outputs) for bf in moves) == ([MergeTabEvents.MOVE_OUTPUTS + 1] * n_controls
                                                       + [MergeTabEvents.MOVE_OUTPUTS + n_controls] * 2)
    lam_at = PARAM_NAMES.index("lam")
    lam_listener = next(bf for bf in moves if bf.name == "move_of_control" and bf.outputs[-1] is bf.inputs[3 + lam_at])
    me = SimpleNamespace(session_hash="one-control")
    inputs = helpers.with_weights(ctl, controls(ctl, lam=0.4))
    inputs += [1.0] * (2 + n_controls - len(inputs))
    frames = list(lam_listener.fn(me, None, *inputs))
    assert len(frames[0]) == MergeTabEvents.MOVE_OUTPUTS + 1 and "lam=0.4" in frames[0][3]
    inputs[2 + lam_at] = 5
    with pytest.warns(UserWarning, match="outside"):
        (frame,) = lam_listener.fn(me, None, *inputs)
    assert frame == (gr.skip(),) * MergeTabEvents.MOVE_OUTPUTS + (gr.update(value=0.4),)
    asyncio.run(app.postprocess_data(lam_listener, list(frame), None))  # Gradio takes the frame as wired


def test_the_page_says_the_forwards_precision(ctl):
    """`merger app --forward bf16`: the page's heading says the forwards run in bf16 autocast, since
    its numbers then differ from fp32 forwards' (by about an image a task on the demo)."""
    import gradio as gr

    from merger import serve
    from merger.cli_jobs import set_forward
    from merger.ui.app import build_app

    def heading():
        app = build_app(ctl.session)
        return next(b.value for b in app.blocks.values() if isinstance(b, gr.Markdown) and b.value.startswith("# merger"))

    assert serve.parse_args([]).forward == "auto" and serve.parse_args(["--forward", "bf16"]).forward == "bf16"
    assert "Forwards in fp32 (cpu)." in heading()
    set_forward(ctl.session.evaluator, "bf16")
    try:
        assert "Forwards in bf16 autocast (cpu)." in heading()
    finally:
        set_forward(ctl.session.evaluator, "auto")
