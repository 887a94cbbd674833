"""MagMax (Marczak et al., arXiv 2407.06322): per parameter, the task-vector entry of the largest
magnitude across tasks; θ0 + λ · that."""
from __future__ import annotations

import torch

from merger.methods.registry import LAM, Method, Paper, each, frange, lam_times, register, with_default
from merger.pool.task_vectors import TaskVectors


def prepare_magmax(tv: TaskVectors, progress=None, cancel=None) -> dict:
    """Per tensor, the entry of largest |τt| over tasks (the last task on a tie), which task gave it
    (uint8 up to 255 experts), and how many entries each task gave."""
    T = tv.num_tasks
    picked, owner, counts = {}, {}, torch.zeros(T, dtype=torch.float64)
    for k in each(tv.keys, progress, cancel, "tensor"):
        # the authors' running selection: a later task's entry wins when |τt| ≥ |kept| (ties: the last)
        best = tv.row(k, 0)
        best_abs, who = best.abs(), torch.zeros(best.shape, dtype=torch.uint8 if T < 256 else torch.int32,
                                                device=best.device)
        for t in range(1, T):
            row = tv.row(k, t)
            wins = row.abs() >= best_abs
            best = torch.where(wins, row, best)
            best_abs = torch.where(wins, row.abs(), best_abs)
            who.masked_fill_(wins, t)
        picked[k], owner[k] = best, who
        counts += torch.bincount(who.reshape(-1).long().cpu(), minlength=T).double()
    return {"picked": picked, "owner": owner, "share": (counts / counts.sum()).tolist(), "T": T}


def kept_by_magmax(tv: TaskVectors, lam=None) -> torch.Tensor:
    """[T, P]: entry p of task t is kept iff τt holds the largest magnitude there."""
    owner = torch.cat([o.reshape(-1).long() for o in prepare_magmax(tv)["owner"].values()])
    return owner[None, :] == torch.arange(tv.num_tasks, device=owner.device)[:, None]


def picked_share(params, num_experts: int, prepared) -> tuple[list[float], str]:
    """λ times the share of entries each task supplies (a reading: the merge picks, it does not sum)."""
    lam = params.get("lam", 1.0)
    return [lam * s for s in prepared["share"]], "λ × the share of entries where τt has the largest magnitude"


MAGMAX = register(Method(
    name="magmax",
    display_name="MagMax",
    slow_prepare=True,
    paper=Paper("MagMax: leveraging model merging for seamless continual learning", "2407.06322"),
    description="Per parameter, the task-vector entry of the largest magnitude across tasks; θ0 + λ · that.",
    params=(with_default(LAM, 0.5),),
    prepare=prepare_magmax,
    apply=lam_times("picked"),
    tune_grid={"lam": frange(0.1, 1.5, 0.1)},
    weights=picked_share,
    mask=kept_by_magmax,
    conventions="Every floating-point tensor of the image tower, entry by entry, as the authors' code and FusionBench; "
                "on a tie of magnitudes the later expert's entry (their running |current| ≥ |kept|). λ = 0.5 as both.",
))
