"""A forward after the cores idled, against one right after another: ``python -m devtools.cold_forward``.

Times the demo's live forward (its image tower over every task's live images) block by block, back
to back and each after a pause, in alternating rounds. ``--busy`` keeps every core from idling during
the pauses with one lowest-priority busy loop per core: where the difference then goes, it is the
cores' idling (the host's), not this process's. ``--class-token`` also times an exact route tried and
not kept: the last block computed for the class token only (its keys and values for every token), the
pooled output being the class token's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def segments(visual, x) -> list[float]:
    """Milliseconds of the embedding, each block, and the pooling with the projection."""
    import torch

    out = []
    with torch.inference_mode():
        t = time.perf_counter()
        h = visual._embeds(x)
        out.append(time.perf_counter() - t)
        for block in visual.transformer.resblocks:
            t = time.perf_counter()
            h = block(h)
            out.append(time.perf_counter() - t)
        t = time.perf_counter()
        pooled, _ = visual._pool(h)
        pooled @ visual.proj
        out.append(time.perf_counter() - t)
    return [1e3 * s for s in out]


def class_token_last(visual, x):
    """The tower's output with the last block run for the class token only: the same sums for that row."""
    import torch

    with torch.inference_mode():
        h = visual._embeds(x)
        *blocks, last = visual.transformer.resblocks
        for block in blocks:
            h = block(h)
        y = last.ln_1(h)
        cls = h[:, :1] + last.ls_1(last.attn(y[:, :1], y, y, need_weights=False)[0])
        cls = cls + last.ls_2(last.mlp(last.ln_2(cls)))
        return visual._pool(cls)[0] @ visual.proj


def compare_class_token_last(visual, x, times: int) -> None:
    import torch

    with torch.inference_mode():
        full = visual(x)
        error = float((class_token_last(visual, x) - full).norm() / full.norm())
        routes = {"as written": visual, "class token only in the last block": lambda v: class_token_last(visual, v)}
        rows = {name: [] for name in routes}
        for _ in range(times):  # in alternation
            for name, fn in routes.items():
                t = time.perf_counter()
                fn(x)
                rows[name].append(1e3 * (time.perf_counter() - t))
    written, short = (statistics.median(v) for v in rows.values())
    print(f"  forward back to back, median of {times}: as written {written:.1f} ms, class token only in the last "
          f"block {short:.1f} ms; ratio {written / short:.2f}x; relative difference {error:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", default="demo")
    parser.add_argument("--pause", type=float, default=0.8, help="seconds idle before each forward of a paused round")
    parser.add_argument("--times", type=int, default=10, help="forwards per round")
    parser.add_argument("--busy", action="store_true", help="a nice-19 busy loop per core during the rounds")
    parser.add_argument("--class-token", action="store_true",
                        help="also time the last block computed for the class token only (an exact route not kept)")
    args = parser.parse_args()
    import torch

    from merger.evaluation.session import PoolSession
    from merger.pool.pool import open_pool

    evaluator = PoolSession(open_pool(args.pool)).evaluator
    x = torch.cat([x for x, _ in evaluator.inputs("live")])
    visual = evaluator.model.visual
    segments(visual, x)  # warm-up
    loops = [subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", "while True: pass"])
             for _ in range(os.cpu_count() or 1)] if args.busy else []
    try:
        print(f"{args.pool} pool, {x.shape[0]} live images, torch threads {torch.get_num_threads()}"
              + (f", {len(loops)} nice-19 busy loops" if loops else "") + "; ms, median of each round:")
        for rnd in range(4):
            pause = args.pause if rnd % 2 else 0.0
            rows = []
            for _ in range(args.times):
                time.sleep(pause)
                rows.append(segments(visual, x))
            med = [statistics.median(column) for column in zip(*rows)]
            print(f"  {'after a ' + format(pause, 'g') + ' s pause' if pause else 'back to back':<22}embedding {med[0]:5.1f}"
                  f"  blocks {' '.join(f'{m:5.1f}' for m in med[1:-1])}  pooling {med[-1]:4.1f}  total {sum(med):6.1f}")
    finally:
        for loop in loops:
            loop.kill()
    if args.class_token:
        compare_class_token_last(visual, x, 3 * args.times)


if __name__ == "__main__":
    main()
