"""Pure plotting: results in, plotly figures out. Nothing here touches weights."""
from __future__ import annotations

from typing import Mapping, Sequence

import plotly.graph_objects as go

PALETTE = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#FF9DA6", "#9D755D",
           "#BAB0AC", "#EECA3B")
_LAYOUT = dict(template="plotly_white", margin=dict(l=50, r=20, t=40, b=40), height=340,
               legend=dict(orientation="h", y=-0.2))


def _pct(values):
    return [100.0 * v for v in values]


def accuracy_bars(result, base=None, experts: Mapping[str, float] | None = None, title: str = "Accuracy per task") -> go.Figure:
    """Merged accuracy per task, with marks for the base's and each task's expert's accuracy."""
    tasks = result.tasks
    fig = go.Figure(go.Bar(x=tasks, y=_pct(result.accuracy[t] for t in tasks), name="merged",
                           marker_color=PALETTE[0], text=[f"{100 * result.accuracy[t]:.1f}" for t in tasks],
                           textposition="outside"))
    if base is not None:
        fig.add_trace(go.Scatter(x=tasks, y=_pct(base.accuracy[t] for t in tasks), mode="markers", name="base",
                                 marker=dict(symbol="line-ew", size=26, line=dict(width=3, color="#888"))))
    if experts:
        fig.add_trace(go.Scatter(x=tasks, y=_pct(experts[t] for t in tasks), mode="markers", name="expert",
                                 marker=dict(symbol="line-ew", size=26, line=dict(width=3, color=PALETTE[3]))))
    fig.update_layout(title=title, yaxis=dict(title="accuracy %", range=[0, 105]), **_LAYOUT)
    return fig


def loss_bars(result, base=None, title: str = "Cross-entropy per task") -> go.Figure:
    tasks = result.tasks
    fig = go.Figure(go.Bar(x=tasks, y=[result.loss[t] for t in tasks], name="merged", marker_color=PALETTE[1]))
    if base is not None:
        fig.add_trace(go.Scatter(x=tasks, y=[base.loss[t] for t in tasks], mode="markers", name="base",
                                 marker=dict(symbol="line-ew", size=26, line=dict(width=3, color="#888"))))
    fig.update_layout(title=title, yaxis=dict(title="mean cross-entropy"), **_LAYOUT)
    return fig


def radar(results: Mapping[str, object], title: str = "Normalised accuracy (merged ÷ expert)") -> go.Figure:
    """One closed polygon per labelled result, over the tasks, in % of each task's expert."""
    fig = go.Figure()
    top = 110.0
    for i, (label, r) in enumerate(results.items()):
        tasks = r.tasks
        vals = _pct(r.normalized[t] for t in tasks)
        top = max(top, *(v + 10 for v in vals if v == v))
        fig.add_trace(go.Scatterpolar(r=vals + vals[:1], theta=tasks + tasks[:1], name=label, fill="toself",
                                      opacity=0.55, line=dict(color=PALETTE[i % len(PALETTE)])))
    fig.update_layout(title=title, polar=dict(radialaxis=dict(range=[0, top], ticksuffix="%")),
                      **{**_LAYOUT, "height": 380})
    return fig


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
    fig.update_layout(title=title, xaxis=dict(title=x_title), yaxis=dict(title="accuracy %"), **_LAYOUT)
    return fig


def empty(message: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_layout(xaxis=dict(visible=False), yaxis=dict(visible=False), **_LAYOUT)
    return fig
