"""The Trade-offs tab: what the coefficients trade. A map of two tasks' accuracy over their two
weights with every evaluated merge's Pareto front, one task's weight turned up against every task,
and a seeded TPE search of the per-task weights (Optuna) beside the best single λ and AdaMerging
task-wise. The spec around which everything varies is the Merge tab's current one."""
from __future__ import annotations

import gradio as gr

from merger import methods, plots
from merger.analysis import coefficients as co
from merger.errors import Cancelled, MergerError
from merger.evaluation.tuning import MAX_GRID_POINTS, auto_tune, tune_weights, weight_range
from merger.methods.adaptive import ADAMERGING_TASK
from merger.methods.basic import TASK_ARITHMETIC
from merger.ui.errors import notice
from merger.ui.merge_events import session_of
from merger.ui.scheduling import BATCH_EVENT, CancelFlags


class TradeoffsTab:
    def __init__(self, ctl, events):
        self.ctl = ctl
        self.events = events  # MergeTabEvents: which merges each browser session evaluated
        self._cancel = CancelFlags()

    def cancel(self, request: gr.Request):
        """Stops this page's trade-offs jobs (the map, turn one up, the weight search); each says so
        in its own status line when it stops. The map's caption is not overwritten: the map it
        describes may stay on screen (a Cancel meant for Turn one up)."""
        self._cancel.cancel_and_say(session_of(request), "trade-offs job", "after the current evaluation")
        return gr.skip()

    def _spec(self, inputs):
        spec = self.ctl.spec_from_controls(*inputs)
        if methods.get(spec.method).data_driven:
            raise MergerError(f"{spec.method} learns its own coefficients: pick a static method in the Merge tab "
                              "(or Start from learned)")
        return spec

    def two_tasks(self, request: gr.Request, task_a, task_b, *inputs, progress=gr.Progress()):
        """(map of A, map of B, Pareto scatter, status) around the Merge tab's spec."""
        with self._cancel.job(session_of(request)) as flag:
            return self._two_tasks(request, flag, task_a, task_b, inputs, progress)

    def _two_tasks(self, request, flag, task_a, task_b, inputs, progress):
        try:
            spec = self._spec(inputs)
            out = co.two_task_map(self.ctl.session, spec, task_a, task_b, progress=lambda f, m: progress(f, desc=m),
                                  cancel=flag.is_set)
        except Cancelled as exc:
            return gr.skip(), gr.skip(), gr.skip(), str(exc)
        except MergerError as exc:  # refused: the maps shown stay, the status says why
            return gr.skip(), gr.skip(), gr.skip(), notice(exc)
        who = session_of(request)
        self.events.saw(who, out["specs"])
        points = co.evaluated_points(self.ctl.session, task_a, task_b, specs=self.events.evaluated(who))
        front = co.pareto_front(points)
        values = out["values"]
        return (plots.weight_map(values, out["accuracy_a"], task_a, task_b, task_a, out["current"]),
                plots.weight_map(values, out["accuracy_b"], task_a, task_b, task_b, out["current"]),
                plots.pareto_scatter(points, front, task_a, task_b),
                f"`{spec.label()}` with the weights of **{task_a}** and **{task_b}** on an "
                f"{len(values)} × {len(values)} grid; {len(points)} merges you evaluated (your moves and grids), "
                f"{len(front)} on the front.")

    def turn_up(self, request: gr.Request, task, *inputs, progress=gr.Progress()):
        """(the lines of every task's accuracy, their status)."""
        with self._cancel.job(session_of(request)) as flag:
            return self._turn_up(flag, task, inputs, progress)

    def _turn_up(self, flag, task, inputs, progress):
        try:
            spec = self._spec(inputs)
            out = co.turn_one_up(self.ctl.session, spec, task, progress=lambda f, m: progress(f, desc=m),
                                 cancel=flag.is_set)
        except Cancelled as exc:
            return gr.skip(), str(exc)
        except MergerError as exc:
            return gr.skip(), notice(exc)
        curves = {t: (out["values"], [100 * a for a in accs]) for t, accs in out["accuracy"].items()}
        return (plots.lines(curves, f"weight of {task}", "accuracy %", f"Turning {task} up: who gains, who pays"),
                f"`{spec.label()}` with the weight of **{task}** from 0 to 2.")

    HEADERS = ["search", "what it sets", "evaluations", "val acc %", "test acc %"]

    def tune(self, request: gr.Request, budget, seed, with_lam, with_ada, *inputs, progress=gr.Progress()):
        """The TPE search of per-task weights beside the best single λ (and AdaMerging task-wise)."""
        with self._cancel.job(session_of(request)) as flag:
            return self._tune(flag, budget, seed, with_lam, with_ada, inputs, progress)

    def _tune(self, flag, budget, seed, with_lam, with_ada, inputs, progress):
        session = self.ctl.session
        try:
            # checked by tune_weights, not by the boxes' bounds: every refusal in this status line (a
            # bound's refusal was a toast, beside an older refusal left standing here)
            for label, value in (("budget (evaluations)", budget), ("seed", seed)):
                if value is None:  # the box left empty, or text typed in it (the browser sends no number)
                    raise MergerError(f"{label}: empty or not a number")
            spec = self._spec(inputs)
            tuned = tune_weights(session, spec.method, spec.kwargs, list(spec.experts), budget=budget,
                                 seed=seed, with_lam=bool(with_lam),
                                 progress=lambda f, m: progress(f, desc=m), cancel=flag.is_set,
                                 cluster=self.ctl.cluster, block_weights=dict(spec.block_weights))
            rows = [["TPE per-task weights" + (" + λ" if with_lam else ""),
                     ", ".join(f"{e}={w:g}" for e, w in tuned["task_weights"].items())
                     + (f"; λ={tuned['spec'].kwargs['lam']:g}" if with_lam else ""),
                     tuned["trials"], round(100 * tuned["val_accuracy"], 2), round(100 * tuned["test_accuracy"], 2)]]
            single = auto_tune(session, [TASK_ARITHMETIC.name], experts=list(spec.experts))[0]
            # that grid is of the plain method: say so beside a search that kept block weights
            rows.append(["best single λ (task arithmetic grid" + (", block weights 1)" if spec.block_weights else ")"),
                         f"λ={single['params']['lam']:g}",
                         single["grid_points"], round(100 * single["val_accuracy"], 2),
                         round(100 * single["test_accuracy"], 2)])
            if with_ada:
                ada = session.spec(ADAMERGING_TASK.name, experts=list(spec.experts))
                test = session.preview(ada, "test")
                rows.append(["AdaMerging task-wise (no labels)", "learned λt", "-", "-",
                             round(100 * test.average_accuracy, 2)])
        except Cancelled as exc:
            return gr.skip(), str(exc), gr.skip()
        except MergerError as exc:
            return gr.skip(), notice(exc), gr.skip()
        return (rows, f"Best of {tuned['trials']} TPE trials (seed {tuned['seed']}) on validation: "
                      f"`{tuned['spec'].label()}`; accuracies on the validation and test splits (the Merge tab "
                      f"shows the live split, a fixed subset of test). Press **Load into the sliders** to drag from "
                      f"there." + (f"\n\n⚠️ {', '.join(tuned['at_edge'])} at an end of its search range "
                                   f"(weights {weight_range()}; λ its tune grid's): the best may lie beyond it." if tuned["at_edge"] else ""),
                tuned["spec"])

    def load(self, tuned, experts, method, *values):
        if tuned is None:
            raise MergerError("tune first: there are no tuned weights to load")
        return self.ctl.updates_of(tuned)


def build_tradeoffs_tab(ctl, merge: dict, events, batch) -> TradeoffsTab:
    tab = TradeoffsTab(ctl, events)
    tasks = list(ctl.pool.tasks)
    inputs = merge["inputs"]
    with gr.Tab("Trade-offs", id="tradeoffs"):
        gr.Markdown("Around the Merge tab's current merge (a static method; its weights as the sliders set them). "
                    "Every point is a real merge and forward of the live split, cached like a slider move.")
        with gr.Row():
            task_a = gr.Dropdown(tasks, value=tasks[0], label="task A (x axis)")
            task_b = gr.Dropdown(tasks, value=tasks[min(1, len(tasks) - 1)], label="task B (y axis)")
            map_btn = gr.Button("Map the two weights", variant="primary")
            cancel_btn = gr.Button("Cancel")
        status = gr.Markdown()
        with gr.Row():
            map_a = gr.Plot(label="task A", elem_id="tradeoff-map-a")
            map_b = gr.Plot(label="task B", elem_id="tradeoff-map-b")
        pareto = gr.Plot(label="Pareto front", elem_id="pareto-plot")
        with gr.Row():
            up_task = gr.Dropdown(tasks, value=tasks[0], label="turn this task's weight up (0 → 2)")
            up_btn = gr.Button("Turn one up")
        up_status = gr.Markdown()
        up_plot = gr.Plot(label="turn one up")
        gr.Markdown("### Tuned search of the per-task weights (validation, then test)")
        with gr.Row():
            budget = gr.Number(value=100, precision=0, label="budget (evaluations)", info=f"1 to {MAX_GRID_POINTS}")
            seed = gr.Number(value=0, precision=0, label="seed")
            with_lam = gr.Checkbox(value=False, label="tune λ too")
            with_ada = gr.Checkbox(value=False, label="compare with AdaMerging task-wise (a run)")
            tune_btn = gr.Button("Tune weights")
        tune_table = gr.Dataframe(headers=TradeoffsTab.HEADERS, interactive=False, wrap=True,
                                  column_widths=["22%", "46%", "10%", "11%", "11%"])  # seven weights wrap
        tune_msg = gr.Markdown()
        tuned = gr.State(None)
        load_btn = gr.Button("Load into the sliders")
    map_btn.click(batch(tab.two_tasks), [task_a, task_b, *inputs], [map_a, map_b, pareto, status], **BATCH_EVENT,
                  api_visibility="private")
    up_btn.click(batch(tab.turn_up), [up_task, *inputs], [up_plot, up_status], **BATCH_EVENT, api_visibility="private")
    tune_btn.click(batch(tab.tune), [budget, seed, with_lam, with_ada, *inputs], [tune_table, tune_msg, tuned], **BATCH_EVENT,
                   api_visibility="private")
    cancel_btn.click(tab.cancel, None, status, concurrency_id="cancel", concurrency_limit=None, api_visibility="private")
    load_btn.click(events_load(events, tab), [tuned, *inputs], inputs, api_visibility="private")
    return tab


def events_load(events, tab):
    """Loading tuned weights sets every Merge-tab input at once, read as one request (like a reload);
    refused, every input stays as it was."""
    def load(request: gr.Request, tuned, experts, method, *values):
        return events.set_or_warn(request, lambda: tab.load(tuned, experts, method, *values), experts, method, values)
    return load
