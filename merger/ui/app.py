"""Layout of the app: Merge, Compare and History tabs, built from the method registry."""
from __future__ import annotations

import gradio as gr

from .. import methods
from ..methods.registry import PARAM_NAMES
from ..tuning import TUNE_GRIDS
from .analysis_tab import build_analysis_tabs
from .callbacks import SPLITS_SHOWN, Controller
from .landscape_tab import LandscapeController, build_landscape_tabs
from .merge_events import MergeTabEvents
from .runs import RunController
from .scheduling import BATCH_EVENT, PREVIEW_EVENT, as_batch

CSS = """
#summary h3 {margin: 0.2em 0;}
"""


def _param_control(name: str, num_experts: int):
    users = [m for m in methods.all_methods() if name in m.param_names]
    m = users[0]
    p = m.param(name)
    value = (m.defaults_for(num_experts) if m.defaults_for else {}).get(name, p.default)
    if value == "auto":  # the slider's auto position: the top of its range for this many experts
        value = m.bounds(name, num_experts)[1]
    label = {"lam": "λ (merge coefficient)", "rank_ratio": "rank ratio", "sparsity": "sparsity",
             "seed": "seed", "steps": "steps", "lr": "learning rate", "init": "initial coefficient",
             "samples": "samples per task", "k": "top-k vertices", "step_size": "FW step factor"}[name]
    if p.kind == "int":
        return gr.Number(value=value, label=label, precision=0, minimum=p.min, maximum=p.max,
                         elem_id=f"ctl-{name}", info=p.help)
    return gr.Slider(minimum=p.min, maximum=p.max, step=p.step, value=value, label=label,
                     elem_id=f"ctl-{name}", info=p.help)


def build_app(session, history=None, title: str = "merger") -> gr.Blocks:
    ctl = Controller(session, history)
    pool = session.pool
    default_method = "task_arithmetic"
    landscape = LandscapeController(ctl)
    events = MergeTabEvents(ctl, default_method, landscape)

    def batch(fn):
        return as_batch(session, fn)

    with gr.Blocks(title=title) as app:
        pins = gr.State([])
        gr.Markdown(f"# merger · model-merging explorer\nPool **{pool.name}** ({pool.architecture_name}): "
                    f"{len(pool.tasks)} experts: {', '.join(pool.tasks)}.")
        with gr.Tabs():
            with gr.Tab("Merge", id="merge"):
                with gr.Row():
                    with gr.Column(scale=1, min_width=300):
                        experts = gr.CheckboxGroup(pool.tasks, value=list(pool.tasks), label="experts to merge",
                                                   elem_id="ctl-experts")
                        method = gr.Dropdown([(m.display_name, m.name) for m in methods.all_methods()],
                                             value=default_method, label="method", elem_id="ctl-method")
                        about = gr.Markdown()
                        controls = [_param_control(n, len(pool.tasks)) for n in PARAM_NAMES]
                        with gr.Row():
                            pin_btn = gr.Button("Pin", elem_id="pin")
                            export_btn = gr.Button("Export", elem_id="export")
                        with gr.Accordion("Data-driven methods (AdaMerging, FW-Merging)", open=False):
                            with gr.Row():
                                run_btn = gr.Button("Run", variant="primary", elem_id="run")
                                cancel_btn = gr.Button("Cancel", elem_id="cancel")
                            run_status = gr.Markdown("Pick a data-driven method, set its parameters, press Run.")
                        pins_md = gr.Markdown(Controller.pins_text([]))
                        files = gr.File(label="exported files", file_count="multiple", interactive=False)
                        export_msg = gr.Markdown()
                    with gr.Column(scale=3):
                        summary = gr.Markdown(elem_id="summary")
                        acc_plot = gr.Plot(label="accuracy per task", elem_id="acc-plot")
                        with gr.Row():
                            loss_plot = gr.Plot(label="loss per task")
                            radar_plot = gr.Plot(label="normalised accuracy")
                        with gr.Accordion("What a data-driven run learned", open=False):
                            objective_plot = gr.Plot(label="objective")
                            with gr.Row():
                                coef_plot = gr.Plot(label="coefficients")
                                fw_plot = gr.Plot(label="Frank–Wolfe")
                inputs = [experts, method, *controls]
                outputs = [acc_plot, loss_plot, radar_plot, summary]
                learned = [objective_plot, coef_plot, fw_plot]
                method.change(events.method_controls, [method, experts, *controls], [*controls, about], queue=False)
                experts.change(ctl.refresh_limits, inputs, controls, queue=False, api_visibility="private")
                runs = RunController(ctl)
                run_btn.click(runs.run, inputs, [run_status, *learned, *outputs], **BATCH_EVENT, api_visibility="private")
                cancel_btn.click(runs.cancel, None, run_status, concurrency_id="cancel", concurrency_limit=None,
                                 api_visibility="private")
                pin_btn.click(ctl.pin, [pins, *inputs], [pins, pins_md], api_visibility="private")
                export_btn.click(batch(ctl.export), inputs, [files, export_msg], **BATCH_EVENT, api_visibility="private")

            with gr.Tab("Compare", id="compare"):
                with gr.Row():
                    cmp_split = gr.Dropdown(list(SPLITS_SHOWN), value="live", label="split")
                    cmp_btn = gr.Button("Compare pinned merges")
                cmp_table = gr.Dataframe(headers=ctl.compare_headers(), interactive=False)
                with gr.Row():
                    cmp_bars = gr.Plot()
                    cmp_radar = gr.Plot()
                cmp_btn.click(batch(ctl.compare), [pins, cmp_split], [cmp_table, cmp_bars, cmp_radar],
                              **BATCH_EVENT, api_visibility="private")
                gr.Markdown("### Auto-tune\nGrid search on the validation split, then the best setting on the test split.")
                tune_methods = gr.CheckboxGroup(list(TUNE_GRIDS), value=["task_arithmetic", "ties", "cart"],
                                                label="methods")
                tune_btn = gr.Button("Auto-tune")
                tune_table = gr.Dataframe(headers=["method", "best parameters", "grid points", "val acc %",
                                                   "test acc %", "test normalised %"], interactive=False)
                with gr.Row():
                    tune_bars = gr.Plot(elem_id="tune-bars")
                    tune_radar = gr.Plot()
                tune_btn.click(batch(ctl.auto_tune), [tune_methods, experts], [tune_table, tune_bars, tune_radar],
                               **BATCH_EVENT, api_visibility="private")
                gr.Markdown("### Sweeps")
                with gr.Row():
                    sweep_axis = gr.Radio([("λ", "lam"), ("rank ratio", "rank_ratio"), ("sparsity", "sparsity"),
                                           ("number of tasks", "tasks")], value="lam", label="against")
                    sweep_methods = gr.CheckboxGroup(methods.names(), value=["task_arithmetic", "ties", "cart"],
                                                     label="methods")
                    sweep_split = gr.Dropdown(list(SPLITS_SHOWN), value="live", label="split")
                sweep_btn = gr.Button("Sweep")
                sweep_plot = gr.Plot(elem_id="sweep-plot")
                sweep_btn.click(batch(ctl.sweep), [sweep_axis, sweep_methods, sweep_split, experts], sweep_plot,
                                **BATCH_EVENT, api_visibility="private")

            land_state, land_plot = build_landscape_tabs(landscape, pins, inputs, batch)
            # One listener per control: the Merge plots, the data-driven panel and the landscape marker
            # from one merge and one forward (MergeTabEvents.move).
            for c in [experts, method, *controls]:
                c.change(events.move, [land_state, *inputs], [*outputs, *learned, land_plot], trigger_mode="always_last",
                         **PREVIEW_EVENT, show_progress="hidden", api_visibility="private")

            build_analysis_tabs(ctl, inputs, experts)

            with gr.Tab("History", id="history"):
                with gr.Row():
                    hist_method = gr.Dropdown([""] + methods.names(), value="", label="method")
                    hist_text = gr.Textbox(label="filter (method, parameters or experts contain)")
                    hist_refresh = gr.Button("Refresh")
                hist_table = gr.Dataframe(headers=Controller.HISTORY_HEADERS, interactive=False)
                with gr.Row():
                    hist_id = gr.Number(label="row id to reload into the Merge tab", precision=0)
                    hist_reload = gr.Button("Reload")
                    hist_csv_btn = gr.Button("Export CSV")
                hist_file = gr.File(label="history CSV", interactive=False)
                for trig in (hist_refresh.click, hist_method.change, hist_text.submit):
                    trig(ctl.history_rows, [hist_method, hist_text], hist_table, api_visibility="private")
                hist_reload.click(events.reload, [hist_id, *inputs], [experts, method, *controls], api_visibility="private")
                hist_csv_btn.click(ctl.history_csv, [hist_method, hist_text], hist_file, api_visibility="private")

        gr.api(ctl.api_evaluate, api_name="evaluate", **PREVIEW_EVENT)
        app.load(ctl.method_controls, [method, experts, *controls], [*controls, about], api_visibility="private")
        app.load(ctl.preview, inputs, outputs, **PREVIEW_EVENT, api_visibility="private")
    return app
