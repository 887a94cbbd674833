"""What data-driven merges share: the run's context (task vectors, the resident model's copy, the
validation data, statistics kept by the session), the Run they return, their objectives, and the
seeded calibration draw. AdaMerging and FW live in adaptive.py, RegMean and Fisher in their own files."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch.func import functional_call

from merger.errors import DataError, MergerError
from merger.methods.registry import SEED, with_default

# The seed of data-driven runs: which validation images they draw (AdaMerging's batches, FW's calibration
# set, RegMean's and Fisher's statistics)
DRAW_SEED = with_default(SEED, 0, help="random seed of the validation images drawn (batches, calibration set, "
                                       "statistics)")

VISUAL = "visual."


@dataclass
class Run:
    method: str
    tasks: list[str]
    groups: list[str]  # coefficient columns: ["all layers"] or one per tensor
    coefficients: torch.Tensor  # AdaMerging: [T, G]; FW: effective task coefficients [T, 1]
    delta: dict[str, torch.Tensor] = field(repr=False)
    trace: dict[str, list] = field(default_factory=dict)  # objective per step; FW: gap, chosen, weights
    iterates: list[torch.Tensor] = field(default_factory=list, repr=False)  # coefficient snapshots [T, G]
    seconds: float = 0.0
    combination: object = field(default=None, repr=False)  # rebuilds weights from coefficients

    def iterate_deltas(self, base: dict):
        """Δ of every recorded iterate (for trajectories on the landscape)."""
        for c in self.iterates:
            yield self.combination.delta(c.to(next(iter(base.values())).device), base)


class Context:
    """What a data-driven run needs: the task vectors of the experts merged and the evaluator's
    data of the tasks those experts were fine-tuned for."""

    def __init__(self, pool, evaluator, experts: tuple[str, ...]):
        self.pool, self.evaluator, self.tasks = pool, evaluator, list(experts)
        self.data_tasks = {pool.task_of(e) for e in experts}
        self.tv = pool.task_vectors.subset(self.tasks)
        self.model = evaluator.model.visual
        self.scale = evaluator.logit_scale
        self.heads = evaluator.heads
        self.device = evaluator.device
        # Statistics of the experts' data that more than one run can use (RegMean's Gram matrices),
        # keyed by name and expert subset; the session hands in the store it owns.
        self.statistics: OrderedDict = OrderedDict()

    def statistic(self, name: tuple, compute: Callable):
        """``compute()`` once per name and expert subset, kept in the session's store."""
        key = (*name, tuple(self.tasks))
        if key not in self.statistics:
            self.statistics[key] = compute()
        else:  # the session's store drops the least recently used
            self.statistics.move_to_end(key)
        return self.statistics[key]

    def expert_params(self, i: int, requires_grad: bool = False) -> dict[str, torch.Tensor]:
        """θi of the image tower, by the model's own names (for ``functional_call``)."""
        return {k[len(VISUAL):]: (self.tv.base[k] + self.tv.row(k, i)).requires_grad_(requires_grad)
                for k in self.tv.keys}

    def expert_batches(self, batches, i: int):
        """(images, labels) of the batches that carry the data task of expert i."""
        task = self.pool.task_of(self.tasks[i])
        return [(x, y) for x, members in batches for t, y in members if t == task]

    def groups(self, split: str = "val"):
        """Inputs of the split grouped by shared images, restricted to the merged experts' tasks."""
        out = []
        for x, members in self.evaluator.inputs(split):
            members = [(t, y) for t, y in members if t in self.data_tasks]
            if members:
                if x.shape[0] == 0:
                    raise DataError(f"task(s) {', '.join(t for t, _ in members)}: no unlabeled {split} images")
                out.append((x, members))
        missing = sorted(t for t in self.data_tasks if not any(t == m for _, ms in out for m, _ in ms))
        if missing:
            raise DataError(f"task(s) {', '.join(missing)}: no {split} data for a data-driven merge")
        return out


def normalized_features(model, params, x):
    dtype = next(iter(params.values())).dtype
    f = functional_call(model, params, (x.to(dtype),))
    return F.normalize(f if dtype == torch.float64 else f.float(), dim=-1)


def entropy_objective(ctx: Context, params: dict, batches) -> torch.Tensor:
    """Mean Shannon entropy of the merged model's predictions, averaged over tasks (labels unused)."""
    total, n = 0.0, 0
    for x, members in batches:
        f = normalized_features(ctx.model, params, x)
        for t, _ in members:
            logp = F.log_softmax(ctx.scale * f @ ctx.heads[t].T.to(f.dtype), dim=-1)
            total = total - (logp.exp() * logp).sum(-1).mean()
            n += 1
    return total / n


def cross_entropy_objective(ctx: Context, params: dict, batches) -> torch.Tensor:
    total, n = 0.0, 0
    for x, members in batches:
        f = normalized_features(ctx.model, params, x)
        for t, y in members:
            total = total + F.cross_entropy(ctx.scale * f @ ctx.heads[t].T.to(f.dtype), y)
            n += 1
    return total / n


def subset_of(groups, idx_fn):
    out = []
    for x, members in groups:
        idx = idx_fn(x.shape[0])
        out.append((x[idx], [(t, y[idx]) for t, y in members]))
    return out


def calibration_set(ctx: Context, samples: int, seed: int):
    """FW's labelled calibration set: ``samples`` validation images per task, drawn with ``seed``."""
    g = torch.Generator().manual_seed(int(seed))
    return subset_of(ctx.groups("val"), lambda n: torch.randperm(n, generator=g)[: min(samples, n)].to(ctx.device))


def static_unused(*a, **k):
    raise MergerError("a data-driven method runs with its data (Explorer.run), it has no static apply")
