"""Zero-shot classification heads (the field's protocol).

For each class, embed every prompt template with the text tower, normalise each embedding,
average over templates, normalise again. Logits are ``logit_scale.exp() * img @ head.T`` with
the image embedding normalised. Heads stay frozen: they are never merged.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

# The standard CLIP ImageNet-style templates, shortened to the ones the task-vector papers use
# for every dataset ("a photo of a {}." family). Our own list; real pools may override per task.
STANDARD_TEMPLATES: tuple[str, ...] = (
    "a photo of a {}.",
    "a bad photo of a {}.",
    "a photo of many {}.",
    "a low resolution photo of the {}.",
    "a cropped photo of the {}.",
    "a bright photo of a {}.",
    "a dark photo of the {}.",
    "a close-up photo of the {}.",
    "a blurry photo of the {}.",
    "a good photo of the {}.",
    "a photo of the small {}.",
    "a photo of the large {}.",
)


class TokenizerMismatch(ValueError):
    """The tokenizer's prompts do not fit the text tower (its vocabulary or context length)."""


@torch.no_grad()
def zero_shot_head(
    model: torch.nn.Module,
    tokenizer: Callable[[list[str]], torch.Tensor],
    classnames: Sequence[str],
    templates: Sequence[str] = STANDARD_TEMPLATES,
) -> torch.Tensor:
    """Return the [classes, embed_dim] head: normalised mean of normalised prompt embeddings."""
    if not classnames:
        raise ValueError("zero_shot_head: no class names")
    if not templates:
        raise ValueError("zero_shot_head: no prompt templates")
    device = next(model.parameters()).device
    vocab = getattr(getattr(model, "token_embedding", None), "num_embeddings", None)
    context = getattr(model, "positional_embedding", None)
    rows = []
    for name in classnames:
        tokens = tokenizer([t.format(name) for t in templates]).to(device)
        if vocab is not None and int(tokens.max()) >= vocab:  # else an IndexError deep in the embedding
            raise TokenizerMismatch(f"token id {int(tokens.max())} is outside the text tower's vocabulary "
                                    f"({vocab} entries)")
        if context is not None and tokens.shape[-1] != context.shape[0]:
            raise TokenizerMismatch(f"prompts of {tokens.shape[-1]} tokens against the text tower's context of "
                                    f"{context.shape[0]}")
        emb = F.normalize(model.encode_text(tokens).float(), dim=-1)
        rows.append(F.normalize(emb.mean(dim=0), dim=-1))
    return torch.stack(rows)


def logits(image_features: torch.Tensor, head: torch.Tensor, logit_scale: torch.Tensor | float) -> torch.Tensor:
    """Zero-shot logits: scale · normalised image embedding · headᵀ (scale is exp of the stored log)."""
    scale = logit_scale.exp() if torch.is_tensor(logit_scale) else torch.tensor(logit_scale).exp()
    return scale * F.normalize(image_features.float(), dim=-1) @ head.T


def heads_cache_dir() -> Path:
    from merger.io.disk_cache import cache_dir

    return cache_dir() / "heads"


def tokenizer_for(pool):
    """The tokenizer of a pool's text tower."""
    if pool.tokenizer_name == "demo":
        from merger.demo.tokenizer import DemoTokenizer

        return DemoTokenizer()
    from merger._compat import open_clip

    return open_clip().get_tokenizer(pool.architecture.get("model", "ViT-B-32"))
