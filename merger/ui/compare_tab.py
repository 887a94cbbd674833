"""The Compare tab: pinned merges side by side, auto-tune (grid search on validation, the best
setting on test) and sweeps against one parameter, all from the registry's grids and sweep values."""
from __future__ import annotations

import gradio as gr

from merger import methods, plots
from merger.errors import Cancelled, MergerError
from merger.evaluation.tuning import (distinct_methods, grid_points, sweep, sweep_axes, sweep_num_tasks,
                                      sweep_values, tunable_methods, tune_rows)
from merger.ui.errors import kept, keeps_outputs, warn
from merger.ui.merge_events import session_of
from merger.ui.scheduling import BATCH_EVENT, CancelFlags

SPLITS_SHOWN = ("live", "val", "test")


def featured(names) -> list[str]:
    """The methods ticked by default: the registry's featured ones among ``names``."""
    return [n for n in names if methods.get(n).featured]


def pin_name(spec, pins) -> str:
    """A pin's name in the plots: its label, with its experts where another pin has the same label
    (the label leaves the experts out: two such pins were one bar and one table row)."""
    label = spec.label()
    return label if sum(p.label() == label for p in pins) == 1 else f"{label} [{', '.join(spec.experts)}]"


# The figures a page's report draws after its merges: elem_id of the plot -> heading
REPORT_VIEWS = {"sweep-plot": "Sweep", "landscape-plot": "Loss landscape, its markers and trajectories",
                "trajectories-plot": "Along the trajectories", "tradeoff-map-a": "Trade-off map, task A",
                "tradeoff-map-b": "Trade-off map, task B", "pareto-plot": "Pareto front of the merges evaluated"}
MAX_VIEW_BYTES = 32 * 2**20  # a figure a page sends back for its report (a 101² surface is ~1 MB)


def figure_of(payload):
    """A plotly figure from a gr.Plot's value as the page sends it; None for an empty plot, another
    kind, or one past ``MAX_VIEW_BYTES`` (the page's own data: a bad one is left out, never an error)."""
    import plotly.io as pio

    data = payload.model_dump() if hasattr(payload, "model_dump") else payload
    if not isinstance(data, dict) or data.get("type") != "plotly" or not isinstance(data.get("plot"), str):
        return None
    if len(data["plot"]) > MAX_VIEW_BYTES:
        return None
    try:
        fig = pio.from_json(data["plot"])
    except Exception:  # noqa: BLE001  any malformed figure: left out
        return None
    return fig if fig.data else None


class CompareTab:
    def __init__(self, ctl):
        self.ctl = ctl
        self._cancel = CancelFlags()  # auto-tune and sweeps: a grid can take minutes

    def cancel(self, request: gr.Request):
        self._cancel.cancel_and_say(session_of(request), "auto-tune or sweep", "after the current evaluation")

    @keeps_outputs(3)
    def compare(self, pins, split):
        if not pins:
            empty = plots.empty("Pin merges in the Merge tab to compare them here.")
            return [], empty, empty
        with self.ctl.session.batch():
            results = {pin_name(s, pins): self.ctl.session.preview(s, split) for s in pins}
        table = [[methods.get(s.method).display_name, (s.arguments() + s.weights_text()).strip() or "-",
                  ", ".join(s.experts), split, round(100 * r.average_accuracy, 2),
                  round(100 * r.normalized_accuracy, 2), round(r.average_loss, 4)]
                 + [round(100 * r.accuracy[t], 1) for t in self.ctl.pool.tasks]
                 for r, s in zip(results.values(), pins)]
        # the split named in the table and both titles: the dropdown may have moved on since
        return (table, plots.grouped_bars(results, f"Pinned merges: accuracy per task ({split} split)"),
                plots.radar(results, f"Normalised accuracy (merged ÷ expert), {split} split"))

    @keeps_outputs(1)
    def report(self, pins, split, *shown):
        """The pinned merges as one self-contained HTML file (merger/reports/session.py), offered as a
        download, with the figures this page shows (``REPORT_VIEWS``, in order); no pins and no
        figures give a report that says so."""
        from merger.reports.session import session_report, write_report

        views = {}
        for heading, payload in zip(REPORT_VIEWS.values(), shown):
            fig = figure_of(payload)
            if fig is not None:
                views[heading] = fig
        text = session_report(self.ctl.session, list(pins or []), split, f"{self.ctl.pool.name}: pinned merges", views)
        return str(write_report(self.ctl.downloads.fresh("merger-report.html"), text))

    def compare_headers(self) -> list[str]:
        return ["method", "parameters", "experts", "split", "avg acc %", "normalised %", "loss"] + list(self.ctl.pool.tasks)

    def compare_widths(self) -> list[str]:
        """Widths in proportion to what each column must show on one line (its longest word, or a
        number; the table's font has one width for every character): the method, parameters and
        experts columns wrap between words, and nothing is broken mid-word ("task_arithm/etic(lam",
        "positi/on", "normalise/d %" in equal columns)."""
        def longest_word(texts) -> int:
            return max(len(word) for text in texts for word in text.split())

        method_words = longest_word(m.display_name for m in methods.all_methods())
        parameter_words = longest_word(f"{p.name}=-0.0000," for m in methods.all_methods() for p in m.params)
        chars = ([method_words + 4, parameter_words + 4, longest_word(self.ctl.pool.tasks) + 5]
                 + [max(len(h), 6) + 4 for h in self.compare_headers()[3:]])  # + the cell padding
        return [f"{100 * c / sum(chars):.2f}%" for c in chars]

    def _record(self, spec, result) -> None:
        """A job's results in the history, as they finish (this process is its one writer)."""
        if self.ctl.history is not None:
            self.ctl.history.record(self.ctl.pool_ref, spec, result)  # evaluate_all's: snapped

    def auto_tune(self, request: gr.Request, method_names, experts, progress=gr.Progress()):
        """Generator: the table and plots after each method's grid (its best on val, then on test),
        with a row per method still to come; a refusal or Cancel keeps what is shown."""
        rows = []
        try:
            names = distinct_methods(method_names or [])
            if not names:
                raise MergerError("tick at least one method to auto-tune")
            with self._cancel.job(session_of(request)) as flag:
                for row in tune_rows(self.ctl.session, names, experts=list(experts) if experts else None,
                                     progress=CancelFlags.reporting(flag, progress, "auto-tune"),
                                     cluster=self.ctl.cluster, on_result=self._record):
                    rows.append(row)
                    yield self._tuned(rows, names)
        except Cancelled as exc:  # the methods tuned before it stay, the others are no longer "to come"
            warn(exc)
            yield self._tuned(rows, [r["method"] for r in rows]) if rows else (gr.skip(),) * 3
        except MergerError as exc:
            yield kept(exc, 3)

    auto_tune.keeps_outputs = 3  # a generator: it yields kept(...) itself

    @staticmethod
    def _tuned(rows, names) -> tuple:
        """(table, bars, radar) of the methods tuned so far; the others named as still to come."""
        table = [[r["method"], (r["spec"].arguments() or "-")
                  + (f" (at the grid's edge: {', '.join(r['at_edge'])})" if r["at_edge"] else ""),
                  r["grid_points"], round(100 * r["val_accuracy"], 2), round(100 * r["test_accuracy"], 2),
                  round(100 * r["test_normalized"], 2)] for r in rows]
        table += [[m, "tuning now…" if i == 0 else "waiting", len(grid_points(m)), None, None, None]
                  for i, m in enumerate(names[len(rows):])]
        results = {f"{r['method']} (best)": r["test"] for r in rows}
        done = f"{len(rows)} of {len(names)} methods tuned" if len(rows) < len(names) else "tuned"
        return (table, plots.grouped_bars(results, f"Auto-tuned ({done}): test accuracy per task"),
                plots.radar(results))

    @keeps_outputs(1)
    def sweep(self, request: gr.Request, axis, method_names, split, experts, progress=gr.Progress()):
        with self._cancel.job(session_of(request)) as flag:
            try:
                return self._sweep(axis, method_names, split, experts, CancelFlags.reporting(flag, progress, "sweep"))
            except Cancelled as exc:  # the previous sweep's plot would stand under these choices as theirs
                warn(exc)
                return plots.empty("Sweep cancelled: no curve for these choices")

    def _sweep(self, axis, method_names, split, experts, progress):
        experts = list(experts) if experts else None
        if not method_names:
            raise MergerError("tick at least one method to sweep")
        if axis == "tasks":
            curves, errors = {}, {}
            for m in method_names:
                r = sweep_num_tasks(self.ctl.session, m, split=split, progress=lambda f, msg: progress(f, f"{m}: {msg}"))
                curves[m], errors[m] = (r["x"], r["mean"]), r["se"]
            return plots.sweep_curves(curves, "number of merged tasks",
                                      f"Average accuracy over the merged tasks ({split} split; each method at its "
                                      "defaults; mean ± s.e. over random subsets)", errors=errors)
        axes = sweep_axes()
        if axis not in axes:
            raise MergerError(f"sweep axis '{axis}' unknown; one of {', '.join(axes)}")
        label, only = axes[axis]
        chosen = [m for m in method_names if axis in methods.get(m).param_names]
        if not chosen:
            raise MergerError(f"none of the ticked methods has {label}" + (f" (try {', '.join(only)})" if only else ""))
        skipped = [m for m in method_names if m not in chosen]
        values = sorted({v for m in chosen for v in sweep_values(axis, m)})
        data = sweep(self.ctl.session, chosen, axis, values, split=split, experts=experts, progress=progress,
                     cluster=self.ctl.cluster, on_result=self._record)
        curves, dashed = {}, []
        for m, d in data.items():
            curves[f"{m} (average)"] = (d["x"], d["average"])
        for m, d in data.items():
            for t, ys in d["per_task"].items():
                curves[f"{m} · {t}"] = (d["x"], ys)
                dashed.append(f"{m} · {t}")
        n = len(experts) if experts else len(self.ctl.pool.tasks)
        capped = [f"{m} stops at {label} {methods.get(m).bounds(axis, n)[1]:.3g}" for m in chosen
                  if methods.get(m).bounds(axis, n)[1] < max(values)]
        notes = ([f"not swept: {', '.join(skipped)} (no {label})"] if skipped else []) + capped
        title = f"Accuracy against {label} ({split} split; per-task curves in the legend)"
        if notes:
            title += "<br><sub>" + "; ".join(notes) + "</sub>"
        return plots.sweep_curves(curves, label, title, dashed=dashed)


def build_compare_tab(ctl, pins, experts, batch) -> CompareTab:
    tab = CompareTab(ctl)
    with gr.Tab("Compare", id="compare"):
        with gr.Row():
            cmp_split = gr.Dropdown(list(SPLITS_SHOWN), value="live", label="split")
            cmp_btn = gr.Button("Compare pinned merges")
            report_btn = gr.Button("Export report")
        report_file = gr.File(label="report (one HTML file: it opens offline)", interactive=False)
        cmp_table = gr.Dataframe(headers=tab.compare_headers(), interactive=False, wrap=True,
                                 column_widths=tab.compare_widths())
        with gr.Row():
            cmp_bars = gr.Plot(elem_id="compare-bars")
            cmp_radar = gr.Plot()
        cmp_btn.click(batch(tab.compare), [pins, cmp_split], [cmp_table, cmp_bars, cmp_radar],
                      **BATCH_EVENT, api_visibility="private")
        # wired by the app, once the tabs whose figures the report draws exist (REPORT_VIEWS)
        tab.report_event = (report_btn, [pins, cmp_split], report_file)
        gr.Markdown("### Auto-tune\nGrid search on the validation split, then the best setting on the test split.")
        tunable = tunable_methods()
        tune_methods = gr.CheckboxGroup([(methods.get(n).display_name, n) for n in tunable], value=featured(tunable),
                                        label="methods")
        with gr.Row():
            tune_btn = gr.Button("Auto-tune")
            tune_cancel = gr.Button("Cancel")
        tune_table = gr.Dataframe(headers=["method", "best parameters", "grid points", "val acc %",
                                           "test acc %", "test normalised %"], interactive=False, wrap=True,
                                  column_widths=["14%", "38%", "10%", "12%", "12%", "14%"])
        with gr.Row():
            tune_bars = gr.Plot(elem_id="tune-bars")
            tune_radar = gr.Plot()
        # one progress bar (on the table), not one over each output
        tune_btn.click(batch(tab.auto_tune), [tune_methods, experts], [tune_table, tune_bars, tune_radar],
                       show_progress_on=tune_table, **BATCH_EVENT, api_visibility="private")
        gr.Markdown("### Sweeps")
        axes = sweep_axes()
        swept = [m.name for m in methods.all_methods() if not m.data_driven]
        with gr.Row():
            sweep_axis = gr.Radio([(label, name) for name, (label, _) in axes.items()] + [("number of tasks", "tasks")],
                                  value=next(iter(axes)), label="against")
            sweep_methods = gr.CheckboxGroup([(methods.get(n).display_name, n) for n in swept], value=featured(swept),
                                             label="methods")
            sweep_split = gr.Dropdown(list(SPLITS_SHOWN), value="live", label="split")
        with gr.Row():
            sweep_btn = gr.Button("Sweep")
            sweep_cancel = gr.Button("Cancel")
        sweep_plot = gr.Plot(elem_id="sweep-plot")
        sweep_btn.click(batch(tab.sweep), [sweep_axis, sweep_methods, sweep_split, experts], sweep_plot,
                        **BATCH_EVENT, api_visibility="private")
        for button in (tune_cancel, sweep_cancel):  # either stops this page's auto-tune and sweep
            button.click(tab.cancel, None, None, concurrency_id="cancel", concurrency_limit=None,
                         api_visibility="private")
    return tab
