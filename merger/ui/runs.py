"""Data-driven runs in the Merge tab: Run (progress bar, objective falling live), Cancel, and
what was learned (coefficient heatmap; for FW the chosen vertices, gap and barycentric weights)."""
from __future__ import annotations

import threading
import time

import gradio as gr

from merger import methods, plots
from merger.errors import MergerError
from merger.methods.adaptive import Cancelled
from merger.ui.errors import notice
from merger.ui.merge_events import session_of


class RunController:
    def __init__(self, controller):
        self.ctl = controller
        self._cancel: dict[str, threading.Event] = {}

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
        if not m.data_driven:
            yield (f"{m.display_name} needs no run: its sliders evaluate live.", *skip7)
            return
        flag = threading.Event()
        self._cancel[session] = flag
        live = {"values": [], "msg": "starting"}
        box = {}

        def progress(frac, msg, value=None):
            live["msg"] = f"{100 * frac:.0f} % · {msg}"
            if value is not None:
                live["values"].append(value)

        def work():
            try:
                box["run"] = self.ctl.session.run(spec, progress, flag.is_set)
            except Exception as exc:  # reported to the user below; the server stays up
                box["error"] = exc

        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        label = self.objective_label(spec.method)
        while worker.is_alive():
            time.sleep(0.5)
            yield (f"⏳ {m.display_name}: {live['msg']}", plots.objective_curve(live["values"], f"Objective ({label})", label),
                   *(gr.skip(),) * 6)
        self._cancel.pop(session, None)
        if "error" in box:
            err = box["error"]
            msg = "cancelled: nothing was cached; the app is as before" if isinstance(err, Cancelled) else str(err)
            yield (notice(msg), gr.skip(), *(gr.skip(),) * 6)
            return
        run = box["run"]
        acc, loss, radar, summary = self.ctl.preview(experts, method, *values)
        yield (f"✅ {m.display_name}: {len(run.trace['objective'])} steps in {run.seconds:.1f} s", *self.views(run),
               acc, loss, radar, summary)

    def cancel(self, request: gr.Request = None):
        flag = self._cancel.get(session_of(request))
        if flag is not None:
            flag.set()
            return "Cancelling…"
        return "No run in progress."
