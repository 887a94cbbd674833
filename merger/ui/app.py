"""The app: one module per tab (Merge, Compare, Trade-offs, Landscape, Analysis, History), built from the
method registry; this file only composes them and wires the listeners that span tabs."""
from __future__ import annotations

import gradio as gr

from merger import methods
from merger.analysis.lab import free_lab_experts
from merger.ui.analysis_tab import build_analysis_tabs
from merger.ui.compare_tab import REPORT_VIEWS, build_compare_tab
from merger.ui.endpoint import evaluate_endpoint
from merger.ui.history_tab import build_history_tab
from merger.ui.landscape_tab import LandscapeController, build_landscape_tabs
from merger.ui.merge_events import MergeTabEvents, session_of
from merger.ui.merge_tab import Controller, build_merge_tab
from merger.ui.room import Room
from merger.ui.room_panel import RoomPanel
from merger.ui.scheduling import BATCH_EVENT, PREVIEW_EVENT, as_batch
from merger.ui.tradeoffs_tab import build_tradeoffs_tab


def default_method() -> str:
    """The method the Merge tab opens with: the registry's first featured one."""
    return next((m.name for m in methods.all_methods() if m.featured), methods.names()[0])


def build_app(session, history=None, title: str = "merger", cluster=None, presenter: str | None = None) -> gr.Blocks:
    """``presenter``: the login name that drives a workshop room (``app --presenter``); None: no room."""
    ctl = Controller(session, history, cluster)
    pool = session.pool
    first = default_method()
    landscape = LandscapeController(ctl)
    room = Room(presenter) if presenter else None
    events = MergeTabEvents(ctl, first, landscape, room)
    panel = RoomPanel(room, ctl, events) if room is not None else None

    def batch(fn):
        return as_batch(session, fn)

    # Gradio's copies of the downloads offered (exports, CSVs): every 10 minutes, those over an hour old go
    with gr.Blocks(title=title, delete_cache=(600, 3600)) as app:
        gr.Markdown(f"# merger · model-merging explorer\nPool **{pool.name}** ({pool.architecture_name}): "
                    f"{len(pool.tasks)} experts: {', '.join(pool.tasks)}. Forwards in "
                    f"{'bf16 autocast' if session.evaluator.forwards_in_bf16 else 'fp32'} ({session.evaluator.device.type}).")
        room_parts = panel.build() if panel is not None else None
        with gr.Tabs() as tabs:
            merge = build_merge_tab(ctl, events, first, batch)
            compare = build_compare_tab(ctl, merge["pins"], merge["experts"], batch)
            build_tradeoffs_tab(ctl, merge, events, batch)
            land_state, land_plot = build_landscape_tabs(landscape, merge["pins"], merge["inputs"], batch)
            # One listener per control: the Merge plots, the data-driven panel and the landscape marker
            # from one merge and one forward (MergeTabEvents.move). It takes the values as the browser
            # sent them: a value out of range goes back to the one on screen (move_or_restore), where
            # Gradio's check would refuse it and leave it in the box. A value control restores itself only.
            controls = merge["inputs"][2:]
            for i, c in enumerate(merge["inputs"]):
                listener, restores = (events.move_or_restore, controls) if i < 2 else (events.move_at(i - 2), [c])
                c.change(listener, [land_state, *merge["inputs"]], [*merge["outputs"], *merge["learned"], land_plot, *restores],
                         preprocess=False, trigger_mode="always_last", **PREVIEW_EVENT, show_progress="hidden",
                         api_visibility="private")
            build_analysis_tabs(ctl, merge["inputs"], merge["experts"])
            build_history_tab(ctl, events, merge)
        plots_by_id = {b.elem_id: b for b in app.blocks.values() if isinstance(b, gr.Plot)}
        button, report_inputs, report_file = compare.report_event
        button.click(batch(compare.report), [*report_inputs, *[plots_by_id[i] for i in REPORT_VIEWS]], report_file,
                     **BATCH_EVENT, api_visibility="private")

        if panel is not None:
            panel.wire(app, room_parts, tabs, {t.label: t.id for t in tabs.children}, merge)
        gr.api(evaluate_endpoint(ctl), api_name="evaluate", **PREVIEW_EVENT)
        app.load(ctl.method_controls, [merge["method"], merge["experts"], *merge["controls"]],
                 [*merge["controls"], merge["about"]], api_visibility="private")
        app.load(events.load, merge["inputs"], merge["outputs"], **PREVIEW_EVENT, api_visibility="private")
        app.load(merge["runs"].under_way, None, merge["under_way"], queue=False, api_visibility="private")

        def ended(request: gr.Request):  # Gradio passes the request to a parameter annotated so
            session_ended(ctl, events, request)
            if room is not None:
                room.left(session_of(request))
            # Gradio keeps a closed page's gr.State values (pins, landscapes) for an hour, for a reload
            # that here opens a new session anyway: they go now
            holder = getattr(app, "state_holder", None)
            if holder is not None and hasattr(holder, "delete_state"):
                holder.delete_state(session_of(request))
        app.unload(ended)
    return app


def session_ended(ctl: Controller, events: MergeTabEvents, request: gr.Request) -> None:
    """A page closed: its lab experts (a task vector each) and what was kept for it go."""
    who = session_of(request)
    free_lab_experts(ctl.session, who)
    events.forget(who)
    if events.landscape is not None:
        events.landscape.forget(who)
    ctl.offered.forget(who)
