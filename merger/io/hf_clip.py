"""Hugging Face CLIP checkpoints → open_clip names.

Two formats. A vision model (``CLIPVisionModel``, ``CLIPVisionModelWithProjection``; the FusionBench
experts) becomes ``visual.*`` only; a ``CLIPVisionModel`` has no projection, so the pool fills
``visual.proj`` from the base. A whole ``CLIPModel`` (openai/clip-vit-base-patch32 and kin, the
field's base) becomes the full open_clip CLIP state dict, text tower included, as the zero-shot
heads need it.

q/k/v projections are fused into ``in_proj``; fc1/fc2 become c_fc/c_proj; layer norms and
embeddings are renamed; HF's projections are ``nn.Linear`` weights ([embed, width]) where open_clip
multiplies by a [width, embed] matrix, hence the transposes.
"""
from __future__ import annotations

import re

import torch

from merger.errors import CheckpointError

_PREFIXES = ("clip.", "model.", "vision_tower.")
_TOP = ("vision_model.", "visual_projection", "text_model.", "text_projection", "logit_scale")
_LAYER = re.compile(r"^vision_model\.encoder\.layers\.(\d+)\.(.+)$")
_TEXT_LAYER = re.compile(r"^text_model\.encoder\.layers\.(\d+)\.(.+)$")
_QKV = re.compile(r"self_attn\.([qkv])_proj\.(weight|bias)$")
_RENAME = {
    "vision_model.embeddings.class_embedding": "visual.class_embedding",
    "vision_model.embeddings.patch_embedding.weight": "visual.conv1.weight",
    "vision_model.embeddings.position_embedding.weight": "visual.positional_embedding",
    "vision_model.pre_layrnorm.weight": "visual.ln_pre.weight",  # (sic: HF's spelling)
    "vision_model.pre_layrnorm.bias": "visual.ln_pre.bias",
    "vision_model.post_layernorm.weight": "visual.ln_post.weight",
    "vision_model.post_layernorm.bias": "visual.ln_post.bias",
}
_TEXT_RENAME = {
    "text_model.embeddings.token_embedding.weight": "token_embedding.weight",
    "text_model.embeddings.position_embedding.weight": "positional_embedding",
    "text_model.final_layer_norm.weight": "ln_final.weight",
    "text_model.final_layer_norm.bias": "ln_final.bias",
}
_LAYER_RENAME = {
    "self_attn.out_proj.weight": "attn.out_proj.weight",
    "self_attn.out_proj.bias": "attn.out_proj.bias",
    "layer_norm1.weight": "ln_1.weight", "layer_norm1.bias": "ln_1.bias",
    "layer_norm2.weight": "ln_2.weight", "layer_norm2.bias": "ln_2.bias",
    "mlp.fc1.weight": "mlp.c_fc.weight", "mlp.fc1.bias": "mlp.c_fc.bias",
    "mlp.fc2.weight": "mlp.c_proj.weight", "mlp.fc2.bias": "mlp.c_proj.bias",
}
_LAYER_KEYS = tuple(_LAYER_RENAME) + tuple(f"self_attn.{c}_proj.{k}" for c in "qkv" for k in ("weight", "bias"))
# HF buffers (arange of positions), saved by older transformers; open_clip computes them
_IGNORED = ("vision_model.embeddings.position_ids", "text_model.embeddings.position_ids")
HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


_BARE = ("embeddings.", "encoder.layers.", "pre_layrnorm.", "post_layernorm.")


def is_hf_vision(sd) -> bool:
    return any(_strip(k).startswith("vision_model.") for k in sd)


def is_hf_clip(sd) -> bool:
    """A whole CLIPModel: both towers' keys (a vision model has no ``text_model.``)."""
    keys = [_strip(k) for k in sd]
    return any(k.startswith("text_model.") for k in keys) and any(k.startswith("vision_model.") for k in keys)


def _strip(key: str) -> str:
    """Onto 'vision_model.…' / 'text_model.…' names: wrapper prefixes off; bare CLIPVisionModel
    keys (newer transformers save them without 'vision_model.') prefixed."""
    for p in _PREFIXES:
        if key.startswith(p) and key[len(p):].startswith(_TOP):
            return key[len(p):]
    if key.startswith(_BARE):
        return "vision_model." + key
    return key


def hf_to_open_clip(sd, source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Map a HF CLIPVisionModel / CLIPVisionModelWithProjection state dict (a CLIPModel's text
    tower is skipped: ``hf_clip_to_open_clip`` converts it)."""
    sd = {_strip(k): v for k, v in sd.items()}
    out: dict[str, torch.Tensor] = {}
    unknown = []
    layers = {}
    for k, v in sd.items():
        if k in _IGNORED or k.startswith(("text_model.", "text_projection", "logit_scale")):
            continue
        if k in _RENAME:
            out[_RENAME[k]] = v
        elif k == "visual_projection.weight":
            out["visual.proj"] = v.T.contiguous()
        elif m := _LAYER.match(k):
            layers[k] = (int(m.group(1)), m.group(2), v)
        else:
            unknown.append(k)
    if unknown:
        raise CheckpointError(f"{source}: unknown Hugging Face CLIP keys: {', '.join(unknown[:8])}")
    out.update(_layers(layers, "visual.transformer.resblocks.", "layer", source))
    return out


def hf_clip_to_open_clip(sd, source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Map a whole HF CLIPModel onto open_clip's CLIP state dict (both towers, projections,
    logit_scale): the names ``open_clip.create_model(arch)`` loads with strict=True."""
    sd = {_strip(k): v for k, v in sd.items()}
    missing = [k for k in _expected(sd) if k not in sd]
    if missing:  # a base must be whole: name what is absent in the file's own names
        raise CheckpointError(f"{source}: incomplete Hugging Face CLIPModel: missing keys: {', '.join(missing[:8])}"
                              + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))
    _check_projections(sd, source)
    out = hf_to_open_clip(sd, source)  # the vision tower and visual.proj
    layers, unknown = {}, []
    for k, v in sd.items():
        if k in _IGNORED or k.startswith(("vision_model.", "visual_projection")):
            continue
        if k in _TEXT_RENAME:
            out[_TEXT_RENAME[k]] = v
        elif k == "text_projection.weight":
            out["text_projection"] = v.T.contiguous()
        elif k == "logit_scale":
            out["logit_scale"] = v.reshape(())  # open_clip's is a 0-d parameter
        elif m := _TEXT_LAYER.match(k):
            layers[k] = (int(m.group(1)), m.group(2), v)
        else:
            unknown.append(k)
    if unknown:
        raise CheckpointError(f"{source}: unknown Hugging Face CLIP keys: {', '.join(unknown[:8])}")
    out.update(_layers(layers, "transformer.resblocks.", "text layer", source))
    return out


def _expected(sd) -> list[str]:
    """Every key a whole CLIPModel holds, for as many layers as its highest layer index says (a
    missing last layer is left to the architecture check, which knows the depth)."""
    keys = list(_RENAME) + list(_TEXT_RENAME) + ["visual_projection.weight", "text_projection.weight", "logit_scale"]
    for pattern, tower in ((_LAYER, "vision_model"), (_TEXT_LAYER, "text_model")):
        depth = 1 + max((int(m.group(1)) for k in sd if (m := pattern.match(k))), default=-1)
        keys += [f"{tower}.encoder.layers.{i}.{rest}" for i in range(depth) for rest in _LAYER_KEYS]
    return keys


def _check_projections(sd, source: str) -> None:
    """HF's projections are [embed, width]; open_clip's the transpose. A file whose shapes say
    otherwise (another layout, or both towers not projecting to one space) is refused here, where
    the file and key can be named, not deep in a matrix product."""
    widths = {"visual_projection.weight": sd["vision_model.post_layernorm.weight"],
              "text_projection.weight": sd["text_model.final_layer_norm.weight"]}
    for key, norm in widths.items():
        w, width = sd[key], norm.shape[-1] if norm.dim() else "width"
        if w.dim() != 2 or w.shape[1] != width:
            raise CheckpointError(f"{source}: {key} is {list(w.shape)}, expected [embed, {width}] "
                                  "(a Linear weight from the tower's width to the shared embedding)")
    embeds = {sd[k].shape[0] for k in widths}
    if len(embeds) > 1:
        raise CheckpointError(f"{source}: visual_projection.weight and text_projection.weight project to different "
                              f"sizes ({sd['visual_projection.weight'].shape[0]} vs "
                              f"{sd['text_projection.weight'].shape[0]})")
    if sd["logit_scale"].numel() != 1:
        raise CheckpointError(f"{source}: logit_scale holds {sd['logit_scale'].numel()} values, expected one")


def _layers(layers: dict, prefix: str, label: str, source: str) -> dict[str, torch.Tensor]:
    """One tower's transformer layers: renamed, q/k/v fused into in_proj (open_clip's
    nn.MultiheadAttention keeps them as one [3·width, width] matrix, q then k then v)."""
    out: dict[str, torch.Tensor] = {}
    qkv: dict[int, dict[str, torch.Tensor]] = {}
    unknown = []
    for k, (i, rest, v) in layers.items():
        if rest in _LAYER_RENAME:
            out[f"{prefix}{i}.{_LAYER_RENAME[rest]}"] = v
        elif q := _QKV.match(rest):
            qkv.setdefault(i, {})[f"{q.group(1)}.{q.group(2)}"] = v
        else:
            unknown.append(k)
    if unknown:
        raise CheckpointError(f"{source}: unknown Hugging Face CLIP keys: {', '.join(unknown[:8])}")
    for i, parts in qkv.items():
        for kind, name in (("weight", "in_proj_weight"), ("bias", "in_proj_bias")):
            missing = [c for c in "qkv" if f"{c}.{kind}" not in parts]
            if missing:
                raise CheckpointError(f"{source}: {label} {i} lacks the {'/'.join(missing)} projection {kind}")
            shapes = {c: tuple(parts[f"{c}.{kind}"].shape) for c in "qkv"}
            if len({s[1:] for s in shapes.values()}) > 1:  # torch.cat's own message named no file
                raise CheckpointError(f"{source}: {label} {i}: the q/k/v projection {kind}s differ in shape ("
                                      + ", ".join(f"{c}_proj {list(s)}" for c, s in shapes.items())
                                      + "): not one CLIP attention layer")
            out[f"{prefix}{i}.attn.{name}"] = torch.cat([parts[f"{c}.{kind}"] for c in "qkv"], 0)
    return out


def check_activation(base_path, architecture: dict, source: str) -> None:
    """A Hugging Face CLIPModel base says its activation in config.json: OpenAI's CLIP uses QuickGELU,
    and open_clip's plain model names use GELU, which loads the same weights and gives features about
    1 % off. Refused, naming the architecture to use, rather than silently off."""
    import json
    from pathlib import Path

    from merger.errors import PoolError

    folder = Path(base_path) if Path(base_path).is_dir() else Path(base_path).parent
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        act = (config.get("vision_config") or {}).get("hidden_act") or config.get("hidden_act")
    except (OSError, ValueError, AttributeError):
        return  # no readable config: nothing to compare
    if act not in ("quick_gelu", "gelu"):
        return
    if "config" in architecture:
        quick = bool(architecture["config"].get("quick_gelu"))
    else:
        from merger._compat import open_clip

        quick = bool((open_clip().get_model_config(architecture["model"]) or {}).get("quick_gelu"))
    if quick != (act == "quick_gelu"):
        if "model" in architecture:
            name = architecture["model"]
            fix = f"name {name}-quickgelu" if act == "quick_gelu" else f"name {name.removesuffix('-quickgelu')}"
        else:
            name, fix = "the inline config", f"set quick_gelu: {str(act == 'quick_gelu').lower()} in architecture.config"
        raise PoolError(f"{source}: architecture: {name} uses {'QuickGELU' if quick else 'GELU'} but the base's "
                        f"config.json says {act}: {fix}")
