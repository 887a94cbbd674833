"""A forward after the cores idled, against one right after another: ``python -m devtools.cold_forward``.

Times the demo's live forward (its image tower over every task's live images) block by block, back
to back and each after a pause, in alternating rounds. ``--busy`` keeps every core from idling during
the pauses with one lowest-priority busy loop per core: where the difference then goes, it is the
cores' idling (the host's), not this process's. ``--class-token`` also times two exact routes tried and
not kept: the last block computed for the class token only (its keys and values for every token), the
pooled output being the class token's; and that with every block's attention read from views of its one
in-projection. nn.MultiheadAttention takes its slow path for the demo's 3 heads (its fast path wants an
even count), which copies q, k and v apart and runs the in-projection as 17 batched products.
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


def attention_from_views(block, h, class_token_only: bool = False):
    """``block(h)`` (an open_clip ResidualAttentionBlock, batch first, no mask) with q, k and v read as views
    of one in-projection; for the class token's row only where asked (its keys and values for every token)."""
    import torch.nn.functional as F

    n, length, width = h.shape
    attn = block.attn
    heads = attn.num_heads
    y = block.ln_1(h)
    w, b = attn.in_proj_weight, attn.in_proj_bias
    if class_token_only:
        k, v = F.linear(y, w[width:], b[width:]).view(n, length, 2, heads, -1).permute(2, 0, 3, 1, 4)
        q = F.linear(y[:, :1], w[:width], b[:width]).view(n, 1, heads, -1).transpose(1, 2)
        h = h[:, :1]
    else:
        q, k, v = F.linear(y, w, b).view(n, length, 3, heads, -1).permute(2, 0, 3, 1, 4)
    o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, -1, width)
    h = h + block.ls_1(F.linear(o, attn.out_proj.weight, attn.out_proj.bias))
    return h + block.ls_2(block.mlp(block.ln_2(h)))


def views_and_class_token_last(visual, x):
    """Every block's attention from views, the last block for the class token only."""
    import torch

    with torch.inference_mode():
        h = visual._embeds(x)
        *blocks, last = visual.transformer.resblocks
        for block in blocks:
            h = attention_from_views(block, h)
        return visual._pool(attention_from_views(last, h, class_token_only=True))[0] @ visual.proj


def compare_class_token_last(visual, x, times: int) -> None:
    import torch

    routes = {"as written": visual, "class token only in the last block": lambda v: class_token_last(visual, v),
              "that, and attention from views": lambda v: views_and_class_token_last(visual, v)}
    with torch.inference_mode():
        full = visual(x).double()
        errors = {name: float((fn(x).double() - full).norm() / full.norm()) for name, fn in routes.items()}
        rows = {name: [] for name in routes}
        for _ in range(times):  # in alternation
            for name, fn in routes.items():
                t = time.perf_counter()
                fn(x)
                rows[name].append(1e3 * (time.perf_counter() - t))
    written = statistics.median(rows["as written"])
    print(f"  forward back to back, median of {times} in alternation (relative difference to as written):")
    for name, ms in rows.items():
        print(f"    {name:<36}{statistics.median(ms):6.1f} ms  {written / statistics.median(ms):.2f}x  ({errors[name]:.1e})")


def compare_on_moves(session, times: int) -> None:
    """The evaluation of a move (merge, apply, forward, scores) as written and with both routes patched in,
    on task arithmetic at λ values, in alternation."""
    from unittest import mock

    import merger.evaluation.evaluator as evaluator

    def routed(model, x, _routed=None):
        return views_and_class_token_last(model.visual, x)

    session.expert_accuracy("live")  # the experts' own forwards, before the moves timed
    rows = {"as written": [], "both routes": []}
    for i in range(times):
        for name, rows_of in rows.items():
            spec = session.spec("task_arithmetic", lam=0.1 + 0.9 * i / times)  # (evaluate_exact caches nothing)
            with mock.patch.object(evaluator, "encode_images", routed if name == "both routes" else evaluator.encode_images):
                t = time.perf_counter()
                session.evaluate_exact(spec)
                rows_of.append(1e3 * (time.perf_counter() - t))
    written, both = (statistics.median(v) for v in rows.values())
    print(f"  a move's evaluation (merge, apply, forward, scores), median of {times} in alternation: as written "
          f"{written:.1f} ms, both routes {both:.1f} ms; {written / both:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", default="demo")
    parser.add_argument("--pause", type=float, default=0.8, help="seconds idle before each forward of a paused round")
    parser.add_argument("--times", type=int, default=10, help="forwards per round")
    parser.add_argument("--busy", action="store_true", help="a nice-19 busy loop per core during the rounds")
    parser.add_argument("--class-token", action="store_true",
                        help="also time the last block for the class token only, and that with attention from views (not kept)")
    args = parser.parse_args()
    import torch

    from merger.evaluation.session import PoolSession
    from merger.pool.pool import open_pool

    session = PoolSession(open_pool(args.pool))
    evaluator = session.evaluator
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
        compare_on_moves(session, 4 * args.times)


if __name__ == "__main__":
    main()
