"""``python -m merger demo export --out DIR``: the built-in demo pool as the files a pool of one's own
is made of (docs/formats.md): its base and experts as safetensors, each task's images as
folders ``data/<task>/{train,test}/<class>/*.png``, and a pool.yaml naming them, to copy and edit."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import yaml

from merger.demo import world
from merger.errors import MergerError
from merger.io import inputs

MAX_IMAGES = 2000  # per task and split


def export_demo(out: str | Path, images: int = 100) -> Path:
    """Write the demo pool under ``out`` (a new or empty folder) with ``images`` images per task and
    split drawn from the demo's own train and test draws; returns pool.yaml's path."""
    from PIL import Image

    from merger.pool.pool import demo_pool_path

    if not 1 <= int(images) <= MAX_IMAGES:
        raise MergerError(f"--images {images}: from 1 to {MAX_IMAGES} per task and split")
    out = inputs.check_path(out, "--out", MergerError).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MergerError(f"--out {out}: exists and is not an empty folder (nothing of it is replaced)")
    source = demo_pool_path().parent
    spec = yaml.safe_load((source / "pool.yaml").read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:  # right after the folder is made: a failure (or a kill, unwound) removes it
        shutil.copy2(source / spec["base"], tmp / "base.safetensors")
        (tmp / "experts").mkdir()
        experts = {}
        for task, entry in spec["experts"].items():
            path = entry["path"] if isinstance(entry, dict) else entry
            shutil.copy2(source / path, tmp / "experts" / f"{task}.safetensors")
            experts[task] = f"experts/{task}.safetensors"
        tasks = {}
        for task, info in spec["tasks"].items():
            demo = info["data"]["demo"]
            for split in ("train", "test"):
                n = min(int(images), int(demo[split]["n"]))
                pixels, labels = world.generate(n, int(demo[split]["seed"]), fixed=demo.get("domain"))
                for c in info["classes"]:
                    (tmp / "data" / task / split / c).mkdir(parents=True)
                for i in range(n):
                    c = info["classes"][int(labels[task][i])]
                    Image.fromarray(np.ascontiguousarray(pixels[i].permute(1, 2, 0).numpy())).save(
                        tmp / "data" / task / split / c / f"{i:05d}.png")
            tasks[task] = {"classes": list(info["classes"]), "templates": list(info["templates"]),
                           "data": {"folder": f"data/{task}"}}
        pool = {"name": "my-pool", "description": "the demo pool exported as files (python -m merger demo export)",
                "architecture": spec["architecture"], "tokenizer": spec["tokenizer"],
                "preprocess": spec["preprocess"], "base": "base.safetensors", "experts": experts, "tasks": tasks}
        (tmp / "pool.yaml").write_text(yaml.safe_dump(pool, sort_keys=False, default_flow_style=None))
        for path in [tmp, *tmp.rglob("*")]:  # mkdtemp's 0700: an exported pool is an ordinary folder
            path.chmod(0o755 if path.is_dir() else 0o644)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out / "pool.yaml"
