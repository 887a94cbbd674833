"""The tiny CLIP of the demo world: an inline open_clip config, built by open_clip's own class.

Size is set by the live app's budget: after every slider move it merges and forwards the live
images of every task (96 per task, each task with its own images: 672 for seven tasks) through
the image tower within ~100 ms on 2 CPU cores. A 3-layer, 96-wide ViT on 8x8 patches of a 32x32
image (16 patches + CLS) does that in ~60 ms (bench live p50 62-67 ms).

The image tower uses fixed 2-D sin-cos position embeddings (not learnable ones): with learnable
ones, contrastive pretraining from scratch never started to use the small spatial cues (dots).
"""
from __future__ import annotations

import copy

import torch

from merger._compat import open_clip
from merger.demo.tokenizer import DemoTokenizer

_TOKENIZER = DemoTokenizer()

CLIP_CONFIG: dict = {
    "embed_dim": 128,
    "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 96, "layers": 3, "head_width": 32,
                   "mlp_ratio": 2.0, "pos_embed_type": "sin_cos_2d"},
    "text_cfg": {"context_length": _TOKENIZER.context_length, "vocab_size": _TOKENIZER.vocab_size,
                 "width": 64, "heads": 2, "layers": 2, "mlp_ratio": 2.0},
}

# Per-channel statistics of the demo images (measured on generate(20000, 0), rounded): inputs
# then have about zero mean and unit variance, as the towers' initialisation expects.
MEAN: tuple[float, float, float] = (0.51, 0.48, 0.47)
STD: tuple[float, float, float] = (0.28, 0.17, 0.22)


def preprocess(images: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 3, 32, 32] (or [3, 32, 32]) -> normalised float32 of the same shape."""
    x = images.float() / 255.0
    mean = torch.tensor(MEAN, dtype=x.dtype).view(3, 1, 1)
    std = torch.tensor(STD, dtype=x.dtype).view(3, 1, 1)
    return (x - mean) / std


def create_model(config: dict = CLIP_CONFIG, seed: int = 0) -> torch.nn.Module:
    """A freshly initialised open_clip ``CLIP`` (deterministic for a seed), in eval mode."""
    oc = open_clip()
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = oc.CLIP(**copy.deepcopy(config))
    finally:
        torch.random.set_rng_state(state)  # do not disturb the caller's random stream
    return model.eval()


def tokenizer() -> DemoTokenizer:
    """The tokenizer matching ``CLIP_CONFIG`` (pool.yaml says ``tokenizer: demo``)."""
    return DemoTokenizer()
