"""Model Stock (Jang et al., arXiv 2403.19522): per layer, interpolate between the base and the
experts' average by a ratio read off the angle between the experts around the base."""
from __future__ import annotations

import torch

from merger.methods.registry import Method, Paper, register
from merger.pool.task_vectors import TaskVectors


def _cos_between_experts(stacked: torch.Tensor) -> torch.Tensor:
    """Mean pairwise cosine of the task vectors of one tensor ([T, ...] → fp32 scalar). One expert is
    its own neighbour: cos θ = 1 (Model Stock is then that expert). In fp64: experts fine-tuned apart
    are nearly orthogonal, and an fp32 sum of millions of products put a cosine of 1e-3 (and so t and
    the merge) 1e-3 off."""
    T = stacked.shape[0]
    if T == 1:
        return stacked.new_tensor(1.0, dtype=torch.float32)
    flat = stacked.reshape(T, -1).double()
    gram = flat @ flat.T
    norms = gram.diagonal().sqrt().clamp_min(torch.finfo(torch.float64).tiny)
    cos = gram / norms[:, None] / norms[None, :]
    return ((cos.sum() - cos.diagonal().sum()) / (T * (T - 1))).float()


def interpolation_ratio(cos: torch.Tensor, k: int) -> torch.Tensor:
    """t = k·cos θ / (1 + (k − 1)·cos θ) (the paper's Eq. for k fine-tuned models), with cos θ
    clamped to [0, 1] so that t stays a ratio in [0, 1]."""
    cos = cos.clamp(0.0, 1.0)
    return k * cos / (1 + (k - 1) * cos)


def prepare_model_stock(tv: TaskVectors) -> dict:
    T = tv.num_tasks
    ratio = {k: interpolation_ratio(_cos_between_experts(tv.stacked[k]), T) for k in tv.keys}
    # θ = t·θavg + (1 − t)·θ0, i.e. Δ = t·mean τ per tensor: no slider, so Δ is computed here once.
    delta = {k: ratio[k] * v.mean(0) for k, v in tv.items32()}
    # the ratios read back at once: a GPU waited for its queue to drain at each of 152 reads
    return {"delta": delta, "ratio": dict(zip(ratio, torch.stack(list(ratio.values())).tolist())), "T": T}


def apply_model_stock(prepared: dict) -> dict:
    return dict(prepared["delta"])


def ratio_note(params, prepared) -> str | None:
    """Where the merge lies between the base and the average: with nearly orthogonal task vectors t is
    small and the merge looks like the base, which a user should not take for a failure."""
    if prepared is None:
        return None
    t = sum(prepared["ratio"].values()) / len(prepared["ratio"])
    why = " (the experts' task vectors are nearly orthogonal: cos θ is small)" if t < 0.2 else ""
    return f"t averages {t:.2f} over tensors: the merge lies {100 * t:.0f} % of the way from the base θ0 to θavg{why}."


def effective_weights(params, num_experts: int, prepared) -> tuple[list[float], str]:
    t = sum(prepared["ratio"].values()) / len(prepared["ratio"])
    return [t / num_experts] * num_experts, f"t/T per task (t = {t:.3g}, the mean ratio over tensors)"


MODEL_STOCK = register(Method(
    name="model_stock",
    display_name="Model Stock",
    paper=Paper("Model Stock: All we need is just a few fine-tuned models", "2403.19522"),
    description="Per tensor, θ = t·θavg + (1 − t)·θ0 with t = k·cos θ / (1 + (k − 1)·cos θ) from the angle θ "
                "between the experts' task vectors (k experts); no slider.",
    params=(),
    prepare=prepare_model_stock,
    apply=apply_model_stock,
    tune_grid={},
    weights=effective_weights,
    note=ratio_note,
    conventions="cos θ is the mean pairwise cosine of the k task vectors of each tensor (the paper states θ for two "
                "models; mergekit averages pairs the same way), clamped to [0, 1] so that t is a ratio (mergekit "
                "clamps to [−1, 1], where t can leave [0, 1] or divide by zero). Every tensor of the image tower is a "
                "'layer', biases and norms included.",
))
