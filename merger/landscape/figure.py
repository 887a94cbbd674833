"""Building a landscape figure from names (shared by the CLI and the app)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from merger import plots
from merger.errors import MergerError
from merger.io import inputs
from merger.io.checkpoints import write_text_atomic
from merger.landscape import trajectories
from merger.landscape.surface import (Landscape, Surface, check_named, extent_of, pca_plane, task_vector_plane,
                                      three_point_plane)
from merger.plot_labels import wrapped

PLANES = ("pca", "tasks", "points")
METRICS = ("loss", "accuracy")


def make_plane(land: Landscape, kind: str, points: dict, tasks: Sequence[str] = ()):
    if kind == "pca":
        return pca_plane(points)
    if kind == "tasks":
        if len(tasks) != 2:
            raise MergerError("the task-vector plane needs exactly two tasks (e.g. --tasks shape,colour)")
        base = land.base_point()
        return task_vector_plane(base, land.expert_point(tasks[0]) - base, land.expert_point(tasks[1]) - base, tasks)
    if kind == "points":
        names = list(points)
        if len(names) != 3:
            raise MergerError(f"the plane through points needs exactly three different points (got {len(names)}: "
                              f"{', '.join(names)})")
        return three_point_plane(*(points[n] for n in names), names=names)
    raise MergerError(f"unknown plane '{kind}'; one of {', '.join(PLANES)}")


def point_kind(label: str, pool) -> str:
    return "base" if label == "base" else "expert" if label in pool.experts else "merge"


def resolve_paths(land: Landscape, names: Sequence[str]) -> list:
    """'TASK' = its fine-tuning path; 'METHOD@AXIS' = that parameter's path (λ, rank_ratio, sparsity)."""
    check_named("paths", names)
    out = []
    for name in names:
        name = name.strip()
        if not name:
            continue
        if "@" in name:
            method, axis = name.split("@", 1)
            out.append(trajectories.parameter_path(land, method, axis, trajectories.default_values(axis)))
        else:
            out.append(trajectories.finetune_trajectory(land, name))
    return out


def projection(land: Landscape, plane, points: dict, paths: list) -> dict:
    """Where the points and paths sit on the plane ({"coords", "drawn", "plane_label"}): what a
    contour needs of them, without their weights (a page's state keeps this, not a model's worth of
    weights per point)."""
    coords = {label: (*plane.coords(v), point_kind(label, land.pool)) for label, v in points.items()}
    drawn = {}
    for tr in paths:
        xs, ys, offs = trajectories.project(plane, tr)
        drawn[tr.name] = (xs, ys, [f"{lab} (off-plane {o:.3g})" for lab, o in zip(tr.labels, offs)])
    return {"coords": coords, "drawn": drawn, "plane_label": plane.label}


def landscape_layers(land: Landscape, plane, surface, metric: str, task: str | None, points: dict | None,
                     paths: list | None, view: str = "contour", projected: dict | None = None) -> dict:
    """What a landscape figure draws besides the live merge: computed once per surface (projections
    and, in 3-D, each marker's measured height), so a slider move only adds its own marker.
    ``projected``: ``projection``'s answer, computed before; the points' weights are then needed
    for the 3-D view alone (its heights)."""
    projected = projected or projection(land, plane, points, paths)
    coords, drawn = projected["coords"], projected["drawn"]
    label = f"{'mean ' if task is None else task + ' '}{metric}"
    scale = 100.0 if metric == "accuracy" else 1.0
    z = [[scale * v for v in row] for row in surface.values(metric, task)]
    heights = None
    if view == "surface":
        height = lambda v: scale * Surface.metric_of(land.point_values(v, surface.split), metric, task)  # noqa: E731
        heights = {name: height(v) for name, v in points.items()}
        heights.update({tr.name: [height(p) for p in tr.points] for tr in paths})
    title = wrapped(f"{label} on {projected['plane_label']} ({surface.split} split)")
    return {"coords": coords, "drawn": drawn, "label": label, "scale": scale, "z": z, "heights": heights,
            "title": title, "metric": metric, "task": task, "view": view, "xs": surface.xs, "ys": surface.ys,
            "labels": plots.label_positions(coords, surface.xs, surface.ys, view)}


def landscape_figure(land: Landscape, plane, surface, metric: str, task: str | None, points: dict,
                     paths: list, view: str = "contour", live=None, live_values=None, layers: dict | None = None):
    """``live``: (label, x, y, off-plane) of the live merge; ``live_values``: its (accuracy, loss) per
    task on the surface's split (the 3-D view draws every marker at its own measured value).
    ``layers``: the figure's static part from ``landscape_layers`` (computed here when not given)."""
    lay = layers or landscape_layers(land, plane, surface, metric, task, points, paths, view)
    heights = dict(lay["heights"]) if lay["heights"] is not None else None
    if heights is not None and live is not None:
        if live_values is None:
            raise MergerError("3-D landscape: the live merge's values are needed for its marker")
        heights["live"] = lay["scale"] * Surface.metric_of(live_values, lay["metric"], lay["task"])
    title = lay["title"]
    if live is not None and not (lay["xs"][0] <= live[1] <= lay["xs"][-1] and lay["ys"][0] <= live[2] <= lay["ys"][-1]):
        title += "<br><sub>the live merge (★) lies outside the computed grid: the surface there was not measured</sub>"
    return plots.landscape(lay["xs"], lay["ys"], lay["z"], lay["label"], lay["coords"], lay["drawn"], live,
                           lay["view"], title=title, heights=heights, labels=lay["labels"])


def write_landscape(land: Landscape, out: str | Path, plane_kind: str, point_names: Sequence[str], grid: int,
                    metric: str, task: str | None = None, tasks: Sequence[str] = (), split: str = "probe",
                    path_names: Sequence[str] = (), view: str = "contour", progress=None,
                    cluster=None, files_relative_to: Path | None = None, forward: str | None = None
                    ) -> tuple[Path, Path]:
    """The figure (``out``, .html) and its grid (.json, with the points' coordinates and ``forward``: the
    forwards' precision, default the landscape's own evaluator's; a cluster's workers' is the caller's to give)."""
    if metric not in METRICS:
        raise MergerError(f"unknown metric '{metric}'; one of {', '.join(METRICS)}")
    out = inputs.check_path(out, "--out", MergerError).expanduser()
    if out.suffix != ".html":
        raise MergerError(f"{out}: the output must end in .html")
    keep = tuple(land.pool.input_files())
    for path in (out, out.with_suffix(".json")):  # before a grid that may take minutes
        inputs.check_output_file(path, "--out", MergerError, keep=keep)
    if task is not None and task not in land.pool.tasks:
        raise MergerError(f"--task {task}: not a task of this pool ({', '.join(land.pool.tasks)})")
    points = land.named_points(point_names, files_relative_to)
    plane = make_plane(land, plane_kind, points, tasks)
    paths = resolve_paths(land, path_names)
    coords = [plane.coords(v)[:2] for v in points.values()]
    for tr in paths:
        xs, ys, _ = trajectories.project(plane, tr)
        coords += list(zip(xs, ys))
    extent = extent_of(coords)
    if cluster is not None:  # the grid at once, row by row on the workers
        surface = land.surface(plane, extent, grid, split, progress, cluster=cluster)
    else:
        for surface in land.progressive(plane, extent, grid, split, progress=progress):
            pass
    fig = landscape_figure(land, plane, surface, metric, task, points, paths, view)
    html = write_text_atomic(out, fig.to_html(include_plotlyjs=True, full_html=True))
    data = surface.to_dict()
    data["points"] = {label: dict(zip(("x", "y", "off_plane"), plane.coords(v))) for label, v in points.items()}
    data["plane_label"] = plane.label
    data["forward"] = forward or land.session.evaluator.forward_precision
    js = write_text_atomic(out.with_suffix(".json"), json.dumps(data))
    return html, js
