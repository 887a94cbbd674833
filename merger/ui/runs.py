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
GOES_ON = (" · Cancel noted, but another page follows this same work: it goes on for that page (and is kept "
           "when done), and this page shows it to the end")


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
        kept_for_others = False  # this page cancelled, but another follows the same work: it goes on
        while worker.is_alive():
            time.sleep(0.5)
            # the live curve only while the controls still show this run's settings
            curve = (plots.objective_curve(live["values"], f"Objective ({label})", label)
                     if m.data_driven and self._shown(session, spec) else gr.skip())
            kept_for_others = kept_for_others or (flag.is_set() and
                                                  self.ctl.session.goes_on_after_cancel(spec, flag.is_set))
            yield (f"◷ {m.display_name}: {live['msg']}" + (GOES_ON if kept_for_others else ""), curve,
                   *(gr.skip(),) * 6)
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
        went_on = " It went on after your Cancel: another page followed it." if kept_for_others else ""
        if not here:  # the controls moved on during the run: its result is cached, not shown as theirs
            took = f"{box['prepared']:.1f}" if "prepared" in box else f"{box['run'].seconds:.1f}"
            # worded to stay true once the controls hold those settings again (this line is not redrawn)
            yield (f"✓ {m.display_name}: done in {took} s for `{spec.label()}`, the settings of when you "
                   "pressed Run; the controls had changed by then, so it shows whenever they hold those settings "
                   f"(kept).{went_on}", *skip7)
            return
        acc, loss, radar, summary = self.ctl.preview(experts, method, *values)
        if "prepared" in box:
            yield (f"✓ {m.display_name}: prepared in {box['prepared']:.1f} s; its sliders are live now.{went_on}",
                   *(gr.skip(),) * 3,
                   acc, loss, radar, summary)
            return
        run = box["run"]
        done = (f"{len(run.trace['objective'])} steps" if run.trace.get("objective")
                else f"{len(run.tasks)} experts' statistics")
        if self.events is not None:
            self.events.panel_shows(session, run)
        yield (f"✓ {m.display_name}: {done} in {run.seconds:.1f} s.{went_on}", *self.views(run),
               acc, loss, radar, summary)

    UNDER_WAY = "◷ Under way on this server: "

    def under_way(self):
        """The page's first Run status (its load event): the runs and preparations under way on this
        server, which Run follows with the same settings (a page reloaded during its run finds it
        so); whether the status timer should watch them end (``still_under_way``); and the chooser
        that sets the controls to one of them, with the works it offers (label -> spec)."""
        work = self.ctl.session.under_way()
        if not work:
            return gr.skip(), gr.Timer(active=False), *(gr.skip(),) * 3
        return self._under_way_line(work), gr.Timer(active=True), *self._chooser(work, {})

    def _under_way_line(self, work) -> str:
        return (self.UNDER_WAY + "; ".join(f"`{w}`" for w in work) + ". " + self.TO_FOLLOW)

    TO_FOLLOW = ("To follow it, set the controls to it (below) and press Run: its progress so far, then its result "
                 "(no second run).")

    @staticmethod
    def _chooser(work: dict, seen: dict) -> tuple:
        """(chooser, its button, the works it offers): every work this page saw under way; the
        chooser on the first of those under way now."""
        seen = {**(seen or {}), **work}
        return gr.update(choices=list(seen), value=next(iter(work)), visible=True), gr.update(visible=True), seen

    def still_under_way(self, status: str, seen: dict):
        """The status timer's tick: the line of work under way follows it (one that ends leaves it,
        and stays in the chooser: a finished run shows at once once the controls hold it), until
        the page's own Run or Cancel has replaced the line; then the timer stops."""
        if not (status or "").startswith(self.UNDER_WAY):
            return gr.skip(), gr.Timer(active=False), *(gr.skip(),) * 3
        work = self.ctl.session.under_way()
        chooser = self._chooser(work, seen) if set(work) - set(seen or {}) else (gr.skip(),) * 3
        if work:
            line = self._under_way_line(work)
            return (gr.skip() if line == status else line), gr.Timer(active=True), *chooser
        ended = status[len(self.UNDER_WAY):].split(". " + self.TO_FOLLOW)[0]
        return (f"The work under way when this page opened has ended: {ended}. A finished run or preparation is "
                "kept: set the controls to it (below) and it shows at once. A cancelled one left nothing."), \
            gr.Timer(active=False), *chooser

    def cancel(self, request: gr.Request = None):
        if self._cancel.cancel(session_of(request)):
            return "Cancelling…"
        gr.Info("No run in progress: nothing to cancel.")  # the status line keeps the last run's outcome
        return gr.skip()
