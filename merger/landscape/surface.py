"""Planes in weight space and loss/accuracy surfaces on them.

A plane is an origin and two orthonormal directions over the merged weights (flattened). PCA
planes come from the small Gram matrix of the centred points (n × n, never parameters ×
parameters). Every grid point is written in place into the resident model and forwarded on a
small probe split; values are cached per (plane, point, split), so refining a coarse grid reuses
what it already computed, and a slider move only projects the live merge onto the plane.
"""
from __future__ import annotations

import difflib
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import torch

from merger import longsum, methods
from merger.errors import Cancelled, MergerError
from merger.io import checkpoints
from merger.spec import assignments as parse_assignments

MAX_GRID = 61
MAX_NAMED = 64  # points or paths named in one landscape: each is a merge (a path, several) to compute
COARSE = 7


def check_named(what: str, names: Sequence[str]) -> None:
    """Refuse more than MAX_NAMED landscape points or paths, before any is computed."""
    named = [n for n in names if str(n).strip()]
    if len(named) > MAX_NAMED:
        raise MergerError(f"landscape {what}: {len(named)} named; at most {MAX_NAMED} (each is a merge to compute)")


class WeightSpace:
    """Flatten / unflatten the merged keys of a pool (fp32, on the pool's device)."""

    def __init__(self, task_vectors):
        self.keys = list(task_vectors.keys)
        self.shapes = [task_vectors.base[k].shape for k in self.keys]
        self.sizes = [task_vectors.base[k].numel() for k in self.keys]
        self.device = task_vectors.device

    @property
    def dim(self) -> int:
        return sum(self.sizes)

    def flatten(self, weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([weights[k].reshape(-1).to(self.device, torch.float32) for k in self.keys])

    def unflatten(self, vec: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views into ``vec`` (no copy)."""
        return {k: v.view(s) for k, v, s in zip(self.keys, vec.split(self.sizes), self.shapes)}


@dataclass
class Plane:
    kind: str
    label: str
    origin: torch.Tensor  # [P]
    dirs: torch.Tensor  # [2, P], orthonormal rows

    @property
    def key(self) -> str:
        h = hashlib.sha1(self.label.encode())
        h.update(self.dirs[:, :: max(1, self.dirs.shape[1] // 4096)].cpu().numpy().tobytes())
        return f"{self.kind}:{h.hexdigest()[:16]}"

    def coords(self, vec: torch.Tensor) -> tuple[float, float, float]:
        """(x, y, off-plane distance) of a point; the sums over every weight in fp64 (``longsum``: in fp32
        an expert that spans the plane was 0.05 off it on a ViT-B/32)."""
        d = vec - self.origin
        x, y = longsum.inner(self.dirs[0], d), longsum.inner(self.dirs[1], d)
        return x, y, longsum.norm(d.sub_(self.dirs[0], alpha=x).sub_(self.dirs[1], alpha=y))

    def point(self, x: float, y: float, out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.add(self.origin, self.dirs[0], alpha=x, out=out)
        return out.add_(self.dirs[1], alpha=y)


def pca_plane(points: Mapping[str, torch.Tensor], label: str | None = None) -> Plane:
    """Origin = mean of the points, directions = their top two principal directions."""
    names = list(points)
    x = torch.stack([points[n] for n in names])
    origin = x.mean(0)
    xc = x - origin
    gram = longsum.gram(xc)
    evals, evecs = torch.linalg.eigh(gram)
    evals, evecs = evals.flip(0), evecs.flip(1)
    scale = float(evals[0]) if len(evals) else 0.0
    if len(names) < 3 or scale <= 0 or float(evals[1]) <= 1e-10 * scale:
        raise MergerError(
            f"PCA plane needs at least three distinct points that do not lie on one line (got {len(names)}: "
            f"{', '.join(names)})")
    dirs = (evecs[:, :2].T.to(xc.dtype) @ xc) / evals[:2].sqrt().to(xc.dtype)[:, None]  # sums over the points only
    return Plane("pca", label or "PCA of " + ", ".join(names), origin, _orthonormal(dirs))


def _orthonormal(dirs: torch.Tensor) -> torch.Tensor:
    u1 = dirs[0] / longsum.norm(dirs[0])
    v = dirs[1] - longsum.inner(dirs[1], u1) * u1
    return torch.stack([u1, v / longsum.norm(v)])


def directions_plane(origin: torch.Tensor, a: torch.Tensor, b: torch.Tensor, kind: str, label: str) -> Plane:
    na = longsum.norm(a)
    if na == 0:
        raise MergerError(f"{label}: the first direction is zero")
    v = b - longsum.inner(b, a) / na**2 * a
    if longsum.norm(v) <= 1e-6 * (longsum.norm(b) + 1e-30):
        raise MergerError(f"{label}: the two directions are parallel, they do not span a plane")
    return Plane(kind, label, origin, _orthonormal(torch.stack([a, b])))


def task_vector_plane(base: torch.Tensor, tau_a: torch.Tensor, tau_b: torch.Tensor, names=("a", "b")) -> Plane:
    """Through the base along two task vectors (orthonormalised)."""
    return directions_plane(base, tau_a, tau_b, "tasks", f"base + span(τ {names[0]}, τ {names[1]})")


def three_point_plane(p0: torch.Tensor, p1: torch.Tensor, p2: torch.Tensor, names=("p0", "p1", "p2")) -> Plane:
    return directions_plane(p0, p1 - p0, p2 - p0, "points", "plane through " + ", ".join(names))


@dataclass
class Surface:
    plane_key: str
    xs: list[float]
    ys: list[float]
    loss: dict[str, list[list[float]]]  # task -> [len(ys)][len(xs)]
    accuracy: dict[str, list[list[float]]]
    split: str

    @staticmethod
    def metric_of(values: tuple[dict, dict], metric: str, task: str | None = None) -> float:
        """One number from (accuracy, loss) per task: a task's, or the mean over tasks."""
        table = values[0] if metric == "accuracy" else values[1]
        if task is not None:
            return table[task]
        return sum(table.values()) / len(table)

    def values(self, metric: str, task: str | None = None) -> list[list[float]]:
        """metric 'loss' or 'accuracy'; task None = the average over tasks."""
        table = self.loss if metric == "loss" else self.accuracy
        if task is not None:
            if task not in table:
                raise MergerError(f"landscape: unknown task '{task}'")
            return table[task]
        tasks = list(table)
        return [[sum(table[t][i][j] for t in tasks) / len(tasks) for j in range(len(self.xs))]
                for i in range(len(self.ys))]

    def to_dict(self) -> dict:
        return {"plane": self.plane_key, "split": self.split, "x": self.xs, "y": self.ys,
                "loss": self.loss, "accuracy": self.accuracy}


def coarse_size(n: int) -> int:
    """A coarse grid (about COARSE per side) whose points are all points of the n-grid."""
    for c in range(COARSE, 4, -1):
        if (n - 1) % (c - 1) == 0:
            return c
    return COARSE


def grid_axis(lo: float, hi: float, n: int) -> list[float]:
    return [round(lo + (hi - lo) * i / (n - 1), 10) for i in range(n)]


def extent_of(coords: Sequence[tuple[float, float]], margin: float = 0.3) -> tuple[float, float, float, float]:
    xs, ys = [c[0] for c in coords], [c[1] for c in coords]
    w, h = max(xs) - min(xs), max(ys) - min(ys)
    w, h = w or max(h, 1e-3), h or max(w, 1e-3)
    return (min(xs) - margin * w, max(xs) + margin * w, min(ys) - margin * h, max(ys) + margin * h)


class Landscape:
    """Planes and surfaces over one pool session (its queue, its caches of values)."""

    def __init__(self, session):
        self.session = session
        self.pool = session.pool
        self.space = WeightSpace(self.pool.task_vectors)

    # ---- points -----------------------------------------------------------------------
    def base_point(self) -> torch.Tensor:
        return self.space.flatten(self.pool.task_vectors.base)

    def expert_point(self, task: str) -> torch.Tensor:
        tv = self.pool.task_vectors
        if task not in tv.tasks:
            raise MergerError(f"landscape: unknown expert '{task}'; known: {', '.join(tv.tasks)}")
        return self.space.flatten(tv.expert(tv.tasks.index(task)))

    def spec_point(self, spec) -> torch.Tensor:
        delta = self.session.delta(spec)
        base = self.pool.task_vectors.base
        return self.space.flatten({k: base[k] + delta[k] for k in self.space.keys})

    def file_point(self, path: str, relative_to: Path | None = None) -> torch.Tensor:
        """A checkpoint from disk: checked against this pool's base (architecture, keys, shapes); a
        Hugging Face CLIPVisionModel's visual.proj from the base, as a pool's expert. A relative path
        is the pool's folder's (the app's), or ``relative_to``'s (the command line's working folder)."""
        if relative_to is not None and path.strip() and not Path(path).expanduser().is_absolute():
            path = str(relative_to / path)
        path = self.pool.resolve(path, "landscape point")
        sd, form = checkpoints.load_weights(path)
        fill = ("visual.proj",) if form == "hf_clip_vision" else ()
        return self.space.flatten(checkpoints.validate_expert(sd, self.pool.base, str(path), fill))

    def named_points(self, names: Sequence[str], files_relative_to: Path | None = None,
                     runs: bool = True) -> dict[str, torch.Tensor]:
        """'base', 'experts', a task name, 'file:PATH', or 'METHOD:param=value:...' (ta = task_arithmetic);
        a relative PATH as ``file_point``'s. ``runs``: a data-driven method's point may run it (the
        CLI); else only its cached run is taken (the app: never a run unseen, without progress)."""
        check_named("points", names)
        out: dict[str, torch.Tensor] = {}
        for raw in names:
            name = raw.strip()
            if not name:
                continue
            if name == "base":
                out["base"] = self.base_point()
            elif name == "experts":
                for t in self.pool.tasks:
                    out[t] = self.expert_point(t)
            elif name in self.pool.experts:
                out[name] = self.expert_point(name)
            elif name.startswith("file:"):
                out[name[5:]] = self.file_point(name[5:], files_relative_to)
            else:
                method, *assignments = name.split(":")
                try:
                    methods.get(method)
                except MergerError:
                    near = (difflib.get_close_matches(name, ["base", *self.pool.experts], n=1, cutoff=0.6)
                            or [f"{n}:{':'.join(assignments)}" if assignments else n for n in
                                difflib.get_close_matches(method, methods.names(), n=1, cutoff=0.6)])
                    what = "not a task, and no method is called" if assignments else "not a task or a method:"
                    raise MergerError(f"landscape point '{name}': {what} '{method}'; "
                                      + (f"did you mean '{near[0]}'? A" if near else "a")
                                      + f" point is base, a task ({', '.join(self.pool.tasks)}), file:PATH, or a "
                                      f"method as METHOD:param=value (e.g. ties:lam=0.5)") from None
                spec = self.pool.make_spec(method, parse_assignments(assignments, f"landscape point '{name}'"))
                if not runs and methods.get(spec.method).data_driven and self.session.cached_run(spec) is None:
                    raise MergerError(f"landscape point '{name}': no {methods.get(spec.method).display_name} run for "
                                      "these settings yet; set them in the Merge tab and press Run first")
                out[spec.label()] = self.spec_point(spec)
        return out

    # ---- surfaces ---------------------------------------------------------------------
    def point_values(self, vec: torch.Tensor, split: str = "probe") -> tuple[dict, dict]:
        """(accuracy, loss) per task at a point itself (one forward; cached by the session)."""
        return self.session.values_at_point(vec, split)

    def surface(self, plane: Plane, extent: Sequence[float], n: int, split: str = "probe", progress=None,
                cluster=None, cancel=None) -> Surface:
        """Loss and accuracy per task over an n × n grid of the plane: here, or row by row on a
        cluster's workers (``merger.cluster.Cluster``). ``cancel()`` is asked before each row here
        (Cancelled: the points computed stay cached, so a Compute again starts where it stopped)."""
        if not 2 <= int(n) <= MAX_GRID:
            raise MergerError(f"landscape grid {n}×{n} is out of bounds (2 to {MAX_GRID} per side)")
        n = int(n)
        xs, ys = grid_axis(extent[0], extent[1], n), grid_axis(extent[2], extent[3], n)
        tasks = self.pool.tasks
        loss = {t: [[0.0] * n for _ in range(n)] for t in tasks}
        acc = {t: [[0.0] * n for _ in range(n)] for t in tasks}
        if cluster is not None:
            done = []

            def row(i, values):
                if cancel is not None and cancel():  # raised here, the rows not yet answered are cancelled
                    raise Cancelled(f"landscape cancelled after {len(done)} of {n} rows (on the workers)")
                for j, (a, lo) in enumerate(values):
                    for t in tasks:
                        acc[t][i][j], loss[t][i][j] = a[t], lo[t]
                done.append(i)
                if progress:
                    progress(len(done) / n, f"row {len(done)}/{n}")

            cluster.plane_rows(plane, xs, ys, split, row)
            return Surface(plane.key, xs, ys, loss, acc, split)
        with self.session.batch(chunks=n * n):  # one chunk per grid point: previews waiting go first
            for i, y in enumerate(ys):
                if cancel is not None and cancel():
                    raise Cancelled(f"landscape cancelled at row {i + 1} of {n}; the points computed are cached (a "
                                    "Compute again goes on from there)")
                for j, x in enumerate(xs):
                    a, lo = self.session.values_on_plane(plane, x, y, split)
                    for t in tasks:
                        acc[t][i][j], loss[t][i][j] = a[t], lo[t]
                if progress:
                    progress((i + 1) / n, f"row {i + 1}/{n}")
        return Surface(plane.key, xs, ys, loss, acc, split)

    def progressive(self, plane: Plane, extent: Sequence[float], n: int, split: str = "probe",
                    progress=None, cancel=None) -> Iterator[Surface]:
        """A coarse surface first, then the requested resolution (reusing coinciding points). Batch
        work: each grid point is a chunk, and waiting previews go first."""
        if not 2 <= int(n) <= MAX_GRID:
            raise MergerError(f"landscape grid {n}×{n} is out of bounds (2 to {MAX_GRID} per side)")
        if n > COARSE:
            yield self.surface(plane, extent, coarse_size(n), split, cancel=cancel)
        yield self.surface(plane, extent, n, split, progress, cancel=cancel)

    def cached_points(self) -> int:
        return self.session.cached_plane_points()
