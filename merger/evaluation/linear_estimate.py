"""The linear estimate: a weighted sum of task vectors answered from forwards already made.

Cross-task linearity (Zhou et al., arXiv 2402.03660): the image tower is close to linear along task vectors, so for
Δ = Σ wₜτₜ, per image,

    f(θ0 + Σ wₜτₜ; x) ≈ f(θ0; x) + Σ wₜ (f(θt; x) − f(θ0; x))

with f the tower's output before normalisation. From T + 1 forwards per split (the base and each
expert on every task's images) any such merge (weight averaging, task arithmetic with any λ and
task weights, task-wise AdaMerging, FW-Merging) gets an accuracy and a loss per task without a
forward of its own: one weighted sum of features and the heads.

It is shown at once on a slow pool while the exact forward runs, labelled, and it is never a
result: not cached as one, not recorded in the history, not exported. Once the exact answer
arrives, the difference between the two (``error``) is computed from both, never assumed.

The forwards are kept in memory and, for pools read from files, on disk (``io/disk_cache.py``),
keyed by the content hashes of the base and the expert file, the architecture, this code and the
evaluator's, the stack's dtype, the device type and a fingerprint of the split's inputs (labels, shapes and every 1009th input value: changed
images give other features, so they must not find the old ones).
"""
from __future__ import annotations

import hashlib
import time
from collections import OrderedDict

import torch

from merger import methods
from merger.errors import MergerError
from merger.evaluation.evaluator import Evaluator, Result
from merger.evaluation.merges import lru_put
from merger.io import disk_cache
from merger.spec import Spec

LABEL = "linear estimate"
_STRIDE = 1009  # the fingerprint reads every 1009th input value (a prime: no alignment with rows)
_BASE = ""  # the base's name among the models whose features are kept (no expert is called "")


class LinearEstimate:
    """Owned by the session: the base's and experts' image features per split, the estimates made."""

    def __init__(self, session):
        self.session = session
        self._features: dict[tuple[str, str], list[torch.Tensor]] = {}  # (model, split) -> per input group
        self._shown: OrderedDict[tuple, Result] = OrderedDict()  # (snapped spec, split) -> the estimate shown
        self._fingerprints: dict[str, str] = {}
        self._seconds: dict[str, float] = {}  # split -> one full forward's seconds (timed after a warm-up)
        self.disk = disk_cache.DiskCache()

    # ---- which merges it answers ------------------------------------------------------------
    def forget_shown(self) -> None:
        """Drop the estimates shown (``PoolSession.shrink``); the features stay."""
        self._shown.clear()

    def forget_features(self) -> None:
        """Drop the features held in memory: the next estimate reads them from disk or forwards again."""
        self._features.clear()

    def applies(self, spec: Spec) -> bool:
        """The spec's Δ is exactly Σ wₜτₜ (no block weights; a data-driven method once it has run)."""
        m = methods.get(spec.method)
        if not m.weighted_sum or spec.block_weights:
            return False
        return not m.data_driven or self.session.cached_run(spec) is not None

    def weights(self, spec: Spec) -> list[float]:
        """wₜ per expert of the spec as given (not snapped to slider steps), task weights included.
        A weighted-sum method reads its weights from its parameters (static) or its run."""
        m = methods.get(spec.method)
        state = self.session.cached_run(spec) if m.data_driven else None
        weights = m.weights(spec.kwargs, len(spec.experts), state)[0]
        if spec.task_weights:
            weights = [v * w for v, w in zip(weights, spec.task_weight_list())]
        return weights

    # ---- the forwards it needs --------------------------------------------------------------
    def missing(self, experts, split: str = "live") -> list[str]:
        """Models (the base: "") whose features for the split are neither in memory nor on disk."""
        names = [_BASE, *experts]
        return [n for n in names if (n, split) not in self._features and not self._from_disk(n, split)]

    def ready(self, spec: Spec, split: str = "live") -> bool:
        return self.applies(spec) and not self.missing(spec.experts, split)

    def prepare(self, experts=None, split: str = "live", check=None) -> int:
        """The forwards still missing for these experts (default: the pool's), one model at a time
        as batch work (waiting previews go between two; ``check()`` true stops). Returns how many ran."""
        experts = list(self.session.pool.experts if experts is None else experts)
        todo = self.missing(experts, split)
        if not todo:
            return 0
        done = 0
        with self.session.batch_job() as between:
            for name in todo:
                if (name, split) in self._features:
                    continue
                self._features[(name, split)] = self._forward(name, split)
                self._to_disk(name, split)
                done += 1
                if between() or (check is not None and check()):
                    break
        return done

    def base_forward(self, split: str = "live") -> float:
        """The base's features for a split and the seconds one full forward takes, both kept (and
        on disk for large pools, so a second open makes no forward): the forward is made twice the
        first time, the second one timed (the first pays one-off costs)."""
        if split not in self._seconds:
            self.missing([], split)  # reads the base's entry (features and seconds) from disk
        if split not in self._seconds:
            with self.session.queue:
                self._forward(_BASE, split)
                t0 = time.perf_counter()
                self._features[(_BASE, split)] = self._forward(_BASE, split)
                self._seconds[split] = time.perf_counter() - t0
            self._to_disk(_BASE, split)
        return self._seconds[split]

    def base_result(self, split: str) -> Result | None:
        """The base's result from its kept features (what its forward gives), or None."""
        feats = self._features.get((_BASE, split))
        if feats is None:
            return None
        per_image: dict = {}
        acc, loss, counts = self.session.evaluator.score(split, feats, per_image)
        return Result(split, acc, loss, {}, counts, self._seconds.get(split, 0.0), per_image=per_image,
                      forward=self.session.evaluator.forward_precision)

    def _forward(self, name: str, split: str) -> list[torch.Tensor]:
        ev = self.session.evaluator
        if name == _BASE:
            ev.load(None)
        else:
            tv = self.session.pool.task_vectors
            ev.load_delta(tv.task_vector(tv.tasks.index(name)))
        return [f.cpu() for f in ev.image_features(split)]

    # ---- the estimate -----------------------------------------------------------------------
    def estimate(self, spec: Spec, split: str = "live") -> Result:
        """The spec's estimated result (``Result.estimate`` is set; never cached as a result). The
        forwards it needs are made first where missing."""
        if not self.applies(spec):
            raise MergerError(f"{methods.get(spec.method).display_name}: the linear estimate needs a merge "
                              "that is a weighted sum of task vectors, without block weights")
        if self.missing(spec.experts, split):
            self.prepare(spec.experts, split)
        base = self._features[(_BASE, split)]
        feats = [b.clone() for b in base]
        for w, name in zip(self.weights(spec), spec.experts):
            if w:
                for f, e, b in zip(feats, self._features[(name, split)], base):
                    f.add_(e - b, alpha=float(w))
        per_image: dict = {}
        acc, loss, counts = self.session.evaluator.score(split, feats, per_image)
        result = Result(split, acc, loss, self.session.expert_accuracy(split), counts, 0.0,
                        per_image=per_image, estimate=True,  # references from the experts' features
                        forward=self.session.evaluator.forward_precision)
        lru_put(self._shown, (spec.snap(), split), result, 256)
        return result

    def shown(self, spec: Spec, split: str = "live") -> Result | None:
        """The estimate shown for this spec, if one was (to set the exact answer beside it)."""
        return self._shown.get((spec.snap(), split))

    def expert_accuracy(self, expert: str, split: str) -> float | None:
        """An expert's accuracy on its own task from its features, when they were forwarded (in memory
        or on disk: the same features give the logits the session's own forward would)."""
        if (expert, split) not in self._features and not self._from_disk(expert, split):
            return None
        feats = self._features[(expert, split)]
        task = self.session.pool.task_of(expert)
        return self.session.evaluator.score(split, feats)[0][task]

    @staticmethod
    def error(estimate: Result, exact: Result) -> dict:
        """Estimate − exact in accuracy points: per task and on the average."""
        per_task = {t: 100 * (estimate.accuracy[t] - exact.accuracy[t]) for t in exact.accuracy}
        return {"average": 100 * (estimate.average_accuracy - exact.average_accuracy), "per_task": per_task,
                "max_abs": max(abs(v) for v in per_task.values())}

    # ---- on disk ----------------------------------------------------------------------------
    def _disk_key(self, name: str, split: str) -> str | None:
        pool = self.session.pool
        tv = pool.task_vectors
        if not self.disk.enabled or tv.numel() * tv.num_tasks < disk_cache.WORTH_ENTRIES:
            return None  # a small pool forwards in milliseconds
        hashes = pool.file_hashes_of([name] if name else [])
        if hashes is None:
            return None
        return disk_cache.key_of({"kind": "features", "base": hashes["base"], "expert": hashes.get(name) if name else None,
                                  "split": split, "inputs": self._fingerprint(split), "dtype": str(tv.dtype),
                                  "device": self.session.evaluator.device.type, "architecture": pool.architecture,
                                  "bf16_forwards": self.session.evaluator.forwards_in_bf16,
                                  "code": disk_cache.source_hash(LinearEstimate, Evaluator)})

    def _fingerprint(self, split: str) -> str:
        if split not in self._fingerprints:
            h = hashlib.sha256()
            for x, members in self.session.evaluator.inputs(split):
                h.update(repr(tuple(x.shape)).encode())
                h.update(x.reshape(-1)[::_STRIDE].float().cpu().numpy().tobytes())
                for t, y in members:
                    h.update(t.encode())
                    h.update(y.cpu().numpy().tobytes())
            self._fingerprints[split] = h.hexdigest()
        return self._fingerprints[split]

    def _from_disk(self, name: str, split: str) -> bool:
        key = self._disk_key(name, split)
        hit = self.disk.get(key) if key is not None else None
        if hit is None:
            return False
        tensors, _, meta = hit
        self._features[(name, split)] = [tensors[str(i)] for i in range(len(tensors))]
        if "seconds" in meta:
            self._seconds[split] = float(meta["seconds"])
        self.session.counts["disk hits"] += 1
        return True

    def _to_disk(self, name: str, split: str) -> None:
        key = self._disk_key(name, split)
        if key is not None:
            feats = self._features[(name, split)]
            extra = {"seconds": repr(self._seconds[split])} if name == _BASE and split in self._seconds else {}
            self.disk.put(key, f"image features of {name or 'the base'} ({split})",
                          {str(i): f.contiguous() for i, f in enumerate(feats)}, None, extra)
