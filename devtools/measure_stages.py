"""Resident memory per stage of a pool from files, as the app opens and moves it: ``python -m
devtools.measure_stages POOL.yaml`` (or ``--write DIR``: first write a random pool of ``--arch``
(ViT-B-32) × 8 with 16 test images per task there, then measure it in a fresh process). Prints the
resident set after each stage (``--stages``: the methods moved, in order) and the highest one sampled
within each part of the stage (the merge, the load of θ0 + Δ, the forwards), then the tensors held after
the last one, by owner (docs/memory.md)."""
from __future__ import annotations

import argparse
import functools
import gc
import threading
import time
from pathlib import Path

from devtools.measure import rss_gb

STAGES = (("task arithmetic move", "task_arithmetic", {"lam": 0.3}), ("TIES move", "ties", {"lam": 1.0, "sparsity": 0.8}),
          ("TSV-M move (prepare + apply)", "tsv_m", {"lam": 1.0}), ("TSV-M second move", "tsv_m", {"lam": 0.8}))


class PartPeaks:
    """The highest resident set sampled (every 2 ms) within each part of a stage: the merge
    (``Merges.delta``), the load of θ0 + Δ and the forwards; "other" for the rest."""

    def __init__(self):
        from merger.evaluation.evaluator import Evaluator
        from merger.evaluation.merges import Merges

        self.part, self.peaks = "other", {}
        for cls, name, part in ((Merges, "delta", "merge"), (Evaluator, "load_delta", "load"), (Evaluator, "forward", "forward")):
            setattr(cls, name, self._within(part, getattr(cls, name)))
        threading.Thread(target=self._sample, daemon=True).start()

    def _within(self, part: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            before, self.part = self.part, part
            try:
                return fn(*args, **kwargs)
            finally:
                self.part = before
        return timed

    def _sample(self) -> None:
        while True:
            now, part = rss_gb()[0], self.part
            self.peaks[part] = max(now, self.peaks.get(part, 0.0))
            time.sleep(0.002)

    def said(self) -> str:
        peaks, self.peaks = self.peaks, {}
        return ", ".join(f"{part} {gb:.2f}" for part, gb in sorted(peaks.items(), key=lambda kv: kv[0]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devtools.measure_stages")
    ap.add_argument("pool", nargs="?", help="a pool YAML")
    ap.add_argument("--write", default=None, help="write a random pool of --arch × 8 to this folder first")
    ap.add_argument("--arch", default="ViT-B-32", help="with --write: the architecture (ViT-B-32)")
    ap.add_argument("--stages", default=",".join(m for _, m, _ in STAGES),
                    help="the methods moved, in order (task_arithmetic,ties,tsv_m,tsv_m)")
    args = ap.parse_args(argv)
    if args.write:
        import subprocess
        import sys

        from devtools.bench_open import write_random_pool

        Path(args.write).mkdir(parents=True, exist_ok=True)
        pool = write_random_pool(Path(args.write), args.arch, 8, 16)
        # measured in a fresh process: writing held the random experts
        return subprocess.call([sys.executable, "-m", "devtools.measure_stages", str(pool), "--stages", args.stages])
    if not args.pool:
        ap.error("give a pool YAML or --write DIR")
    asked = args.stages.split(",")
    stages, left = [], list(STAGES)
    for method in asked:  # each asked method's next stage (a second TSV-M is its second move)
        found = next((st for st in left if st[1] == method), None)
        if found is None:
            ap.error(f"--stages: {method}: each method at most as often as in "
                     f"{','.join(m for _, m, _ in STAGES)}")
        left.remove(found)
        stages.append(found)
    from merger.evaluation.memory import limit_arenas, release_freed_memory

    limit_arenas()  # as the app does at start
    t0, parts = time.perf_counter(), []

    def say(stage: str) -> None:
        gc.collect()
        release_freed_memory()  # as the app's MemoryKeeper does every 10 s
        now, peak = rss_gb()
        print(f"{stage:<34}{now:6.2f} GB (peak {peak:5.2f}){time.perf_counter() - t0:8.1f} s"
              + (f"   within: {parts[0].said()}" if parts else ""),
              flush=True)

    say("python + torch")
    import merger

    parts.append(PartPeaks())

    pool = merger.open_pool(args.pool)
    say("pool open (task vectors)")
    session = merger.PoolSession(pool)
    session.evaluator.inputs("live")
    say("live images read, heads built")
    session.expert_accuracy("live")
    say("experts' accuracies")
    for stage, method, params in stages:
        session.preview(session.spec(method, **params))
        say(stage)
    print_held(session)
    return 0


def print_held(session) -> None:
    """The tensors the session holds, by owner, each storage counted once."""
    from merger.evaluation.merges import held_bytes

    tv, merges, seen = session.pool.task_vectors, session.merges, set()
    owners = [("task vectors", tv.stacked), ("the base's merged keys", tv.base), ("the base, the rest", session.pool.base),
              ("the resident model", dict(session.evaluator.model.named_parameters())),
              ("live images", [x for _, x in session.evaluator._whole.values()]),
              ("preparations", list(merges._prepared.values())), ("derived states", list(merges._derived.values())),
              ("Δs", list(merges._deltas.values()))]
    for name, tensors in owners:
        size = held_bytes(tensors, seen)  # each storage counted under its first owner
        print(f"  {name:<26}{size / 2**30:6.2f} GB")
    print(f"  preparations of: {', '.join(key[0] for key in merges._prepared)}")


if __name__ == "__main__":
    raise SystemExit(main())
