"""Pure plotting: results in, plotly figures out. Nothing here touches weights."""
from __future__ import annotations

from typing import Mapping, Sequence

import plotly.graph_objects as go
import plotly.io as pio

from merger.plot_labels import place_labels, wrapped

PALETTE = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#FF9DA6", "#9D755D",
           "#BAB0AC", "#EECA3B")
# Figures are rebuilt on every slider move, and plotly deep-copies a figure's template into it:
# "plotly_white" costs ~25 ms a figure, this small look of our own well under 1 ms.
_AXIS = dict(gridcolor="#EBF0F8", zerolinecolor="#EBF0F8", linecolor="#EBF0F8")
pio.templates["merger"] = go.layout.Template(layout=dict(
    paper_bgcolor="white", plot_bgcolor="white", colorway=list(PALETTE), font=dict(color="#2a3f5f"),
    xaxis=_AXIS, yaxis=_AXIS, polar=dict(bgcolor="white", radialaxis=dict(gridcolor="#EBF0F8"),
                                         angularaxis=dict(gridcolor="#EBF0F8")),
    scene=dict(xaxis=dict(gridcolor="#DFE8F3", backgroundcolor="white"), yaxis=dict(gridcolor="#DFE8F3", backgroundcolor="white"),
               zaxis=dict(gridcolor="#DFE8F3", backgroundcolor="white"))))
pio.templates.default = "merger"
TEMPLATE = "merger"
_LAYOUT = dict(template=TEMPLATE, margin=dict(l=50, r=20, t=40, b=40), height=340,
               legend=dict(orientation="h", y=-0.2))
# Curves over a titled x axis: their legend at the right (long ones scroll), where a legend below
# would sit on the axis title.
_CURVES = {**_LAYOUT, "legend": dict(orientation="v", x=1.02, xanchor="left", y=1, yanchor="top")}


def _figure(traces, **layout) -> go.Figure:
    """Traces and layout handed to the constructor at once: a figure built by add_trace and
    update_layout costs several times more, and these are rebuilt on every slider move."""
    return go.Figure(data=list(traces), layout={**_LAYOUT, **layout})


def _pct(values):
    return [100.0 * v for v in values]


def accuracy_bars(result, base=None, experts: Mapping[str, float] | None = None, title: str = "Accuracy per task",
                  guides: Mapping[str, float] | None = None) -> go.Figure:
    """Merged accuracy per task, with marks for the base's and each task's expert's accuracy, and
    optional labelled horizontal guide lines (e.g. the field's reference averages)."""
    tasks = result.tasks
    margins = result.margins() if result.counts else {}
    traces = [go.Bar(x=tasks, y=_pct(result.accuracy[t] for t in tasks), name="merged",
                     marker_color=PALETTE[0], text=[f"{100 * result.accuracy[t]:.1f}" for t in tasks],
                     # the value at the foot of its bar: above it, it overlaps the interval and the marks
                     textposition="auto", insidetextanchor="start",
                     error_y=dict(type="data", array=_pct(margins[t] for t in tasks), visible=True,
                                  color="#555", thickness=1) if margins else None,
                     hovertemplate="%{x}: %{y:.1f} % ± %{error_y.array:.1f} (95 % binomial)<extra></extra>")]
    if base is not None:
        traces.append(go.Scatter(x=tasks, y=_pct(base.accuracy[t] for t in tasks), mode="markers", name="base",
                                 marker=dict(symbol="line-ew", size=26, line=dict(width=3, color="#888"))))
    if experts:
        traces.append(go.Scatter(x=tasks, y=_pct(experts[t] for t in tasks), mode="markers", name="expert",
                                 marker=dict(symbol="line-ew", size=26, line=dict(width=3, color=PALETTE[3]))))
    fig = _figure(traces, title=title, yaxis=dict(title="accuracy %", range=[0, 105]))
    for label, value in (guides or {}).items():
        fig.add_hline(y=100 * value, line_dash="dash", line_color="#999", annotation_text=f"{label}: {100 * value:.1f}",
                      annotation_position="top left", annotation_font_size=10)
    return fig


def loss_bars(result, base=None, title: str = "Cross-entropy per task") -> go.Figure:
    tasks = result.tasks
    traces = [go.Bar(x=tasks, y=[result.loss[t] for t in tasks], name="merged", marker_color=PALETTE[1])]
    if base is not None:
        traces.append(go.Scatter(x=tasks, y=[base.loss[t] for t in tasks], mode="markers", name="base",
                                 marker=dict(symbol="line-ew", size=26, line=dict(width=3, color="#888"))))
    return _figure(traces, title=title, yaxis=dict(title="mean cross-entropy"))


def radar(results: Mapping[str, object], title: str = "Normalised accuracy (merged ÷ expert)") -> go.Figure:
    """One closed polygon per labelled result, over the tasks, in % of each task's expert; bars below
    three tasks (a radar of two collapses to a line)."""
    if results and len(next(iter(results.values())).tasks) < 3:
        fig = go.Figure([go.Bar(x=r.tasks, y=_pct(r.normalized[t] for t in r.tasks), name=label,
                                marker_color=PALETTE[i % len(PALETTE)]) for i, (label, r) in enumerate(results.items())])
        fig.update_layout(title=title, barmode="group", yaxis=dict(title="% of the expert's accuracy"), **_LAYOUT)
        fig.add_hline(y=100, line_dash="dash", line_color="#999")
        return fig
    traces = []
    top = 110.0
    for i, (label, r) in enumerate(results.items()):
        tasks = r.tasks
        vals = _pct(r.normalized[t] for t in tasks)
        top = max(top, *(v + 10 for v in vals if v == v))
        traces.append(go.Scatterpolar(r=vals + vals[:1], theta=tasks + tasks[:1], name=label, fill="toself",
                                      opacity=0.55, line=dict(color=PALETTE[i % len(PALETTE)])))
    # the radial axis half-way between the first two tasks, its tick labels off the first task's name
    half_step = 180.0 / max(1, len(tasks)) if results else 0.0
    # two small ticks (50 %, and 100 %: the expert's own accuracy): six piled onto the first task's name
    return _figure(traces, title=title, height=380,
                   polar=dict(radialaxis=dict(range=[0, top], ticksuffix="%", angle=half_step, tickangle=half_step,
                                              tickvals=[50, 100], tickfont=dict(size=9, color="#666"))))


def grouped_bars(results: Mapping[str, object], title: str = "Pinned merges: accuracy per task") -> go.Figure:
    fig = go.Figure()
    for i, (label, r) in enumerate(results.items()):
        fig.add_trace(go.Bar(x=r.tasks, y=_pct(r.accuracy[t] for t in r.tasks), name=label,
                             marker_color=PALETTE[i % len(PALETTE)]))
    fig.update_layout(title=title, barmode="group", yaxis=dict(title="accuracy %", range=[0, 105]), **_LAYOUT)
    return fig


def sweep_curves(curves: Mapping[str, tuple[Sequence[float], Sequence[float]]], x_title: str,
                 title: str, errors: Mapping[str, Sequence[float]] | None = None,
                 dashed: Sequence[str] = ()) -> go.Figure:
    """Accuracy curves: label -> (x values, accuracy values in [0, 1]); optional ± error bars.
    Labels in ``dashed`` (e.g. per-task curves) are drawn dotted and start hidden in the legend."""
    fig = go.Figure()
    for i, (label, (xs, ys)) in enumerate(curves.items()):
        err = errors.get(label) if errors else None
        thin = label in dashed
        fig.add_trace(go.Scatter(
            x=list(xs), y=_pct(ys), mode="lines+markers", name=label, visible="legendonly" if thin else True,
            line=dict(color=PALETTE[i % len(PALETTE)], dash="dot" if thin else "solid", width=1.5 if thin else 2.5),
            error_y=dict(type="data", array=_pct(err), visible=True) if err is not None else None))
    fig.update_layout(title=title, xaxis=dict(title=x_title), yaxis=dict(title="accuracy %"), **_CURVES)
    return fig


def empty(message: str) -> go.Figure:
    return _figure([], xaxis=dict(visible=False), yaxis=dict(visible=False),
                   annotations=[dict(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")])


MARKERS = {"base": ("square", "#222"), "expert": ("diamond", PALETTE[3]), "merge": ("circle", PALETTE[0]),
           "pinned": ("circle-open", PALETTE[2]), "live": ("star", "#FFD700")}
# The 3-D view has no star: the live merge is a cross there (the Landscape tab's caption says so).
SYMBOLS_3D = {"star": "x"}
# Point names sit on the whole of Viridis, dark purple to yellow: dark text with a light halo.
_LABEL_FONT = dict(color="#111", shadow="auto")


def _hover(label, x, y, off):
    return f"{label}<br>plane ({x:.3g}, {y:.3g})<br>off-plane distance {off:.3g}"


def landscape(xs, ys, z, metric_label: str, points: Mapping[str, tuple] = (), paths: Mapping[str, tuple] = (),
              live: tuple | None = None, view: str = "contour", title: str = "",
              heights: Mapping[str, float | list] | None = None, labels: Mapping[str, str] | None = None) -> go.Figure:
    """Contour (or 3-D surface) of a metric on a plane.

    points: label -> (x, y, off_plane, kind) with kind in MARKERS; paths: name -> (xs, ys, labels);
    live: (label, x, y, off_plane) for the live merge marker. Hover texts give off-plane distances.
    The 3-D view needs ``heights``: label (and "live", and each path's name: a list) -> the metric
    measured at the point itself, not read off the surface (which holds it at the projection).
    ``labels``: each point's textposition (``label_positions``), where the caller keeps them.
    """
    traces = []
    points = dict(points or {})
    paths = dict(paths or {})
    where = labels if labels is not None else label_positions(points, xs, ys, view)
    if view == "surface":
        heights = dict(heights or {})
        missing = [label for label in [*points, *paths] if label not in heights] + (
            ["live"] if live is not None and "live" not in heights else [])
        if missing:
            raise ValueError(f"3-D landscape: no measured height for {', '.join(missing)}")
        traces.append(go.Surface(x=xs, y=ys, z=z, colorscale="Viridis", opacity=0.9, name=metric_label,
                                 colorbar=dict(title=metric_label)))
        for label, (x, y, off, kind) in points.items():
            sym, col = MARKERS.get(kind, MARKERS["merge"])
            traces.append(go.Scatter3d(x=[x], y=[y], z=[heights[label]], mode="markers+text", text=[label],
                                       textposition=where[label],
                                       name=label, marker=dict(symbol=SYMBOLS_3D.get(sym, sym), size=6, color=col),
                                       hovertext=_hover(label, x, y, off) + f"<br>{metric_label} {heights[label]:.4g}"))
        for i, (name, (pxs, pys, labels)) in enumerate(paths.items()):
            traces.append(go.Scatter3d(x=list(pxs), y=list(pys), z=list(heights[name]), mode="lines+markers", name=name,
                                       line=dict(color=PALETTE[(i + 4) % len(PALETTE)], width=5),
                                       marker=dict(size=3), hovertext=list(labels), hoverinfo="text+name"))
        if live is not None:
            label, x, y, off = live
            traces.append(go.Scatter3d(x=[x], y=[y], z=[heights["live"]], mode="markers", name="live merge",
                                       marker=dict(symbol=SYMBOLS_3D["star"], size=9, color=MARKERS["live"][1],
                                                   line=dict(width=2, color="black")),
                                       hovertext=_hover(label, x, y, off) + f"<br>{metric_label} {heights['live']:.4g}"))
        return _figure(traces, title=title, scene=dict(zaxis_title=metric_label), height=560,
                       margin=dict(l=0, r=0, t=_title_px(title), b=0))
    traces.append(go.Contour(x=xs, y=ys, z=z, colorscale="Viridis", ncontours=24, name=metric_label,
                             colorbar=dict(title=metric_label), hovertemplate="(%{x:.3g}, %{y:.3g}): %{z:.4g}<extra></extra>"))
    for i, (name, (pxs, pys, labels)) in enumerate(paths.items()):
        traces.append(go.Scatter(x=list(pxs), y=list(pys), mode="lines+markers", name=name,
                                 line=dict(color=PALETTE[(i + 4) % len(PALETTE)], width=2),
                                 marker=dict(symbol="arrow", angleref="previous", size=11),
                                 hovertext=list(labels), hoverinfo="text+name"))
    kinds: dict[str, list] = {}  # one trace per kind of marker: the figure is rebuilt on every move
    for label, (x, y, off, kind) in points.items():
        kinds.setdefault(kind if kind in MARKERS else "merge", []).append((label, x, y, off))
    for kind, members in kinds.items():
        sym, col = MARKERS[kind]
        traces.append(go.Scatter(x=[m[1] for m in members], y=[m[2] for m in members], mode="markers+text",
                                 text=[m[0] for m in members], textposition=[where[m[0]] for m in members],
                                 textfont=_LABEL_FONT, name=kind,
                                 marker=dict(symbol=sym, size=13, color=col, line=dict(width=1, color="white")),
                                 hovertext=[_hover(*m) for m in members], hoverinfo="text", showlegend=False))
    if live is not None:
        label, x, y, off = live
        traces.append(go.Scatter(x=[x], y=[y], mode="markers", name="live merge",
                                 marker=dict(symbol="star", size=20, color=MARKERS["live"][1], line=dict(width=1.5, color="black")),
                                 hovertext=_hover("live: " + label, x, y, off), hoverinfo="text"))
    # Equal scales on both directions (distances in weight space read the same either way): the x
    # axis gives up width rather than stretching its range past the data.
    # Taller than the other plots: with equal scales the plane is as tall as the panel lets it be.
    return _figure(traces, title=title, xaxis=dict(title="direction 1", constrain="domain"),
                   yaxis=dict(title="direction 2", scaleanchor="x"), height=720, legend=dict(orientation="h", y=-0.1),
                   margin={**_LAYOUT["margin"], "t": _title_px(title)})


def label_positions(points: Mapping[str, tuple], xs, ys, view: str = "contour") -> dict[str, str]:
    """Each point's textposition in ``landscape``, its name clear of the other markers and names
    (``place_labels``); the plot is about 560 pixels on its longer side, 420 in 3-D (equal scales)."""
    plot_px = 420 if view == "surface" else 560
    span = max(float(xs[-1]) - float(xs[0]), float(ys[-1]) - float(ys[0]), 1e-12)
    # merges sit near the base at small λ: their names below first, the base's and experts' above
    prefer = ["bottom center" if kind in ("merge", "pinned") else "top center" for *_, kind in points.values()]
    order = [(label, x, y) for label, (x, y, _, _) in points.items()]
    return dict(zip(points, place_labels(order, plot_px / span, prefer)))


def _title_px(title: str) -> int:
    """The top margin a title of several lines (<br>) needs."""
    return 24 + 22 * (title.count("<br>") + 1)


def trajectory_curves(curves: Mapping[str, dict], metric: str, task: str | None = None,
                      missing: Sequence[str] = ()) -> go.Figure:
    """curves: name -> {"steps", "x_title", "accuracy", "loss", "per_task": {task: {"accuracy", "loss"}}};
    ``task``: one task's values instead of the mean; ``missing``: trajectories not drawn, and why.
    Curves whose x counts different things (epochs, λ, iterations) get one panel each, with its own
    x axis: on one axis, epoch 3 and λ = 3 would read as the same place."""
    from plotly.subplots import make_subplots

    x_titles = list(dict.fromkeys(c.get("x_title", "step") for c in curves.values()))
    fig = make_subplots(rows=len(x_titles), cols=1, vertical_spacing=0.3 / max(1, len(x_titles)))
    for i, (name, c) in enumerate(curves.items()):
        values = c["per_task"][task][metric] if task is not None else c[metric]
        ys = _pct(values) if metric == "accuracy" else values
        fig.add_trace(go.Scatter(x=c["steps"], y=ys, mode="lines+markers", name=name,
                                 line=dict(color=PALETTE[i % len(PALETTE)])),
                      row=x_titles.index(c.get("x_title", "step")) + 1, col=1)
    what = "accuracy %" if metric == "accuracy" else "loss"
    for row, x_title in enumerate(x_titles, start=1):
        fig.update_xaxes(title_text=x_title, row=row, col=1)
        fig.update_yaxes(title_text=what, row=row, col=1)
    title = f"{task + ' ' if task else 'Average '}{what} along trajectories"
    if missing:
        title += "<br><sub>" + wrapped("not drawn: " + "; ".join(missing), 110, 2) + "</sub>"
    fig.update_layout(title=title, **{**_CURVES, "height": max(_CURVES.get("height", 420), 300 * len(x_titles))})
    return fig


def objective_curve(values: Sequence[float], title: str = "Objective", y_title: str = "objective") -> go.Figure:
    fig = go.Figure(go.Scatter(x=list(range(1, len(values) + 1)), y=list(values), mode="lines",
                               line=dict(color=PALETTE[0], width=2)))
    fig.update_layout(title=title, xaxis=dict(title="step"), yaxis=dict(title=y_title), **{**_CURVES, "height": 260})
    return fig


def coefficient_heatmap(coefficients: Sequence[Sequence[float]], tasks: Sequence[str], groups: Sequence[str],
                        title: str = "Learned coefficients (task × layer)") -> go.Figure:
    fig = go.Figure(go.Heatmap(z=[list(r) for r in coefficients], x=list(groups), y=list(tasks),
                               colorscale="Viridis", colorbar=dict(title="λ"),
                               hovertemplate="%{y} · %{x}: %{z:.3f}<extra></extra>"))
    fig.update_layout(title=title, xaxis=dict(showticklabels=len(groups) <= 12), template=TEMPLATE,
                      height=300, margin=dict(l=80, r=20, t=40, b=40))
    return fig


def fw_progress(weights: Sequence[Sequence[float]], labels: Sequence[str], gaps: Sequence[float],
                chosen: Sequence[str]) -> go.Figure:
    """Barycentric weights over iterations (stacked areas) and the FW gap (right axis)."""
    fig = go.Figure()
    its = list(range(len(weights)))
    for j, label in enumerate(labels):
        fig.add_trace(go.Scatter(x=its, y=[w[j] for w in weights], name=label, stackgroup="w",
                                 line=dict(color=PALETTE[j % len(PALETTE)])))
    fig.add_trace(go.Scatter(x=list(range(1, len(gaps) + 1)), y=list(gaps), name="FW gap", yaxis="y2",
                             mode="lines+markers", text=list(chosen), hovertemplate="gap %{y:.4g}<br>chose %{text}",
                             line=dict(color="black", dash="dot")))
    fig.update_layout(title="Frank–Wolfe: barycentric weights and gap per iteration", xaxis=dict(title="iteration"),
                      yaxis=dict(title="weight", range=[0, 1.02]),
                      yaxis2=dict(title="gap", overlaying="y", side="right", showgrid=False), **{**_LAYOUT, "height": 320})
    return fig


def heatmap(matrix, xlabels, ylabels, title: str, zmid: float | None = None, fmt: str = ".2f") -> go.Figure:
    fig = go.Figure(go.Heatmap(z=matrix, x=list(xlabels), y=list(ylabels), colorscale="RdBu" if zmid is not None else "Viridis",
                               zmid=zmid, texttemplate="%{z:" + fmt + "}", hovertemplate="%{y} · %{x}: %{z:.4g}<extra></extra>"))
    fig.update_layout(title=title, template=TEMPLATE, height=360, margin=dict(l=80, r=20, t=40, b=60),
                      xaxis=dict(automargin=True), yaxis=dict(automargin=True))  # long names ("positional_embedding")
    return fig


def _error_bars(err) -> dict | None:
    """Symmetric errors [e, ...], or a (below, above) pair of lists (e.g. quartiles around a mean)."""
    if err is None:
        return None
    if len(err) == 2 and all(isinstance(e, (list, tuple)) for e in err):
        return dict(type="data", symmetric=False, arrayminus=list(err[0]), array=list(err[1]), visible=True)
    return dict(type="data", array=list(err), visible=True)


def bars(series: Mapping[str, Sequence[float]], labels: Sequence[str], title: str, y_title: str = "",
         errors: Mapping[str, Sequence] | None = None) -> go.Figure:
    fig = go.Figure()
    for i, (name, ys) in enumerate(series.items()):
        fig.add_trace(go.Bar(x=list(labels), y=list(ys), name=name, marker_color=PALETTE[i % len(PALETTE)],
                             error_y=_error_bars((errors or {}).get(name))))
    margin = {**_LAYOUT["margin"], "t": _title_px(title)} if "<br>" in title else _LAYOUT["margin"]
    fig.update_layout(title=title, barmode="group", yaxis=dict(title=y_title), **{**_LAYOUT, "margin": margin})
    return fig


def lines(curves: Mapping[str, tuple], x_title: str, y_title: str, title: str, log_x: bool = False,
          dashed: Sequence[str] = (), right: Sequence[str] = (), right_title: str = "") -> go.Figure:
    """curves: name -> (xs, ys); names in ``dashed`` are drawn dotted (e.g. a fitted trend); names in
    ``right`` on a second y axis (a quantity of another scale: beside one of 34 to 105, one of 0 to 4
    read as flat at zero)."""
    fig = go.Figure()
    for i, (name, (xs, ys)) in enumerate(curves.items()):
        fig.add_trace(go.Scatter(x=list(xs), y=list(ys), name=name, mode="lines" if name in dashed else "lines+markers",
                                 line=dict(color=PALETTE[i % len(PALETTE)], dash="dot" if name in dashed else "solid"),
                                 yaxis="y2" if name in right else "y"))
    xaxis = dict(title=x_title, type="log" if log_x else "linear")
    if log_x:  # a log axis over a decade or two labels 2, 5, 2, 5…: tick the values run instead
        run = sorted({float(x) for name, (xs, _) in curves.items() if name not in dashed for x in xs})
        if len(run) <= 12:
            xaxis.update(tickvals=run, ticktext=[f"{x:g}" for x in run])
    extra = {"yaxis2": dict(title=right_title, overlaying="y", side="right", showgrid=False),
             "legend": {**_CURVES["legend"], "x": 1.12}} if right else {}  # the legend clear of that axis
    fig.update_layout(title=title, xaxis=xaxis, yaxis=dict(title=y_title), **{**_CURVES, **extra})
    return fig


def stacked_lines(panels: Mapping[str, Mapping[str, tuple]], x_title: str, title: str) -> go.Figure:
    """One panel per quantity, over one shared x axis: panels: y title -> {name: (xs, ys)}. For
    quantities of different units and scales (an accuracy in %, a loss, a cosine distance near 0)."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.06)
    i = 0
    for row, (y_title, curves) in enumerate(panels.items(), start=1):
        for name, (xs, ys) in curves.items():
            fig.add_trace(go.Scatter(x=list(xs), y=list(ys), name=name, mode="lines+markers",
                                     line=dict(color=PALETTE[i % len(PALETTE)])), row=row, col=1)
            i += 1
        fig.update_yaxes(title_text=y_title, row=row, col=1)
    fig.update_xaxes(title_text=x_title, row=len(panels), col=1)
    fig.update_layout(title=title, template=TEMPLATE, height=160 + 150 * len(panels), showlegend=False,
                      margin=dict(l=70, r=20, t=_title_px(title) if "<br>" in title else 50, b=40))
    return fig


def weight_map(values: Sequence[float], accuracy: Sequence[Sequence[float]], x_task: str, y_task: str, task: str,
               current: tuple[float, float] | None = None) -> go.Figure:
    """One task's accuracy (%) over a grid of two tasks' weights (rows: y_task's weight), with the
    current point."""
    traces = [go.Heatmap(z=[_pct(row) for row in accuracy], x=list(values), y=list(values), colorscale="Viridis",
                         colorbar=dict(title="%"), texttemplate="%{z:.0f}",
                         hovertemplate=f"w {x_task} %{{x}} · w {y_task} %{{y}}: %{{z:.1f}} %<extra></extra>")]
    if current is not None:
        traces.append(go.Scatter(x=[current[0]], y=[current[1]], mode="markers", name="current",
                                 marker=dict(symbol="x", size=14, color="white", line=dict(width=2, color="black"))))
    return _figure(traces, title=f"{task} accuracy", xaxis=dict(title=f"weight of {x_task}"),
                   yaxis=dict(title=f"weight of {y_task}"), showlegend=False)


def pareto_scatter(points: Sequence[Mapping], front: Sequence[int], task_a: str, task_b: str) -> go.Figure:
    """Task A vs task B accuracy (%) of every evaluated spec, the Pareto front joined."""
    traces = [go.Scatter(x=_pct(p["a"] for p in points), y=_pct(p["b"] for p in points), mode="markers",
                         name="evaluated", text=[p["label"] for p in points], marker=dict(color=PALETTE[0], opacity=0.6),
                         hovertemplate="%{text}<br>%{x:.1f} % · %{y:.1f} %<extra></extra>")]
    if front:
        fp = [points[i] for i in front]
        traces.append(go.Scatter(x=_pct(p["a"] for p in fp), y=_pct(p["b"] for p in fp), mode="lines+markers",
                                 name="Pareto front", text=[p["label"] for p in fp], line=dict(color=PALETTE[1]),
                                 hovertemplate="%{text}<br>%{x:.1f} % · %{y:.1f} %<extra></extra>"))
    return _figure(traces, title=f"Every evaluated merge: {task_a} vs {task_b}",
                   xaxis=dict(title=f"{task_a} accuracy %"), yaxis=dict(title=f"{task_b} accuracy %"),
                   legend=_CURVES["legend"])


def guesses_histogram(guesses: Sequence[float], answer: float, mine: float | None = None,
                      title: str = "The room's guesses") -> go.Figure:
    """A room's guesses of an average accuracy (in %) against the answer, and this page's own guess."""
    marks = [dict(type="line", x0=answer, x1=answer, y0=0, y1=1, yref="paper", line=dict(color=PALETTE[3], width=3))]
    notes = [dict(x=answer, y=1, yref="paper", text=f"answer {answer:.1f} %", showarrow=False, yanchor="bottom")]
    if mine is not None:
        marks.append(dict(type="line", x0=mine, x1=mine, y0=0, y1=1, yref="paper", line=dict(color="#222", dash="dot")))
    return _figure([go.Histogram(x=list(guesses), xbins=dict(start=0, end=100, size=2.5), marker_color=PALETTE[0],
                                 name="guesses")], title=title, shapes=marks, annotations=notes, bargap=0.05,
                   xaxis=dict(title="average accuracy %", range=[0, 100]), yaxis=dict(title="guesses"))
