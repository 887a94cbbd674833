"""Hugging Face CLIP vision checkpoints (the format FusionBench distributes) → open_clip names.

q/k/v projections are fused into ``in_proj``; fc1/fc2 become c_fc/c_proj; layer norms,
embeddings, pre/post layer norms and the visual projection (transposed) are renamed.
A ``CLIPVisionModel`` has no projection: the pool fills ``visual.proj`` from the base.
"""
from __future__ import annotations

import re

import torch

from merger.errors import CheckpointError

_PREFIXES = ("clip.", "model.", "vision_tower.")
_LAYER = re.compile(r"^vision_model\.encoder\.layers\.(\d+)\.(.+)$")
_RENAME = {
    "vision_model.embeddings.class_embedding": "visual.class_embedding",
    "vision_model.embeddings.patch_embedding.weight": "visual.conv1.weight",
    "vision_model.embeddings.position_embedding.weight": "visual.positional_embedding",
    "vision_model.pre_layrnorm.weight": "visual.ln_pre.weight",  # (sic: HF's spelling)
    "vision_model.pre_layrnorm.bias": "visual.ln_pre.bias",
    "vision_model.post_layernorm.weight": "visual.ln_post.weight",
    "vision_model.post_layernorm.bias": "visual.ln_post.bias",
}
_LAYER_RENAME = {
    "self_attn.out_proj.weight": "attn.out_proj.weight",
    "self_attn.out_proj.bias": "attn.out_proj.bias",
    "layer_norm1.weight": "ln_1.weight", "layer_norm1.bias": "ln_1.bias",
    "layer_norm2.weight": "ln_2.weight", "layer_norm2.bias": "ln_2.bias",
    "mlp.fc1.weight": "mlp.c_fc.weight", "mlp.fc1.bias": "mlp.c_fc.bias",
    "mlp.fc2.weight": "mlp.c_proj.weight", "mlp.fc2.bias": "mlp.c_proj.bias",
}
_IGNORED = ("vision_model.embeddings.position_ids",)
HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


_BARE = ("embeddings.", "encoder.layers.", "pre_layrnorm.", "post_layernorm.")


def is_hf_vision(sd) -> bool:
    return any(_strip(k).startswith("vision_model.") for k in sd)


def _strip(key: str) -> str:
    """Onto 'vision_model.…' names: wrapper prefixes off; bare CLIPVisionModel keys (newer
    transformers save them without 'vision_model.') prefixed."""
    for p in _PREFIXES:
        if key.startswith(p + "vision_model.") or key.startswith(p + "visual_projection"):
            return key[len(p):]
    if key.startswith(_BARE):
        return "vision_model." + key
    return key


def hf_to_open_clip(sd, source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Map a HF CLIPVisionModel / CLIPVisionModelWithProjection / CLIPModel state dict."""
    sd = {_strip(k): v for k, v in sd.items()}
    out: dict[str, torch.Tensor] = {}
    qkv: dict[int, dict[str, torch.Tensor]] = {}
    unknown = []
    for k, v in sd.items():
        if k in _IGNORED or k.startswith(("text_model.", "text_projection", "logit_scale")):
            continue
        if k in _RENAME:
            out[_RENAME[k]] = v
        elif k == "visual_projection.weight":
            out["visual.proj"] = v.T.contiguous()
        elif m := _LAYER.match(k):
            i, rest = int(m.group(1)), m.group(2)
            pre = f"visual.transformer.resblocks.{i}."
            if rest in _LAYER_RENAME:
                out[pre + _LAYER_RENAME[rest]] = v
            elif q := re.match(r"self_attn\.([qkv])_proj\.(weight|bias)$", rest):
                qkv.setdefault(i, {})[f"{q.group(1)}.{q.group(2)}"] = v
            else:
                unknown.append(k)
        else:
            unknown.append(k)
    if unknown:
        raise CheckpointError(f"{source}: unknown Hugging Face CLIP keys: {', '.join(unknown[:8])}")
    for i, parts in qkv.items():
        pre = f"visual.transformer.resblocks.{i}.attn."
        for kind, name in (("weight", "in_proj_weight"), ("bias", "in_proj_bias")):
            missing = [c for c in "qkv" if f"{c}.{kind}" not in parts]
            if missing:
                raise CheckpointError(f"{source}: layer {i} lacks the {'/'.join(missing)} projection {kind}")
            shapes = {c: tuple(parts[f"{c}.{kind}"].shape) for c in "qkv"}
            if len({s[1:] for s in shapes.values()}) > 1:  # torch.cat's own message named no file
                raise CheckpointError(f"{source}: layer {i}: the q/k/v projection {kind}s differ in shape ("
                                      + ", ".join(f"{c}_proj {list(s)}" for c, s in shapes.items())
                                      + "): not one CLIP attention layer")
            out[pre + name] = torch.cat([parts[f"{c}.{kind}"] for c in "qkv"], 0)
    return out
