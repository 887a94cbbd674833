"""Where a GPU slider move's time goes: a move's parts (apply, load, forward,
scores) timed apart, the image tower alone under each forward precision, and the CUDA kernels of
one move by the torch profiler. Usage (on a GPU machine): python3 devtools/gpu_profile.py ViT-B-32"""
from __future__ import annotations

import copy
import statistics
import sys
import time

import torch

from devtools.bench_scale import scale_session


def timed(fn, n: int = 10) -> float:
    """Median seconds of fn() over n calls after one warm-up, the device synchronised around each."""
    fn()
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main(arch: str, n: int = 10, images: int = 128, device: str = "cuda") -> None:
    t0 = time.perf_counter()
    ex = scale_session(arch, 8, images, device)
    ev = ex.evaluator
    print(f"{arch}: set-up {time.perf_counter() - t0:.0f} s; batch size {ev.batch_size}; tower {ev.tower_route}",
          flush=True)
    lams = iter([round(0.05 * i, 2) for i in range(-59, 60) if i != 0])  # λ snaps to 0.05: each one new
    ex.preview(ex.spec("task_arithmetic", lam=next(lams)))
    delta = ex.delta(ex.spec("task_arithmetic", lam=0.3))
    x = torch.cat([g[0] for g in ev.inputs("live")])  # every task's live images, for the tower's variants
    rows = {
        "preview (a new λ each)": lambda: ex.preview(ex.spec("task_arithmetic", lam=next(lams))),
        "evaluate(Δ) (load + forward + scores)": lambda: ev.evaluate(delta=delta, split="live"),
        "apply (Δ of a new λ)": lambda: ex.delta(ex.spec("task_arithmetic", lam=next(lams))),
        "load_delta": lambda: ev.load_delta(delta),
        "forward (features + scores)": lambda: ev.forward("live"),
        "image features, autocast bf16": lambda: ev.image_features("live"),
    }
    for name, fn in rows.items():
        print(f"  {name:<44}{timed(fn, n) * 1e3:9.1f} ms", flush=True)
    visual = ev.model.visual
    with torch.inference_mode():
        ev.autocast = False
        try:
            fp32 = timed(lambda: ev.image_features("live"), max(3, n // 3))
        finally:
            ev.autocast = True
        print(f"  {'image features, fp32':<44}{fp32 * 1e3:9.1f} ms", flush=True)
        vb = copy.deepcopy(visual).to(torch.bfloat16)
        xb = x.to(torch.bfloat16)
        print(f"  {'visual in bf16 weights (no autocast)':<44}{timed(lambda: vb(xb), n) * 1e3:9.1f} ms", flush=True)
        for bs in (128, 256, 512):
            def chunks(bs=bs):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    return [visual(x[i: i + bs]) for i in range(0, x.shape[0], bs)]
            print(f"  {'autocast in batches of ' + str(bs):<44}{timed(chunks, n) * 1e3:9.1f} ms", flush=True)
        del vb, xb
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ex.preview(ex.spec("task_arithmetic", lam=next(lams)))
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
    print(f"GPU memory peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GB", flush=True)


if __name__ == "__main__":
    arch, n, images, device = (sys.argv[1:] + ["ViT-B-32", "10", "128", "cuda"][len(sys.argv) - 1:])[:4]
    main(arch, int(n), int(images), device)
