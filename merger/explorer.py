"""Explorer: a pool, its prepared methods, one evaluator, and a result cache.

``preview(spec)`` is what a slider move calls: a cache hit returns at once; a miss applies the
method to its cached preparation, writes θ0 + Δ into the resident model in place, and forwards
the device-resident inputs of every task.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from . import methods
from .evaluation import Result, evaluator_for
from .merging import Spec


class Explorer:
    def __init__(self, pool, cache_size: int = 1024):
        self.pool = pool
        self.evaluator = evaluator_for(pool)
        self.cache_size = cache_size
        self._results: OrderedDict[tuple, Result] = OrderedDict()
        # One resident model: evaluations are serialised (the GPU/CPU queue of DESIGN.md).
        self.lock = threading.RLock()

    @property
    def tasks(self) -> list[str]:
        return self.pool.tasks

    def spec(self, method: str, experts=None, **params) -> Spec:
        return Spec.make(method, params, experts, self.pool.tasks)

    def delta(self, spec: Spec) -> dict:
        m = methods.get(spec.method)
        prepared = self.pool.prepared(m, spec.experts, {k: spec.kwargs[k] for k in m.prepare_params})
        return m.apply(prepared, **spec.kwargs)

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
        with self.lock:
            result = self.evaluator.evaluate(delta=self.delta(rounded), split=split)
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
