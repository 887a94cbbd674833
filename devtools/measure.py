"""What every benchmark measures with: resident memory, percentiles, random pools of a real
architecture, the naive per-move evaluation a tool without caches does, the featured methods."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from merger import methods


def merge_settings(method: str, n: int = 5) -> list[dict]:
    """``n`` settings spread over a method's tune grid (what a user drags through)."""
    from merger.evaluation.tuning import grid_points

    points = grid_points(method)
    return [points[(i * len(points)) // n] for i in range(n)]


def rss_gb() -> tuple[float, float]:
    """(current, peak since the last reset) resident set size in GB, from /proc."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS", "VmHWM")):
            name, value = line.split(":")
            fields[name] = int(value.split()[0]) / 2**20
    return fields.get("VmRSS", float("nan")), fields.get("VmHWM", float("nan"))


def page_faults() -> int:
    """Minor page faults of this process so far: pages it touched for the first time (a VM pays
    several µs for each)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def fresh_memory_cost(gb: int = 1) -> tuple[float, float]:
    """(s per GB to touch memory the process never had, s per GB to rewrite it): what a move that
    grows the process pays per "faulted GB" on this machine (a VM backs pages lazily)."""
    import mmap

    import numpy as np

    with mmap.mmap(-1, gb << 30) as block:  # anonymous, outside the heap: fresh whatever it holds
        view = np.frombuffer(block, dtype=np.uint8)
        t0 = time.perf_counter()
        view[:] = 1
        t1 = time.perf_counter()
        view[:] = 2
        t2 = time.perf_counter()
        del view
    return (t1 - t0) / gb, (t2 - t1) / gb


def reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def random_pool(arch: str, n_experts: int, relative: float = 1e-3, seed: int = 0):
    """An open_clip model with random weights and experts = base + noise of relative size ``relative``."""
    base = random_base(arch, seed)
    g = torch.Generator().manual_seed(seed + 1)
    return base, {f"task{t + 1}": noisy_expert(base, relative, g) for t in range(n_experts)}


def random_pool_in_memory(arch: str, n_experts: int, tv_dtype: str = "auto", name: str = "bench"):
    """A pool of ``random_pool``'s state dicts held in memory (benches and reports), said as it is built."""
    from merger.pool.pool import pool_from_state_dicts

    print(f"building {arch} (pretrained=None) and {n_experts} random experts (relative size 1e-3)...", flush=True)
    base, experts = random_pool(arch, n_experts)
    return pool_from_state_dicts(name, arch, base, experts, tv_dtype=tv_dtype)


def random_base(arch: str, seed: int = 0) -> dict:
    from merger._compat import create_model

    torch.manual_seed(seed)
    model = create_model(arch)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def noisy_expert(base: dict, relative: float, g: torch.Generator) -> dict:
    """The image tower of the base plus noise of relative size ``relative`` per tensor."""
    sd = {}
    for k, v in base.items():
        if k.startswith("visual.") and v.is_floating_point():
            scale = relative * float(v.float().pow(2).mean().sqrt()) + 1e-12
            sd[k] = v + scale * torch.randn(v.shape, generator=g)
    return sd


LIVE_METHODS = tuple(m.name for m in methods.all_methods() if m.featured)


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def naive_evaluation(pool_path, method: str, params: dict, split: str = "live"):
    """What a tool without our caches does per slider move: open the pool, deepcopy a model,
    merge from scratch, re-read and preprocess the inputs, build the heads, forward."""
    import copy

    import torch.nn.functional as F

    from merger.api import merge
    from merger.data import tasks as data_mod
    from merger.data.heads import zero_shot_head
    from merger.data.heads import tokenizer_for
    from merger.pool.pool import open_pool

    data_mod._generate_cached.cache_clear()
    pool = open_pool(pool_path)
    model = copy.deepcopy(pool.build_model())
    model.load_state_dict(merge(pool, method, **params))
    store = data_mod.TaskDataStore(pool)
    tok = tokenizer_for(pool)
    acc = {}
    with torch.inference_mode():
        for t in pool.tasks:
            d = store.split(t, split)
            x = data_mod.preprocess(d.images, pool.preprocess_cfg)
            head = zero_shot_head(model, tok, store.classes(t), store.templates(t))
            feats = F.normalize(model.encode_image(x).float(), dim=-1)
            logits = model.logit_scale.exp() * feats @ head.T
            acc[t] = float((logits.argmax(-1) == d.labels).float().mean())
    return acc


def close_dicts(a: dict, b: dict, rel: float = 1e-9) -> bool:
    """Equal dicts of floats up to rounding through JSON."""
    return set(a) == set(b) and all(abs(a[k] - b[k]) <= rel * max(1.0, abs(b[k])) for k in b)
