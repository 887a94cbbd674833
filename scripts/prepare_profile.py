"""Where TSV-M's and Iso-CTS's CPU preparations spend their time (issue 6/8, part 1): each preparation's
wall time, the process's CPU time and the core time left idle (workers × wall − CPU), and each LAPACK/BLAS
routine's core time (summed over the LAPACK workers), on the random ViT-B/32 × 8 pool of ``bench merge``;
then the floor those core times put on the wall time (their sum / the workers), and the routines' cost
at 768², two at once, as in a preparation.
Usage: PYTHONPATH=. python3 scripts/prepare_profile.py [ViT-B-32 [8]]"""
from __future__ import annotations

import collections
import gc
import statistics
import sys
import threading
import time

import torch

from merger.methods import iso_cts, lapack, linalg, lowrank, native
from merger.pool.pool import pool_from_state_dicts
from merger.tools.measure import random_pool

CORE = collections.defaultdict(float)
ALL = "all"
_LOCK = threading.Lock()
_INSIDE = threading.local()


def timing(fn, label: str):
    """fn, adding the time of each call (on whichever thread) to CORE[label]; a call inside another call
    of the same label (a worker's nested side_by_side) counts once."""
    def wrapper(*args, **kwargs):
        inside = _INSIDE.__dict__.setdefault("labels", set())
        if label in inside:
            return fn(*args, **kwargs)
        inside.add(label)
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            inside.discard(label)
            with _LOCK:
                CORE[label] += time.perf_counter() - t
    return wrapper


def count_routines() -> None:
    """Time the leaf routines where the preparations look them up (none calls another of them), and every
    call a LAPACK worker runs (linalg.side_by_side: a matrix's or a task's whole work)."""
    for module in (linalg, lowrank, iso_cts):
        for name, label in (("gram_rows", "Grams (?syrk; bf16: native.gram_bf16)"), ("top_eigh", "top / full eigenpairs (?syevr, eigh)"),
                            ("polar_svd", "square polar SVDs (sgesdd)"), ("refined_inverse_sqrt", "refined G^-1/2"),
                            ("inverse_sqrt", "fp64 G^-1/2 (Iso-CTS' polar factors)"),
                            ("_tsv_product", "TSV-M's last direction products")):
            if hasattr(module, name):
                setattr(module, name, timing(getattr(module, name), label))
    side_by_side = linalg.side_by_side
    linalg.side_by_side = lambda fn, items: side_by_side(timing(fn, ALL), items)


def profile(name: str, prepare) -> None:
    CORE.clear()
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    prepare()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    core = CORE.pop(ALL, 0.0)
    print(f"\n{name}: preparation {wall:.2f} s of wall time, {cpu:.2f} s of CPU time, "
          f"{linalg.workers() * wall - cpu:.2f} s of core time idle")
    for label, seconds in sorted(CORE.items()):
        print(f"  core {seconds:6.2f} s  {label}")
    print(f"  core {core:6.2f} s  all the workers' work (the routines above, their products and conversions)")
    print(f"  floor: {core:.1f} s of core time on {linalg.workers()} workers = {core / linalg.workers():.1f} s of wall time "
          f"with perfect balance and nothing on the main thread")


def routine_costs() -> None:
    """Milliseconds per call of each routine on 768² fp32, as many at once as there are workers."""
    a = [torch.randn(768, 768) for _ in range(4 * linalg.workers())]
    g = [x @ x.mT for x in a]
    rows = [("torch eigh, fp32", torch.linalg.eigh, g), ("torch eigh, fp64", lambda x: torch.linalg.eigh(x.double()), g),
            ("?syevr top 96 (top_eigh)", lambda x: linalg.top_eigh(x[None], 96), g),
            ("square SVD (thin_svd)", linalg.thin_svd, a), ("torch inverse", torch.linalg.inv, a),
            ("torch QR", torch.linalg.qr, a), ("product", lambda x: x @ x, a)]
    wide = [torch.randn(768, 3072).bfloat16() for _ in range(4 * linalg.workers())]  # a c_fc τt's Gram
    rows.append(("Gram 768 × 3072 of bf16, fp32 copy + ?syrk", lambda x: lapack.gram_rows(x.float(), True), wide))
    if native.ready():
        rows.append(("Gram 768 × 3072 of bf16, native.gram_bf16", lambda x: native.gram_bf16(x, True), wide))
    print(f"\nroutines on 768², fp32 (a Gram's rows: 768 × 3072), {linalg.workers()} at once (ms per call; SciPy LAPACK ready: {lapack.ready()}):")
    for label, fn, items in rows:
        times = []
        for _ in range(3):
            t = time.perf_counter()
            list(linalg.side_by_side(fn, items))
            times.append((time.perf_counter() - t) / len(items) * linalg.workers())
        print(f"  {statistics.median(times) * 1e3:7.1f}  {label}")


def main(arch: str = "ViT-B-32", n_experts: int = 8) -> None:
    base, experts = random_pool(arch, n_experts)
    pool = pool_from_state_dicts("profile", arch, base, experts)
    del experts
    gc.collect()
    tv = pool.task_vectors
    print(f"{arch} x {n_experts}, task vectors in {tv.dtype}, {linalg.workers()} LAPACK workers")
    count_routines()
    profile("TSV-M", lambda: lowrank.prepare_tsv(tv))
    profile("Iso-CTS", lambda: iso_cts.prepare_iso_cts(tv, 0.8))
    routine_costs()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "ViT-B-32", int(sys.argv[2]) if len(sys.argv) > 2 else 8)
