"""The coefficients panel and the Trade-offs tab as their callbacks run: a weight
slider's move costs what a λ move costs, presets, start from learned, reload, the tab's views."""
from types import SimpleNamespace

import gradio as gr
import pytest
from helpers import controls, ui_controller, with_weights

from merger.ui.coefficients_panel import preset_values
from merger.ui.merge_events import MergeTabEvents


@pytest.fixture(scope="module")
def ctl(tmp_path_factory):
    return ui_controller(tmp_path_factory.mktemp("coef-ui"))


def person(name="p"):
    return SimpleNamespace(session_hash=name)


def work(ctl):
    return ctl.session.evaluator.forwards, ctl.session.counts["applies"]


def test_a_weight_slider_move_costs_what_a_lambda_move_costs(ctl):
    events = MergeTabEvents(ctl, "task_arithmetic")
    first = ctl.weight_experts[0]
    list(events.move(person(), None, *with_weights(ctl, controls(ctl, lam=0.45))))
    for method in ("task_arithmetic", "ties"):
        for w in (0.37, 1.62):
            before = work(ctl)
            *_, numbers, _ = list(events.move(person(), None, *with_weights(ctl, controls(ctl, method, lam=0.45),
                                                                         {first: w}, {"block0": 0.5})))
            after = work(ctl)
            assert (after[0] - before[0], after[1] - before[1]) == (1, 1), (method, w)
            assert f"w[{first}={w:g}] b[block0=0.5]" in numbers[3]


def test_weights_of_unticked_experts_are_ignored_and_data_driven_methods_ignore_the_sliders(ctl):
    ticked = ctl.pool.tasks[:2]
    values = with_weights(ctl, controls(ctl, experts=ticked)[2:], {ctl.pool.tasks[2]: 2.0, ticked[0]: 0.5})
    spec = ctl.spec_from_controls(ticked, "task_arithmetic", *values)
    assert spec.task_weights == ((ticked[0], 0.5),)
    spec = ctl.spec_from_controls(ticked, "adamerging_task", *values)
    assert spec.task_weights == () and spec.block_weights == ()


def test_presets(ctl):
    blocks = ctl.weight_blocks
    assert preset_values("flat", blocks) == [1.0] * len(blocks)
    deeper = preset_values("deeper blocks more", blocks)
    assert deeper[0] == 0.5 and deeper[-1] == 1.5 and deeper == sorted(deeper)
    assert preset_values("shallower blocks more", blocks) == deeper[::-1]
    assert preset_values("last k only", blocks, 2) == [0.0] * (len(blocks) - 2) + [1.0, 1.0]
    from merger.ui.coefficients_panel import CoefficientsPanel

    with pytest.warns(UserWarning, match="k must be between 1 and"):  # a toast; every slider keeps its value
        assert CoefficientsPanel(ctl).preset("last k only", 99) == tuple(gr.skip() for _ in blocks)
    with pytest.warns(UserWarning, match="k must be a whole number, got 2.5"):  # Gradio rounded it to 2
        assert CoefficientsPanel(ctl).preset("last k only", 2.5) == tuple(gr.skip() for _ in blocks)
    with pytest.warns(UserWarning, match="k is empty; type a whole number between 1 and"):
        assert CoefficientsPanel(ctl).preset("last k only", None) == tuple(gr.skip() for _ in blocks)


def test_out_of_range_weights_and_parameters_name_their_field():
    """A typed value outside a slider's range is refused with the slider's label (Gradio's own
    check names no field), and the browser still draws Gradio's slider and number box."""
    from merger.ui.controls import param_control  # importing merger.ui names the fields

    w = gr.Slider(-3, 3, value=1.0, step=0.01, label="w · size")
    assert w.get_block_name() == "slider" and w.preprocess(2.5) == 2.5
    for value, shown in ((5, "5"), (-9, "-9"), (float("nan"), "nan")):
        with pytest.raises(gr.Error, match=rf"w · size: {shown} is outside \[-3, 3\]"):
            w.preprocess(value)
    with pytest.raises(gr.Error, match=r"w · size: empty or not a number; type a number in \[-3, 3\]"):
        w.preprocess(None)  # its box cleared, or 'abc' typed: Gradio's own check raised a TypeError
    rank = param_control("rank_ratio", 3)  # the methods refuse 0: its range reads (0, 1], as theirs
    for value, shown in ((-0.5, "-0.5"), (1.5, "1.5")):
        with pytest.raises(gr.Error, match=rf"{rank.label}: {shown} is outside \(0, 1\]"):
            rank.preprocess(value)
    assert rank.preprocess(0) == 0 and rank.preprocess(1) == 1  # 0 itself: the method's check, outputs kept
    seed = param_control("seed", 3)
    assert seed.get_block_name() == "number"
    with pytest.raises(gr.Error, match=r"seed: -1 is outside \[0, 2.14748e\+09\]"):
        seed.preprocess(-1)
    epochs = gr.Number(value=1, precision=0, label="epochs")  # no bounds (the lab's boxes)
    for value, message in (("abc", "epochs: 'abc' is not a number"), (10**400, "epochs: an integer of 401 digits is not a number"),
                           (float("inf"), "epochs: inf is not a finite number")):
        with pytest.raises(gr.Error, match=message):
            epochs.preprocess(value)
    # 2.5 reaches the listener as it is (Gradio rounded it to 2), whose own check refuses it
    assert epochs.preprocess(2.5) == 2.5 and epochs.preprocess(3.0) == 3 and epochs.preprocess(None) is None


def test_a_slider_names_its_field_after_a_listener_updated_it():
    """A method switch updates the controls' props, and Gradio then rebuilds each one for that
    browser session from its class: the rebuilt λ slider still names itself (it once fell back to
    "Value 7 is greater than maximum value 3.")."""
    import asyncio

    from gradio.state_holder import SessionState

    from merger.ui.controls import param_control

    with gr.Blocks() as app:
        lam = param_control("lam", 3)  # the Merge tab's λ
        switch, shown = gr.Button(), gr.Number()
        switch.click(lambda: gr.update(info="another method's help"), None, lam)
        lam.change(lambda v: v, lam, shown)
    relabel, move = app.fns.values()
    state = SessionState(app)  # one browser session
    assert asyncio.run(app.process_api(move, [2.5], state=state))["data"] == [2.5]
    asyncio.run(app.process_api(relabel, [], state=state))
    assert state[lam._id] is not lam  # Gradio's rebuilt copy, the one the next move goes through
    with pytest.raises(gr.Error, match=r"λ \(merge coefficient\): 7 is outside \[-3, 3\]"):
        asyncio.run(app.process_api(move, [7], state=state))


def test_start_from_learned_sets_the_sliders_to_what_the_run_learned(ctl):
    values = controls(ctl, "adamerging_task", steps=3, samples=8, lr=0.05)
    spec = ctl.spec_from_controls(*values)
    run = ctl.session.run(spec)
    updates = ctl.learned_updates(*values)
    experts, method, *rest = [u.get("value") for u in updates]
    assert method == "task_arithmetic" and experts == list(spec.experts)
    loaded = ctl.spec_from_controls(experts, method, *rest)
    assert loaded.kwargs["lam"] == 1.0
    assert loaded.task_weight_list() == pytest.approx(run.coefficients[:, 0].tolist(), abs=0.005)
    assert all(round(w, 2) == w for w in loaded.task_weight_list())  # on the sliders' step: shown = computed
    mine = ctl.session.preview(loaded, "test")
    theirs = ctl.session.preview(spec, "test")
    assert abs(mine.average_accuracy - theirs.average_accuracy) <= 0.02  # sliders snap to 0.01
    with pytest.raises(gr.Error, match="pick AdaMerging or FW-Merging"):
        ctl.learned_updates(*controls(ctl))
    with pytest.raises(gr.Error, match=r"Start from learned: no AdaMerging \(task-wise\) run for these settings yet"):
        ctl.learned_updates(*controls(ctl, "adamerging_task", steps=4, samples=8, lr=0.05))  # never run


def test_the_merge_start_from_learned_sets_is_recorded(ctl):
    """Loaded into the sliders, the learned weights are a new spec: its result goes into the history
    like a move's (it was read as a History reload and never written)."""
    values = with_weights(ctl, controls(ctl, "adamerging_task", steps=3, samples=8, lr=0.05))
    ctl.session.run(ctl.spec_from_controls(*values))
    events = MergeTabEvents(ctl, "task_arithmetic")
    updates = events.start_from_learned(person("me"), *values)
    loaded = [u.get("value") for u in updates]
    before = len(ctl.history.rows(limit=10**6))
    list(events.move(person("me"), None, *loaded))
    rows = ctl.history.rows(limit=10**6)
    assert len(rows) == before + 1 and rows[0]["method"] == "task_arithmetic" and "task_weights" in rows[0]["params"]


def test_history_reload_restores_the_weights(ctl):
    first = ctl.weight_experts[1]
    values = with_weights(ctl, controls(ctl, lam=0.55)[2:], {first: 1.75}, {"projection": 0.25})
    ans = ctl.answer(list(ctl.pool.tasks), "task_arithmetic", *values)
    row = ctl.history.rows()[0]
    assert row["method"] == "task_arithmetic" and "1.75" in row["params"]
    updates = ctl.reload(row["id"])
    experts, method, *rest = [u.get("value") for u in updates]
    assert ctl.spec_from_controls(experts, method, *rest).snap() == ans.spec.snap()
    # a row written before its method took a parameter: that control at its default, not emptied
    updates = ctl.spec_updates(list(ctl.pool.tasks), "consensus_ta", {"lam": 0.5}, {}, {})
    experts, method, *rest = [u.get("value") for u in updates]
    assert ctl.spec_from_controls(experts, method, *rest).kwargs == {"lam": 0.5, "mask_lambda": 0.4, "agree": 2}


def test_tradeoffs_tab_views(ctl):
    from merger.analysis.coefficients import MAP_VALUES
    from merger.ui.tradeoffs_tab import TradeoffsTab, events_load

    events = MergeTabEvents(ctl, "task_arithmetic")
    tab = TradeoffsTab(ctl, events)
    a, b = ctl.pool.tasks[:2]
    inputs = with_weights(ctl, controls(ctl, lam=0.4))
    list(events.move(person("other"), None, *with_weights(ctl, controls(ctl, lam=0.95))))  # someone else's merge
    list(events.move(person("me"), None, *with_weights(ctl, controls(ctl, lam=0.85))))
    map_a, map_b, pareto, status = tab.two_tasks(person("me"), a, b, *inputs, progress=lambda *x, **k: None)
    assert len(map_a.data[0].z) == len(MAP_VALUES) and f"{len(MAP_VALUES)} × {len(MAP_VALUES)}" in status
    assert [t.name for t in pareto.data][:2] == ["evaluated", "Pareto front"]
    n = len(MAP_VALUES) ** 2 + 1  # the grid and my one move: not the other person's
    assert len(pareto.data[0].x) == n and f"{n} merges you evaluated" in status
    assert tab.cancel(person("me")) == gr.skip()  # the map is done: its summary stays in the status line
    fig, _ = tab.turn_up(person(), b, *inputs, progress=lambda *x, **k: None)
    assert {t.name for t in fig.data} == set(ctl.pool.tasks)
    # refused: the maps shown stay, the status line says why
    *maps, status = tab.two_tasks(person(), a, b, *with_weights(ctl, controls(ctl, "adamerging_task")),
                                  progress=lambda *x, **k: None)
    assert maps == [gr.skip()] * 3 and status.startswith("⚠️") and "learns its own coefficients" in status
    table, msg, kept = tab.tune(person(), None, 0, False, False, *inputs, progress=lambda *x, **k: None)
    assert (table, kept) == (gr.skip(), gr.skip()) and msg == "⚠️ budget (evaluations): empty or not a number"
    _, msg, _ = tab.tune(person(), 4, 2**40, False, False, *inputs, progress=lambda *x, **k: None)
    assert msg == "⚠️ seed: 1099511627776 is outside [0, 2^32 − 1]"  # not Optuna's words, mid-job
    _, msg, _ = tab.tune(person(), 500, 0, False, False, *inputs, progress=lambda *x, **k: None)
    assert msg == "⚠️ budget (evaluations): 500 is outside [1, 400]"  # here, not a toast beside an older line
    table, msg, kept = tab.tune(person(), 2.5, 0, False, False, *inputs, progress=lambda *x, **k: None)
    assert (table, kept) == (gr.skip(), gr.skip()) and msg == "⚠️ budget (evaluations): 2.5 is not a whole number"
    rows, msg, tuned = tab.tune(person(), 4, 0, False, False, *inputs, progress=lambda *x, **k: None)
    assert rows[0][0] == "TPE per-task weights" and rows[0][2] == 4 and rows[1][0].startswith("best single λ")
    updates = tab.load(tuned, *inputs)
    with pytest.warns(UserWarning, match="tune first"):  # every Merge-tab input as it was: no error badges
        assert events_load(events, tab)(person(), None, *inputs) == (gr.skip(),) * len(inputs)
    experts, method, *rest = [u.get("value") for u in updates]
    assert ctl.spec_from_controls(experts, method, *rest).snap() == tuned.snap()
    assert all(v == round(v, 2) for v in rest[-len(ctl.weight_experts + ctl.weight_blocks):])  # no 1.9000000000000001
    # around the current merge: its block weights stay in every trial and in what Load sets (once 1)
    blocked = with_weights(ctl, controls(ctl, lam=0.4), blocks={"projection": 0.5})
    _, msg, tuned = tab.tune(person(), 2, 0, False, False, *blocked, progress=lambda *x, **k: None)
    assert dict(tuned.block_weights) == {"projection": 0.5} and "b[projection=0.5]" in msg
    experts, method, *rest = [u.get("value") for u in tab.load(tuned, *blocked)]
    assert dict(ctl.spec_from_controls(experts, method, *rest).block_weights) == {"projection": 0.5}
