"""``python -m devtools bench hub``: a pool whose sources are Hub repositories, ViT-B/32-shaped
(random weights: an open_clip base, --experts experts, each task a parquet dataset of --images test
and train images at 224 px), served by the local fake hub (devtools/fake_hub.py) and fetched
through the real huggingface_hub, as ``merger pools fetch`` does. Then opened in fresh processes,
offline from the cache: cold (merger's disk cache empty: hash, task vectors, heads, the base's
forward) and warm (read back), each to its first live answer (devtools/bench_open.py)."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from devtools.bench_open import _in_a_fresh_process
from devtools.fake_hub import FakeHub
from devtools.measure import noisy_expert, random_base
from devtools.testing import write_parquet_dataset


def _tensor_bytes(sd: dict) -> bytes:
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in sd.items()})


def _dataset(root: Path, task: str, images: int) -> dict[str, bytes]:
    """Random 224-px JPEGs over 10 classes, a train and a test parquet file (the Hub's layout)."""
    import numpy as np
    import torch

    rng, files = np.random.default_rng(len(task)), {}
    for split, n in (("train", images), ("test", images)):
        pixels = torch.from_numpy(rng.integers(0, 256, (n, 3, 224, 224), dtype=np.uint8))
        path = write_parquet_dataset(root / task / f"{split}.parquet", pixels, [i % 10 for i in range(n)],
                                     [f"class {c}" for c in range(10)])
        files[f"data/{split}-00000-of-00001.parquet"] = path.read_bytes()
    return files


def bench_hub(args) -> int:
    import torch

    from merger.methods import basic

    images = args.images or 128
    with tempfile.TemporaryDirectory(prefix="merger-hub-") as tmp:
        tmp = Path(tmp)
        print(f"building a fake hub: {args.arch} base, {args.experts} random experts, {images} train and test "
              f"images per task ...", flush=True)
        hub, g = FakeHub(), torch.Generator().manual_seed(1)
        base = random_base(args.arch)
        hub.add_repo("bench/base", {"open_clip_model.safetensors": _tensor_bytes(base)})
        tasks = [f"task{i + 1}" for i in range(args.experts)]
        for t in tasks:
            hub.add_repo(f"bench/expert_{t}", {"model.safetensors": _tensor_bytes(noisy_expert(base, 1e-3, g))})
            hub.add_repo(f"bench/{t}", _dataset(tmp / "data", t, images), kind="dataset")
        del base
        spec = {"name": f"hub-{args.arch}", "architecture": args.arch, "base": {"hub": "bench/base"},
                "experts": {t: {"hub": f"bench/expert_{t}"} for t in tasks},
                "tasks": {t: {"templates": ["a photo of a {}."], "data": {"hub": f"bench/{t}"}} for t in tasks}}
        path = tmp / "pool.yaml"
        path.write_text(yaml.safe_dump(spec))
        env = {**os.environ, "HF_HUB_CACHE": str(tmp / "hf"), "MERGER_CACHE_DIR": str(tmp / "cache"),
               "HF_HUB_DISABLE_XET": "1"}
        with hub.serving() as url:
            t0 = time.perf_counter()
            fetched = subprocess.run([sys.executable, "-m", "merger", "pools", "fetch", str(path)], text=True,
                                     capture_output=True, env={**env, "HF_ENDPOINT": url, "HF_HUB_OFFLINE": "0"})
            fetch_s = time.perf_counter() - t0
        if fetched.returncode:
            raise SystemExit(f"bench hub: the fetch failed:\n{fetched.stderr[-2000:]}")
        print(fetched.stdout)
        size = sum(f.stat().st_size for f in (tmp / "hf").rglob("*") if f.is_file() and not f.is_symlink())
        os.environ.update({**env, "HF_HUB_OFFLINE": "1"})  # the opens read the cache only
        rows = {run: _in_a_fresh_process(path, [basic.TASK_ARITHMETIC.name], args.tv_dtype, run.split()[0])
                for run in ("cold", "warm 1", "warm 2")}
    print(f"fetch: {len(hub.requests)} requests, {size / 2**30:.2f} GB into the cache in {fetch_s:.1f} s "
          f"(a fresh process, over the loopback: the Hub's own speed is the network's)")
    print(f"\n{'open':<8}{'imports s':>10}{'open s':>8}{'app up s':>10}{'first answer s':>16}{'kind':>10}"
          f"{'first TA move s':>17}{'peak RSS GB':>13}")
    for run, r in rows.items():
        print(f"{run:<8}{r['imports']:>10.2f}{r['open']:>8.2f}{r['up']:>10.2f}{r['answer']:>16.2f}{r['kind']:>10}"
              f"{r['methods'][0]:>17.2f}{r['peak']:>13.2f}")
    print("\nEach open in a fresh process, offline (HF_HUB_OFFLINE=1), from the Hugging Face cache: open = hash the "
          "files, build (cold) or read (warm) the task vectors; app up = open + model, heads, the parquet test "
          "splits decoded, the base's forward; first answer = a move in the Merge tab's listener.")
    return 0
