"""Landscape and Trajectories tabs: callbacks and layout. A page's landscape state keeps the
points' projections and how to make their weights again, never the weights themselves (a point is a
model's worth); planes are shared by the pages that computed the same one (``PLANES_KEPT`` kept), and
a page whose plane was dropped makes it again."""
from __future__ import annotations

import functools
import threading
from collections import OrderedDict

import gradio as gr

from merger import methods, plots
from merger.errors import MergerError
from merger.landscape import trajectories
from merger.landscape.figure import landscape_figure, landscape_layers, make_plane, projection
from merger.landscape.surface import check_named, extent_of
from merger.methods.registry import with_param
from merger.ui.errors import keeps_outputs, kept, warn
from merger.ui.merge_events import session_of
from merger.ui.scheduling import BATCH_EVENT, PREVIEW_EVENT, CancelFlags

PLANE_CHOICES = [("PCA of base, experts and pinned merges", "pca"), ("base + two task vectors", "tasks"),
                 ("three points (named below)", "points")]
PATH_AXES = {"λ path (current method)": "lam", "rank path (CART / TSV-M)": "rank_ratio",
             "sparsity path (TIES / DARE)": "sparsity"}
ITERATES = "iterates of the current data-driven run"


def _one_task(choice):
    """A task dropdown's choice: one task's name, or None for the mean over tasks."""
    return None if choice in (None, "", "all tasks (mean)") else choice


class LandscapeController:
    def __init__(self, controller):
        self.ctl = controller
        self.land = controller.session.landscape
        self.pool = controller.pool
        self._cancel = CancelFlags()
        self._styles: dict[str, tuple] = {}  # browser session -> the (metric, task, view) its tab shows
        # Planes (an origin and two directions: three models' worth of weights) shared by the pages
        # that computed them (a room computes the default PCA plane many times over), a few kept;
        # a page whose plane went makes it again from its points.
        self._planes: OrderedDict[str, object] = OrderedDict()
        self._planes_lock = threading.Lock()

    PLANES_KEPT = 4

    def forget(self, who: str) -> None:
        """A page closed: the view it showed goes (its landscape state is Gradio's, deleted with it)."""
        self._styles.pop(who, None)

    def _keep_plane(self, plane):
        """The plane kept under its key: the one already there when another page computed it."""
        with self._planes_lock:
            kept = self._planes.setdefault(plane.key, plane)
            self._planes.move_to_end(plane.key)
            while len(self._planes) > self.PLANES_KEPT:
                self._planes.popitem(last=False)
        return kept

    def plane_of(self, state):
        """The plane of a page's landscape: kept, or made again from its points (same key)."""
        with self._planes_lock:
            plane = self._planes.get(state["plane_key"])
        if plane is None:
            plane = self._keep_plane(state["remake_plane"]())
        return plane

    def planes_kept(self) -> list[str]:
        """The keys of the planes kept, oldest first."""
        with self._planes_lock:
            return list(self._planes)

    def forget_planes(self) -> None:
        """Drop every plane kept: each page's next move makes its own again."""
        with self._planes_lock:
            self._planes.clear()

    def path_choices(self) -> list[str]:
        ft = [f"fine-tuning: {t}" for t in self.pool.tasks if trajectories.has_trajectory(self.pool, t)]
        return ft + list(PATH_AXES) + [ITERATES]

    def paths(self, chosen, method, spec_params, spec=None) -> tuple[list, list[str]]:
        """(the trajectories that could be built, a note for each that could not): one
        unavailable path never takes the others down with it; more than the landscape's bound, none."""
        check_named("paths", list(chosen or []))
        out, problems = [], []
        for name in chosen or []:
            try:
                out.append(self._path(name, method, spec_params, spec))
            except MergerError as exc:
                problems.append(f"{name}: {exc}")
        return out, problems

    def _path(self, name, method, spec_params, spec):
        if name == ITERATES:
            run = self.ctl.session.cached_run(spec) if spec is not None and methods.get(spec.method).data_driven else None
            if run is None:
                raise MergerError("no data-driven run for the current spec: pick AdaMerging or FW and press Run first")
            return trajectories.run_path(self.land, run)
        if name.startswith("fine-tuning: "):
            return trajectories.finetune_trajectory(self.land, name[len("fine-tuning: "):])
        axis = PATH_AXES[name]
        m = method
        if methods.get(m).data_driven or axis not in methods.get(m).param_names:
            takers = with_param(axis)  # the current method has no such slider: the first one that does
            m = next((t.name for t in takers if t.featured), takers[0].name)
        fixed = {k: v for k, v in spec_params.items() if k in methods.get(m).param_names and k != axis}
        # through the current merge: its experts, and its weights where the path keeps its method
        same = spec is not None and m == spec.method
        return trajectories.parameter_path(self.land, m, axis, trajectories.default_values(axis), fixed,
                                           experts=list(spec.experts) if spec is not None else None,
                                           task_weights=dict(spec.task_weights) if same else None,
                                           block_weights=dict(spec.block_weights) if same else None)

    def _marked(self, spec):
        """The spec the live marker shows, or None for a data-driven one whose run is not cached: its
        point would run it here, unseen, without progress or Cancel."""
        if spec is None or (methods.get(spec.method).data_driven and self.ctl.session.cached_run(spec) is None):
            return None
        return spec

    def cancel(self, request: gr.Request):
        self._cancel.cancel_and_say(session_of(request), "landscape", "the landscape after the current row")

    def compute(self, request: gr.Request, pins, plane_kind, task_a, task_b, three, metric, task, grid, view,
                chosen_paths, experts, method, *values, progress=gr.Progress()):
        """Generator: the coarse surface first, then the full grid; the state keeps it for markers.
        Refused (a point that names nothing, a plane without its tasks) or cancelled: the landscape
        shown stays."""
        who = session_of(request)
        with self._cancel.job(who) as flag:
            yield from self._compute(who, flag, pins, plane_kind, task_a, task_b, three, metric, task, grid, view,
                                     chosen_paths, experts, method, values, progress)

    def _compute(self, who, flag, pins, plane_kind, task_a, task_b, three, metric, task, grid, view, chosen_paths,
                 experts, method, values, progress):
        try:
            spec = self.ctl.spec_from_controls(experts, method, *values)
            names = ["base", "experts"] if plane_kind != "points" else [n.strip() for n in (three or "").split(",")]
            typed = f"{(three or '').strip()[:120]!r}{' (cut)' if len((three or '').strip()) > 120 else ''}"
            named = len([n for n in names if n])
            if plane_kind == "points" and named != 3:  # said before any is merged
                raise MergerError(f"three points: {named} named in {typed}; type three, "
                                  "separated by commas (base, a task, file:PATH or METHOD:param=value)")
            rebuild = functools.partial(self._vectors, names, list(pins or []), chosen_paths, spec)
            plane_points, points, paths, problems = rebuild()
            if plane_kind == "points" and len(plane_points) != 3:
                # never filled up with pins, nor cut to the first three: the plane is the one typed
                raise MergerError(f"three points: {len(plane_points)} different point(s) in {typed}; type three, "
                                  "separated by commas (base, a task, file:PATH or METHOD:param=value)")
            remake_plane = functools.partial(self._plane, plane_kind, [task_a, task_b], rebuild)
            plane = self._keep_plane(self._plane(plane_kind, [task_a, task_b], rebuild,
                                                 (plane_points, points, paths, problems)))
            marked = self._marked(spec)
            if marked is None:
                problems.append(f"the live merge ★: no {methods.get(spec.method).display_name} run for these "
                                "settings yet (press Run in the Merge tab)")
            if problems:
                warn("Not drawn: " + "; ".join(problems))
            coords = [plane.coords(v)[:2] for v in points.values()]
            if marked is not None:
                coords.append(plane.coords(self.land.spec_point(marked))[:2])
            for tr in paths:
                xs, ys, _ = trajectories.project(plane, tr)
                coords += list(zip(xs, ys))
            extent = extent_of(coords)
            task = _one_task(task)
            shown = lambda f, m: progress(f, desc=m)  # noqa: E731
            surfaces = ([self.land.surface(plane, extent, int(grid), progress=shown, cluster=self.ctl.cluster,
                                           cancel=flag.is_set)]
                        if self.ctl.cluster is not None else
                        self.land.progressive(plane, extent, int(grid), progress=shown, cancel=flag.is_set))
            self._styles[who] = (metric, task, view)
            # the page keeps where the points sit, and how to make them again for a 3-D view's heights:
            # their weights (a model's worth each) in every page's state took the server past its memory
            projected = projection(self.land, plane, points, paths)
            for surface in surfaces:
                # the metric, task and view the page shows now: chosen again while this computed
                metric, task, view = self._styles.get(who, (metric, task, view))
                state = {"plane_key": plane.key, "remake_plane": remake_plane, "surface": surface,
                         "projected": projected, "rebuild": rebuild, "metric": metric, "task": task, "view": view}
                yield state, self.figure(state, marked, vectors=(points, paths))
        except MergerError as exc:
            yield kept(exc, 2)

    def restyle(self, request: gr.Request, state, metric, task, view, experts, method, *values):
        """The metric, its task or the view changed: the landscape shown is redrawn from its surface,
        which holds every metric and task (no recompute), and a Compute under way draws its next
        frames so; before any Compute, nothing to redraw."""
        task = _one_task(task)
        self._styles[session_of(request)] = (metric, task, view)
        if not state:
            return gr.skip(), gr.skip()
        state = {**state, "metric": metric, "task": task, "view": view}
        try:
            spec = self._marked(self.ctl.spec_from_controls(experts, method, *values))
        except MergerError:  # the Merge tab's controls hold a refused value: no live marker
            spec = None
        return state, self.figure(state, spec)

    def _vectors(self, names, pins, chosen_paths, spec) -> tuple[dict, dict, list, list[str]]:
        """(the named points, those and the pins, the paths, why a path could not be drawn): the
        weights of everything a landscape draws."""
        named = self.land.named_points(names, runs=False)  # a data-driven point: its run on screen only
        points = dict(named)
        for s in pins:
            points.setdefault(s.label(), self.land.spec_point(s))
        paths, problems = self.paths(chosen_paths, spec.method, spec.kwargs, spec)
        return named, points, paths, problems

    def _plane(self, kind, tasks, rebuild, vectors=None):
        plane_points, points, _, _ = vectors or rebuild()
        return make_plane(self.land, kind, plane_points if kind == "points" else points, tasks)

    def figure(self, state, spec=None, vectors=None):
        """The landscape of ``state`` with the live marker of ``spec``; ``vectors``: (points, paths)
        where the caller holds them (else made again, for a 3-D view's heights only)."""
        live = live_values = None
        if spec is not None:
            x, y, off = self.ctl.session.coords_on_plane(self.plane_of(state), spec)
            live = (spec.label(), x, y, off)
            if state["view"] == "surface":  # the marker sits at the merge's own measured value
                live_values = self._measured(spec, state["surface"].split)
        # once per surface and view: the projections and heights of everything but the live merge
        key = (state["metric"], state["task"], state["view"])
        layers = state.setdefault("layers", {})
        if key not in layers:
            if key[2] == "surface" and vectors is None:
                vectors = state["rebuild"]()[1:3]
            points, paths = vectors if key[2] == "surface" else (None, None)
            layers[key] = landscape_layers(self.land, None, state["surface"], *key[:2], points, paths,
                                           key[2], projected=state["projected"])
        return landscape_figure(self.land, None, state["surface"], state["metric"], state["task"],
                                None, None, state["view"], live, live_values, layers[key])

    def _measured(self, spec, split: str) -> tuple[dict, dict]:
        """(accuracy, loss) of the live merge on the surface's split: from the move's own live
        result when it holds those images (no forward), else one forward of the point."""
        session = self.ctl.session
        cached = session.cached(spec, split)
        if cached is not None:
            return cached.accuracy, cached.loss
        if split == "probe":
            values = session.probe_from_live(spec)
            if values is not None:
                return values
        return self.land.point_values(self.land.spec_point(spec), split)

    def move_live(self, state, experts, method, *values):
        """The slider moved: only the live marker moves; the surface is not recomputed."""
        if not state:
            return gr.skip()
        try:
            spec = self._marked(self.ctl.spec_from_controls(experts, method, *values))
        except MergerError:  # a refused value: no merge on screen, so no marker (never the last one's)
            spec = None
        return self.figure(state, spec)

    @keeps_outputs(1)
    def curves(self, chosen, metric, split, task, experts, method, *values):
        """Accuracy or loss along the ticked trajectories (the mean over tasks, or one task's); a
        trajectory that is not available is named in the title, the others are drawn."""
        if not chosen:
            raise MergerError("tick at least one trajectory")
        task = _one_task(task)
        spec = self.ctl.spec_from_controls(experts, method, *values)
        paths, problems = self.paths(chosen, spec.method, spec.kwargs, spec)
        data = {tr.name: trajectories.evaluate_along(self.land, tr, split) for tr in paths}
        if not data:
            return plots.empty("No trajectory available: " + "; ".join(problems))
        return plots.trajectory_curves(data, metric, task=task, missing=problems)


RELAYOUT_JS = "() => { setTimeout(() => window.dispatchEvent(new Event('resize')), 100); }"


def build_landscape_tabs(lc: LandscapeController, pins, inputs, batch):
    """Adds the two tabs; returns (state, plot) so the Merge tab's moves can move the live marker.
    ``batch`` wraps a listener so its work is batch work."""
    tasks = lc.pool.tasks
    with gr.Tab("Landscape", id="landscape") as landscape_tab:
        state = gr.State(None)
        with gr.Row():
            plane = gr.Radio(PLANE_CHOICES, value="pca", label="plane")
            task_a = gr.Dropdown(tasks, value=tasks[0], label="task vector A")
            task_b = gr.Dropdown(tasks, value=tasks[min(1, len(tasks) - 1)], label="task vector B")
            three = gr.Textbox(value=f"base,{tasks[0]},ta:lam=0.3", label="three points",
                               info="base, a task, file:PATH, or METHOD:param=value")
        with gr.Row():
            metric = gr.Radio(["loss", "accuracy"], value="loss", label="metric")
            task = gr.Dropdown(["all tasks (mean)"] + tasks, value="all tasks (mean)", label="of")
            grid = gr.Dropdown([7, 15, 21, 31], value=21, label="resolution")
            view = gr.Radio(["contour", "surface"], value="contour", label="view")
        paths = gr.CheckboxGroup(lc.path_choices(), value=[], label="trajectories to draw")
        with gr.Row():
            go_btn = gr.Button("Compute landscape", variant="primary")
            cancel_btn = gr.Button("Cancel")
        plot = gr.Plot(elem_id="landscape-plot")
        gr.Markdown("Markers: ■ base · ◆ experts · ● merges (pinned, or named as a point) · ★ the live merge (✕ in "
                    "the 3-D view; it moves with the Merge tab's sliders). Hover a point for its off-plane distance: a "
                    "projection is not the real location.")
        go_btn.click(batch(lc.compute), [pins, plane, task_a, task_b, three, metric, task, grid, view, paths, *inputs],
                     [state, plot], **BATCH_EVENT, api_visibility="private")
        cancel_btn.click(lc.cancel, None, None, concurrency_id="cancel", concurrency_limit=None, api_visibility="private")
        for choice in (metric, task, view):  # what the surface already holds: redrawn at once
            choice.change(batch(lc.restyle), [state, metric, task, view, *inputs], [state, plot], **PREVIEW_EVENT,
                          api_visibility="private")
        # A plot redrawn while its tab is hidden (the live marker follows the Merge tab's moves) is
        # laid out at a default width; a resize once the tab shows lays it out again at the tab's.
        landscape_tab.select(None, None, None, js=RELAYOUT_JS)
    with gr.Tab("Trajectories", id="trajectories"):
        chosen = gr.CheckboxGroup(lc.path_choices(), value=lc.path_choices()[:2], label="trajectories")
        with gr.Row():
            t_metric = gr.Radio(["accuracy", "loss"], value="accuracy", label="metric")
            t_split = gr.Dropdown(["probe", "live", "val", "test"], value="live", label="split")
            t_task = gr.Dropdown(["all tasks (mean)"] + tasks, value="all tasks (mean)", label="of")
        t_btn = gr.Button("Evaluate along trajectories")
        t_plot = gr.Plot(elem_id="trajectories-plot")
        t_btn.click(batch(lc.curves), [chosen, t_metric, t_split, t_task, *inputs], t_plot, **BATCH_EVENT,
                    api_visibility="private")
    return state, plot
