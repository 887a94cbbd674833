"""Planes, surfaces and trajectories."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import base_and_experts, write_pool

import merger
from merger.errors import CheckpointError, MergerError
from merger.io.checkpoints import save_safetensors
from merger.landscape import trajectories
from merger.landscape.surface import pca_plane, task_vector_plane, three_point_plane


@pytest.fixture(scope="module")
def land(tmp_path_factory):
    path = write_pool(tmp_path_factory.mktemp("landpool"), n_experts=3, scale=0.2, demo_data=True)
    pool = merger.open_pool(path)
    return merger.PoolSession(pool).landscape


def test_pca_plane_of_three_points_contains_them(land):
    pts = land.named_points(["base", land.pool.tasks[0], land.pool.tasks[1]])
    plane = pca_plane(pts)
    assert torch.allclose(plane.dirs @ plane.dirs.T, torch.eye(2), atol=1e-5)
    for v in pts.values():
        x, y, off = plane.coords(v)
        assert off == pytest.approx(0.0, abs=1e-3 * float(v.norm()) / 1e3 + 1e-3)
        assert torch.allclose(plane.point(x, y), v, atol=1e-4)


def test_pca_directions_are_the_principal_directions(land):
    pts = land.named_points(["base", "experts"])
    plane = pca_plane(pts)
    x = torch.stack(list(pts.values())).double()
    xc = x - x.mean(0)
    # the top right-singular vectors of the centred points span the same plane
    _, _, vh = torch.linalg.svd(xc, full_matrices=False)
    proj = plane.dirs.double() @ vh[:2].T
    assert torch.allclose(proj.abs().det().abs(), torch.tensor(1.0, dtype=torch.float64), atol=1e-4)


def test_value_at_a_grid_point_equals_evaluate(land):
    pts = land.named_points(["base", "experts"])
    plane = pca_plane(pts)
    surface = land.surface(plane, (-1.0, 1.0, -2.0, 2.0), 3)
    x, y = surface.xs[2], surface.ys[0]
    weights = land.space.unflatten(plane.point(x, y))
    full = dict(land.pool.base)
    full.update(weights)
    res = merger.evaluate(land.pool, full, split="probe")
    for t in land.pool.tasks:
        assert surface.accuracy[t][0][2] == pytest.approx(res.accuracy[t], abs=1e-6)
        assert surface.loss[t][0][2] == pytest.approx(res.loss[t], rel=1e-5)
    mean = surface.values("loss")[0][2]
    assert mean == pytest.approx(res.average_loss, rel=1e-5)


def test_repeated_requests_hit_the_cache_and_coarse_points_are_reused(land):
    pts = land.named_points(["base", "experts"])
    plane = pca_plane(pts)
    extent = (-3.0, 3.0, -3.0, 3.0)
    coarse, fine = list(land.progressive(plane, extent, 11))
    assert len(coarse.xs) == 6 and len(fine.xs) == 11  # (11 - 1) is a multiple of (6 - 1)
    n = land.cached_points()
    again = land.surface(plane, extent, 11)
    assert land.cached_points() == n and again.loss == fine.loss
    assert coarse.loss[land.pool.tasks[0]][0][1] == fine.loss[land.pool.tasks[0]][0][2]


def test_task_vector_and_three_point_planes(land):
    base = land.base_point()
    a, b = land.pool.tasks[:2]
    plane = task_vector_plane(base, land.expert_point(a) - base, land.expert_point(b) - base, (a, b))
    assert plane.coords(base) == pytest.approx((0.0, 0.0, 0.0), abs=1e-4)
    assert plane.coords(land.expert_point(a))[2] == pytest.approx(0.0, abs=1e-3)
    p = three_point_plane(base, land.expert_point(a), land.expert_point(b))
    assert p.coords(land.expert_point(b))[2] == pytest.approx(0.0, abs=1e-3)


def test_trajectory_projection_matches_each_checkpoint(land, tmp_path):
    tv = land.pool.task_vectors
    for epoch, frac in enumerate((0.25, 0.5, 1.0), start=1):
        sd = {k: tv.base[k] + frac * tv.stacked[k][0] for k in tv.keys}
        save_safetensors(sd, tmp_path / f"epoch_{epoch:03d}.safetensors")
    (tmp_path / "epoch_010.safetensors").write_bytes((tmp_path / "epoch_003.safetensors").read_bytes())
    traj = trajectories.load_folder(land, tmp_path, "ft")
    assert traj.steps == [0, 1, 2, 3, 10]  # sorted by step number, not by name
    plane = pca_plane(land.named_points(["base", "experts"]))
    xs, ys, offs = trajectories.project(plane, traj)
    for i, f in enumerate(["epoch_001", "epoch_002", "epoch_003"], start=1):
        own = plane.coords(land.file_point(str(tmp_path / f"{f}.safetensors")))
        assert (xs[i], ys[i], offs[i]) == pytest.approx(own, abs=1e-4)
    curves = trajectories.evaluate_along(land, traj)
    assert len(curves["accuracy"]) == 5


def test_parameter_paths(land):
    traj = trajectories.parameter_path(land, "cart", "rank_ratio", [0.1, 1.0], {"lam": 1.5})
    wa = land.spec_point(land.session.spec("weight_averaging"))
    assert torch.allclose(traj.points[1], wa, atol=1e-5)  # full rank: the weight average
    lam_path = trajectories.parameter_path(land, "task_arithmetic", "lam", [0.0, 0.5])
    assert torch.allclose(lam_path.points[0], land.base_point())


@pytest.mark.parametrize("names", [["base", "base", "base"], ["base"], ["base", "task_arithmetic:lam=0.5"]])
def test_pca_needs_three_distinct_points(land, names):
    pts = land.named_points(names)
    with pytest.raises(MergerError, match="at least three distinct points"):
        pca_plane(pts)


def test_a_point_that_names_nothing_and_a_repeated_point_are_refused_by_name(land):
    from merger.landscape.figure import make_plane

    task = land.pool.tasks[0]
    with pytest.raises(MergerError, match=f"landscape point 'nosuchtask': not a task or a method: 'nosuchtask'; "
                                          f"a point is base, a task \\({task}, "):
        land.named_points(["base", "nosuchtask", task])
    typo = task[:-1] + "x" + task[-1]  # one letter in: the task is suggested
    with pytest.raises(MergerError, match=f"landscape point '{typo}': .*; did you mean '{task}'\\? A point is base"):
        land.named_points(["base", typo, task])
    with pytest.raises(MergerError, match="landscape point 'tiess:lam=0.3': not a task, and no method is called "
                                          "'tiess'; did you mean 'ties:lam=0.3'\\?"):
        land.named_points(["base", "tiess:lam=0.3", task])
    from merger.landscape.trajectories import finetune_trajectory

    with pytest.raises(MergerError, match=f"path 'nope': not an expert of the pool \\({task}, .*METHOD@lam"):
        finetune_trajectory(land, "nope")
    with pytest.raises(MergerError, match=f"exactly three different points \\(got 2: base, {task}\\)"):
        make_plane(land, "points", land.named_points(["base", task, task]))


def test_points_and_paths_named_past_the_bound_are_refused_before_any_is_merged(land, monkeypatch):
    from merger.landscape.figure import resolve_paths
    from merger.landscape.surface import MAX_NAMED

    merged = []
    monkeypatch.setattr(type(land), "spec_point", lambda self, spec: merged.append(spec))
    many = [f"task_arithmetic:lam={i / 1000}" for i in range(MAX_NAMED + 1)]
    with pytest.raises(MergerError, match=f"landscape points: {MAX_NAMED + 1} named; at most {MAX_NAMED} "):
        land.named_points(many + ["", " "])  # blanks are not points
    with pytest.raises(MergerError, match=f"landscape paths: {MAX_NAMED + 1} named; at most {MAX_NAMED} "):
        resolve_paths(land, [land.pool.tasks[0]] * (MAX_NAMED + 1))
    assert merged == []


def test_collinear_points_are_refused(land):
    pts = land.named_points(["base", "ta:lam=0.5", "ta:lam=1.0"])
    with pytest.raises(MergerError, match="at least three distinct points"):
        pca_plane(pts)


def test_grid_beyond_bound(land):
    plane = pca_plane(land.named_points(["base", "experts"]))
    with pytest.raises(MergerError, match="grid 500×500 is out of bounds"):
        land.surface(plane, (-1, 1, -1, 1), 500)


def test_point_from_another_architecture(land, tmp_path):
    from helpers import TINY_CONFIG  # 16-pixel images: different positional embedding shape

    base, experts = base_and_experts(1, config=TINY_CONFIG)
    save_safetensors(experts[0], tmp_path / "other.safetensors")
    with pytest.raises(CheckpointError, match="other.safetensors: does not match the base: mis-shaped"):
        land.named_points([f"file:{tmp_path / 'other.safetensors'}"])


def test_a_file_point_is_relative_to_the_pool_in_the_app_and_to_the_working_folder_on_the_command_line(
        land, tmp_path):
    """`merge --out merged.safetensors`, then `landscape --points file:merged.safetensors` in the same
    folder: the file was looked for beside the pool's YAML ("file not found")."""
    merged = merger.merge(land.pool, "task_arithmetic", lam=0.3)
    save_safetensors(merged, tmp_path / "merged.safetensors")
    with pytest.raises(CheckpointError, match="merged.safetensors: file not found"):
        land.named_points(["file:merged.safetensors"])  # the app: beside the pool
    point = land.named_points(["file:merged.safetensors"], files_relative_to=tmp_path)["merged.safetensors"]
    with pytest.raises(MergerError, match="expected a file path"):  # not the working folder itself
        land.named_points(["file:"], files_relative_to=tmp_path)
    (computed,) = land.named_points(["ta:lam=0.3"]).values()
    assert torch.allclose(point, computed, atol=1e-6)
    res = subprocess.run([sys.executable, "-m", "merger", "landscape", "--pool", str(Path(land.pool.source).resolve()),
                          "--points", "base,experts,file:merged.safetensors", "--grid", "3", "--out", "ls.html"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(Path(merger.__file__).parents[1])})
    assert res.returncode == 0, res.stderr
    assert "merged.safetensors" in json.loads((tmp_path / "ls.json").read_text())["points"]


def test_empty_trajectory_folder(land, tmp_path):
    with pytest.raises(MergerError, match="no checkpoints in this trajectory folder"):
        trajectories.load_folder(land, tmp_path, "empty")
    with pytest.raises(MergerError, match="has no trajectory"):
        trajectories.finetune_trajectory(land, land.pool.tasks[0])


def test_cli_writes_html_and_grid(land, tmp_path):
    out = tmp_path / "ls.html"
    res = subprocess.run([sys.executable, "-m", "merger", "landscape", "--pool", land.pool.source, "--plane", "pca",
                          "--points", "base,experts,ta:lam=0.3", "--grid", "5", "--metric", "loss",
                          "--paths", "ta@lam", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "plotly" in out.read_text()[:5_000_000].lower()
    grid = json.loads(out.with_suffix(".json").read_text())
    assert len(grid["x"]) == 5 and len(grid["loss"][land.pool.tasks[0]]) == 5
    assert grid["points"]["base"]["off_plane"] >= 0


def test_off_plane_distance_of_a_known_point(land):
    base = land.base_point()
    a, b = land.pool.tasks[:2]
    plane = task_vector_plane(base, land.expert_point(a) - base, land.expert_point(b) - base, (a, b))
    g = torch.Generator().manual_seed(5)
    n = torch.randn(base.shape, generator=g)
    n -= plane.dirs.T @ (plane.dirs @ n)  # orthogonal to the plane
    n /= n.norm()
    x, y, off = plane.coords(base + 0.7 * plane.dirs[0] - 0.2 * plane.dirs[1] + 3.0 * n)
    assert (x, y, off) == pytest.approx((0.7, -0.2, 3.0), abs=1e-3)


def test_3d_markers_sit_at_their_own_measured_value(land):
    from merger.landscape.figure import landscape_figure

    pool = land.pool
    pts = land.named_points(["base", "experts"])
    plane = pca_plane(pts)
    surface = land.surface(plane, (-1.0, 1.0, -1.0, 1.0), 3)
    spec = land.session.spec("task_arithmetic", lam=0.4)
    live = land.session.preview(spec, "probe")
    x, y, off = plane.coords(land.spec_point(spec))
    fig = landscape_figure(land, plane, surface, "loss", None, pts, [], "surface", ("ta", x, y, off),
                           (live.accuracy, live.loss))
    markers = {t.name: t.z[0] for t in fig.data if t.type == "scatter3d"}
    for label, vec in pts.items():
        res = merger.evaluate(pool, {**pool.base, **land.space.unflatten(vec)}, "probe")
        assert markers[label] == pytest.approx(res.average_loss, rel=1e-5)
    assert markers["live merge"] == pytest.approx(
        merger.evaluate(pool, merger.merge(pool, "task_arithmetic", lam=0.4), "probe").average_loss, rel=1e-5)
    acc = landscape_figure(land, plane, surface, "accuracy", pool.tasks[0], pts, [], "surface")
    base_res = merger.evaluate(pool, pool.base, "probe")
    assert {t.name: t.z[0] for t in acc.data if t.type == "scatter3d"}["base"] == pytest.approx(
        100 * base_res.accuracy[pool.tasks[0]])


def test_a_live_merge_outside_the_computed_grid_says_so(land):
    """The live marker beyond the grid sat on no measured surface, and nothing said it."""
    from merger.landscape.figure import landscape_figure

    pts = land.named_points(["base", "experts"])
    plane = pca_plane(pts)
    surface = land.surface(plane, (-1.0, 1.0, -1.0, 1.0), 3)
    inside = landscape_figure(land, plane, surface, "loss", None, pts, [], "contour", ("ta", 0.5, -0.5, 0.0))
    outside = landscape_figure(land, plane, surface, "loss", None, pts, [], "contour", ("ta", 1.5, 0.0, 0.0))
    assert "outside the computed grid" not in inside.layout.title.text
    assert "the live merge (★) lies outside the computed grid" in outside.layout.title.text


def _label_boxes(points, positions, px):
    """The pixel boxes of the markers and of the names at ``positions`` (plot_labels' geometry)."""
    from merger.plot_labels import CHAR_PX, LINE_PX, MARKER_PX, POSITIONS

    r, markers, names = MARKER_PX / 2, [], []
    for (label, x, y), pos in zip(points, positions):
        cx, cy = x * px, y * px
        markers.append((cx - r, cy - r, cx + r, cy + r))
        w, h = CHAR_PX * len(label) / 2, LINE_PX / 2
        dx, dy = POSITIONS[pos]
        nx, ny = cx + dx * (w + r), cy + dy * (h + r)
        names.append((nx - w, ny - h, nx + w, ny + h))
    return markers, names


def test_point_names_hide_neither_each_other_nor_a_marker():
    """The demo's base and experts sit close on a PCA plane: their names overlapped and hid the base."""
    from merger.plot_labels import _overlap, place_labels

    points = [("base", 0.0, 0.0), ("dots", 0.02, 0.0), ("size", 0.0, 0.02), ("shape", 0.02, 0.02),
              ("task_arithmetic(lam=0.3)", 0.01, -0.01)]
    px = 560 / 0.5  # a grid half a unit wide on a 560-pixel plot
    everything_on_top = ["top center"] * len(points)
    markers, names = _label_boxes(points, everything_on_top, px)
    assert any(_overlap(a, b) for i, a in enumerate(names) for b in names[i + 1:])  # the old placement
    positions = place_labels(points, px, ["top center"] * 4 + ["bottom center"])
    markers, names = _label_boxes(points, positions, px)
    assert not any(_overlap(a, b) for i, a in enumerate(names) for b in names[i + 1:])
    assert not any(_overlap(name, marker) for name in names for marker in markers)
    assert place_labels([("base", 0.0, 0.0), ("dots", 1.0, 1.0)], px, ["top center", "bottom center"]) == [
        "top center", "bottom center"]  # the first choice wherever it is free


def test_a_long_plane_name_is_wrapped_between_words_never_cut(land):
    from merger.landscape.figure import landscape_figure

    pts = land.named_points(["base", "experts"])
    plane = pca_plane(pts, label="PCA of " + ", ".join(f"task_arithmetic(lam=0.{i})" for i in range(1, 10)))
    surface = land.surface(plane, (-1.0, 1.0, -1.0, 1.0), 3)
    for view in ("contour", "surface"):
        fig = landscape_figure(land, plane, surface, "loss", None, pts, [], view)
        title = fig.layout.title.text
        assert "task_ari…" not in title and title.count("<br>") >= 2
        whole = set(plane.label.replace(",", " ").split()) | {"mean", "loss", "on", "(probe", "split)", "…",
                                                              "more", "words)"}
        assert all(w.rstrip(",") in whole or w.strip("()").isdigit()
                   for w in title.replace("<br>", " ").split()), title
        assert fig.layout.margin.t >= 24 + 22 * (title.count("<br>") + 1)
