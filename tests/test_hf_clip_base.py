"""A whole Hugging Face CLIPModel (openai/clip-vit-base-patch32's format) as a pool's base: both
towers converted to open_clip's CLIP names, checked against transformers' own forward on a tiny
random model.

Needs the test-only dependency `transformers` (to build the HF reference model)."""
import re

import pytest
import torch
import yaml

import merger
from merger._compat import ensure_torchvision, open_clip
from merger.errors import CheckpointError
from merger.io import checkpoints
from merger.io.checkpoints import save_safetensors

ensure_torchvision()  # transformers imports torchvision too
transformers = pytest.importorskip("transformers")

VOCAB, CONTEXT = 64, 16
EOT, SOT = VOCAB - 1, VOCAB - 2  # as OpenAI's vocabulary: <end_of_text> is its largest id, <start_of_text> next
CONFIG = {  # open_clip tiny CLIP with OpenAI-style quick GELU, as HF CLIP uses; embed ≠ widths, so a
    # projection left untransposed cannot load
    "embed_dim": 16, "quick_gelu": True,
    "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 32, "layers": 2, "head_width": 16, "mlp_ratio": 2},
    "text_cfg": {"context_length": CONTEXT, "vocab_size": VOCAB, "width": 24, "heads": 2, "layers": 2, "mlp_ratio": 2},
}


def hf_config(eos_token_id=EOT):
    v, t = CONFIG["vision_cfg"], CONFIG["text_cfg"]
    vision = transformers.CLIPVisionConfig(
        hidden_size=v["width"], intermediate_size=v["width"] * v["mlp_ratio"], num_hidden_layers=v["layers"],
        num_attention_heads=v["width"] // v["head_width"], image_size=v["image_size"], patch_size=v["patch_size"],
        projection_dim=CONFIG["embed_dim"], hidden_act="quick_gelu")
    text = transformers.CLIPTextConfig(
        vocab_size=t["vocab_size"], max_position_embeddings=t["context_length"], hidden_size=t["width"],
        intermediate_size=t["width"] * t["mlp_ratio"], num_hidden_layers=t["layers"], num_attention_heads=t["heads"],
        projection_dim=CONFIG["embed_dim"], hidden_act="quick_gelu",
        bos_token_id=SOT, eos_token_id=eos_token_id, pad_token_id=0)
    return transformers.CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                   projection_dim=CONFIG["embed_dim"])


def hf_clip(seed=0, eos_token_id=EOT):
    torch.manual_seed(seed)
    hf = transformers.CLIPModel(hf_config(eos_token_id)).eval()
    with torch.no_grad():  # non-trivial LayerNorm, embedding and logit_scale values
        for p in hf.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return hf


def tokens(seed=0):
    """Sequences on which both poolings read the same position: open_clip pools at the argmax id,
    transformers at the first eos_token_id (or, for the legacy eos_token_id=2 of openai's configs, at
    the argmax too). With EOT the largest id and appearing once, followed by padding 0, all agree;
    lengths differ, and one sequence fills the context (EOT at the last position)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in (1, 5, CONTEXT - 2):
        row = torch.zeros(CONTEXT, dtype=torch.long)
        row[0], row[n + 1] = SOT, EOT
        row[1:n + 1] = torch.randint(1, SOT, (n,), generator=g)
        rows.append(row)
    return torch.stack(rows)


def features(out):
    """transformers 5 returns an output whose pooler_output is projected; 4.x the tensor."""
    return out.pooler_output if hasattr(out, "pooler_output") else out


def close(ours, ref, rel=1e-5):
    return (ours - ref).abs().max() <= rel * ref.abs().max()


# eos_token_id=2: openai/clip-vit-*'s config.json, which transformers reads as "pool at the argmax"
@pytest.mark.parametrize("eos_token_id", [EOT, 2])
def test_hf_clip_model_converts_to_the_same_features(tmp_path, eos_token_id):
    hf = hf_clip(eos_token_id=eos_token_id)
    hf.save_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").exists()
    for where in (tmp_path / "hf", tmp_path / "hf" / "model.safetensors"):  # the folder or its weights file
        sd, fmt = checkpoints.load_weights(where)
        assert fmt == "hf_clip"
    model = open_clip().CLIP(**CONFIG).eval()
    model.load_state_dict(sd, strict=True)  # every open_clip key, nothing else (position_ids dropped)
    assert set(sd) == set(model.state_dict())
    x, text = torch.randn(4, 3, 32, 32), tokens()
    with torch.no_grad():
        assert close(model.encode_image(x), features(hf.get_image_features(pixel_values=x)))
        assert close(model.encode_text(text), features(hf.get_text_features(input_ids=text)))
    assert sd["logit_scale"].shape == model.logit_scale.shape == ()
    assert torch.equal(model.logit_scale.detach(), hf.logit_scale.detach())
    assert torch.equal(sd["text_projection"], hf.text_projection.weight.detach().T)
    assert torch.equal(sd["visual.proj"], hf.visual_projection.weight.detach().T)


def test_wrapper_prefixes_are_stripped(tmp_path):
    hf = hf_clip()
    save_safetensors({"clip." + k: v for k, v in hf.state_dict().items()}, tmp_path / "wrapped.safetensors")
    sd, fmt = checkpoints.load_weights(tmp_path / "wrapped.safetensors")
    assert fmt == "hf_clip"
    open_clip().CLIP(**CONFIG).load_state_dict(sd, strict=True)


@pytest.mark.parametrize("key", ["text_model.final_layer_norm.weight",
                                 "text_model.encoder.layers.1.self_attn.k_proj.bias", "text_projection.weight",
                                 "logit_scale"])
def test_a_clip_model_missing_a_key_is_refused_naming_it(tmp_path, key):
    sd = hf_clip().state_dict()
    del sd[key]
    save_safetensors(sd, tmp_path / "base.safetensors")
    with pytest.raises(CheckpointError, match=r"base\.safetensors: incomplete Hugging Face CLIPModel: missing keys: "
                                              + re.escape(key) + "$"):
        checkpoints.load_weights(tmp_path / "base.safetensors")


def test_a_projection_of_another_layout_is_named(tmp_path):
    sd = hf_clip().state_dict()
    sd["text_projection.weight"] = sd["text_projection.weight"].T.contiguous()  # already open_clip's [width, embed]
    save_safetensors(sd, tmp_path / "base.safetensors")
    with pytest.raises(CheckpointError, match=r"base\.safetensors: text_projection\.weight is \[24, 16\], "
                                              r"expected \[embed, 24\]"):
        checkpoints.load_weights(tmp_path / "base.safetensors")


def test_vision_only_models_keep_their_format(tmp_path):
    hf = transformers.CLIPVisionModelWithProjection(hf_config().vision_config)
    hf.save_pretrained(tmp_path / "vision")
    sd, fmt = checkpoints.load_weights(tmp_path / "vision")
    assert fmt == "hf_clip_vision" and all(k.startswith("visual.") for k in sd)


def test_a_pool_opens_on_a_hf_clip_model_base(tmp_path):
    """The base and an expert as Hugging Face CLIPModel folders, another expert in open_clip names."""
    base, expert = hf_clip(0), hf_clip(1)
    base.save_pretrained(tmp_path / "base")
    expert.save_pretrained(tmp_path / "expert")
    tuned = open_clip().CLIP(**CONFIG).state_dict()
    save_safetensors(tuned, tmp_path / "tuned.safetensors")
    spec = {"name": "hf_base", "architecture": {"config": CONFIG}, "base": "base",
            "experts": {"a": "expert", "b": "tuned.safetensors"}}
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(spec))
    pool = merger.open_pool(tmp_path / "pool.yaml")
    assert pool.base_format == "hf_clip" and pool.expert_info["a"]["format"] == "hf_clip"
    assert torch.equal(pool.base["logit_scale"], base.logit_scale.detach())
    # the expert's own projection (a CLIPModel has one), not the base's
    proj = expert.visual_projection.weight.detach().T - base.visual_projection.weight.detach().T
    assert torch.allclose(pool.task_vectors.stacked["visual.proj"][0], proj, atol=1e-6)
    merged = merger.merge(pool, "task_arithmetic", lam=0.3)
    assert set(merged) == set(pool.base)
