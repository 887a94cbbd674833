"""merger: an interactive explorer for model merging of CLIP image encoders.

Public API (stable)::

    pool = merger.open_pool("demo")
    merged = merger.merge(pool, "ties", lam=1.0, sparsity=0.8)
    res = merger.evaluate(pool, merged, split="live")     # Result: per-task accuracy and loss
    session = merger.PoolSession(pool)                     # the live path: session.preview(session.spec(...))
    sd = merger.merge_state_dicts(base_sd, [sd1, sd2], "cart", lam=1.5, rank_ratio=0.08)
    merger.methods.names()
"""
from __future__ import annotations

__version__ = "0.5.0"

from merger import methods
from merger.api import evaluate, merge, merge_state_dicts
from merger.errors import CheckpointError, DataError, MergerError, MethodError, PoolError
from merger.evaluation.evaluator import Evaluator, Result
from merger.evaluation.session import PoolSession, session_for
from merger.pool.pool import Pool, open_pool
from merger.spec import Spec

__all__ = [
    "CheckpointError", "DataError", "MergerError", "MethodError", "PoolError",
    "Evaluator", "Pool", "PoolSession", "Result", "Spec", "evaluate", "merge", "merge_state_dicts", "methods", "open_pool",
    "session_for", "__version__",
]
