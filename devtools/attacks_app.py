"""The bad-input catalogue's cases about the app's listeners (devtools/attacks.py lists them):
what a browser box or a client of Gradio's queue can send to the Merge tab's listener, which takes
the values as sent (``MergeTabEvents.move_or_restore``), and a job list a client can inflate."""
from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

from merger.errors import MergerError
from merger.methods.basic import TASK_ARITHMETIC
from merger.methods.ties import TIES
from devtools.testing import write_pool


def _app(root: Path):
    """A Controller and the Merge tab's events over a small demo-data pool, and the controls' values
    (experts, method, parameters, weights) the page opens with."""
    import merger
    from merger.methods import PARAM_NAMES
    from merger.ui.controls import control_values, default_params
    from merger.ui.merge_events import MergeTabEvents
    from merger.ui.merge_tab import Controller

    ctl = Controller(merger.PoolSession(merger.open_pool(write_pool(root, n_experts=3, scale=0.1, demo_data=True))))
    m = TASK_ARITHMETIC
    values = control_values(m, default_params(m, len(ctl.pool.tasks)), len(ctl.pool.tasks))
    inputs = [list(ctl.pool.tasks), m.name, *values, *[1.0] * (len(ctl.weight_experts) + len(ctl.weight_blocks))]
    return ctl, MergeTabEvents(ctl, m.name), inputs, PARAM_NAMES


def sent(change):
    """A move whose inputs ``change(inputs, names)`` spoiled: its warnings are the refusal, and
    nothing may be computed (a refused value stays unseen, and so does its clamp)."""
    def build(root: Path):
        def action():
            ctl, events, inputs, names = _app(root)
            page = SimpleNamespace(session_hash="attacker")
            list(events.move_or_restore(page, None, *inputs))  # the page's first answer
            forwards = ctl.session.evaluator.forwards
            change(inputs, names)
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                frames = list(events.move_or_restore(page, None, *inputs))
            if ctl.session.evaluator.forwards != forwards or len(frames) != 1:
                raise AssertionError("a refused move computed a merge")
            if said:
                raise MergerError("; ".join(str(w.message) for w in said))
        return action
    return build


def at(name: str, value):
    def change(inputs, names):
        inputs[2 + names.index(name)] = value
    return change


def first_weight(value):
    def change(inputs, names):
        inputs[2 + len(names)] = value
    return change


def slot(i: int, value):
    def change(inputs, names):
        inputs[i] = value
    return change


def clamp_after_refusal(root: Path):
    """λ = 5 refused, then the browser's clamp to 3 when the box loses focus: restored to the λ on
    screen, silently, and nothing computed at 5 or 3."""
    def action():
        import gradio as gr

        ctl, events, inputs, names = _app(root)
        page = SimpleNamespace(session_hash="attacker")
        list(events.move_or_restore(page, None, *inputs))
        forwards, lam = ctl.session.evaluator.forwards, inputs[2 + names.index("lam")]
        frames = []
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for value in (5, 3):
                at("lam", value)(inputs, names)
                frames += list(events.move_or_restore(page, None, *inputs))
        restored = [frame[events.MOVE_OUTPUTS + names.index("lam")] for frame in frames]
        if ctl.session.evaluator.forwards != forwards or restored != [gr.update(value=lam)] * 2 or len(said) != 1:
            raise AssertionError(f"the clamp was computed or not restored ({len(said)} warning(s))")
    return action


def inflated_auto_tune(root: Path):
    """Auto-tune of one method named 100,000 times: one grid, one row."""
    def action():
        from merger.ui.compare_tab import CompareTab

        ctl, _, _, _ = _app(root)
        frames = list(CompareTab(ctl).auto_tune(SimpleNamespace(session_hash="attacker"), [TIES.name] * 100_000,
                                                None, progress=lambda *a, **k: None))
        table = frames[-1][0]
        if len(frames) != 1 or [row[0] for row in table] != [TIES.name]:
            raise AssertionError(f"auto-tune ran {len(frames)} method(s)")
    return action
