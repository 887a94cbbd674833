"""A merge's numbers on one split (per task: top-1 accuracy, mean cross-entropy, image count) and
the two ways a result is made from others: a subset of its images, and a progressive answer's parts joined."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import torch


@dataclass
class Result:
    """Per-task accuracy (in [0, 1]) and mean cross-entropy on one split."""

    split: str
    accuracy: dict[str, float]
    loss: dict[str, float]
    expert_accuracy: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    partial: bool = False  # on the first images of each task only (a progressive answer's first part)
    estimate: bool = False  # the linear estimate (no forward of its own): shown, never stored as a result
    forward: str = "fp32"  # the forwards' precision: fp32, or bf16 (autocast); the merge is fp32 either way
    # per task: (correct [N] bool, loss [N]) on the CPU, so subsets of the split cost no forward
    per_image: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    @property
    def tasks(self) -> list[str]:
        return list(self.accuracy)

    @property
    def provisional(self) -> bool:
        """Shown while the exact answer is computed; never cached, recorded or exported."""
        return self.partial or self.estimate

    @property
    def average_accuracy(self) -> float:
        return sum(self.accuracy.values()) / len(self.accuracy)

    @property
    def average_loss(self) -> float:
        return sum(self.loss.values()) / len(self.loss)

    def margins(self, z: float = 1.96) -> dict[str, float]:
        """Per task, the half-width of the binomial interval (95 % for z = 1.96) of the accuracy
        measured on ``counts`` images: with 96 images one image is about a point."""
        return {t: z * math.sqrt(a * (1 - a) / self.counts[t]) if self.counts.get(t) else float("nan")
                for t, a in self.accuracy.items()}

    def average_margin(self, z: float = 1.96) -> float:
        """The same for the average accuracy (independent tasks: the variances add)."""
        var = sum(a * (1 - a) / self.counts[t] for t, a in self.accuracy.items() if self.counts.get(t))
        return z * math.sqrt(var) / len(self.accuracy)

    @property
    def normalized(self) -> dict[str, float]:
        """Merged accuracy ÷ the task's own expert accuracy, per task."""
        return {t: a / self.expert_accuracy[t] if self.expert_accuracy.get(t) else float("nan")
                for t, a in self.accuracy.items()}

    @property
    def normalized_accuracy(self) -> float:
        vals = list(self.normalized.values())
        return sum(vals) / len(vals)

    def to_dict(self) -> dict:
        """Plain JSON values: a non-finite number (an infinite loss, a ratio over an expert with
        0 % accuracy) becomes None, which every JSON encoder can write."""
        def finite(v):
            return v if math.isfinite(v) else None

        return {
            "split": self.split,
            "accuracy": self.accuracy,
            "loss": {t: finite(v) for t, v in self.loss.items()},
            "normalized": {t: finite(v) for t, v in self.normalized.items()} if self.expert_accuracy else {},
            "average_accuracy": self.average_accuracy,
            "average_loss": finite(self.average_loss),
            "normalized_accuracy": finite(self.normalized_accuracy) if self.expert_accuracy else None,
            "counts": self.counts,
            "forward": self.forward,
        }


def result_subset(result: Result, positions: Mapping[str, torch.Tensor]) -> Result | None:
    """The result restricted to some images of each task (from its per-image values)."""
    if not all(t in result.per_image for t in result.accuracy):
        return None
    acc, loss, counts = {}, {}, {}
    for t, (correct, losses) in result.per_image.items():
        idx = positions[t]
        acc[t], loss[t], counts[t] = float(correct[idx].float().mean()), float(losses[idx].mean()), int(idx.numel())
    return Result(result.split, acc, loss, result.expert_accuracy, counts, forward=result.forward)


def joined(first: Result, rest: Result) -> Result:
    """A split's complete result from a partial one (its first images of each task) and one on the
    images after them: the per-image values side by side, in the split's order."""
    acc, loss, counts, per_image = {}, {}, {}, {}
    for t in first.accuracy:  # the pool's order
        parts = [first.per_image[t]] + ([rest.per_image[t]] if t in rest.per_image else [])
        correct, losses = per_image[t] = tuple(torch.cat(p) for p in zip(*parts))
        acc[t], loss[t], counts[t] = float(correct.float().mean()), float(losses.mean()), int(correct.numel())
    return Result(first.split, acc, loss, first.expert_accuracy, counts, first.seconds + rest.seconds,
                  per_image=per_image, forward=first.forward)
