"""Explorer: a pool, its prepared methods, one evaluator, and a result cache.

``preview(spec)`` is what a slider move calls: a cache hit returns at once; a miss applies the
method to its cached preparation, writes θ0 + Δ into the resident model in place, and forwards
the device-resident inputs of every task.
"""
from __future__ import annotations

import copy
import threading
from collections import OrderedDict

from . import methods
from .errors import MergerError
from .evaluation import Result, evaluator_for
from .merging import Spec


def explorer_for(pool) -> "Explorer":
    """The pool's shared explorer (so API calls reuse its caches and data-driven runs)."""
    ex = getattr(pool, "_explorer", None)
    if ex is None:
        ex = Explorer(pool)
    return ex


class Explorer:
    def __init__(self, pool, cache_size: int = 1024):
        self.pool = pool
        self.evaluator = evaluator_for(pool)
        pool._explorer = self
        self.cache_size = cache_size
        self._results: OrderedDict[tuple, Result] = OrderedDict()
        # One resident model: evaluations are serialised (the GPU/CPU queue of DESIGN.md).
        self.lock = threading.RLock()
        self._runs: dict = {}
        self._run_lock = threading.Lock()
        self._run_model = None

    @property
    def tasks(self) -> list[str]:
        return self.pool.tasks

    def spec(self, method: str, experts=None, **params) -> Spec:
        return self.pool.make_spec(method, params, experts)

    def delta(self, spec: Spec) -> dict:
        m = methods.get(spec.method)
        if m.kind == "data":
            return self.run(spec).delta
        prepared = self.pool.prepared(m, spec.experts, {k: spec.kwargs[k] for k in m.prepare_params})
        return m.apply(prepared, **spec.kwargs)

    def run(self, spec: Spec, progress=None, cancel=None):
        """A data-driven method's run (cached by spec; deterministic for its seed)."""
        from .methods.adaptive import Context

        m = methods.get(spec.method)
        if m.kind != "data":
            raise MergerError(f"{m.name} is a static method: it has no run")
        key = spec.rounded()
        if key in self._runs:
            return self._runs[key]
        with self._run_lock:  # one optimisation at a time; previews go on (separate model copy)
            if key in self._runs:
                return self._runs[key]
            if self._run_model is None:
                self._run_model = copy.deepcopy(self.evaluator.model.visual)
            ctx = Context(self.pool, self.evaluator, spec.experts)
            ctx.model = self._run_model
            run = m.run(ctx, progress, cancel, **key.kwargs)
            run.method = m.name
            self._runs[key] = run
        return run

    def cached_run(self, spec: Spec):
        return self._runs.get(spec.rounded())

    def cached(self, spec: Spec, split: str = "live") -> Result | None:
        key = (spec.rounded(), split)
        with self.lock:
            if key in self._results:
                self._results.move_to_end(key)
                return self._results[key]
        return None

    def preview(self, spec: Spec, split: str = "live") -> Result:
        """Result of the spec with parameters snapped to slider steps (cached by that)."""
        hit = self.cached(spec, split)
        if hit is not None:
            return hit
        rounded = spec.rounded()
        delta = self.delta(rounded)  # a data-driven run happens here, outside the evaluation lock
        with self.lock:
            result = self.evaluator.evaluate(delta=delta, split=split)
            self._results[(rounded, split)] = result
            while len(self._results) > self.cache_size:
                self._results.popitem(last=False)
        return result

    def base(self, split: str = "live") -> Result:
        with self.lock:
            return self.evaluator.base_result(split)

    def experts(self, split: str = "live") -> dict[str, float]:
        with self.lock:
            return self.evaluator.expert_accuracy(split)
