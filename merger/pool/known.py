"""The field's CLIP merging benchmarks as pools on the Hugging Face Hub: ``--pool hub:NAME``.

A name is ``clip-vit-{b32,b16,l14}-{ta8,ta14,ta20}``: OpenAI's CLIP (``openai/clip-vit-…``, a
``CLIPModel``) as the base, FusionBench's experts (``tanganke/clip-vit-…_<task>``, each a
``CLIPVisionModel`` fine-tuned on one task) and each task's train and test splits (parquet), with
the class names and templates of the task-vectors code (arXiv:2212.04089) that FusionBench reuses
(``clip_tasks.yaml``, data). The 8-task set is task arithmetic's; the 14- and 20-task sets are
arXiv:2405.07813's.
"""
from __future__ import annotations

from pathlib import Path

import yaml

from merger.errors import PoolError

# short name: (open_clip model, base repo, FusionBench's expert prefix). OpenAI's CLIP uses QuickGELU:
# open_clip's plain ViT-B-32 (GELU) would take these weights and give features about 1 % off.
ARCHITECTURES = {
    "b32": ("ViT-B-32-quickgelu", "openai/clip-vit-base-patch32", "tanganke/clip-vit-base-patch32_"),
    "b16": ("ViT-B-16-quickgelu", "openai/clip-vit-base-patch16", "tanganke/clip-vit-base-patch16_"),
    "l14": ("ViT-L-14-quickgelu", "openai/clip-vit-large-patch14", "tanganke/clip-vit-large-patch14_"),
}
# Test sets FusionBench reads from elsewhere than tanganke/<task> (its dataset configs), with their
# split names where they differ from train/test.
DATASETS = {
    "oxford_flowers102": {"hub": "dpdl-benchmark/oxford_flowers102"},
    "oxford-iiit-pet": {"hub": "timm/oxford-iiit-pet"},
    "pcam": {"hub": "1aurent/PatchCamelyon"},
    "food101": {"hub": "ethz/food101", "test": "validation"},
}
OPENAI_PREPROCESS = {"image_size": 224, "mean": [0.48145466, 0.4578275, 0.40821073],
                     "std": [0.26862954, 0.26130258, 0.27577711]}


def _facts(text: str | None = None) -> dict:
    doc = yaml.safe_load(text if text is not None else (Path(__file__).parent / "clip_tasks.yaml").read_text("utf-8"))
    return doc


def names(facts: dict | None = None) -> list[str]:
    facts = facts or _facts()
    return [f"clip-vit-{arch}-{bench}" for arch in ARCHITECTURES for bench in facts["benchmarks"]]


def pool_spec(name: str, facts: dict | None = None) -> dict:
    """The pool YAML of a known benchmark, as a mapping (Hub sources, classes, templates)."""
    facts = facts or _facts()
    known = names(facts)
    if name not in known:
        raise PoolError(f"hub:{name}: not a known pool; known: {', '.join(known)} (or a pool YAML whose sources "
                        "name Hub repositories: docs/formats.md)")
    arch, bench = name.removeprefix("clip-vit-").split("-", 1)
    model, base, prefix = ARCHITECTURES[arch]
    tasks = facts["benchmarks"][bench]
    return {
        "name": name,
        "description": f"OpenAI CLIP {model} and FusionBench's {len(tasks)} experts ({bench})",
        "architecture": model,
        "base": {"hub": base},
        "preprocess": dict(OPENAI_PREPROCESS),
        "experts": {t: {"hub": prefix + t} for t in tasks},
        "tasks": {t: {"classes": list(facts["tasks"][t]["classes"]), "templates": list(facts["tasks"][t]["templates"]),
                      "data": dict(DATASETS.get(t, {"hub": f"tanganke/{t}"}))} for t in tasks},
    }
