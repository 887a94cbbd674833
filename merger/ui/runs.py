"""Runs in the Merge tab: Run (progress bar, objective falling live), Cancel, and what was learned
(coefficient heatmap; for FW the chosen vertices, gap and barycentric weights). The same button
prepares a slow_prepare method on a large pool (SVDs, sorts), with progress and Cancel."""
from __future__ import annotations

import threading
import time
import traceback

import gradio as gr

from merger import methods, plots
from merger.errors import Cancelled, MergerError, Unfollowed
from merger.ui.errors import notice
from merger.ui.merge_events import session_of
from merger.ui.scheduling import CancelFlags

RUNS_LABEL = "Runs: data-driven methods and slow preparations"


class RunController:
    def __init__(self, controller, events=None):
        self.ctl = controller
        self.events = events  # MergeTabEvents: what each browser session's controls show now
        self._cancel = CancelFlags()

    def _shown(self, session: str, spec) -> bool:
        return self.events is None or self.events.still_shown(session, spec)

    @staticmethod
    def objective_label(method: str) -> str:
        return methods.get(method).objective

    @classmethod
    def views(cls, run) -> tuple:
        """(objective curve, coefficient heatmap, FW progress) of a finished run."""
        label = cls.objective_label(run.method)
        return (plots.objective_curve(run.trace["objective"], f"Objective ({label})", label), *cls.learned(run))

    @staticmethod
    def learned(run) -> tuple:
        """(coefficient heatmap, FW progress figure or an empty note) for a finished run."""
        if run.combination is None:  # RegMean, Fisher: per-parameter statistics, no task coefficients
            heat = plots.empty(f"{methods.get(run.method).display_name} learns no coefficients over the task vectors: "
                               "it weighs each parameter by its data statistics.")
            return heat, plots.empty("Frank–Wolfe diagnostics appear here for fw_hard / fw_soft.")
        heat = plots.coefficient_heatmap(run.coefficients.tolist(), run.tasks, run.groups,
                                         "Learned coefficients (task × layer)" if len(run.groups) > 1
                                         else "Learned coefficients (per task)")
        if "weights" in run.trace:
            fw = plots.fw_progress(run.trace["weights"], run.trace["vertices"], run.trace["gap"], run.trace["chosen"])
        else:
            fw = plots.empty("Frank–Wolfe diagnostics appear here for fw_hard / fw_soft.")
        return heat, fw

    def run(self, request: gr.Request, experts, method, *values):
        """Generator: status and the objective while the run goes; then every view of the result.
        (``request`` comes first: Gradio injects it only among the positional parameters.)"""
        session = session_of(request)
        skip7 = (gr.skip(),) * 7
        try:
            spec = self.ctl.spec_from_controls(experts, method, *values)
        except MergerError as exc:
            yield (notice(exc), *skip7)
            return
        m = methods.get(spec.method)
        if not m.data_driven and not self.ctl.session.prepare_is_slow(spec):
            yield (f"{m.display_name} needs no run: its sliders evaluate live.", *skip7)
            return
        flag = self._cancel.start(session)
        live = {"values": [], "msg": "starting"}
        box = {}

        def progress(frac, msg, value=None):
            live["msg"] = f"{100 * frac:.0f} % · {msg}"
            if value is not None:
                live["values"].append(value)

        def work():
            try:
                if m.data_driven:
                    box["run"] = self.ctl.session.run(spec, progress, flag.is_set)
                else:
                    t0 = time.perf_counter()
                    self.ctl.session.prepare(spec, progress, flag.is_set)
                    box["prepared"] = time.perf_counter() - t0
            except Exception as exc:  # reported to the user below; the server stays up
                box["error"] = exc
                if not isinstance(exc, MergerError):  # not the input's fault: the log keeps where it arose
                    traceback.print_exc()

        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        label = self.objective_label(spec.method)
        while worker.is_alive():
            time.sleep(0.5)
            # the live curve only while the controls still show this run's settings
            curve = (plots.objective_curve(live["values"], f"Objective ({label})", label)
                     if m.data_driven and self._shown(session, spec) else gr.skip())
            yield (f"◷ {m.display_name}: {live['msg']}", curve, *(gr.skip(),) * 6)
        self._cancel.end(session, flag)  # not on a closed page: the run goes on (and is cached)
        here = self._shown(session, spec)
        if "error" in box:
            err = box["error"]
            msg = (f"cancelled: {err}" if isinstance(err, Unfollowed) else
                   "cancelled: nothing was cached; the app is as before" if isinstance(err, Cancelled) else str(err))
            # the panel as for these settings again (an earlier run's, or none): not the stopped curve
            panel = self.ctl.learned(experts, method, *values) if here and m.data_driven else (gr.skip(),) * 3
            if here and m.data_driven and self.events is not None:
                self.events.panel_shows(session, self.ctl.session.cached_run(spec))
            yield (notice(msg), *panel, *(gr.skip(),) * 4)
            return
        if not here:  # the controls moved on during the run: its result is cached, not shown as theirs
            took = f"{box['prepared']:.1f}" if "prepared" in box else f"{box['run'].seconds:.1f}"
            yield (f"✓ {m.display_name}: done in {took} s, for the settings of when you pressed Run; you have "
                   "changed them since: set them again to see its result.", *skip7)
            return
        acc, loss, radar, summary = self.ctl.preview(experts, method, *values)
        if "prepared" in box:
            yield (f"✓ {m.display_name}: prepared in {box['prepared']:.1f} s; its sliders are live now", *(gr.skip(),) * 3,
                   acc, loss, radar, summary)
            return
        run = box["run"]
        done = (f"{len(run.trace['objective'])} steps" if run.trace.get("objective")
                else f"{len(run.tasks)} experts' statistics")
        if self.events is not None:
            self.events.panel_shows(session, run)
        yield (f"✓ {m.display_name}: {done} in {run.seconds:.1f} s", *self.views(run),
               acc, loss, radar, summary)

    def under_way(self):
        """The page's first Run status (its load event): the runs and preparations under way on this
        server, which Run follows with the same settings (a page reloaded during its run finds it so)."""
        work = self.ctl.session.under_way()
        if not work:
            return gr.skip()
        return ("◷ Under way on this server: " + "; ".join(f"`{w}`" for w in work) + ". Press Run with the same "
                "settings to follow it: its progress so far, then its result (no second run).")

    def cancel(self, request: gr.Request = None):
        if self._cancel.cancel(session_of(request)):
            return "Cancelling…"
        gr.Info("No run in progress: nothing to cancel.")  # the status line keeps the last run's outcome
        return gr.skip()
