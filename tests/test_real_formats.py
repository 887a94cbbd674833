"""Real-world formats on small random models: HF CLIP vision experts, image folders, heads cache.

Needs the test-only dependency `transformers` (to build the HF reference model)."""
import re

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

import merger
from merger._compat import ensure_torchvision, open_clip
from merger.data import folders
from merger.errors import CheckpointError, DataError
from merger.io import checkpoints, hf_clip
from merger.io.checkpoints import save_safetensors

ensure_torchvision()  # transformers imports torchvision too
transformers = pytest.importorskip("transformers")

CONFIG = {  # open_clip tiny CLIP with OpenAI-style quick GELU, as HF CLIP uses
    "embed_dim": 16, "quick_gelu": True,
    "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 32, "layers": 2, "head_width": 16, "mlp_ratio": 2},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def hf_config():
    v = CONFIG["vision_cfg"]
    return transformers.CLIPVisionConfig(hidden_size=v["width"], intermediate_size=v["width"] * v["mlp_ratio"],
                                         num_hidden_layers=v["layers"], num_attention_heads=v["width"] // v["head_width"],
                                         image_size=v["image_size"], patch_size=v["patch_size"],
                                         projection_dim=CONFIG["embed_dim"], hidden_act="quick_gelu")


def test_hf_clip_vision_converts_to_the_same_features(tmp_path):
    torch.manual_seed(0)
    hf = transformers.CLIPVisionModelWithProjection(hf_config()).eval()
    with torch.no_grad():  # non-trivial LayerNorm and embedding values
        for p in hf.parameters():
            p.add_(0.02 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "hf")
    sd, fmt = checkpoints.load_weights(tmp_path / "hf")
    assert fmt == "hf_clip_vision"
    model = open_clip().CLIP(**CONFIG).eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all(not k.startswith("visual.") for k in missing)
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        ours = model.encode_image(x)
        ref = hf(pixel_values=x).image_embeds
    assert torch.allclose(ours, ref, atol=1e-5)


def test_hf_projections_of_different_shapes_are_named_by_file_and_layer():
    """torch.cat's own error ("Sizes of tensors must match…") named neither the file nor the layer."""
    from merger.io.hf_clip import hf_to_open_clip

    sd = transformers.CLIPVisionModelWithProjection(hf_config()).state_dict()
    key = "vision_model.encoder.layers.0.self_attn.q_proj.weight"
    sd[key] = torch.zeros(sd[key].shape[0], sd[key].shape[1] + 1)
    with pytest.raises(CheckpointError, match=r"expert\.safetensors: layer 0: the q/k/v projection weights differ in "
                                              r"shape \(q_proj \[32, 33\], k_proj \[32, 32\], v_proj \[32, 32\]\)"):
        hf_to_open_clip(sd, "expert.safetensors")


@pytest.fixture
def mixed_pool(tmp_path):
    """Base: open_clip full CLIP; experts: HF folder (no projection), tower-only .pt, full safetensors."""
    torch.manual_seed(1)
    base = open_clip().CLIP(**CONFIG).state_dict()
    save_safetensors(base, tmp_path / "base.safetensors")
    g = torch.Generator().manual_seed(2)

    def perturbed():
        return {k: v + 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                for k, v in base.items()}

    # HF CLIPVisionModel expert: built from a perturbed open_clip tower, written in HF names
    e1 = perturbed()
    hf = transformers.CLIPVisionModel(hf_config())
    inv = _open_clip_to_hf({k: v for k, v in e1.items() if k.startswith("visual.")})
    own = set(hf.state_dict())
    inv = {k if k in own else k.replace("vision_model.", "", 1): v for k, v in inv.items()}
    missing, unexpected = hf.load_state_dict(inv, strict=False)
    assert not unexpected and all("position_ids" in k for k in missing)
    hf.save_pretrained(tmp_path / "experts" / "hf_expert")
    e2 = perturbed()
    torch.save({"state_dict": {"module." + k[7:]: v for k, v in e2.items() if k.startswith("visual.")}},
               tmp_path / "experts" / "tower.pt")
    e3 = perturbed()
    save_safetensors(e3, tmp_path / "experts" / "full.safetensors")
    spec = {"name": "mixed", "architecture": {"config": CONFIG}, "base": "base.safetensors",
            "experts": {"a": "experts/hf_expert", "b": "experts/tower.pt", "c": "experts/full.safetensors"}}
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(spec))
    return tmp_path, base, (e1, e2, e3)


def _open_clip_to_hf(sd):
    """Inverse mapping, for building the HF fixture only."""
    out = {}
    inv = {v: k for k, v in hf_clip._RENAME.items()}
    for k, v in sd.items():
        if k in inv:
            out[inv[k]] = v
        elif k.startswith("visual.transformer.resblocks."):
            i, rest = k.split(".")[3], ".".join(k.split(".")[4:])
            pre = f"vision_model.encoder.layers.{i}."
            if rest in ("attn.in_proj_weight", "attn.in_proj_bias"):
                kind = "weight" if rest.endswith("weight") else "bias"
                for c, part in zip("qkv", v.chunk(3, 0)):
                    out[pre + f"self_attn.{c}_proj.{kind}"] = part
            else:
                out[pre + {b: a for a, b in hf_clip._LAYER_RENAME.items()}[rest]] = v
    return out


def test_mixed_formats_open_and_map_onto_open_clip(mixed_pool):
    root, base, (e1, e2, e3) = mixed_pool
    pool = merger.open_pool(root / "pool.yaml")
    tv = pool.task_vectors
    assert pool.expert_info["a"]["format"] == "hf_clip_vision"
    for i, e in enumerate((e1, e2, e3)):
        k = "visual.transformer.resblocks.1.attn.in_proj_weight"
        assert torch.allclose(tv.stacked[k][i], e[k] - base[k], atol=1e-6)
    # a CLIPVisionModel has no projection: taken from the base, so its task vector is zero
    assert torch.equal(tv.stacked["visual.proj"][0], torch.zeros_like(base["visual.proj"]))
    assert torch.allclose(tv.stacked["visual.proj"][1], e2["visual.proj"] - base["visual.proj"])
    merger.merge(pool, "ties", lam=1.0, sparsity=0.8)  # and it merges


def test_merge_state_dicts_reads_the_files_a_pool_reads(mixed_pool):
    """merge_state_dicts takes checkpoint paths "as a pool reads its experts": a Hugging Face
    CLIPVisionModel folder (no visual.proj) was refused ("expert_1: … missing keys: visual.proj")."""
    root, _, _ = mixed_pool
    pool = merger.open_pool(root / "pool.yaml")
    files = [root / "experts" / name for name in ("hf_expert", "tower.pt", "full.safetensors")]
    merged = merger.merge_state_dicts(root / "base.safetensors", files, "task_arithmetic", lam=0.4)
    expected = merger.merge(pool, "task_arithmetic", lam=0.4)
    assert all(torch.allclose(merged[k], expected[k], atol=1e-6) for k in expected)
    # the experts go by their file names (they were expert_1, expert_2, …): weights and subsets by them
    weighted = merger.merge_state_dicts(root / "base.safetensors", files, "task_arithmetic", lam=0.4,
                                        task_weights={"tower": 0.5}, experts=["hf_expert", "tower"])
    expected = merger.merge(pool, "task_arithmetic", lam=0.4, task_weights={pool.tasks[1]: 0.5},
                            experts=pool.tasks[:2])
    assert all(torch.allclose(weighted[k], expected[k], atol=1e-6) for k in expected)
    other = dict(CONFIG, vision_cfg=dict(CONFIG["vision_cfg"], patch_size=16))
    save_safetensors(open_clip().CLIP(**other).state_dict(), root / "b16.safetensors")
    with pytest.raises(CheckpointError, match=r"b16.safetensors \(experts\[1\]\): does not match the base"):
        merger.merge_state_dicts(root / "base.safetensors", [files[0], root / "b16.safetensors"], "task_arithmetic")


def test_expert_of_another_architecture_is_named(mixed_pool):
    root, _, _ = mixed_pool
    other = dict(CONFIG, vision_cfg=dict(CONFIG["vision_cfg"], patch_size=16))
    save_safetensors(open_clip().CLIP(**other).state_dict(), root / "experts" / "b16.safetensors")
    spec = yaml.safe_load((root / "pool.yaml").read_text())
    spec["experts"]["c"] = "experts/b16.safetensors"
    (root / "pool.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(CheckpointError, match=r"b16.safetensors \(expert 'c'\): does not match the base "
                                              r"\(another architecture\? patch size 16 vs the base's 8\)"):
        merger.open_pool(root / "pool.yaml")


def _write_images(folder, classes, per_class, seed=0, size=40):
    rng = np.random.default_rng(seed)
    for c in classes:
        (folder / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            arr = (rng.random((size, size, 3)) * 255).astype(np.uint8)
            arr[..., classes.index(c) % 3] = 255  # a class-dependent channel
            Image.fromarray(arr).save(folder / c / f"{i:03d}.{'png' if i % 2 else 'jpg'}")


@pytest.fixture
def folder_pool(mixed_pool):
    root, _, _ = mixed_pool
    classes = ["cat", "dog", "fish"]
    for split, n in (("train", 6), ("test", 4)):
        _write_images(root / "data" / split, classes, n, seed=len(split))
    (root / "data" / "test" / "dog" / "broken.png").write_bytes(b"not an image")
    (root / "classes.txt").write_text("cat\ndog\nfish\n")
    spec = yaml.safe_load((root / "pool.yaml").read_text())
    spec["tasks"] = {
        "a": {"classes": classes, "data": {"folder": "data"}},
        "b": {"classes": "classes.txt", "templates": ["a photo of a {}."], "data": {"folder": {"root": "data"}}},
        "c": {"classes": classes, "data": {"folder": "data"}},
    }
    (root / "pool.yaml").write_text(yaml.safe_dump(spec))
    return root


def test_folder_tasks_load_with_the_right_labels(folder_pool, caplog):
    (folder_pool / "data" / "test" / ".ipynb_checkpoints").mkdir()  # Jupyter's: no class
    pool = merger.open_pool(folder_pool / "pool.yaml")
    ev = merger.Evaluator(pool)
    with caplog.at_level("WARNING", logger="merger.data.folders"):
        test = ev.data.split("a", "test")
    assert test.images.shape == (12, 3, 32, 32)  # resized to the model's input size
    assert test.labels.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    # the broken file, counted in a warning naming its folder
    assert f"{folder_pool / 'data' / 'test'}: skipped 1 unreadable image(s)" in caplog.messages
    assert ev.data.classes("b") == ["cat", "dog", "fish"]
    res = ev.evaluate(None, "test")
    assert set(res.accuracy) == {"a", "b", "c"} and res.counts["a"] == 12
    # tasks reading the same folder share one forward
    assert len(ev.inputs("test")) == 1
    # live and the landscape's probe are drawn from the test folder, val from train
    for split in ("live", "probe"):
        assert torch.equal(ev.data.split("a", split).images, test.images)  # 12 test images: all of them
    assert ev.data.split("a", "val").labels.numel() == 2  # 10 % of the 18 train images


def test_folder_layout_and_class_mismatches(folder_pool):
    import shutil

    spec = yaml.safe_load((folder_pool / "pool.yaml").read_text())
    spec["tasks"]["a"]["classes"] = ["cat", "dog", "bird"]
    (folder_pool / "pool.yaml").write_text(yaml.safe_dump(spec))
    ev = merger.Evaluator(merger.open_pool(folder_pool / "pool.yaml"))
    with pytest.raises(DataError, match="class folders in .* do not match the class names; missing: bird; unexpected: fish"):
        ev.evaluate(None, "test")
    shutil.rmtree(folder_pool / "data" / "test")
    ev = merger.Evaluator(merger.open_pool(folder_pool / "pool.yaml"))
    with pytest.raises(DataError, match=r"data/test is missing \(expected <root>/test/<class>/\*.png; found train\)"):
        ev.evaluate(None, "test")


@pytest.mark.parametrize("template", ["a {} {}", "a {name}", "a { photo of {}", "a photo"])
def test_a_template_the_heads_cannot_fill_is_named(folder_pool, template):
    """A template str.format cannot fill with one class name raised IndexError mid-evaluation."""
    spec = yaml.safe_load((folder_pool / "pool.yaml").read_text())
    spec["tasks"]["b"]["templates"] = ["a photo of a {}.", template]
    (folder_pool / "pool.yaml").write_text(yaml.safe_dump(spec))
    pool = merger.open_pool(folder_pool / "pool.yaml")
    with pytest.raises(DataError, match=r"pool.yaml: tasks.b.templates: every template needs one '\{\}' for the class name.*"
                                        rf"\(not: '{re.escape(template)}'\)"):
        merger.Evaluator(pool).evaluate(None, "test")  # the heads are built with the evaluator


def test_heads_are_cached_on_disk(folder_pool, monkeypatch):
    pool = merger.open_pool(folder_pool / "pool.yaml")
    first = merger.Evaluator(pool).heads
    from merger.data import heads

    def refuse(*a, **k):
        raise AssertionError("heads should come from the disk cache")

    monkeypatch.setattr(heads, "zero_shot_head", refuse)
    second = merger.Evaluator(pool).heads
    assert all(torch.equal(first[t], second[t]) for t in first)


class WholeModel:
    """Stands for a pickled nn.Module: loading it needs code, which we refuse to run."""


def test_pickled_checkpoint_refusal_says_how_to_convert(tmp_path):
    import pickle

    path = tmp_path / "expert.bin"
    with open(path, "wb") as fh:
        pickle.dump({"model": WholeModel()}, fh)
    # the hint loads what torch 2.6+ refuses by default (weights_only=True)
    with pytest.raises(CheckpointError, match=r"refused.*execute code\. Convert it on a machine where you trust it.*"
                                              r"torch\.load\(p, weights_only=False\)"):
        checkpoints.load_weights(path)
    torch.save(torch.nn.Linear(2, 2), tmp_path / "whole.pt")  # a whole saved model: named
    with pytest.raises(CheckpointError, match=r"execute code \(it holds a torch\.nn\.modules\.linear\.Linear\)\."):
        checkpoints.load_weights(tmp_path / "whole.pt")


def test_a_pool_without_its_image_statistics_says_which_it_uses(folder_pool, caplog):
    """A missing preprocess scored the demo's expert 92.0 % instead of 95.7 %, and nothing said why."""
    spec = yaml.safe_load((folder_pool / "pool.yaml").read_text())
    spec.pop("preprocess", None)
    (folder_pool / "pool.yaml").write_text(yaml.safe_dump(spec))
    with caplog.at_level("WARNING", logger="merger.pool.pool"):
        merger.open_pool(folder_pool / "pool.yaml")
    assert f"{folder_pool / 'pool.yaml'}: preprocess gives no mean and std: images are normalised with OpenAI " \
           "CLIP's" in caplog.text
    caplog.clear()
    (folder_pool / "pool.yaml").write_text(yaml.safe_dump({**spec, "base": "missing.pt"}))
    with caplog.at_level("WARNING", logger="merger.pool.pool"), pytest.raises(CheckpointError, match="missing.pt"):
        merger.open_pool(folder_pool / "pool.yaml")  # a pool that does not open: its error alone
    assert "preprocess" not in caplog.text
    spec["preprocess"] = {"image_size": 32, "mean": [0.5] * 3, "std": [0.25] * 3}
    (folder_pool / "pool.yaml").write_text(yaml.safe_dump(spec))
    caplog.clear()
    with caplog.at_level("WARNING", logger="merger.pool.pool"):
        merger.open_pool(folder_pool / "pool.yaml")
    assert "preprocess" not in caplog.text
