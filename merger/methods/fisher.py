"""Fisher merging (Matena & Raffel, arXiv 2111.09832): θ = Σt Ft θt / Σt Ft with Ft the diagonal
Fisher information of expert t on its task's validation images, so each parameter follows the
experts for which it matters. In task vectors: Δ = Σt Ft τt / Σt Ft (θ0 cancels)."""
from __future__ import annotations

import time
import warnings

import torch
import torch.nn.functional as F
from torch.func import grad, vmap

from merger.errors import Cancelled
from merger.methods.data import DRAW_SEED, VISUAL, Run, calibration_set, normalized_features, static_unused
from merger.methods.registry import FUSIONBENCH, SAMPLES, Method, Paper, Published, register, with_default

FLOOR = 1e-6  # every Fisher at least this (the authors' fisher_floor and FusionBench's minimal weight)
MAX_CHUNK = 64
CPU_GRAD_BYTES = 1 << 30  # a chunk's per-example gradients on the CPU: about 1 GB


def chunk_size(numel: int, device) -> int:
    """Images per vmap call: as many as fit their fp32 gradients (numel each) in the gradient budget,
    1 to 64. On a GPU the budget is a quarter of its free memory: a chunk of 3 ViT-B/32 images kept
    an H100 waiting on kernel launches for minutes."""
    device = torch.device(device)
    budget = torch.cuda.mem_get_info(device)[0] // 4 if device.type == "cuda" else CPU_GRAD_BYTES
    return max(1, min(MAX_CHUNK, budget // (4 * max(1, numel))))


def empirical_fisher(ctx, i: int, batches, progress=None, cancel=None) -> dict[str, torch.Tensor]:
    """Mean over expert i's validation images of the squared per-example gradient of −log p(y | x),
    y the true label, at θi: the diagonal of the empirical Fisher. Per-example gradients come from
    vmap over a chunk of images (``chunk_size``)."""
    params = ctx.expert_params(i)
    head = ctx.heads[ctx.pool.task_of(ctx.tasks[i])].float()

    def nll(p, x, y):
        return F.cross_entropy(ctx.scale * normalized_features(ctx.model, p, x[None]) @ head.T, y[None])

    per_example = vmap(grad(nll), in_dims=(None, 0, 0))
    chunk = chunk_size(sum(p.numel() for p in params.values()), next(iter(params.values())).device)
    fisher = {n: torch.zeros_like(p) for n, p in params.items()}
    data = ctx.expert_batches(batches, i)
    total, seen = sum(x.shape[0] for x, _ in data), 0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*performance drop.*")  # SDPA has no batching rule yet
        for x, y in data:
            j = 0
            while j < x.shape[0]:
                if cancel is not None and cancel():
                    raise Cancelled("run cancelled; nothing was cached")
                try:
                    grads = per_example(params, x[j:j + chunk], y[j:j + chunk])
                except torch.OutOfMemoryError:  # the budget counts gradients alone: half as many again
                    if chunk == 1:
                        raise
                    chunk = chunk // 2
                    continue
                for n, g in grads.items():
                    fisher[n] += g.square().sum(0)
                seen += min(chunk, x.shape[0] - j)
                j += chunk
                if progress:
                    progress(seen / total, f"image {seen}/{total}")
    return {VISUAL + n: f / max(seen, 1) for n, f in fisher.items()}


class FisherSum:
    """Σt F̃t τt and Σt F̃t (F̃ = max(F, FLOOR)) added one expert at a time (no T Fishers held at
    once), and each expert's share of the total Fisher mass."""

    def __init__(self, tv):
        self.tv = tv
        self.num = {k: torch.zeros_like(b) for k, b in tv.base.items()}
        self.den = {k: torch.zeros_like(b) for k, b in tv.base.items()}
        self.mass: list[float] = []

    def add(self, i: int, fisher: dict[str, torch.Tensor]) -> None:
        mass = 0.0
        for k in self.tv.keys:
            f = fisher[k].to(self.num[k].device).clamp(min=FLOOR)
            self.num[k] += f * self.tv.row(k, i)
            self.den[k] += f
            mass += float(f.sum(dtype=torch.float64))
        self.mass.append(mass)

    def delta(self) -> tuple[dict, list[float]]:
        total = sum(self.mass)
        return {k: self.num[k] / self.den[k] for k in self.tv.keys}, [m / total for m in self.mass]


def fisher_delta(tv, fishers: list[dict]) -> tuple[dict, list[float]]:
    """(Δ = Σt F̃t τt / Σt F̃t, each expert's share Σ F̃t / Σ F̃ of the Fisher mass)."""
    acc = FisherSum(tv)
    for i, f in enumerate(fishers):
        acc.add(i, f)
    return acc.delta()


def run_fisher(ctx, progress=None, cancel=None, *, samples: int, seed: int) -> Run:
    t0 = time.perf_counter()
    batches = calibration_set(ctx, samples, seed)
    T = ctx.tv.num_tasks
    acc = FisherSum(ctx.tv)
    for i in range(T):
        def part(frac, msg, i=i):
            if progress:
                progress((i + frac) / T, f"Fisher of expert {i + 1}/{T}: {msg}")
        acc.add(i, empirical_fisher(ctx, i, batches, part, cancel))
    delta, share = acc.delta()
    return Run("", ctx.tasks, ["all layers"], torch.tensor(share)[:, None].float(), delta, {"objective": []}, [],
               time.perf_counter() - t0)


def fisher_weights(params, num_experts: int, run) -> tuple[list[float], str]:
    return run.coefficients.mean(1).tolist(), "each expert's share Σ F̃t / Σ F̃ of the Fisher mass (a reading)"


register(Method(
    name="fisher",
    display_name="Fisher merging",
    paper=Paper("Merging models with Fisher-weighted averaging", "2111.09832"),
    description="θ = Σt Ft θt / Σt Ft per parameter, Ft the diagonal empirical Fisher of expert t on its task's "
                "validation images (floor 1e-6).",
    params=(with_default(SAMPLES, 256), DRAW_SEED),
    prepare=static_unused, apply=static_unused,
    run=run_fisher,
    objective="Fisher information",
    iterate="estimate",
    weights=fisher_weights,
    conventions="The empirical Fisher: squared per-example gradients of the true label's "
                "log-likelihood (the authors' code takes the expectation over the model's predicted labels, one "
                "backward per class; FusionBench squares the gradient of a batch sum). Every floating-point tensor "
                "of the image tower; F̃ = max(F, 1e-6) for every expert; no Fisher normalisation.",
    published=(Published("ViT-B-32", 70.6, FUSIONBENCH),),
))
