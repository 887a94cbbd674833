"""The expert lab (demo world): fine-tune new experts from the demo base with chosen settings,
add them to the pool under a name, and the scaling view across expert sets."""
from __future__ import annotations

import math
import re
from typing import Sequence

import torch

from .errors import MergerError
from .task_vectors import TaskVectors

LIMITS = {"lr": (0.0, 1.0), "epochs": (1, 100), "batch_size": (1, 4096), "data_fraction": (0.0, 1.0)}
ONE_EPOCH = {"epochs": 1}


def check_settings(lr, epochs, batch_size, data_fraction, seed) -> dict:
    """Refuse out-of-range settings, naming the field."""
    def num(name, v, kind=float):
        try:
            x = kind(v)
        except (TypeError, ValueError):
            raise MergerError(f"lab: {name}={v!r} is not a number") from None
        if kind is int and float(v) != x:
            raise MergerError(f"lab: {name}={v!r} must be a whole number")
        return x

    lr, epochs, batch_size = num("lr", lr), num("epochs", epochs, int), num("batch_size", batch_size, int)
    data_fraction, seed = num("data_fraction", data_fraction), num("seed", seed, int)
    if not (lr > 0 and math.isfinite(lr)) or lr > LIMITS["lr"][1]:
        raise MergerError(f"lab: lr={lr} must be > 0 and ≤ {LIMITS['lr'][1]}")
    if not LIMITS["epochs"][0] <= epochs <= LIMITS["epochs"][1]:
        raise MergerError(f"lab: epochs={epochs} must be between 1 and {LIMITS['epochs'][1]}")
    if not LIMITS["batch_size"][0] <= batch_size <= LIMITS["batch_size"][1]:
        raise MergerError(f"lab: batch_size={batch_size} must be between 1 and {LIMITS['batch_size'][1]}")
    if not 0 < data_fraction <= 1:
        raise MergerError(f"lab: data_fraction={data_fraction} must be in (0, 1]")
    return {"lr": lr, "epochs": epochs, "batch_size": batch_size, "data_fraction": data_fraction, "seed": seed}


def _require_demo(pool, task: str) -> dict:
    if pool.tokenizer_name != "demo" or "config" not in pool.architecture:
        raise MergerError("the expert lab fine-tunes in the demo world: open the demo pool (or one built by "
                          "`python -m merger demo build`)")
    info = pool.task_info.get(task) or {}
    data = (info.get("data") or {}).get("demo")
    if not data:
        raise MergerError(f"lab: task '{task}' has no demo-world data to fine-tune on")
    return data


def finetune(pool, task: str, settings: dict, progress=None, cancel=None):
    """(final image-tower weights, per-epoch weights, hparams) of a new expert for ``task``."""
    from .demo import train, world

    data = _require_demo(pool, task)
    base_task = pool.expert_info.get(task, {}).get("lab_task", task)
    if base_task not in world.TASKS:
        raise MergerError(f"lab: '{base_task}' is not a task of the demo world ({', '.join(world.TASKS)})")
    from .data import demo_domain

    fixed = dict(demo_domain(data, base_task))
    images, labels = world.generate(int(data["train"]["n"]), int(data["train"]["seed"]), fixed=fixed)
    return train.finetune_expert(pool.base, base_task, images=images, labels=labels, progress=progress,
                                 cancel=cancel, config=pool.architecture["config"], **settings)


def add_expert(explorer, name: str, like_task: str, weights: dict, hparams: dict | None = None,
               trajectory: Sequence[dict] | None = None) -> None:
    """Add an expert under ``name`` for the data and classes of ``like_task``; caches are reset."""
    pool = explorer.pool
    if not re.fullmatch(r"[A-Za-z0-9_.@\-]{1,40}", name or ""):
        raise MergerError(f"lab: name {name!r}: use 1-40 letters, digits, '_', '-', '.', '@'")
    if name in pool.tasks:
        raise MergerError(f"lab: an expert named '{name}' already exists")
    if like_task not in pool.tasks:
        raise MergerError(f"lab: unknown task '{like_task}'")
    from .checkpoints import validate_expert

    sd = validate_expert(weights, pool.base, f"lab expert '{name}'")
    tv = pool.task_vectors
    with explorer.lock:
        stacked = {k: torch.cat([tv.stacked[k], (sd[k].to(tv.device, torch.float32) - tv.base[k])[None]])
                   for k in tv.keys}
        new = TaskVectors._from_parts(tv.tasks + [name], tv.device, tv.keys, tv.frozen, tv.base, stacked)
        pool.task_vectors = new
        pool.tasks.append(name)
        pool.expert_info[name] = {"path": None, "hparams": dict(hparams or {}), "lab_task": pool.expert_info[like_task].get("lab_task", like_task),
                                  "lab_trajectory": list(trajectory or [])}
        pool.task_info[name] = {**pool.task_info[like_task],
                                "labels_of": pool.task_info[like_task].get("labels_of", like_task)}
        pool._prepared.clear()
        ev = explorer.evaluator
        ev.heads[name] = ev.heads[like_task]
        ev._inputs.clear()
        ev._expert_acc.clear()
        explorer._results.clear()
        explorer._runs.clear()


# ---- scaling view -------------------------------------------------------------------------

TRENDS = {  # the paper's predicted shape of the merged loss in one hyperparameter (seed 000, §V-B)
    "lr": ("a + b·η² (quadratic stability penalty)", lambda x: x ** 2),
    "epochs": ("a + b·K (stability grows with steps)", lambda x: x),
    "batch_size": ("a + b/B", lambda x: 1.0 / x),
    "data_fraction": ("a + b/α (more data: a free lunch)", lambda x: 1.0 / x),
}


def fit_trend(param: str, xs: Sequence[float], losses: Sequence[float]) -> dict:
    """Least-squares a + b·g(x) for the paper's g; a fitted *trend*, not a prediction."""
    label, g = TRENDS[param]
    gx = torch.tensor([g(float(x)) for x in xs], dtype=torch.float64)
    y = torch.tensor(list(losses), dtype=torch.float64)
    A = torch.stack([torch.ones_like(gx), gx], 1)
    coef = torch.linalg.lstsq(A, y[:, None]).solution[:, 0]
    grid = torch.linspace(min(xs), max(xs), 50, dtype=torch.float64)
    fitted = coef[0] + coef[1] * torch.tensor([g(float(v)) for v in grid], dtype=torch.float64)
    return {"label": f"trend (paper's shape, fitted): {label}", "a": float(coef[0]), "b": float(coef[1]),
            "x": grid.tolist(), "y": fitted.tolist()}


def scaling_view(explorer, param: str, values: Sequence[float], base_settings: dict, tasks: Sequence[str],
                 lam: float = 0.3, progress=None, cancel=None) -> dict:
    """For each value of one fine-tuning hyperparameter: fine-tune an expert per task, merge the set
    with task arithmetic (λ) and measure the merged model's average accuracy and loss (test split)."""
    if param not in TRENDS:
        raise MergerError(f"lab: scaling over '{param}' is not supported; one of {', '.join(TRENDS)}")
    if len(values) < 2:
        raise MergerError("lab: the scaling view needs at least two values")
    accs, losses = [], []
    pool = explorer.pool
    for vi, v in enumerate(values):
        settings = check_settings(**{**base_settings, param: v})
        names = []
        for ti, t in enumerate(tasks):
            name = f"{t}@{param}={v:g}"
            if name not in pool.tasks:
                done = (vi * len(tasks) + ti) / (len(values) * len(tasks))
                sd, traj, hp = finetune(pool, t, settings, cancel=cancel,
                                        progress=(lambda f, m, d=done: progress(d + f / (len(values) * len(tasks)), m))
                                        if progress else None)
                add_expert(explorer, name, t, sd, hp, traj)
            names.append(name)
        res = explorer.preview(explorer.spec("task_arithmetic", experts=names, lam=lam), "test")
        accs.append(sum(res.accuracy[n] for n in names) / len(names))
        losses.append(sum(res.loss[n] for n in names) / len(names))
    return {"param": param, "values": list(values), "accuracy": accs, "loss": losses,
            "trend": fit_trend(param, values, losses)}
