"""Small random CLIP pools (open_clip's own CLIP class, a tiny config): for the tests, the
benchmarks and the bad-input catalogue. Nothing is downloaded; everything is seeded."""
from __future__ import annotations

import math
from pathlib import Path

import torch
import yaml

from merger._compat import open_clip
from merger.io.checkpoints import save_safetensors

TINY_CONFIG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 16, "patch_size": 8, "width": 32, "layers": 2, "head_width": 16, "mlp_ratio": 2},
    "text_cfg": {"context_length": 8, "vocab_size": 64, "width": 32, "heads": 2, "layers": 1},
}


def demo_config() -> dict:
    """TINY_CONFIG with the demo tokenizer's vocabulary and 32-pixel images (for demo data)."""
    from merger.demo.tokenizer import DemoTokenizer

    tok = DemoTokenizer()
    cfg = {k: dict(v) if isinstance(v, dict) else v for k, v in TINY_CONFIG.items()}
    cfg["vision_cfg"].update(image_size=32, patch_size=8)
    cfg["text_cfg"].update(vocab_size=tok.vocab_size, context_length=tok.context_length)
    return cfg


def tiny_model(seed: int = 0, config: dict | None = None):
    torch.manual_seed(seed)
    return open_clip().CLIP(**(config or TINY_CONFIG)).eval()


def base_and_experts(n_experts: int = 3, scale: float = 0.05, seed: int = 0, config: dict | None = None):
    """A full CLIP base and image-tower experts: base + random perturbations."""
    base = tiny_model(seed, config).state_dict()
    g = torch.Generator().manual_seed(seed + 1)
    experts = []
    for _ in range(n_experts):
        sd = {}
        for k, v in base.items():
            if k.startswith("visual."):
                sd[k] = v + scale * torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone()
        experts.append(sd)
    return base, experts


def write_pool(root: Path, n_experts: int = 3, scale: float = 0.05, tasks=None, demo_data: bool = False,
               own_images: bool = False) -> Path:
    """A random pool; with ``demo_data`` its tasks are the demo world's, with small data splits
    (one image set labelled by every task, or with ``own_images`` a set per task)."""
    from merger.demo import world

    config = demo_config() if demo_data else TINY_CONFIG
    base, experts = base_and_experts(n_experts, scale, config=config)
    if demo_data:
        tasks = list(world.TASKS)[:n_experts]
    tasks = tasks or [f"task{i}" for i in range(n_experts)]
    save_safetensors(base, root / "base.safetensors")
    for t, sd in zip(tasks, experts):
        save_safetensors(sd, root / "experts" / f"{t}.safetensors")
    spec = {
        "name": "tiny",
        "architecture": {"config": config},
        "base": "base.safetensors",
        "experts": {t: f"experts/{t}.safetensors" for t in tasks},
    }
    if demo_data:
        from merger.demo import model as demo_model

        spec["tokenizer"] = "demo"
        spec["preprocess"] = {"image_size": 32, "mean": list(demo_model.MEAN), "std": list(demo_model.STD)}
        def data(i):
            off = 100 * i if own_images else 0
            return {"demo": {"train": {"n": 400, "seed": 11 + off}, "test": {"n": 300, "seed": 12 + off}}}

        spec["tasks"] = {t: {"classes": list(world.TASKS[t]), "templates": list(world.TEMPLATES[t]), "data": data(i)}
                         for i, t in enumerate(tasks)}
    (root / "pool.yaml").write_text(yaml.safe_dump(spec))
    return root / "pool.yaml"


# One ViT-B/32 block's matrices and one of its other tensors: the shapes people merge.
VIT_B32_BLOCK = {
    "visual.transformer.resblocks.0.attn.in_proj_weight": (2304, 768),
    "visual.transformer.resblocks.0.attn.out_proj.weight": (768, 768),
    "visual.transformer.resblocks.0.mlp.c_fc.weight": (3072, 768),
    "visual.transformer.resblocks.0.mlp.c_proj.weight": (768, 3072),
    "visual.transformer.resblocks.0.ln_1.bias": (768,),
}


def realistic_task_vectors(T: int, shapes: dict, dtype: str = "float32", seed: int = 0, scale: float = 1e-3,
                           apart: float = 1.0):
    """Task vectors shaped as fine-tuned ones are (TaskVectors, base zero): per matrix a low-rank part all
    tasks share, a low-rank part of each task's own and dense noise (both times ``apart``: small, and the
    experts are nearly alike), singular values that decay; other tensors dense noise. Stored in ``dtype``
    as a pool would."""
    from merger.pool.task_vectors import TaskVectors

    g = torch.Generator().manual_seed(seed)

    def low_rank(m, n, rank):
        u = torch.linalg.qr(torch.randn(m, rank, generator=g, dtype=torch.float64))[0]
        v = torch.linalg.qr(torch.randn(n, rank, generator=g, dtype=torch.float64))[0]
        return (u * torch.exp(-torch.arange(rank, dtype=torch.float64) / (rank / 4))) @ v.T

    base = {k: torch.zeros(s) for k, s in shapes.items()}
    shared = {k: low_rank(*s, 24) for k, s in shapes.items() if len(s) == 2}
    experts = {}
    for t in range(T):
        expert = {}
        for k, s in shapes.items():
            noise = torch.randn(s, generator=g, dtype=torch.float64) / math.sqrt(max(s))
            own = 0.7 * shared[k] + apart * (low_rank(*s, 48) + 0.15 * noise) if len(s) == 2 else noise
            expert[k] = (scale * own).float()
        experts[f"task{t + 1}"] = expert
    return TaskVectors(base, experts, dtype=dtype)


def write_parquet_dataset(path: Path, images, labels, class_names: list[str], image_column: str = "image",
                          label_column: str = "label", rows_per_group: int = 64) -> Path:
    """A parquet image dataset as the Hugging Face Hub stores one: PNG bytes in an ``{bytes, path}``
    struct column, integer labels, and the ``ClassLabel`` names in the ``huggingface`` metadata."""
    import io
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    encoded = []
    for i, img in enumerate(images):
        buf = io.BytesIO()
        Image.fromarray(img.permute(1, 2, 0).numpy()).save(buf, format="PNG")
        encoded.append({"bytes": buf.getvalue(), "path": f"{i}.png"})
    features = {image_column: {"_type": "Image"}, label_column: {"names": list(class_names), "_type": "ClassLabel"}}
    table = pa.table({image_column: encoded, label_column: pa.array([int(x) for x in labels], pa.int64())})
    table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=rows_per_group)
    return path
