"""The Merge tab: the method controls, the live answer to every move (accuracy, loss, radar,
summary), pins, export, the data-driven panel; its callbacks as plain methods (tested without a
browser). Per-session state (pins) lives in a ``gr.State``; caches are the pool session's.
"""
from __future__ import annotations

import json
from typing import NamedTuple

import gradio as gr

from merger import methods, plots
from merger.errors import MergerError
from merger.evaluation.linear_estimate import LABEL as LINEAR_LABEL
from merger.evaluation.work_queue import Superseded
from merger.io.export import export_merge
from merger.methods import PARAM_NAMES
from merger.spec import WEIGHT_STEP, snap_weight
from merger.ui.coefficients_panel import build_coefficients_panel, wire_coefficients_panel
from merger.ui.controls import ControlPanel, control_values, param_control, shown
from merger.ui.downloads import Downloads
from merger.ui.errors import fail, notice, warn
from merger.ui.merge_events import MergeTabEvents
from merger.ui.offered import OfferedExperts
from merger.ui.runs import RUNS_LABEL, RunController
from merger.ui.scheduling import BATCH_EVENT


class Answer(NamedTuple):
    """What a move computed: the spec and its result, or the message to show instead."""
    spec: object
    result: object
    cached: bool
    message: str = ""
    why: str = ""


class Controller(ControlPanel):
    """The Merge tab's callbacks (the controls' spec, its answer and views, pins, export); the other
    tabs reach the session, the pool and the history through it."""

    def __init__(self, session, history=None, cluster=None):
        super().__init__(session, history)
        # A Ray cluster (app --ray) that runs the Sweep / Auto-tune / Landscape jobs; the sliders keep
        # this process's resident model.
        self.cluster = cluster
        self.offered = OfferedExperts(self.pool)
        self.downloads = Downloads()

    # ---- merge tab ----------------------------------------------------------------------
    def preview(self, experts, method, *values, **options):
        """(accuracy bars, loss bars, radar, summary markdown) for the controls' spec (see ``answer``)."""
        ans = self.answer(experts, method, *values, **options)
        if ans.result is None:
            return self.no_result(ans.message, ans.why)
        return (*self.figures(ans), self.summary(ans.spec, ans.result, ans.cached))

    def answer(self, experts, method, *values, record: bool = True, session: str | None = None,
               ticket: int | None = None, images: int | None = None, estimate: bool = False) -> "Answer":
        """The controls' spec and its result; a new complete result goes into the history unless
        ``record`` is False. ``images``: a partial answer on the first images of each task (never
        cached, never recorded); ``estimate``: the linear estimate (no forward; never cached, never
        recorded). A move of a browser ``session`` superseded before it starts raises
        ``Superseded``. Bad settings give an answer without a result, with the message to show."""
        split = "live"
        try:
            spec = self.spec_from_controls(experts, method, *values)
            m = methods.get(spec.method)
            waiting = m.data_driven and self.session.cached_run(spec) is None
            if (waiting or self.session.prepare_is_slow(spec)) and self._under_way(spec):
                return Answer(spec, None, False,
                              f"**{m.display_name}** is {'learning' if m.data_driven else 'preparing'} for these "
                              f"experts now: its progress is under **{RUNS_LABEL}** below the controls, and its "
                              "result shows here when it ends.", "under way")
            if waiting:
                return Answer(spec, None, False,
                              f"**{m.display_name}** learns its coefficients from validation data: set its "
                              f"parameters, open **{RUNS_LABEL}** below the controls and press **Run**.",
                              "no run yet for these settings")
            if self.session.prepare_is_slow(spec):
                return Answer(spec, None, False,
                              f"**{m.display_name}** prepares once per expert subset, and on this pool that takes "
                              f"a while: open **{RUNS_LABEL}** below the controls and press **Run** to prepare "
                              "it with a progress bar (Cancel stops it). Every move after that is live.",
                              "not prepared yet for these experts")
            cached = self.session.cached(spec, split) is not None
            if estimate:
                result = self.session.linear.estimate(spec, split)
            elif images is not None:
                result = self.session.partial(spec, images, split)
            else:
                result = self.session.preview(spec, split, session=session, ticket=ticket)
        except Superseded:
            raise
        except MergerError as exc:
            return Answer(None, None, False, notice(exc), "no result for the current settings")
        if self.history is not None and not cached and record and not result.provisional:
            self.history.record(self.pool_ref, spec, result)
        return Answer(spec, result, cached)

    def figures(self, ans: "Answer") -> tuple:
        """(accuracy bars, loss bars, radar) of an answer with a result."""
        from merger.reference import guides

        base = self.session.base(ans.result.split)
        experts_acc = self.session.expert_accuracy(ans.result.split)
        model = self.pool.architecture.get("model")
        shown = (f" (≈ {LINEAR_LABEL}; the exact answer follows)" if ans.result.estimate else
                 " (partial: the first images of each task)" if ans.result.partial else "")  # on the plots too
        return (plots.accuracy_bars(ans.result, base, experts_acc, title="Accuracy per task" + shown,
                                    guides=guides(model, ans.spec.method)),
                plots.loss_bars(ans.result, base, title="Cross-entropy per task" + shown),
                plots.radar({ans.spec.label(): ans.result}, title="Normalised accuracy (merged ÷ expert)" + shown))

    def _under_way(self, spec) -> bool:
        """A run or slow preparation of this method over these experts is going on (any page's)."""
        return any(s.method == spec.method and tuple(s.experts) == tuple(spec.experts)
                   for s in self.session.under_way().values())

    @staticmethod
    def no_result(message: str, why: str):
        """The plots cleared (never an earlier result shown as the current one) and the message."""
        empty = plots.empty(why)
        return empty, empty, empty, message

    def learned(self, experts, method, *values):
        """What the current settings' data-driven run learned (objective, coefficients, FW), or empty
        figures saying there is none: an earlier run is never shown as the current one."""
        from merger.ui.runs import RunController

        try:
            spec = self.spec_from_controls(experts, method, *values)
            run = self.session.cached_run(spec) if methods.get(spec.method).data_driven else None
        except MergerError:
            run = None
        if run is None:
            empty = plots.empty("no data-driven run for the current settings")
            return empty, empty, empty
        return RunController.views(run)

    def summary(self, spec, result, cached: bool, estimated: bool = False) -> str:
        """The summary markdown; ``estimated``: this move showed the linear estimate first (its
        error against this exact answer is then stated)."""
        note = self.session.note(spec)
        timing = "cached" if cached else f"{1000 * result.seconds:.0f} ms"
        if result.partial:
            timing += " · ◷ partial: the first images of each task; the whole live split follows"
        if result.estimate:
            timing = (f"≈ {LINEAR_LABEL}: f(θ0) + Σ wₜ (f(θt) − f(θ0)) per image from the experts' cached forwards "
                      "(no forward of its own) · ◷ the exact answer follows")
        shown = self.session.linear.shown(spec, result.split) if estimated and not result.provisional else None
        if shown is not None:
            err = self.session.linear.error(shown, result)
            timing += (f" · the {LINEAR_LABEL} shown before said <span id='est-acc'>{100 * shown.average_accuracy:.1f}"
                       f"</span> % ({err['average']:+.1f} points; per task at most {err['max_abs']:.1f})")
        images = sorted(set(result.counts.values()))
        avg, norm = 100 * result.average_accuracy, 100 * result.normalized_accuracy
        lines = [
            f"### Average accuracy <span id='avg-acc' title='{avg:.4f}'>{avg:.1f}</span> "
            f"± {100 * result.average_margin():.1f} % · "
            f"normalised <span id='norm-acc' title='{norm:.4f}'>{norm:.1f}</span> % · "
            f"loss {result.average_loss:.3f}",
            f"`{spec.label()}` over {self._experts_text(spec)} · "
            f"{result.split} split ({'/'.join(map(str, images))} images per task; ± is the 95 % binomial "
            f"interval) · {timing}",
        ]
        if note:
            lines.append(f"ℹ️ {note}")
        snapped = spec.snapping()
        if snapped:  # a typed value between two slider steps: say which value the result is for
            lines.append("ℹ️ computed on the sliders' steps: " + ", ".join(
                f"{n}={computed:g} (typed {given:g})" for n, (given, computed) in snapped.items()))
        if self.session.evaluator.notices:
            lines.append(f"⚠️ {self.session.evaluator.notices[-1]}")
        if self.history is not None and self.history.write_error:
            lines.append(f"⚠️ {self.history.write_error}")
        return "\n\n".join(lines)

    def _experts_text(self, spec) -> str:
        """'3 of 7 experts' (the pool's), or with lab experts among them '8 experts (2 from the lab)':
        '8 of 7' read as a fault."""
        lab = [e for e in spec.experts if e not in self.pool.tasks]
        if not lab:
            return f"{len(spec.experts)} of {len(self.pool.tasks)} experts"
        return f"{len(spec.experts)} experts ({len(lab)} from the lab)"

    def reload(self, row_id, session: str = "default"):
        """Controls of the Merge tab set from a history row (method, parameters, experts, weights),
        for the browser ``session`` (its expert checkbox lists the experts it is offered)."""
        if self.history is None:
            fail("history is off (the app was started with --history '')")
        text = "" if row_id is None else str(row_id).strip()
        if not text:
            fail("history: type the id of a row (the table's first column)")
        if not (text.isascii() and text.isdigit()):  # '²' is a digit to Python, not to int()
            fail(f"history: row id {text!r} is not a row's id (a positive whole number: the table's first column)")
        row = self.history.get(int(text)) if len(text) <= 18 else None  # SQLite's integers stop at 2^63
        if row is None:
            fail(f"history: no row with id {text}")
        experts = [e for e in row["experts"].split(",") if e]
        self._offered_or_fail(experts, session, f"history: row {text}", "reload the row")
        params = json.loads(row["params"])
        task_weights, block_weights = params.pop("task_weights", {}), params.pop("block_weights", {})
        updates = self.spec_updates(experts, row["method"], params, task_weights, block_weights)
        acc = row.get("average_accuracy")
        recorded = f" It recorded {100 * acc:.1f} % on the {row['split']} split" if acc is not None else ""
        gr.Info(f"History row {text} ({row['method']}) is in the Merge tab's controls now.{recorded}"
                + ("; the Merge tab shows the live split." if recorded and row["split"] != "live" else "."))
        return updates

    def _offered_or_fail(self, experts, session: str, what: str, again: str) -> None:
        """Refuse settings whose experts this browser session's checkbox does not list: it would take
        a name it does not offer, and every later event of the page would fail."""
        gone = [e for e in experts if e not in self.pool.experts]
        if gone:
            fail(f"{what} merges {', '.join(gone)}, not an expert of this pool now (a lab expert lives in memory: "
                 "it went with the server that made it); nothing was changed")
        unoffered = [e for e in experts if e not in self.offered.to(session)]
        if unoffered:
            fail(f"{what} merges {', '.join(unoffered)}, made in the Expert lab by another page: tick \"also offer "
                 f"the lab experts other sessions made\" there, then {again}; nothing was changed")

    def work_updates(self, picked, seen, session: str = "default") -> tuple:
        """Controls of the Merge tab set to a run or slow preparation the page saw under way
        (``RunController.under_way``: label -> spec)."""
        spec = (seen or {}).get(picked)
        if spec is None:
            fail("pick one of the works listed under the Run status first")
        self._offered_or_fail(spec.experts, session, f"`{picked}`", "set the controls to it again")
        still = picked in self.session.under_way()
        gr.Info(f"The controls hold `{picked}` now: " + ("press Run to follow it." if still else
                                                           "it shows as soon as it is evaluated, if it finished."))
        return self.updates_of(spec)

    def updates_of(self, spec) -> tuple:
        """``spec_updates`` that show one spec."""
        return self.spec_updates(list(spec.experts), spec.method, dict(spec.kwargs), dict(spec.task_weights),
                                 dict(spec.block_weights))

    def spec_updates(self, experts, method: str, params: dict, task_weights: dict, block_weights: dict) -> tuple:
        """Updates of every Merge-tab input (experts, method, parameter controls, coefficient
        sliders) that describe one spec."""
        m = methods.get(method)
        values = control_values(m, params, len(experts))
        updates = [shown(m, name, value=v) for name, v in zip(PARAM_NAMES, values)]
        # on the sliders' step: the sliders show what a preview computes (a learned 0.6001 shows 0.6)
        weights = [gr.update(value=snap_weight(float(task_weights.get(e, 1.0)))) for e in self.weight_experts]
        weights += [gr.update(value=snap_weight(float(block_weights.get(b, 1.0)))) for b in self.weight_blocks]
        return (gr.update(value=list(experts)), gr.update(value=m.name), *updates, *weights)

    def learned_updates(self, experts, method, *values) -> tuple:
        """Start from learned: the current settings' data-driven run, as task arithmetic (λ = 1)
        with its coefficients in the coefficient sliders (see ``analysis.coefficients.learned``)."""
        from merger.analysis.coefficients import learned

        try:
            spec = self.spec_from_controls(experts, method, *values)
            if not methods.get(spec.method).data_driven:
                raise MergerError("pick AdaMerging or FW-Merging and press Run first")
            got = learned(self.run_on_screen(spec), self.pool)
        except MergerError as exc:
            fail(f"Start from learned: {exc}")
        gr.Info(f"Loaded {methods.get(spec.method).display_name}'s coefficients into the sliders (task arithmetic, "
                f"λ = 1, on the sliders' {WEIGHT_STEP:g} step): {got.note}.")
        target = got.spec(self.session, spec.experts)
        return self.spec_updates(list(spec.experts), target.method, target.kwargs, got.task_weights,
                                 got.block_weights)

    def run_on_screen(self, spec):
        """The cached run of a data-driven spec: the one whose numbers the page shows (None for a
        static spec, which needs none). Pin, Export, Start from learned and the views of the current
        merge take it, and never start one unseen (Compare would otherwise run a pinned one for
        minutes, without progress or Cancel)."""
        if not methods.get(spec.method).data_driven:
            return None
        run = self.session.cached_run(spec)
        if run is None and spec in self.session.under_way().values():
            raise MergerError(f"the {methods.get(spec.method).display_name} run for these settings is still under "
                              f"way (its progress is in “{RUNS_LABEL}”): this takes it once it has ended")
        if run is None:
            raise MergerError(f"no {methods.get(spec.method).display_name} run for these settings yet: press Run "
                              f"(in “{RUNS_LABEL}”) first; this takes the run whose numbers the page shows")
        return run

    def pin(self, pins, experts, method, *values):
        try:
            spec = self.spec_from_controls(experts, method, *values)
            self.run_on_screen(spec)
        except MergerError as exc:
            warn(f"Pin: {exc}")
            return pins, self.pins_text(pins)
        pins = list(pins or [])
        if spec not in pins:
            pins.append(spec)
        return pins, self.pins_text(pins)

    @classmethod
    def clear_pins(cls):
        return [], cls.pins_text([])

    @staticmethod
    def pins_text(pins) -> str:
        if not pins:
            return "No pinned merges yet."
        return "Pinned: " + "; ".join(f"`{s.label()}`" for s in pins)

    def export(self, experts, method, *values):
        """Merged safetensors + spec YAML (the CLI's files), offered as downloads."""
        try:
            spec = self.spec_from_controls(experts, method, *values)
            delta = None
            if methods.get(spec.method).data_driven:
                delta = self.run_on_screen(spec).delta
            out = self.downloads.fresh(f"merged-{spec.method}.safetensors")
            with self.session.batch(), self.session.lock:
                weights, spec_yaml = export_merge(self.pool, spec, out, delta)
            card = self._card(spec, weights, spec_yaml)
        except (MergerError, OSError) as exc:
            return None, notice(f"export failed: {exc}")
        return [str(weights), str(spec_yaml), str(card)], f"Exported `{spec.label()}` with its model card."

    def _card(self, spec, weights, spec_yaml):
        """The model card of an export: the live result on screen (cached: no forward of its own)."""
        from merger.io.export import read_spec_file
        from merger.io.model_card import card_text, write_card

        return write_card(weights, card_text(self.pool, spec, read_spec_file(spec_yaml), self.session.preview(spec)))


def build_merge_tab(ctl: Controller, events: MergeTabEvents, default_method: str, batch) -> dict:
    """The Merge tab's components; the listeners that need other tabs' outputs are wired by the app."""
    pool = ctl.pool
    first = methods.get(default_method)
    with gr.Tab("Merge", id="merge"):
        with gr.Row():
            with gr.Column(scale=1, min_width=300):
                experts = gr.CheckboxGroup(pool.tasks, value=list(pool.tasks), label="experts to merge",
                                           elem_id="ctl-experts")
                method = gr.Dropdown([(m.display_name, m.name) for m in methods.all_methods()],
                                     value=default_method, label="method", elem_id="ctl-method")
                about = gr.Markdown()
                controls = [param_control(n, len(pool.tasks), first) for n in PARAM_NAMES]
                panel = build_coefficients_panel(ctl)
                with gr.Row():
                    pin_btn = gr.Button("Pin", elem_id="pin")
                    unpin_btn = gr.Button("Clear pins", elem_id="clear-pins")
                    export_btn = gr.Button("Export", elem_id="export")
                with gr.Accordion(RUNS_LABEL, open=False):
                    with gr.Row():
                        run_btn = gr.Button("Run", variant="primary", elem_id="run")
                        cancel_btn = gr.Button("Cancel", elem_id="cancel")
                    run_status = gr.Markdown("A data-driven method learns its coefficients when you press Run; a "
                                             "slow preparation (SVDs, sorts on a large pool) also runs here.")
                    # follows the work under way when the page opened, until it ends (RunController)
                    status_timer = gr.Timer(2.0, active=False)
                    with gr.Row():
                        work_pick = gr.Dropdown([], label="a run or preparation seen under way on this server",
                                                visible=False, elem_id="work-pick")
                        work_btn = gr.Button("Set the controls to it", visible=False, elem_id="work-set")
                    work_seen = gr.State({})
                pins = gr.State([])
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
        weights = [*panel["tasks"], *panel["blocks"]]
        inputs = [experts, method, *controls, *weights]  # the order spec_from_controls reads
        outputs = [acc_plot, loss_plot, radar_plot, summary]
        learned = [objective_plot, coef_plot, fw_plot]
        method.change(events.method_controls, [method, experts, *controls], [*controls, about], queue=False,
                      api_visibility="private")
        experts.change(ctl.refresh_limits, inputs, controls, queue=False, api_visibility="private")
        runs = RunController(ctl, events)
        # No progress overlay: the status line streams the run's progress, and a value a control
        # refuses then comes as its toast alone, not as error badges over every Merge-tab output.
        run_btn.click(runs.run, inputs, [run_status, *learned, *outputs], **BATCH_EVENT, show_progress="hidden",
                      api_visibility="private")
        cancel_btn.click(runs.cancel, None, run_status, concurrency_id="cancel", concurrency_limit=None,
                         api_visibility="private")
        under_way = [run_status, status_timer, work_pick, work_btn, work_seen]
        status_timer.tick(runs.still_under_way, [run_status, work_seen], under_way, queue=False,
                          api_visibility="private")
        work_btn.click(events.set_to_work, [work_pick, work_seen, *inputs], inputs, api_visibility="private")
        pin_btn.click(events.pin, [pins, *inputs], [pins, pins_md], api_visibility="private")
        unpin_btn.click(Controller.clear_pins, None, [pins, pins_md], queue=False, api_visibility="private")
        export_btn.click(batch(events.export), inputs, [files, export_msg], **BATCH_EVENT, api_visibility="private")
        wire_coefficients_panel(panel, ctl, events, experts, inputs, inputs)
    return {"experts": experts, "method": method, "controls": controls, "about": about, "pins": pins, "pins_md": pins_md,
            "inputs": inputs, "outputs": outputs, "learned": learned, "weights": weights, "runs": runs,
            "under_way": under_way}
