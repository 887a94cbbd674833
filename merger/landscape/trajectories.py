"""Trajectories: ordered weight-space points (fine-tuning checkpoints, λ / rank / sparsity paths,
optimiser iterates), loaded or recorded, projected onto planes and evaluated along the way."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from merger import methods
from merger.errors import MergerError
from merger.io import checkpoints
from merger.methods.registry import inside

CHECKPOINT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")


@dataclass
class Trajectory:
    name: str
    kind: str  # finetune | lam | rank_ratio | sparsity | iterates
    steps: list[float]  # the x of its curves: epoch/step or parameter value
    points: list[torch.Tensor] = field(repr=False)  # flattened weights, same order
    labels: list[str] = field(default_factory=list)
    x_title: str = ""  # what its steps count: trajectories of different x titles are drawn on separate axes

    def __post_init__(self):
        if not self.points:
            raise MergerError(f"trajectory {self.name}: no points")
        if not self.labels:
            self.labels = [f"{self.kind}={s:g}" for s in self.steps]
        if not self.x_title:
            self.x_title = X_TITLES.get(self.kind, self.kind)


# A parameter path's x is the parameter's value; a run's, its iteration.
X_TITLES = {"finetune": "fine-tuning step (the number in each checkpoint's name)", "lam": "λ",
            "rank_ratio": "rank ratio", "sparsity": "sparsity", "iterates": "iteration"}


def _step_of(path: Path) -> int:
    numbers = re.findall(r"\d+", path.stem)
    return int(numbers[-1]) if numbers else -1


def checkpoint_files(folder: str | Path) -> list[Path]:
    """Checkpoint files of a folder, sorted by the last number in their names (the step)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise MergerError(f"{folder}: trajectory folder not found")
    files = [p for p in folder.iterdir() if p.suffix.lower() in CHECKPOINT_SUFFIXES]
    if not files:
        raise MergerError(f"{folder}: no checkpoints in this trajectory folder "
                          f"(expected files ending in {', '.join(CHECKPOINT_SUFFIXES)})")
    return sorted(files, key=lambda p: (_step_of(p), p.name))


def load_folder(landscape, folder: str | Path, name: str, start_at_base: bool = True) -> Trajectory:
    """A folder of checkpoints (one expert's fine-tuning), each checked against the pool's base."""
    folder = landscape.pool.resolve(folder, f"trajectory {name}")
    files = checkpoint_files(folder)
    points, steps, labels = [], [], []
    if start_at_base:
        points.append(landscape.base_point())
        steps.append(0)
        labels.append("base")
    for f in files:
        sd = checkpoints.validate_expert(checkpoints.load_state_dict(f), landscape.pool.base, str(f))
        points.append(landscape.space.flatten(sd))
        steps.append(_step_of(f))
        labels.append(f.stem)
    return Trajectory(name, "finetune", steps, points, labels)


def has_trajectory(pool, expert: str) -> bool:
    """The expert's fine-tuning path is known: checkpoints on disk, or kept by the expert lab."""
    info = pool.expert_info.get(expert) or {}
    return bool(info.get("trajectory") or info.get("lab_trajectory"))


def finetune_trajectory(landscape, task: str) -> Trajectory:
    info = landscape.pool.expert_info.get(task)
    if info is None:
        raise MergerError(f"path '{task}': not an expert of the pool ({', '.join(landscape.pool.experts)}) "
                          "nor METHOD@lam|rank_ratio|sparsity")
    if info.get("lab_trajectory"):  # fine-tuned in the expert lab: checkpoints kept in memory
        base = landscape.pool.task_vectors.base
        points = [landscape.base_point()] + [landscape.space.flatten({k: sd[k] for k in base}) for sd in info["lab_trajectory"]]
        return Trajectory(f"fine-tuning {task}", "finetune", list(range(len(points))), points,
                          ["base"] + [f"epoch {i}" for i in range(1, len(points))], x_title="epoch")
    if not info.get("trajectory"):
        raise MergerError(f"expert '{task}' has no trajectory (experts.{task}.trajectory in {landscape.pool.source})")
    try:
        return load_folder(landscape, info["trajectory"], f"fine-tuning {task}")
    except MergerError as exc:
        raise type(exc)(f"{landscape.pool.source}: experts.{task}.trajectory: {exc}") from None


def parameter_path(landscape, method: str, axis: str, values: Sequence[float], fixed: dict | None = None,
                   experts=None, task_weights=None, block_weights=None) -> Trajectory:
    """Merged points as one parameter sweeps (λ path, CART's rank path, TIES/DARE sparsity path),
    over ``experts`` (None: the pool's own) with their per-task and per-block weights."""
    m = methods.get(method)
    if axis not in m.param_names:
        raise MergerError(f"{m.name} has no parameter {axis}")
    points, steps = [], []
    bounds = m.bounds(axis, len(experts) if experts else len(landscape.pool.tasks))
    for v in [v for v in values if inside(v, bounds)]:  # TSV-M's rank path stops at 1/T
        params = dict(fixed or {})
        params[axis] = v
        spec = landscape.pool.make_spec(m.name, params, experts, task_weights, block_weights)
        points.append(landscape.spec_point(spec))
        steps.append(float(v))
    return Trajectory(f"{m.name} {axis} path", axis, steps, points)


def run_path(landscape, run) -> Trajectory:
    """The iterates of a data-driven run (AdaMerging steps, FW iterations) as a trajectory."""
    if not run.iterates:
        raise MergerError(f"{run.method} has no iterates: it computes its merge in one solve, there is no path to draw")
    base = landscape.pool.task_vectors.base
    points = [landscape.space.flatten({k: base[k] + d[k] for k in landscape.space.keys})
              for d in run.iterate_deltas(base)]
    kind = methods.get(run.method).iterate
    return Trajectory(f"{run.method} iterates", "iterates", list(range(len(points))), points,
                      [f"{kind} {i}" for i in range(len(points))], x_title=f"{kind} (iteration)")


# Path points per axis: fewer than a sweep's (each point is a forward per plane cell it lands on).
PATH_VALUES = {"lam": [round(0.1 * i, 2) for i in range(0, 16)],
               "rank_ratio": [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.5, 0.75, 1.0],
               "sparsity": [0.0, 0.2, 0.4, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99]}


def default_values(axis: str) -> list[float]:
    """The points of a parameter path; a parameter without its own list takes its sweep values."""
    if axis in PATH_VALUES:
        return PATH_VALUES[axis]
    takers = methods.registry.with_param(axis)
    if not takers or not takers[0].param(axis).sweep:
        raise MergerError(f"no method has a parameter {axis} to draw a path along")
    return list(takers[0].param(axis).sweep)


def project(plane, trajectory: Trajectory) -> tuple[list[float], list[float], list[float]]:
    xs, ys, offs = [], [], []
    for p in trajectory.points:
        x, y, o = plane.coords(p)
        xs.append(x)
        ys.append(y)
        offs.append(o)
    return xs, ys, offs


def evaluate_along(landscape, trajectory: Trajectory, split: str = "live") -> dict:
    """Accuracy and loss at every point of the trajectory: the mean over tasks and per task."""
    acc, loss, per_task = [], [], {}
    for p in trajectory.points:
        a, lo = landscape.point_values(p, split)
        acc.append(sum(a.values()) / len(a))
        loss.append(sum(lo.values()) / len(lo))
        for t in a:
            per_task.setdefault(t, {"accuracy": [], "loss": []})
            per_task[t]["accuracy"].append(a[t])
            per_task[t]["loss"].append(lo[t])
    return {"steps": trajectory.steps, "x_title": trajectory.x_title, "accuracy": acc, "loss": loss,
            "per_task": per_task}
