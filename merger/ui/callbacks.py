"""Callbacks of the app, as plain methods (tested without a browser).

Per-session state (pins) lives in a ``gr.State`` the callbacks receive and return; caches are
the pool session's. Bad input becomes a message, never a crash: the server stays up.
"""
from __future__ import annotations

import json
import math
import tempfile
import uuid
from pathlib import Path
from typing import NamedTuple

import gradio as gr

from .. import methods, plots
from ..errors import MergerError, MethodError
from ..export import export_merge, pool_reference
from ..methods.registry import PARAM_NAMES
from ..tuning import SWEEP_AXES, auto_tune, sweep, sweep_num_tasks
from ..work_queue import Superseded

SPLITS_SHOWN = ("live", "val", "test")
EXPORT_ROOT = Path(tempfile.gettempdir()) / "merger-exports"


def _fmt(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _at_auto(method, name: str, value, num_experts: int) -> bool:
    """A slider sits at a parameter's auto position: the top of its T-dependent range (TSV-M:
    1/T), or a value the app set for another T (1/n, off the slider's grid: no drag lands there)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return False
    if abs(v - method.bounds(name, num_experts)[1]) < 1e-9:
        return True
    step = method.param(name).step
    off_grid = abs(v / step - round(v / step)) > 1e-6
    return v > 0 and off_grid and abs(1 / v - round(1 / v)) < 1e-6


def _fits(param, value, hi: float = math.inf) -> bool:
    """A control's value is a valid value of this parameter (its own check), under a cap that
    depends on T (so a method change may keep it)."""
    try:
        v = param.check(value, "")
    except MethodError:
        return False
    return isinstance(v, str) or v <= hi + 1e-12


class Answer(NamedTuple):
    """What a move computed: the spec and its result, or the message to show instead."""
    spec: object
    result: object
    cached: bool
    message: str = ""
    why: str = ""


class Controller:
    def __init__(self, session, history=None):
        self.session = session
        self.pool = session.pool
        self.history = history
        self.pool_ref = pool_reference(self.pool)

    # ---- specs --------------------------------------------------------------------------
    def spec_from_controls(self, experts, method, *values):
        """The spec the controls describe (values in PARAM_NAMES order); only the parameters the
        method uses are read. A parameter with an "auto" rule reads "auto" where the slider sits at
        its auto position (see ``_at_auto``), so snapping to the slider step cannot change it."""
        m = methods.get(method)
        values = dict(zip(PARAM_NAMES, values))
        params = {k: values[k] for k in m.param_names if values.get(k) is not None}
        if not experts:
            raise MergerError("experts: empty subset, tick at least one expert")
        for k, v in params.items():
            if m.param(k).auto and _at_auto(m, k, v, len(experts)):
                params[k] = "auto"
        return self.session.spec(m.name, experts=list(experts), **params)

    def method_controls(self, method, experts, *values, previous: str | None = None):
        """Control updates for a method: its parameters enabled with their ranges, the others
        disabled. A value the person set in the ``previous`` method (a parameter both share, moved
        from that method's default) is kept where it fits; every other parameter starts at the new
        method's default. Without ``previous`` (a reload), every value that fits is kept."""
        m = methods.get(method)
        n = max(1, len(experts or self.pool.tasks))
        current = dict(zip(PARAM_NAMES, values))
        set_by_person = set(m.param_names)
        if previous:
            before = methods.get(previous)
            old = dict(zip(PARAM_NAMES, self.control_values(before, self.default_params(before, n), n)))
            set_by_person = {k for k in before.param_names if _fits(before.param(k), current.get(k))
                             and abs(float(current[k]) - float(old[k])) > 1e-9}
        defaults = self.control_values(m, self.default_params(m, n), n)
        updates = []
        for name, default in zip(PARAM_NAMES, defaults):
            if name in m.param_names:
                p = m.param(name)
                lo, hi = m.bounds(name, n)
                value = current.get(name)
                if name not in set_by_person or not _fits(p, value, hi):
                    value = default
                updates.append(gr.update(interactive=True, value=value, minimum=lo, maximum=hi, step=p.step,
                                         info=p.help))
            else:
                updates.append(gr.update(interactive=False, info=f"not used by {m.display_name}"))
        about = f"**{m.display_name}**: {m.description}  \n*{m.paper}*"
        if m.conventions:
            about += f"  \nConventions: {m.conventions}"
        return (*updates, about)

    def refresh_limits(self, experts, method, *values):
        """The expert subset changed: ranges that depend on T follow it (TSV-M's rank ratio ≤ 1/T),
        and a slider at its auto position moves to the new one."""
        m = methods.get(method)
        n = max(1, len(experts or []))
        values = dict(zip(PARAM_NAMES, values))
        limits = m.limits_for(n) if m.limits_for else {}
        updates = []
        for name in PARAM_NAMES:
            if name not in limits or name not in m.param_names:
                updates.append(gr.skip())
                continue
            lo, hi = m.bounds(name, n)
            v = values.get(name)
            if v is None or v > hi or (m.param(name).auto and _at_auto(m, name, v, n)):
                v = hi
            updates.append(gr.update(minimum=lo, maximum=hi, value=v))
        return tuple(updates)

    # ---- merge tab ----------------------------------------------------------------------
    def preview(self, experts, method, *values, **options):
        """(accuracy bars, loss bars, radar, summary markdown) for the controls' spec (see ``answer``)."""
        ans = self.answer(experts, method, *values, **options)
        if ans.result is None:
            return self.no_result(ans.message, ans.why)
        return (*self.figures(ans), self.summary(ans.spec, ans.result, ans.cached))

    def answer(self, experts, method, *values, record: bool = True, session: str | None = None,
               ticket: int | None = None, images: int | None = None) -> "Answer":
        """The controls' spec and its result; a new complete result goes into the history unless
        ``record`` is False. ``images``: a partial answer on the first images of each task (never
        cached, never recorded). A move of a browser ``session`` superseded before it starts raises
        ``Superseded``. Bad settings give an answer without a result, with the message to show."""
        split = "live"
        try:
            spec = self.spec_from_controls(experts, method, *values)
            if methods.get(spec.method).kind == "data" and self.session.cached_run(spec) is None:
                return Answer(spec, None, False,
                              f"**{methods.get(spec.method).display_name}** learns its coefficients from validation "
                              "data: set its parameters, open **Data-driven methods** below the controls and press "
                              "**Run**.", "no run yet for these settings")
            cached = self.session.cached(spec, split) is not None
            if images is not None:
                result = self.session.partial(spec.rounded(), images, split)
            else:
                result = self.session.preview(spec, split, session=session, ticket=ticket)
        except Superseded:
            raise
        except MergerError as exc:
            return Answer(None, None, False, f"⚠️ {exc}", "no result for the current settings")
        if self.history is not None and not cached and record and not result.partial:
            self.history.record(self.pool_ref, spec.rounded(), result)
        return Answer(spec, result, cached)

    def figures(self, ans: "Answer") -> tuple:
        """(accuracy bars, loss bars, radar) of an answer with a result."""
        from ..reference import guides

        base = self.session.base(ans.result.split)
        experts_acc = self.session.experts(ans.result.split)
        model = self.pool.architecture.get("model")
        return (plots.accuracy_bars(ans.result, base, experts_acc, guides=guides(model, ans.spec.method)),
                plots.loss_bars(ans.result, base),
                plots.radar({ans.spec.label(): ans.result}))

    @staticmethod
    def no_result(message: str, why: str):
        """The plots cleared (never an earlier result shown as the current one) and the message."""
        empty = plots.empty(why)
        return empty, empty, empty, message

    def learned(self, experts, method, *values):
        """What the current settings' data-driven run learned (objective, coefficients, FW), or empty
        figures saying there is none: an earlier run is never shown as the current one."""
        from .runs import RunController

        try:
            spec = self.spec_from_controls(experts, method, *values)
            run = self.session.cached_run(spec) if methods.get(spec.method).kind == "data" else None
        except MergerError:
            run = None
        if run is None:
            empty = plots.empty("no data-driven run for the current settings")
            return empty, empty, empty
        return RunController.views(run)

    def summary(self, spec, result, cached: bool) -> str:
        m = methods.get(spec.method)
        rounded = spec.rounded()
        note = m.note(rounded.kwargs, None) if m.note else None
        timing = "cached" if cached else f"{1000 * result.seconds:.0f} ms"
        if result.partial:
            timing += " · ⏳ partial: the first images of each task; the whole live split follows"
        images = sorted(set(result.counts.values()))
        avg, norm = 100 * result.average_accuracy, 100 * result.normalized_accuracy
        lines = [
            f"### Average accuracy <span id='avg-acc' title='{avg:.4f}'>{avg:.1f}</span> "
            f"± {100 * result.average_margin():.1f} % · "
            f"normalised <span id='norm-acc' title='{norm:.4f}'>{norm:.1f}</span> % · "
            f"loss {result.average_loss:.3f}",
            f"`{rounded.label()}` over {len(spec.experts)} of {len(self.pool.tasks)} experts · "
            f"{result.split} split ({'/'.join(map(str, images))} images per task; ± is the 95 % binomial "
            f"interval) · {timing}",
        ]
        if note:
            lines.append(f"ℹ️ {note}")
        if self.session.evaluator.notices:
            lines.append(f"⚠️ {self.session.evaluator.notices[-1]}")
        return "\n\n".join(lines)

    def pin(self, pins, experts, method, *values):
        try:
            spec = self.spec_from_controls(experts, method, *values).rounded()
        except MergerError as exc:
            gr.Warning(str(exc))
            return pins, self.pins_text(pins)
        pins = list(pins or [])
        if spec not in pins:
            pins.append(spec)
        return pins, self.pins_text(pins)

    @staticmethod
    def pins_text(pins) -> str:
        if not pins:
            return "No pinned merges yet."
        return "Pinned: " + "; ".join(f"`{s.label()}`" for s in pins)

    def export(self, experts, method, *values):
        """Merged safetensors + spec YAML (the CLI's files), offered as downloads."""
        try:
            spec = self.spec_from_controls(experts, method, *values).rounded()
            out = EXPORT_ROOT / uuid.uuid4().hex / f"merged-{spec.method}.safetensors"
            with self.session.batch(), self.session.lock:
                weights, spec_yaml = export_merge(self.pool, spec, out)
        except (MergerError, OSError) as exc:
            gr.Warning(f"export failed: {exc}")
            return None, f"⚠️ export failed: {exc}"
        return [str(weights), str(spec_yaml)], f"Exported `{spec.label()}`."

    # ---- compare tab --------------------------------------------------------------------
    def compare(self, pins, split):
        if not pins:
            empty = plots.empty("Pin merges in the Merge tab to compare them here.")
            return [], empty, empty
        try:
            with self.session.batch():
                results = {s.label(): self.session.preview(s, split) for s in pins}
        except MergerError as exc:
            raise gr.Error(str(exc))
        table = [[label, ", ".join(s.experts), round(100 * r.average_accuracy, 2),
                  round(100 * r.normalized_accuracy, 2), round(r.average_loss, 4)]
                 + [round(100 * r.accuracy[t], 1) for t in self.pool.tasks]
                 for (label, r), s in zip(results.items(), pins)]
        return table, plots.grouped_bars(results), plots.radar(results)

    def compare_headers(self) -> list[str]:
        return ["spec", "experts", "avg acc %", "normalised %", "loss"] + list(self.pool.tasks)

    def auto_tune(self, method_names, experts, progress=gr.Progress()):
        if not method_names:
            raise gr.Error("tick at least one method to auto-tune")
        try:
            rows = auto_tune(self.session, method_names, experts=list(experts) if experts else None,
                             progress=lambda f, msg: progress(f, desc=msg))
        except MergerError as exc:
            raise gr.Error(str(exc))
        table = [[r["method"], ", ".join(f"{k}={_fmt(v)}" for k, v in r["params"].items()) or "-",
                  r["grid_points"], round(100 * r["val_accuracy"], 2), round(100 * r["test_accuracy"], 2),
                  round(100 * r["test_normalized"], 2)] for r in rows]
        results = {f"{r['method']} (best)": r["test"] for r in rows}
        return table, plots.grouped_bars(results, "Auto-tuned: test accuracy per task"), plots.radar(results)

    def sweep(self, axis, method_names, split, experts, progress=gr.Progress()):
        experts = list(experts) if experts else None
        try:
            if axis == "tasks":
                if not method_names:
                    raise MergerError("tick at least one method")
                curves, errors = {}, {}
                for m in method_names:
                    r = sweep_num_tasks(self.session, m, split=split, progress=lambda f, msg: progress(f, desc=f"{m}: {msg}"))
                    curves[m], errors[m] = (r["x"], r["mean"]), r["se"]
                return plots.sweep_curves(curves, "number of merged tasks",
                                          "Average accuracy over the merged tasks (mean ± s.e. over random subsets)",
                                          errors=errors)
            label, only = SWEEP_AXES[axis]
            chosen = [m for m in method_names if axis in methods.get(m).param_names]
            if not chosen:
                raise MergerError(f"none of the ticked methods has {label}" + (f" (try {', '.join(only)})" if only else ""))
            skipped = [m for m in method_names if m not in chosen]
            p = methods.get(chosen[0]).param(axis)
            values = {"lam": [round(0.1 * i, 2) for i in range(0, 31)],
                      "rank_ratio": [0.01, 0.02, 0.04, 0.06, 0.08, 0.12, 0.16, 0.24, 0.32, 0.5, 0.75, 1.0],
                      "sparsity": [round(0.1 * i, 2) for i in range(0, 10)] + [0.95, 0.99]}[axis]
            values = [v for v in values if p.min <= v <= p.max and not (p.min_open and v == p.min)]
            data = sweep(self.session, chosen, axis, values, split=split, experts=experts,
                         progress=lambda f, msg: progress(f, desc=msg))
        except MergerError as exc:
            raise gr.Error(str(exc))
        curves, dashed = {}, []
        for m, d in data.items():
            curves[f"{m} (average)"] = (d["x"], d["average"])
        for m, d in data.items():
            for t, ys in d["per_task"].items():
                curves[f"{m} · {t}"] = (d["x"], ys)
                dashed.append(f"{m} · {t}")
        n = len(experts) if experts else len(self.pool.tasks)
        capped = [f"{m} stops at {label} {methods.get(m).bounds(axis, n)[1]:.3g}" for m in chosen
                  if methods.get(m).bounds(axis, n)[1] < max(values)]
        notes = ([f"not swept: {', '.join(skipped)} (no {label})"] if skipped else []) + capped
        title = f"Accuracy against {label} ({split} split; per-task curves in the legend)"
        if notes:
            title += "<br><sub>" + "; ".join(notes) + "</sub>"
        return plots.sweep_curves(curves, label, title, dashed=dashed)

    # ---- history tab --------------------------------------------------------------------
    HISTORY_HEADERS = ["id", "time", "method", "params", "experts", "split", "avg acc %", "normalised %", "loss"]

    def history_rows(self, method_filter="", text=""):
        if self.history is None:
            return []
        rows = self.history.rows(method=method_filter or None, pool=self.pool_ref, text=text or None)
        return [[r["id"], r["time"], r["method"], r["params"], r["experts"], r["split"],
                 round(100 * r["average_accuracy"], 2),
                 None if r["normalized_accuracy"] is None else round(100 * r["normalized_accuracy"], 2),
                 round(r["average_loss"], 4)] for r in rows]

    def reload(self, row_id):
        """Controls of the Merge tab set from a history row (method, parameters, experts)."""
        row = self.history.get(int(row_id)) if (self.history is not None and row_id not in (None, "")) else None
        if row is None:
            raise gr.Error(f"history: no row with id {row_id}")
        experts = [e for e in row["experts"].split(",") if e]
        m = methods.get(row["method"])
        values = self.control_values(m, json.loads(row["params"]), len(experts))
        updates = [gr.update(value=v, interactive=True) if name in m.param_names
                   else gr.update(interactive=False, info=f"not used by {m.display_name}")
                   for name, v in zip(PARAM_NAMES, values)]
        return (gr.update(value=experts), gr.update(value=m.name), *updates)

    @staticmethod
    def default_params(method, num_experts: int) -> dict:
        auto = method.defaults_for(num_experts) if method.defaults_for else {}
        return {p.name: auto.get(p.name, p.default) for p in method.params}

    @staticmethod
    def control_values(method, params: dict, num_experts: int) -> list:
        """One value per control (PARAM_NAMES order; None where the method has no such parameter):
        "auto" becomes its slider position for this many experts."""
        out = []
        for name in PARAM_NAMES:
            value = params.get(name) if name in method.param_names else None
            if value == "auto":
                value = method.bounds(name, max(1, num_experts))[1]
            out.append(value)
        return out

    def history_csv(self, method_filter="", text=""):
        if self.history is None:
            raise gr.Error("history is off")
        out = EXPORT_ROOT / uuid.uuid4().hex / "history.csv"
        return str(self.history.export_csv(out, method=method_filter or None, pool=self.pool_ref, text=text or None))

    # ---- scripting ----------------------------------------------------------------------
    def api_evaluate(self, method: str, lam: float | None = None, rank_ratio: float | None = None,
                     sparsity: float | None = None, seed: int | None = None,
                     experts: list[str] | str | None = None, split: str = "live") -> dict:
        """Evaluate a spec; returns per-task accuracy and loss, averages and normalised accuracy.
        (Static methods; data-driven ones run from the Merge tab or the CLI.)"""
        try:
            if methods.get(method).kind == "data":
                raise MergerError(f"{method} learns from data: run it in the Merge tab or with `python -m merger merge`")
            params = {k: v for k, v in {"lam": lam, "rank_ratio": rank_ratio, "sparsity": sparsity,
                                        "seed": seed}.items() if v is not None}
            if experts is not None and not isinstance(experts, str) and len(experts) == 0:
                raise MergerError("experts: empty subset, pick at least one expert")
            names = experts.split(",") if isinstance(experts, str) else (experts or [])
            private = [str(e).strip() for e in names if str(e).strip() in self.pool.expert_info
                       and str(e).strip() not in self.pool.tasks]
            if private:
                raise MergerError(f"experts: {', '.join(private)} belong(s) to a browser session's expert lab; the "
                                  f"endpoint merges the pool's experts ({', '.join(self.pool.tasks)})")
            spec = self.session.spec(method, experts=experts, **params)
            cached = self.session.cached(spec, split) is not None
            result = self.session.preview(spec, split)
        except MergerError as exc:
            raise gr.Error(str(exc))
        if self.history is not None and not cached:
            self.history.record(self.pool_ref, spec.rounded(), result)
        return {"spec": spec.rounded().as_dict(), **result.to_dict()}
