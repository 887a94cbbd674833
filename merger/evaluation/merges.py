"""The merges of a pool session: each method's preparation per expert subset (and per task
weighting, for a method that prepares on the weighted task vectors), what is derived from it
(TSV-M's directions per rank), and Δ per spec. Owned by a ``PoolSession``; the applies take its
queue (they run beside the resident model's work, never during another apply)."""
from __future__ import annotations

import inspect
import sys
from collections import Counter, OrderedDict

import torch

from merger import methods
from merger.io import disk_cache
from merger.errors import MergerError
from merger.evaluation.memory import release_freed_memory
from merger.evaluation.shared_work import SharedWork
from merger.methods._scaled import Scaled
from merger.spec import Spec, on_experts, with_block_weights


def code_of(fn) -> tuple:
    """The modules whose source a preparation depends on: its own, every merger.methods module it
    imports functions or modules from, and theirs in turn (Iso-CTS prepares through spectral's SVDs);
    where one of them routes through merger.accel, every drop-in module there (a drop-in replaces
    a reference function without being imported by it)."""
    own = inspect.getmodule(fn)
    seen, todo = {own}, [own]
    while todo:
        for v in vars(todo.pop()).values():
            m = v if inspect.ismodule(v) else inspect.getmodule(v) if callable(v) else None
            if m is not None and m.__name__.startswith(("merger.methods.", "merger.accel")) and m not in seen:
                seen.add(m)
                todo.append(m)
    if any(m.__name__.startswith("merger.accel") for m in seen):
        seen |= {m for name, m in list(sys.modules.items()) if name.startswith("merger.accel.")}
    return (own, *sorted(seen - {own}, key=lambda m: m.__name__))


def lru_put(cache: OrderedDict, key, value, size: int, dropped=None):
    """Put ``value`` as the most recent entry; the oldest go above ``size`` (``dropped(key)`` for each)."""
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > size:
        old, _ = cache.popitem(last=False)
        if dropped is not None:
            dropped(old)
    return value


def held_bytes(state, seen: set) -> int:
    """Bytes of the tensors a cached state holds, each storage once: those in ``seen`` are not
    counted, and those counted are added to it."""
    total, todo = 0, [state]
    while todo:
        obj = todo.pop()
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, Scaled):  # holds its state only (reading its values would compute them)
            todo.append(obj.state)
        elif isinstance(obj, (list, tuple)):  # states are dicts, lists and tuples of tensors (disk_cache.flatten)
            todo.extend(obj)
    return total


def lru_make_room(cache: OrderedDict, size: int):
    """Drop the oldest entries until one more fits: called before computing a new one, so that the
    process never holds one more than the cache's size (each is about one fp32 Δ)."""
    while cache and len(cache) >= size:
        cache.popitem(last=False)


class Merges:
    # Task-vector entries (size × experts) above which a slow_prepare method prepares through Run
    # rather than inside a move (see prepare_is_slow).
    INLINE_ENTRIES = 20_000_000
    DERIVED_BYTES = 2 << 30  # derived states kept: about this much (each about one fp32 Δ), 1 to 4 of them
    # What other methods than the one on screen may hold (preparations, derived states, Δs) before
    # the oldest goes: a ViT-B/32 × 8 pool then stays within a 16 GB laptop's share of memory
    # (docs/memory.md). A preparation that went comes back from the disk cache or is recomputed.
    OTHERS_BYTES = 256 << 20

    def __init__(self, pool, queue, counts: Counter, deltas: int = 2):
        self.pool, self.queue, self.counts = pool, queue, counts
        self.delta_size = deltas
        self.inline_entries = self.INLINE_ENTRIES
        self.derived_bytes = self.DERIVED_BYTES
        self.others_bytes = self.OTHERS_BYTES
        self._prepared: OrderedDict = OrderedDict()
        self._derived: OrderedDict = OrderedDict()
        self._deltas: OrderedDict = OrderedDict()
        self._preparing = SharedWork()  # slow preparations under way (Run), each followed by every caller
        self.disk = disk_cache.DiskCache()

    @staticmethod
    def _prepared_key(method, experts: tuple[str, ...], prepare_args: dict, scale: tuple = ()) -> tuple:
        return method.name, experts, tuple(sorted(prepare_args.items())), scale

    def prepared(self, method, experts: tuple[str, ...], prepare_args: dict, scale: tuple = ()):
        """A method's preparation for an expert subset (immutable; LRU of 3: they are large).
        ``scale``: task weights of a method that does not take them in apply, which then prepares
        on the weighted task vectors wₜτₜ (see ``Method.task_weighted``)."""
        key = self._prepared_key(method, experts, prepare_args, scale)
        if key in self._prepared:
            self._prepared.move_to_end(key)
            return key, self._prepared[key]
        return key, self._store_prepared(key, self.compute(method, experts, prepare_args, scale))

    def compute(self, method, experts: tuple[str, ...], prepare_args: dict, scale: tuple, progress=None, cancel=None):
        """A preparation from the disk cache, else computed (and written there when worth it)."""
        tv = self._task_vectors(experts, scale)
        store = self._disk_key(method, experts, prepare_args, scale, tv)
        hit = None if store is None else self.disk.get(store)
        if hit is not None:
            self.counts["disk hits"] += 1
            state = disk_cache.unflatten(hit[1], hit[0], tv, tv.device)
        else:
            state = method.prepare_with(tv, progress, cancel, **prepare_args)
            if method.slow_prepare:  # its workspace back to the system before the move's load and forward
                release_freed_memory()
            if store is not None:
                tensors, structure = disk_cache.flatten(state)
                self.disk.put(store, f"{method.name} over {', '.join(experts)}", tensors, structure)
        return state

    def _disk_key(self, method, experts, prepare_args: dict, scale: tuple, tv) -> str | None:
        """The disk-cache key of a slow preparation over experts read from files, else None."""
        if not (method.slow_prepare and self.disk.enabled) or tv.numel() * tv.num_tasks < disk_cache.WORTH_ENTRIES:
            return None
        hashes = self.pool.file_hashes_of(experts)
        if hashes is None:
            return None
        return disk_cache.key_of({"kind": "prepared", "method": method.name,
                                  "code": disk_cache.source_hash(*code_of(method.prepare)),
                                  "base": hashes["base"], "experts": [[e, hashes[e]] for e in experts],
                                  "args": prepare_args, "scale": list(scale), "dtype": str(tv.dtype)})

    def _task_vectors(self, experts: tuple[str, ...], scale: tuple = ()):
        tv = self.pool.task_vectors.subset(experts)
        return tv.scaled(dict(scale)) if scale else tv

    def _store_prepared(self, key: tuple, state):
        self.counts["prepares"] += 1
        return lru_put(self._prepared, key, state, 3)

    def shrink(self) -> None:
        """Over the memory budget: every derived state and Δ, and each preparation but the newest."""
        self.forget_derived()
        with self.queue:
            while len(self._prepared) > 1:
                self._prepared.popitem(last=False)

    def kept(self) -> dict[str, int]:
        """How many preparations, derived states and Δs are held now."""
        with self.queue:
            return {"prepared": len(self._prepared), "derived": len(self._derived), "deltas": len(self._deltas)}

    def forget_derived(self) -> None:
        """Drop the derived states and Δs (benches: the next move of each setting derives again)."""
        with self.queue:
            self._derived.clear()
            self._deltas.clear()

    def _large(self, experts) -> bool:
        """A pool large enough that slow work goes through Run."""
        return self.pool.task_vectors.numel() * len(experts) > self.inline_entries

    def _prepare_args(self, spec: Spec, snapped: bool = True):
        """(method, prepare arguments, task weights it prepares with) of a spec (see ``prepared``): on its
        sliders' steps, as a preview computes it, unless ``snapped`` is False (a merge as given)."""
        m = methods.get(spec.method)
        spec = spec.snap() if snapped else spec
        kw = spec.kwargs
        scale = () if m.task_weighted or m.data_driven else spec.task_weights
        return m, {k: kw[k] for k in m.prepare_params}, scale

    def prepared_for(self, spec: Spec, snapped: bool = True):
        """(key, state): the preparation of a static spec (computed when not cached)."""
        m, args, scale = self._prepare_args(spec, snapped)
        return self.prepared(m, spec.experts, args, scale)

    def _spec_key(self, spec: Spec) -> tuple:
        """(method, the cache key of its preparation) of a spec, snapped as previews are."""
        m, args, scale = self._prepare_args(spec)
        return m, self._prepared_key(m, spec.experts, args, scale)

    def prepared_state(self, spec: Spec):
        """The cached preparation of a static spec, or None (never computes: for notes and views)."""
        m, key = self._spec_key(spec)
        return None if m.data_driven else self._prepared.get(key)

    def is_prepared(self, spec: Spec) -> bool:
        """Whether a move of this static spec costs only an apply (its preparation is cached)."""
        m, key = self._spec_key(spec)
        return m.data_driven or key in self._prepared

    def prepare_is_slow(self, spec: Spec) -> bool:
        """A static spec whose preparation is not cached, of a slow_prepare method, on a pool large
        enough that preparing would stall a move (about 2 s; ViT-B/32 × 8 experts takes 5–20 s per method,
        see `bench merge`): the app then prepares
        it through Run, with progress and Cancel."""
        if not methods.get(spec.method).slow_prepare:
            return False
        return self._large(spec.experts) and not self.is_prepared(spec)

    def prepare(self, spec: Spec, progress=None, cancel=None) -> None:
        """Prepare a static spec's method ahead of its moves, with progress and cancel where the
        method reports them (``Method.slow_prepare``). A cancelled preparation raises Cancelled and
        caches nothing."""
        m, args, scale = self._prepare_args(spec)
        if m.data_driven:
            raise MergerError(f"{m.name} learns from data: it has a run, not a preparation")
        key = self._prepared_key(m, spec.experts, args, scale)
        if key in self._prepared:
            return

        # A preparation reads the task vectors, never the resident model: it runs beside the
        # previews instead of holding the queue for a minute, and only its result goes in under it.
        def compute(progress, cancel):
            if key in self._prepared:  # stored by a preparation that ended since the check above
                return
            state = self.compute(m, spec.experts, args, scale, progress, cancel)
            with self.queue:
                self._store_prepared(key, state)

        # callers of the same one follow it (one holding the model prepares on its own)
        self._preparing.get(key, compute, progress, cancel, alone=self.queue.held_here(), subject=spec,
                            label=on_experts(f"preparing {m.display_name}", spec.experts, self.pool.tasks))

    def preparation_goes_on(self, spec: Spec, cancel) -> bool:
        """Whether the slow preparation of ``spec`` goes on for another caller after the Cancel of the
        caller whose cancel check is ``cancel`` (``SharedWork.goes_on_after_cancel``)."""
        m, key = self._spec_key(spec)
        return not m.data_driven and self._preparing.goes_on_after_cancel(key, cancel)

    def preparation_followers(self, spec: Spec) -> int:
        """How many callers follow the slow preparation of ``spec`` now (0: none goes)."""
        m, key = self._spec_key(spec)
        return 0 if m.data_driven else self._preparing.followers(key)

    def preparing(self) -> dict:
        """The slow preparations under way: label -> the spec that started each."""
        return self._preparing.under_way()

    def _derived_size(self) -> int:
        """How many derived states to keep: each (CART's rank-k sums, TIES' merge at λ = 1, TSV-M's
        direction) is about one fp32 Δ, 0.35 GB on ViT-B/32 and 1.2 GB on ViT-L/14, so 4 of them
        there and 1 here."""
        delta_bytes = 4 * self.pool.task_vectors.numel()
        return max(1, min(4, self.derived_bytes // max(1, delta_bytes)))

    def delta(self, spec: Spec) -> dict:
        """Δ of a static spec as given (previews pass it snapped): from the small Δ cache, else one
        method apply."""
        m = methods.get(spec.method)
        key = spec
        if key in self._deltas:
            self._deltas.move_to_end(key)
            return self._deltas[key]
        kw = key.kwargs
        with self.queue:
            self._fit(key)  # before this merge's own states are made: the process never holds both
            pkey, state = self.prepared_for(key, snapped=False)
            if m.derive is not None:
                dargs = tuple((k, tuple(v) if isinstance(v, list) else v)
                              for k, v in m.derive_kwargs({**kw, **m.weights_kwargs(key)}).items())
                dkey = (pkey, dargs)
                if dkey in self._derived:
                    self._derived.move_to_end(dkey)
                    state = self._derived[dkey]
                else:
                    if self._derived_size() > 1:  # one is kept, as the state a rank move may start from
                        lru_make_room(self._derived, self._derived_size())
                    extra = {}
                    if m.derive_near and self._large(spec.experts):
                        # large pools only: small ones recompute in milliseconds and stay path-independent
                        extra["near"] = [v for (p, _), v in self._derived.items() if p == pkey]
                    self.counts["derives"] += 1
                    state = lru_put(self._derived, dkey, m.derive(state, **dict(dargs), **extra), self._derived_size())
            self.counts["applies"] += 1
            lru_make_room(self._deltas, self.delta_size)
            delta = with_block_weights(m.apply(state, **kw, **m.weights_kwargs(key)), key)
        return lru_put(self._deltas, key, delta, self.delta_size)

    def _fit(self, on_screen: Spec) -> None:
        """Past ``others_bytes`` held for anything but the merge ``on_screen`` (its Δ, and its method's
        preparations and derived states), drop the rest: Δs first, then derived states, then
        preparations, oldest first. Views of the pool's task vectors hold nothing of their own."""
        pool_storages = {t.untyped_storage().data_ptr() for tv_part in (self.pool.task_vectors.stacked,
                                                                          self.pool.task_vectors.base)
                         for t in tv_part.values()}
        caches = ((self._deltas, lambda k: k != on_screen), (self._derived, lambda k: k[0][0] != on_screen.method),
                  (self._prepared, lambda k: k[0] != on_screen.method))
        others = [(cache, key, held_bytes(value, set(pool_storages))) for cache, other in caches
                  for key, value in cache.items() if other(key)]
        total, evicted = sum(size for _, _, size in others), []
        for cache, key, size in others:  # each cache in its LRU order
            if total <= self.others_bytes:
                break
            evicted.append(cache.pop(key, None))
            total -= size
        if not evicted:
            return
        self.counts["evicted"] += len(evicted)
        still = set(pool_storages)
        held_bytes([list(cache.values()) for cache, _ in caches], still)
        if held_bytes(evicted, still):  # what went (a Scaled Δ's state may stay) back to the system before
            del evicted  # this merge makes its own: another thread's arena would not serve them
            release_freed_memory()
