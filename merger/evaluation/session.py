"""PoolSession: a session of a pool, the one owner of everything computed from it.

The pool holds data (base, task vectors, tasks). The session owns the resident model (through
its ``Evaluator``), the queue in front of it (``WorkQueue``: previews first) and every cache:

- through its ``Merges``: prepared methods per expert subset and task weighting (LRU), what is
  derived from them per rank (LRU), Δ per snapped spec (a small LRU: a slider move and its
  landscape marker share one merge);
- results per (snapped spec, split); base results and expert accuracies per split (once);
- data-driven runs; landscape values per plane point and per point.

``preview(spec)`` is one slider move: a cache hit costs nothing; a miss is at most one method
apply and one forward. Each forward writes every merged tensor of the model first, so no weights
a batch job left behind are ever seen by a preview.
"""
from __future__ import annotations

import hashlib
import math
import weakref
from collections import Counter, OrderedDict
from contextlib import contextmanager

import torch

from merger import methods
from merger.errors import MergerError
from merger.evaluation.evaluator import Evaluator, Result, joined, result_subset
from merger.evaluation.linear_estimate import LinearEstimate
from merger.evaluation.merges import Merges, lru_put
from merger.evaluation.shared_work import SharedWork
from merger.evaluation.work_queue import WorkQueue
from merger.io.inputs import integer
from merger.spec import Spec, on_experts

LIVE_S, FIRST_ANSWER_S = 0.3, 0.1  # a live forward over LIVE_S: moves answer first on a forward of FIRST_ANSWER_S

_SESSIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def session_for(pool) -> "PoolSession":
    """The pool's shared session (API calls, the CLI and the app reuse its caches and runs)."""
    s = _SESSIONS.get(pool)
    return s if s is not None else PoolSession(pool)


class PoolSession:
    PLANE_VALUES_KEPT = 50_000  # about 50 MB of per-task numbers for 7 tasks: a hundred 21 × 21 landscapes
    POINT_VALUES_KEPT = 10_000
    def __init__(self, pool, cache_size: int = 1024, deltas: int = 2):
        from merger.pool.pool import require_open

        self.pool = require_open(pool, "PoolSession")
        self._evaluator: Evaluator | None = None
        self.queue = WorkQueue()
        self.cache_size = cache_size
        self.delta_size = deltas
        self._results: OrderedDict[tuple, Result] = OrderedDict()
        self._base: dict[str, Result] = {}
        self._expert_acc: dict[tuple[str, str], float] = {}
        self._runs: dict = {}
        self._running = SharedWork()  # runs under way, each followed by every caller of its settings
        self._run_model = None
        self._statistics: OrderedDict = OrderedDict()  # data statistics of runs (Context.statistic), 2 kept
        # landscape grid points and single points measured: (accuracy, loss) per task, LRU (a room's
        # landscapes over an hour: 441 points each on a 21 × 21 grid)
        self._plane_values: OrderedDict[tuple, tuple[dict, dict]] = OrderedDict()
        self._point_values: OrderedDict[tuple, tuple[dict, dict]] = OrderedDict()
        self._coords: OrderedDict = OrderedDict()  # (plane, spec) -> where its merge sits on the plane
        self._landscape = None
        self._point_buf: torch.Tensor | None = None
        self.counts: Counter = Counter()  # method applies and prepares (forwards: evaluator.forwards)
        self.merges = Merges(pool, self.queue, self.counts, deltas)
        self.partial_images: int | None = None  # set by measure_live(): images per task of a partial answer
        # (spec, split) -> (images per task, its partial result): the complete answer forwards only the rest
        self._partials: OrderedDict[tuple, tuple[int, Result]] = OrderedDict()
        self.linear = LinearEstimate(self)  # the base's and experts' features: estimates with no forward
        _SESSIONS[pool] = self

    @property
    def evaluator(self) -> Evaluator:
        """The resident model and its inputs (built on first use: merging alone needs no data)."""
        if self._evaluator is None:
            with self.queue:
                if self._evaluator is None:
                    self._evaluator = Evaluator(self.pool)
        return self._evaluator

    @property
    def tasks(self) -> list[str]:
        return self.pool.tasks

    @property
    def lock(self) -> WorkQueue:
        """``with session.lock:`` holds the resident model (as a preview, or a chunk of batch work)."""
        return self.queue

    def batch(self, chunks: int | None = None):
        """``with session.batch():`` marks the thread's work as batch work of ``chunks`` chunks, when
        known (see WorkQueue)."""
        return self.queue.batch(chunks)

    @contextmanager
    def batch_job(self, cancel=None):
        """Batch work that holds the model across many steps (a run, a fine-tune): gives a check to
        call between steps, which lets waiting previews go first and says whether to stop."""
        def check() -> bool:
            self.queue.yield_point()
            return bool(cancel and cancel())

        with self.queue.batch(), self.queue:
            yield check

    def spec(self, method: str, experts=None, task_weights=None, block_weights=None, **params) -> Spec:
        return self.pool.make_spec(method, params, experts, task_weights, block_weights)

    # ---- merging (the preparations and Δ caches: ``Merges``) ------------------------------------
    @property
    def PREPARE_INLINE_ENTRIES(self) -> int:  # noqa: N802  (a threshold a test may lower)
        return self.merges.inline_entries

    @PREPARE_INLINE_ENTRIES.setter
    def PREPARE_INLINE_ENTRIES(self, value: int) -> None:  # noqa: N802
        self.merges.inline_entries = value

    def prepared(self, method, experts: tuple[str, ...], prepare_args: dict, scale: tuple = ()):
        return self.merges.prepared(method, experts, prepare_args, scale)

    def prepared_for(self, spec: Spec, snapped: bool = True):
        return self.merges.prepared_for(spec, snapped)

    def prepared_state(self, spec: Spec):
        return self.merges.prepared_state(spec)

    def note(self, spec: Spec) -> str | None:
        """The method's note on these parameters ("λ has no effect", "the merge is the base"): the page
        shows it under the result, the endpoint and ``eval`` beside theirs."""
        m = methods.get(spec.method)
        return m.note(spec.kwargs, self.prepared_state(spec)) if m.note else None

    def is_prepared(self, spec: Spec) -> bool:
        return self.merges.is_prepared(spec)

    def prepare_is_slow(self, spec: Spec) -> bool:
        return self.merges.prepare_is_slow(spec)

    def prepare(self, spec: Spec, progress=None, cancel=None) -> None:
        self.merges.prepare(spec, progress, cancel)

    def delta(self, spec: Spec) -> dict:
        """Δ of the spec as given (previews pass it snapped): a data-driven run's, or from the
        small Δ cache, else one method apply."""
        if methods.get(spec.method).data_driven:
            return self.run(spec).delta
        return self.merges.delta(spec)

    # ---- data-driven runs -------------------------------------------------------------------
    def run(self, spec: Spec, progress=None, cancel=None):
        """A data-driven method's run (batch work; cached by spec; deterministic for its seed). It
        trains on its own copy of the image tower and lets waiting previews go between steps. Callers
        of the same settings while it runs follow that one run (``SharedWork``)."""
        m = methods.get(spec.method)
        if not m.data_driven:
            raise MergerError(f"{m.name} is a static method: it has no run")
        key = spec.snap()
        if key in self._runs:
            return self._runs[key]
        return self._running.get(key, lambda progress, cancel: self.compute_run(m, key, progress, cancel),
                                 progress, cancel, alone=self.queue.held_here(),
                                 label=on_experts(key.label(), key.experts, self.pool.tasks), subject=key)

    def compute_run(self, m, key: Spec, progress, cancel):
        """One run, computed (``run`` calls it once per settings; tests hold it to stage callers)."""
        from merger.methods.adaptive import Context

        with self.batch_job(cancel) as checkpoint:
            if key in self._runs:
                return self._runs[key]
            if self._run_model is None:
                self._run_model = self.evaluator.tower_copy()
            ctx = Context(self.pool, self.evaluator, key.experts)
            ctx.model, ctx.statistics = self._run_model, self._statistics
            run = m.run(ctx, progress, checkpoint, **key.kwargs)
            run.method = m.name
            self._runs[key] = run
            while len(self._statistics) > 2:
                self._statistics.popitem(last=False)
        return run

    def under_way(self) -> dict:
        """The runs and slow preparations under way: label (as a page names it) -> its spec."""
        return {**self._running.under_way(), **self.merges.preparing()}

    def goes_on_after_cancel(self, spec: Spec, cancel) -> bool:
        """Whether the run or slow preparation of ``spec`` goes on although its first caller (whose cancel
        check is ``cancel``) cancelled: another caller follows it (``SharedWork``), so it ends and is kept."""
        if methods.get(spec.method).data_driven:
            return self._running.goes_on_after_cancel(spec.snap(), cancel)
        return self.merges.preparation_goes_on(spec, cancel)

    def followers(self, spec: Spec) -> int:
        """How many callers follow the run or slow preparation of ``spec`` now (0: none goes)."""
        return self._running.followers(spec.snap()) or self.merges.preparation_followers(spec)

    def cached_run(self, spec: Spec):
        return self._runs.get(spec.snap())

    # ---- results ----------------------------------------------------------------------------
    def results(self, split: str = "live") -> list[tuple[Spec, Result]]:
        """(spec, result) of every complete result cached for a split, oldest first."""
        return [(spec, r) for (spec, s), r in list(self._results.items()) if s == split]

    def cached(self, spec: Spec, split: str = "live") -> Result | None:
        key = (spec.snap(), split)
        hit = self._results.get(key)
        if hit is not None:
            self._results.move_to_end(key)
        return hit

    def preview(self, spec: Spec, split: str = "live", *, session: str | None = None,
                ticket: int | None = None) -> Result:
        """The result of the spec on its sliders' steps (``Spec.snap``: cached by that). With a ``ticket``
        of a browser session, a preview superseded before it starts raises ``Superseded``."""
        if not isinstance(spec, Spec):
            raise MergerError(f"preview: expected a Spec (session.spec(method, ...)), got {type(spec).__name__} "
                              f"{str(spec)[:60]!r}")
        hit = self.cached(spec, split)
        if hit is not None:
            return hit
        spec = spec.snap()
        if methods.get(spec.method).data_driven:
            self.run(spec)  # batch work of its own, before this evaluation takes the model
        # A split's images are read (once), and the experts' accuracies on it computed (once, each on
        # its own turn), before this evaluation takes the model: an auto-tune's first val point
        # otherwise held every other job for 5 s.
        self.evaluator.inputs(split)
        self.expert_accuracy(split)
        with self.queue:
            self.queue.drop_if_superseded(session, ticket)
            hit = self.cached(spec, split)  # computed by someone else while this one waited
            if hit is not None:
                return hit
            images, first = self._partials.pop((spec, split), (0, None))  # its images are not forwarded again
            result = self.evaluator.evaluate(delta=self.delta(spec), split=split, start=images)
            result = self._with_references(result if first is None else joined(first, result))
            lru_put(self._results, (spec, split), result, self.cache_size)
        return result

    def partial(self, spec: Spec, images: int, split: str = "live") -> Result:
        """The spec's result on the first ``images`` images per task (a progressive answer's first
        part; never cached as a result, never recorded; kept until its complete answer)."""
        images = integer(images, "partial: images per task", MergerError, 1, 2**31 - 1)
        spec = spec.snap()
        with self.queue:
            result = self._with_references(self.evaluator.evaluate(delta=self.delta(spec), split=split, limit=images))
            lru_put(self._partials, (spec, split), (images, result), 4)
        return result

    def _with_references(self, result: Result) -> Result:
        result.expert_accuracy = self.expert_accuracy(result.split)
        return result

    def evaluate_exact(self, spec: Spec, split: str = "live") -> Result:
        """The spec with its parameters exactly as given (not snapped to slider steps; not cached)."""
        delta = self.delta(spec)
        with self.queue:
            return self._with_references(self.evaluator.evaluate(delta=delta, split=split))

    def evaluate_weights(self, weights, split: str = "live") -> Result:
        """Merged weights from elsewhere (a full or merged-key state dict; None: the base)."""
        with self.queue:
            return self._with_references(self.evaluator.evaluate(weights, split))

    def base(self, split: str = "live") -> Result:
        """The base model's result on a split (computed once)."""
        if split not in self._base:
            with self.queue:
                if split not in self._base:  # the base's features kept for the linear estimate, else a forward
                    result = self.linear.base_result(split) or self.evaluator.evaluate(None, split)
                    self._base[split] = self._with_references(result)
        return self._base[split]

    def expert_accuracy(self, split: str = "live") -> dict[str, float]:
        """Each task's accuracy under the pool's own expert for it (the reference of a result)."""
        return {t: self.expert_task_accuracy(t, split) for t in self.pool.tasks}

    def expert_task_accuracy(self, expert: str, split: str) -> float:
        """An expert's accuracy on the task it was fine-tuned for (once per expert and split)."""
        key = (expert, split)
        if key not in self._expert_acc:
            self._expert_acc[key] = self.linear.expert_accuracy(expert, split)
        if self._expert_acc[key] is None:
            self.evaluator.inputs(split)  # read outside the queue (see preview)
            with self.queue:
                tv = self.pool.task_vectors
                i = tv.tasks.index(expert)
                task = self.pool.task_of(expert)
                self.evaluator.load_delta(tv.task_vector(i))
                self._expert_acc[key] = self.evaluator.forward(split, tasks=[task])[0][task]
        return self._expert_acc[key]

    def probe_from_live(self, spec: Spec) -> tuple[dict, dict] | None:
        """(accuracy, loss) on the probe split from the cached live result (the probe images are a
        subset of the live ones): the landscape's 3-D marker without another forward."""
        live = self.cached(spec, "live")
        if live is None or not live.per_image:
            return None
        sub = result_subset(live, self.evaluator.probe_positions())
        return (sub.accuracy, sub.loss) if sub is not None else None

    # ---- progressive answers ----------------------------------------------------------------
    def measure_live(self, budget_s: float = LIVE_S, first_s: float = FIRST_ANSWER_S) -> float:
        """Time one full live forward (the base's, after a warm-up; kept with its features, on disk for
        large pools); when slower than ``budget_s``, moves answer first on ``partial_images`` images per
        task (or the linear estimate), as many as a forward of ``first_s`` takes."""
        seconds = self.linear.base_forward("live")
        per_task = max(self.base("live").counts.values())
        n = self.partial_images = (max(2, min(per_task - 1, math.floor(per_task * min(first_s, budget_s) / seconds)))
                                   if seconds > budget_s else None)
        if n:
            with self.queue:  # a chosen tower route recorded on a progressive move's two batches
                self.evaluator.warm_tower("live", ((0, n), (n, None)))
        return seconds

    # ---- landscape values -------------------------------------------------------------------
    @property
    def landscape(self):
        """The session's landscape (planes and surfaces over this pool; values cached here)."""
        if self._landscape is None:
            from merger.landscape.surface import Landscape

            self._landscape = Landscape(self)
        return self._landscape

    def values_on_plane(self, plane, x: float, y: float, split: str) -> tuple[dict, dict]:
        """(accuracy, loss) per task at a grid point of a plane (cached per plane point)."""
        key = (plane.key, round(x, 9), round(y, 9), split)
        values = self._plane_values.get(key)
        if values is None:
            with self.queue:
                values = self._plane_values.get(key)
                if values is None:
                    self._point_buf = plane.point(x, y, out=self._point_buf)
                    values = lru_put(self._plane_values, key, self._forward_point(self._point_buf, split),
                                     self.PLANE_VALUES_KEPT)
        return values

    def values_at_point(self, vec: torch.Tensor, split: str = "probe") -> tuple[dict, dict]:
        """(accuracy, loss) per task at a flattened point (one forward; cached by its bytes)."""
        key = (hashlib.sha1(vec.detach().cpu().numpy().tobytes()).hexdigest(), split)
        values = self._point_values.get(key)
        if values is None:
            with self.queue:
                values = lru_put(self._point_values, key, self._forward_point(vec, split), self.POINT_VALUES_KEPT)
        return values

    def _forward_point(self, vec: torch.Tensor, split: str) -> tuple[dict, dict]:
        self.evaluator.load(self.landscape.space.unflatten(vec))
        acc, loss, _ = self.evaluator.forward(split)
        return acc, loss

    def coords_on_plane(self, plane, spec: Spec) -> tuple[float, float, float]:
        """(x, y, off-plane distance) of a spec's merge on a plane (cached: a move back to a value
        seen before costs no merge)."""
        key = (plane.key, spec)
        if key in self._coords:
            self._coords.move_to_end(key)
            return self._coords[key]
        return lru_put(self._coords, key, plane.coords(self.landscape.spec_point(spec)), 4096)

    def shrink(self) -> None:
        """Over the memory budget (``MemoryKeeper``): the caches of what can be computed again go
        (results, partial answers, landscape values, derived states, older preparations, every
        run but the newest, runs' data statistics); the pool, lab experts and the newest run stay."""
        with self.queue:
            for cache in (self._results, self._partials, self._plane_values, self._point_values, self._coords,
                          self._statistics):
                cache.clear()
            while len(self._runs) > 1:
                self._runs.pop(next(iter(self._runs)))
            self.linear.forget_shown()
        self.merges.shrink()

    def cached_plane_points(self) -> int:
        return len(self._plane_values)

    # ---- experts added later ----------------------------------------------------------------
    def remove_experts(self, names) -> None:
        """Remove lab experts (their page closed): the task-vector stack shrinks; their names are
        never reused, so nothing cached under them is ever taken for another expert's."""
        with self.queue:
            self.pool.remove_experts(names)

    def add_expert(self, name: str, task: str, weights, info) -> None:
        """Another expert for one of the pool's tasks. Every cache is keyed by the experts it
        merged, by name, and names are never reused: nothing cached depends on the new one, so
        nothing is invalidated."""
        with self.queue:
            self.pool.add_expert(name, task, weights, info)
