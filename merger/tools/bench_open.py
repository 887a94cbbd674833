"""``bench open``: a ViT-B/32-size pool written to files, opened twice: cold (hash, read one
expert at a time, prepare, write the disk cache) and warm (the same files again: stacks and
preparations read from the disk cache), in fresh sessions. Task vectors only: no forward."""
from __future__ import annotations

import gc
import os
import tempfile
import time
from pathlib import Path

import yaml

from merger.tools.measure import LIVE_METHODS, random_pool, reset_peak_rss, rss_gb


def write_random_pool(root: Path, arch: str, experts: int) -> Path:
    from merger.io.checkpoints import save_safetensors

    base, sds = random_pool(arch, experts)
    save_safetensors(base, root / "base.safetensors")
    for t in list(sds):
        save_safetensors(sds.pop(t), root / f"{t}.safetensors")
    spec = {"name": f"random-{arch}", "architecture": arch, "base": "base.safetensors",
            "experts": {f"task{i + 1}": f"task{i + 1}.safetensors" for i in range(experts)}}
    (root / "pool.yaml").write_text(yaml.safe_dump(spec))
    return root / "pool.yaml"


def bench_open(args) -> int:
    from merger.evaluation.session import PoolSession
    from merger.pool.pool import open_pool

    from merger.methods import basic, lowrank

    names = args.methods.split(",") if args.methods else [basic.TASK_ARITHMETIC.name] + list(LIVE_METHODS[1:]) + [
        lowrank.TSV_M.name]
    with tempfile.TemporaryDirectory(prefix="merger-open-") as tmp:
        os.environ["MERGER_CACHE_DIR"] = str(Path(tmp) / "cache")  # a cold cache, removed afterwards
        print(f"writing {args.arch} base + {args.experts} random experts to {tmp} ...", flush=True)
        path = write_random_pool(Path(tmp), args.arch, args.experts)
        gc.collect()
        rows = {}
        for run in ("cold", "warm"):
            reset_peak_rss()
            t0 = time.perf_counter()
            pool = open_pool(path, tv_dtype=args.tv_dtype)
            opened = time.perf_counter() - t0
            session = PoolSession(pool)
            times = []
            for name in names:
                t1 = time.perf_counter()
                session.merges.delta(session.spec(name))  # prepare (or read) + the first apply
                times.append(time.perf_counter() - t1)
            rows[run] = (opened, times, rss_gb())
            del pool, session
            gc.collect()
        print(f"\n{'open':<6}{'open s':>8}" + "".join(f"{n + ' s':>18}" for n in names) + f"{'resident GB':>13}")
        for run, (opened, times, (rss, peak)) in rows.items():
            print(f"{run:<6}{opened:>8.2f}" + "".join(f"{t:>18.2f}" for t in times) + f"{rss:>13.2f}")
        warm = rows["warm"][0] + max(rows["warm"][1])
        print(f"\nopen = hash the files (remembered when warm), build or read the bf16 task vectors; each method = its "
              f"preparation (cold: computed and written; warm: read from the disk cache) + the first apply.")
        print(f"goal: a second open to a merged Δ of any of these methods <= 3 s: "
              f"{warm:.2f} s " + ("met" if warm <= 3 else "MISSED"))
    return 0 if warm <= 3 else 1
