"""``python -m devtools bench accel``: each piece of merger/accel on what a person waits for, on a
random ViT-B/32 × 8 pool (or --arch, --experts): the preparation or the slider move it speeds, timed
with the piece off (its references) and on (every other piece on in both), their ratio, and the
largest relative difference per matrix between the two merges. A piece is kept only at ≥ 1.5×."""
from __future__ import annotations

import gc
import time
from pathlib import Path

import torch

import merger
from merger.accel import cart_ranks, compiled, drop_ins, gram, histogram, iso_cts, reference_only
from merger.methods.cart import CART
from merger.methods.consensus import CONSENSUS_TA
from merger.methods.iso import ISO_C, ISO_CTS
from merger.methods.breadcrumbs import BREADCRUMBS
from merger.methods.ties import DARE_LINEAR, DARE_TIES, TIES
from merger.methods.tsv_m import TSV_M
from merger.pool.task_vectors import is_matrix

KEEP_AT = 1.5


def _piece(module) -> str:
    """A piece's name: its module's in merger/accel (Iso-CTS' piece is named as its method is)."""
    return module.__name__.rsplit(".", 1)[1]


# piece -> (what a person waits for, method, the setting prepared (and moved from), the move timed: None for
# the preparation, {} for the first move after it)
WAITS = {
    _piece(gram): [("TSV-M: prepare (default rank ready)", TSV_M, {}, None),
             ("CART: prepare", CART, {}, None),
             ("Iso-C: prepare", ISO_C, {}, None)],
    _piece(iso_cts): [("Iso-CTS: prepare", ISO_CTS, {}, None)],
    _piece(histogram): [("TIES: prepare", TIES, {}, None)],
    _piece(compiled): [("TIES: sparsity move 0.8 → 0.7", TIES, {"sparsity": 0.8}, {"sparsity": 0.7}),
                 ("DARE (linear): sparsity move 0.9 → 0.8", DARE_LINEAR, {"sparsity": 0.9}, {"sparsity": 0.8}),
                 ("DARE-TIES: sparsity move 0.9 → 0.8", DARE_TIES, {"sparsity": 0.9}, {"sparsity": 0.8}),
                 ("Consensus: λ_mask move 0.4 → 0.5", CONSENSUS_TA, {"mask_lambda": 0.4}, {"mask_lambda": 0.5}),
                 ("Breadcrumbs: γ move 0.16 → 0.2", BREADCRUMBS, {"gamma": 0.16}, {"gamma": 0.2})],
    _piece(cart_ranks): [("CART: first move after preparing (0.08)", CART, {}, {}),
                   ("CART: rank move 0.08 → 0.09", CART, {"rank_ratio": 0.08}, {"rank_ratio": 0.09}),
                   ("CART: rank move 0.08 → 0.04", CART, {"rank_ratio": 0.08}, {"rank_ratio": 0.04}),
                   ("CART: rank move 0.08 → 0.5", CART, {"rank_ratio": 0.08}, {"rank_ratio": 0.5})],
}


def _lines(piece: str) -> int:
    path = Path(merger.__file__).resolve().parent / "accel" / f"{piece}.py"
    return len(path.read_text(encoding="utf-8").splitlines())


def _timed(session, method, start: dict, move: dict | None):
    """(seconds, Δ) of a preparation (move None), of the first move after it (move {}), or of one move after
    a preparation and a first move, in a fresh session's Merges as the app runs them."""
    experts = method.experts_for(session.tasks)
    first = session.spec(method.name, experts=experts, **start)
    if move is None:
        t0 = time.perf_counter()
        session.merges.prepared_for(first)
        seconds = time.perf_counter() - t0
        return seconds, session.merges.delta(first)
    if not move:
        session.merges.prepared_for(first)
        t0 = time.perf_counter()
        delta = session.merges.delta(first)
        return time.perf_counter() - t0, delta
    session.merges.delta(first)  # prepared, and the starting point derived (a compile happens here)
    spec = session.spec(method.name, experts=experts, **{**start, **move})
    t0 = time.perf_counter()
    delta = session.merges.delta(spec)
    return time.perf_counter() - t0, delta


def _largest_difference(a: dict, b: dict, tv) -> float:
    worst = 0.0
    for k in a:
        if is_matrix(k, tv.base[k].shape):
            ref = b[k].double()
            worst = max(worst, float((a[k].double() - ref).norm() / ref.norm().clamp(min=1e-30)))
    return worst


def bench_accel(args) -> int:
    from merger.evaluation.session import PoolSession
    from devtools.measure import random_pool_in_memory

    pool = random_pool_in_memory(args.arch, args.experts, args.tv_dtype)
    tv = pool.task_vectors
    print(f"task vectors {tv.nbytes() / 2**30:.2f} GB in {str(tv.dtype)[6:]}; torch threads {torch.get_num_threads()}")
    known = {d.piece for d in drop_ins()}
    pieces = [p for p in WAITS if p in known and (not args.methods or p in args.methods.split(","))]
    print(f"\n{'piece':<12}{'lines':>6}  {'what a person waits for':<38}{'off s':>8}{'on s':>8}{'ratio':>7}"
          f"{'max rel. diff':>15}  keep")
    verdicts = {}
    for piece in pieces:
        for i, (label, method, start, move) in enumerate(WAITS[piece]):
            times = {}
            for route in ("on", "off"):
                gc.collect()
                session = PoolSession(pool)
                if route == "off":
                    with reference_only(piece):
                        times[route] = _timed(session, method, start, move)
                else:
                    times[route] = _timed(session, method, start, move)
                del session
            (on_s, on_delta), (off_s, off_delta) = times["on"], times["off"]
            ratio = off_s / max(on_s, 1e-9)
            diff = _largest_difference(on_delta, off_delta, tv)
            verdicts.setdefault(piece, []).append(ratio)
            head = f"{piece:<12}{_lines(piece):>6}" if i == 0 else " " * 18
            print(f"{head}  {label:<38}{off_s:>8.2f}{on_s:>8.2f}{ratio:>6.1f}x{diff:>15.1e}  "
                  f"{'yes' if ratio >= KEEP_AT else 'no'}", flush=True)
            del times, on_delta, off_delta
    kept = [p for p, r in verdicts.items() if max(r) >= KEEP_AT]
    print(f"\noff = the piece's references (the other pieces on); a move is timed after its preparation and a first "
          f"move (a compile happens there). Kept at ≥ {KEEP_AT:g}× on at least one wait: "
          f"{', '.join(kept) or 'none'}; below: {', '.join(p for p in verdicts if p not in kept) or 'none'}.")
    return 0 if len(kept) == len(verdicts) else 1
