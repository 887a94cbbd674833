"""The expert lab (demo world): fine-tune new experts from the demo base with chosen settings,
add them to the pool under a name, and the scaling view across expert sets."""
from __future__ import annotations

import hashlib
import itertools
import math
import random
import re
from typing import Sequence

import torch

from merger.errors import MergerError
from merger.methods.basic import WEIGHT_AVERAGING

LIMITS = {"lr": (0.0, 1.0), "epochs": (1, 100), "batch_size": (0, 100_000), "data_fraction": (0.0, 1.0),
          "momentum": (0.0, 1.0), "weight_decay": (0.0, 10.0)}
OPTIMIZERS = ("adamw", "sgd")
MAX_LAB_EXPERTS = 64  # per page: each is a task vector in memory (3 MB on the demo) until the page closes
SCHEDULES = ("cosine", "constant")
ONE_EPOCH = {"epochs": 1}
# One step of full-batch gradient descent from the base: τ(1) = −lr ∇L(θ0), so
# cos(τ(1), −∇L(θ0)) = 1 (arXiv 2508.16082). batch_size 0 = the whole train split.
GRADIENT_DESCENT = {"optimizer": "sgd", "momentum": 0.0, "weight_decay": 0.0, "schedule": "constant",
                    "epochs": 1, "batch_size": 0, "lr": 0.1}
# The lab's settings in its controls' order, with the labels the controls show (and its messages use)
SETTING_LABELS = {"lr": "learning rate", "epochs": "epochs", "batch_size": "batch size", "data_fraction": "data fraction",
                  "seed": "seed", "optimizer": "optimiser", "momentum": "momentum", "weight_decay": "weight decay",
                  "schedule": "schedule"}
SETTING_KEYS = tuple(SETTING_LABELS)
# the scaling view's variables: the settings above, and how many experts are merged
VARIABLE_LABELS = {**SETTING_LABELS, "num_tasks": "number of tasks merged"}


def check_settings(lr, epochs, batch_size, data_fraction, seed, optimizer="adamw", momentum=0.9,
                   weight_decay=0.1, schedule="cosine") -> dict:
    """Refuse out-of-range settings, naming the field by the lab's label for it."""
    def num(name, v, kind=float):
        if v is None:  # a box left empty, or text typed in it (the browser sends no number)
            raise MergerError(f"lab: {SETTING_LABELS[name]} is empty or not a number")
        try:
            x = kind(v)
        except (TypeError, ValueError, OverflowError):
            raise MergerError(f"lab: {SETTING_LABELS[name]} {v!r} is not a number") from None
        if kind is int and float(v) != x:
            raise MergerError(f"lab: {SETTING_LABELS[name]} {v!r} must be a whole number")
        return x

    def refuse(name, v, rule):
        raise MergerError(f"lab: {SETTING_LABELS[name]} {v!r} {rule}")

    lr, epochs, batch_size = num("lr", lr), num("epochs", epochs, int), num("batch_size", batch_size, int)
    data_fraction, seed = num("data_fraction", data_fraction), num("seed", seed, int)
    momentum, weight_decay = num("momentum", momentum), num("weight_decay", weight_decay)
    if not (lr > 0 and math.isfinite(lr)) or lr > LIMITS["lr"][1]:
        refuse("lr", lr, f"must be > 0 and ≤ {LIMITS['lr'][1]:g}")
    if not LIMITS["epochs"][0] <= epochs <= LIMITS["epochs"][1]:
        refuse("epochs", epochs, f"must be between 1 and {LIMITS['epochs'][1]}")
    if not LIMITS["batch_size"][0] <= batch_size <= LIMITS["batch_size"][1]:
        refuse("batch_size", batch_size, f"must be between 1 and {LIMITS['batch_size'][1]} (or 0: the whole "
                                         "train split, full batch)")
    if not 0 < data_fraction <= 1:
        refuse("data_fraction", data_fraction, "must be in (0, 1]")
    if not 0 <= seed < 2**31:  # as the Merge tab's seeds (torch's generator took 1e30 as an overflow)
        refuse("seed", seed, "must be between 0 and 2147483647")
    if not LIMITS["momentum"][0] <= momentum < LIMITS["momentum"][1]:
        refuse("momentum", momentum, "must be in [0, 1)")
    if not (math.isfinite(weight_decay) and LIMITS["weight_decay"][0] <= weight_decay <= LIMITS["weight_decay"][1]):
        refuse("weight_decay", weight_decay, f"must be in [0, {LIMITS['weight_decay'][1]:g}]")
    optimizer, schedule = str(optimizer).lower(), str(schedule).lower()
    if optimizer not in OPTIMIZERS:
        refuse("optimizer", optimizer, f"must be one of {', '.join(OPTIMIZERS)}")
    if schedule not in SCHEDULES:
        refuse("schedule", schedule, f"must be one of {', '.join(SCHEDULES)}")
    return {"lr": lr, "epochs": epochs, "batch_size": batch_size, "data_fraction": data_fraction, "seed": seed,
            "optimizer": optimizer, "momentum": momentum, "weight_decay": weight_decay, "schedule": schedule}


def describe_settings(hparams: dict) -> str:
    """A lab expert's settings as a person reads them, by the lab's labels: "learning rate 0.001,
    epochs 1, batch size 0 (full batch), …"."""
    def value(k, v):
        return f"{v:g}" if isinstance(v, float) else ("0 (full batch)" if k == "batch_size" and v == 0 else str(v))
    labels = {**SETTING_LABELS, "images": "train images"}
    return ", ".join(f"{labels.get(k, k)} {value(k, v)}" for k, v in hparams.items())




def settings_of(pool, task: str, **overrides) -> dict:
    """The settings an expert of the pool was fine-tuned with (its hparams), with overrides."""
    hp = dict(pool.expert_info[task].get("hparams") or {})
    given = {"lr": 1e-3, "epochs": 3, "batch_size": 128, "data_fraction": 1.0, "seed": 0}
    given.update({k: hp[k] for k in SETTING_KEYS if k in hp})
    given.update(overrides)
    return check_settings(**given)


def _require_demo(pool, task: str) -> dict:
    if pool.tokenizer_name != "demo" or "config" not in pool.architecture:
        raise MergerError("the expert lab fine-tunes in the demo world: open the demo pool (or one built by "
                          "`python -m merger demo build`)")
    info = pool.task_info.get(task) or {}
    data = (info.get("data") or {}).get("demo")
    if not data:
        raise MergerError(f"lab: task '{task}' has no demo-world data to fine-tune on")
    return data


def finetune(session, task: str, settings: dict, progress=None, cancel=None):
    """(final image-tower weights, per-epoch weights, hparams) of a new expert for ``task``: batch
    work on its own model copy, letting waiting previews go between steps."""
    from merger.demo import train, world

    pool = session.pool
    task = pool.task_of(task)
    data = _require_demo(pool, task)
    base_task = task
    if base_task not in world.TASKS:
        raise MergerError(f"lab: '{base_task}' is not a task of the demo world ({', '.join(world.TASKS)})")
    from merger.data.tasks import demo_domain

    fixed = dict(demo_domain(data, base_task))
    images, labels = world.generate(int(data["train"]["n"]), int(data["train"]["seed"]), fixed=fixed)
    with session.batch_job(cancel) as check:
        return train.finetune_expert(pool.base, base_task, images=images, labels=labels, progress=progress,
                                     cancel=check, config=pool.architecture["config"], **settings)


def check_name(pool, name: str) -> None:
    """A new expert's name: free, and one a pool, a History row and a spec file can carry. Checked
    before a fine-tune too (a taken name was refused after minutes of training)."""
    if not re.fullmatch(r"[A-Za-z0-9_.@=\-]{1,40}", name or ""):
        raise MergerError(f"lab: name {name!r}: use 1-40 letters, digits, '_', '-', '.', '@', '='")
    if name in pool.expert_info:
        raise MergerError(f"lab: an expert named '{name}' already exists (names are shared by every session)")
    if name in pool.retired:
        raise MergerError(f"lab: '{name}' named an expert freed with the page that made it; names are not reused "
                          "(what was computed with it may still be cached): pick another")


def unused_name(pool, stem: str) -> str:
    """``stem``, or ``stem-2``, ``stem-3``… : the first name no expert holds or held."""
    taken = lambda n: n in pool.expert_info or n in pool.retired  # noqa: E731
    return next(n for n in (stem, *(f"{stem}-{i}" for i in range(2, len(pool.expert_info) + len(pool.retired) + 3)))
                if not taken(n))


def check_room(pool, owner: str | None, more: int) -> None:
    """Refuse a lab run that would leave its page holding over MAX_LAB_EXPERTS experts (each a task
    vector in memory, kept until the page is closed)."""
    held = len(lab_experts(pool, owner))
    if held + more > MAX_LAB_EXPERTS:
        raise MergerError(f"lab: this page holds {held} lab expert(s) and this run adds {more}: at most "
                          f"{MAX_LAB_EXPERTS} per page (they are freed when the page is closed)")


def free_lab_experts(session, owner: str) -> list[str]:
    """Remove the lab experts a page made (its session ended); their names are never used again."""
    names = lab_experts(session.pool, owner)
    if names:
        session.remove_experts(names)
    return names


def add_expert(session, name: str, like_task: str, weights: dict, hparams: dict | None = None,
               trajectory: Sequence[dict] | None = None, owner: str | None = None) -> None:
    """Add an expert under ``name`` for the task ``like_task`` (a lab expert's own task when it is
    one), made by the session ``owner``. The pool's tasks do not change: results stay per task."""
    pool = session.pool
    check_name(pool, name)
    check_room(pool, owner, 1)
    if like_task not in pool.expert_info:
        raise MergerError(f"lab: unknown task '{like_task}'")
    session.add_expert(name, pool.task_of(like_task), weights,
                       {"hparams": dict(hparams or {}), "lab_trajectory": list(trajectory or []), "owner": owner})


def lab_experts(pool, owner: str | None = None, everyone: bool = False) -> list[str]:
    """The experts added in the lab: a session's own (``owner``), or every session's."""
    return [e for e in pool.experts if e not in pool.tasks
            and (everyone or pool.expert_info[e].get("owner") == owner)]


# ---- scaling view -------------------------------------------------------------------------
MAX_SCALING_VALUES = 8

# The paper's predicted shape of the merged loss in one variable (arXiv 2601.21690, §V-B), as terms
# b_i g_i(x) of a least-squares fit a + Σ b_i g_i(x): a fitted *trend*, not a prediction. Each term of
# the paper's bound is a product of non-negative constants (L, C, σ², ζ², η², f(x0) − f_inf): b_i ≥ 0.
TRENDS = {
    "lr": ("a + b·η² (quadratic stability penalty)", (("b·η²", lambda x: x ** 2),)),
    "epochs": ("a + b·K + c/K (stability grows with steps, optimisation error falls: a trade-off)",
               (("b·K", lambda x: x), ("c/K", lambda x: 1.0 / x))),
    "batch_size": ("a + b/B", (("b/B", lambda x: 1.0 / x),)),
    "data_fraction": ("a + b/α (more data: a free lunch)", (("b/α", lambda x: 1.0 / x),)),
    "num_tasks": ("a + b·N + c/√N (heterogeneity accumulates, optimisation benefit O(1/√N))",
                  (("b·N", lambda x: x), ("c/√N", lambda x: 1.0 / math.sqrt(x)))),
}


def fit_trend(param: str, xs: Sequence[float], losses: Sequence[float]) -> dict:
    """Least squares a + Σ b_i g_i(x) with the paper's signs, every b_i ≥ 0: the best fit among those of
    each subset of the terms whose coefficients all come out ≥ 0 (the constrained optimum is the plain
    fit on its own support, and with one or two terms every subset is tried). A term left at 0 is one
    the points run against; the label says so, with R²."""
    label, terms = TRENDS[param]
    if len(xs) < len(terms) + 1:
        raise MergerError(f"lab: the {VARIABLE_LABELS[param]} trend has {len(terms) + 1} constants: give at least "
                          f"{len(terms) + 1} values")
    x = [float(v) for v in xs]
    y = torch.tensor(list(losses), dtype=torch.float64)
    best = None
    for support in itertools.chain.from_iterable(itertools.combinations(range(len(terms)), k)
                                                 for k in range(len(terms), -1, -1)):  # the full fit first
        A = torch.tensor([[1.0] + [terms[i][1](v) for i in support] for v in x], dtype=torch.float64)
        sol = torch.linalg.lstsq(A, y[:, None]).solution[:, 0]
        if bool((sol[1:] < 0).any()):
            continue
        residual = float((A @ sol - y).pow(2).sum())
        if best is None or residual < best[0] * (1 - 1e-12):
            best = (residual, support, sol)
    residual, support, sol = best  # the constant alone always qualifies
    b = [0.0] * len(terms)
    for i, c in zip(support, sol[1:].tolist()):
        b[i] = c
    spread = float((y - y.mean()).pow(2).sum())
    r2 = 1.0 - residual / spread if spread > 0 else float("nan")
    against = [terms[i][0] for i in range(len(terms)) if i not in support]
    said = f"R² {r2:.2f}" + (f"; the points run against {' and '.join(against)} (fitted 0)" if against else
                             "; as many points as constants: it passes through them" if len(x) == len(terms) + 1 else "")
    grid = torch.linspace(min(x), max(x), 50, dtype=torch.float64).tolist()
    fitted = [float(sol[0]) + sum(c * g(v) for c, (_, g) in zip(b, terms)) for v in grid]
    return {"label": f"trend (paper's shape, its signs, fitted): {label}; {said}", "a": float(sol[0]), "b": b,
            "r2": r2, "against": against, "x": grid, "y": fitted}


def _merge_set(session, names: Sequence[str]) -> tuple[float, float]:
    """Weight averaging of an expert set (Σλ = 1, the merge the paper's theory and experiments use):
    (accuracy, loss) averaged over the tasks of the merged experts, test split."""
    res = session.preview(session.spec(WEIGHT_AVERAGING.name, experts=list(names)), "test")
    tasks = [session.pool.task_of(n) for n in names]
    return sum(res.accuracy[t] for t in tasks) / len(tasks), sum(res.loss[t] for t in tasks) / len(tasks)


def scaling_view(session, param: str, values: Sequence[float], base_settings: dict, tasks: Sequence[str],
                 progress=None, cancel=None, subsets: int = 5, seed: int = 0, owner: str | None = None) -> dict:
    """Merged accuracy and loss against one variable, with the paper's trend fitted to the loss.

    A fine-tuning hyperparameter: for each value, fine-tune an expert per task and merge the set.
    num_tasks: merge random subsets of N of ``tasks`` (mean over up to ``subsets`` subsets).
    Merges are weight averages: the theory's coefficients lie on the simplex (Σλ = 1)."""
    if param not in TRENDS:
        raise MergerError(f"lab: scaling over '{param}' is not supported; one of {', '.join(TRENDS)}")
    if len(values) < 2:
        raise MergerError("lab: the scaling view needs at least two values")
    if len(values) > MAX_SCALING_VALUES:
        raise MergerError(f"lab: {len(values)} scaling values: at most {MAX_SCALING_VALUES} (each value fine-tunes an "
                          "expert per task)")
    if not all(math.isfinite(v) for v in values):
        raise MergerError(f"lab: scaling values {list(values)}: every value must be a finite number")
    if param == "batch_size" and 0 in [float(v) for v in values]:  # said before minutes of fine-tuning
        raise MergerError("lab: batch size 0 (the full batch) has no place on the a + b/B trend: give the "
                          "batch size in images")
    accs, losses = [], []
    pool = session.pool
    if param == "num_tasks":
        rng = random.Random(seed)
        for v in values:
            n = int(v)
            if n != v or not 1 <= n <= len(tasks):
                raise MergerError(f"lab: number of tasks merged {v!r} must be a whole number between 1 and {len(tasks)}")
            combos = list(itertools.combinations(tasks, n))
            chosen = combos if len(combos) <= subsets else rng.sample(combos, subsets)
            scores = [_merge_set(session, c) for c in chosen]
            accs.append(sum(a for a, _ in scores) / len(scores))
            losses.append(sum(lo for _, lo in scores) / len(scores))
    else:
        check_room(pool, owner, len(values) * len(tasks))  # said before minutes of fine-tuning
        for vi, v in enumerate(values):
            settings = check_settings(**{**base_settings, param: v})
            # the other settings in the name too: a view run again with another optimiser reused these
            digest = hashlib.sha1(repr(sorted(settings.items())).encode()).hexdigest()[:6]
            names = []
            for ti, t in enumerate(tasks):
                name = f"{t}@{param}={v:g}-{digest}"
                if name in pool.retired:  # freed with another page: trained again under a new name
                    name = unused_name(pool, name)
                if name not in pool.expert_info:
                    done = (vi * len(tasks) + ti) / (len(values) * len(tasks))
                    sd, traj, hp = finetune(session, t, settings, cancel=cancel,
                                            progress=(lambda f, m, d=done: progress(d + f / (len(values) * len(tasks)), m))
                                            if progress else None)
                    add_expert(session, name, t, sd, hp, traj, owner)
                names.append(name)
            acc, loss = _merge_set(session, names)
            accs.append(acc)
            losses.append(loss)
    return {"param": param, "values": list(values), "accuracy": accs, "loss": losses,
            "trend": fit_trend(param, values, losses), "merge": "weight averaging (Σλ = 1)"}
