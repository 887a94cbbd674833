"""Evaluator: one resident model, device-resident inputs and heads, weights written in place. Per
task: top-1 accuracy and mean cross-entropy of the zero-shot head (task arithmetic's protocol,
arXiv:2212.04089). Tasks whose images are one tensor (the demo's) are forwarded once, scored per head."""
from __future__ import annotations

import copy
import hashlib
import json
import threading
import time
from contextlib import nullcontext
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from merger.accel import accelerable
from merger.data import heads as heads_mod
from merger.data.heads import heads_cache_dir, tokenizer_for
from merger.data.splits import SPLITS
from merger.data.tasks import TaskDataStore, preprocess
from merger.errors import DataError, PoolError
from merger.evaluation.model_thread import ModelThread, on_model_thread
from merger.evaluation.result import Result, joined, result_subset  # noqa: F401  (where callers import them)


class Evaluator:
    """Built once per pool; ``evaluate(weights, split)`` copies weights in place and forwards."""
    EVERYWHERE = "everywhere"  # autocast: bf16 forwards on the CPU too (docs/performance.md)

    def __init__(self, pool, device: str | torch.device | None = None, batch_size: int = 1024):
        self.pool = pool
        self.model_thread = ModelThread()  # every load and forward of the model runs on it
        self.device = torch.device(device) if device else pool.device
        self.batch_size = batch_size
        self.autocast: bool | str = True  # bf16 forwards (fp32 sums) on a GPU; EVERYWHERE: on the CPU too; False: fp32
        self.data = TaskDataStore(pool)
        missing = [t for t in pool.tasks if not (pool.task_info.get(t) or {}).get("data")]
        if missing:
            raise DataError(
                f"task(s) {', '.join(missing)} have an expert but no data (tasks.<name>.data in {pool.source})"
            )
        self.model = pool.build_model().to(self.device)
        self.model.requires_grad_(False)
        if self.device.type == "cpu":
            self.batch_size = min(batch_size, cpu_batch(self.model))
        state = self.model.state_dict()
        self._targets = {k: state[k] for k in pool.task_vectors.keys}  # storage shared with the model
        self.logit_scale = float(self.model.logit_scale.exp())
        self.heads = self._build_heads()
        for name, p in self.model.named_parameters():  # every later forward is the image tower's: the
            if not name.startswith("visual.") and name != "logit_scale" and name not in self._targets:
                p.data = p.data.new_empty(0)  # text tower leaves the resident model (the pool's base keeps it)
        self._inputs: dict[str, list[tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]]] = {}
        self._inputs_lock = threading.Lock()  # a split is read outside the work queue (see inputs)
        # (split, window of images per task) -> (the split's groups, that window's inputs concatenated)
        self._whole: dict[tuple, tuple[list, torch.Tensor]] = {}
        self._probe_positions: dict[str, torch.Tensor] | None = None
        self.notices: list[str] = []  # out-of-memory fallbacks, shown to the user
        self.forwards = 0  # forwards of the resident model (counted: tests and benches)
        self.routed_tower = None  # the image tower as a chosen route runs it (use_tower; None: as written)

    def _build_heads(self) -> dict[str, torch.Tensor]:
        """Zero-shot heads, cached on disk keyed by the text tower's hash, classes, templates and
        tokenizer (signed entries of a private folder, as the prepared methods'); an entry of the wrong
        shape or with a value that is not finite is computed again."""
        from merger.io.checkpoints import tensors_hash
        from merger.io.disk_cache import DiskCache

        text = {k: v for k, v in self.pool.base.items() if not k.startswith("visual.")}
        tower = tensors_hash(text)
        width = getattr(getattr(self.model, "visual", None), "output_dim", None)  # the image features' width
        tok = None
        tokenizer = self.pool.tokenizer_name or "open_clip"
        store = DiskCache(heads_cache_dir())
        out = {}
        for t in self.pool.tasks:
            classes, templates = self.data.classes(t), self.data.templates(t)
            key = hashlib.sha256(json.dumps([tower, classes, templates, tokenizer]).encode()).hexdigest()[:32]
            hit = store.get(key)
            head = hit[0].get("head") if hit else None
            if head is not None and not (head.dim() == 2 and head.shape[0] == len(classes)
                                         and (width is None or head.shape[1] == width)
                                         and head.is_floating_point() and bool(head.isfinite().all())):
                head = None
            if head is None:
                tok = tok or tokenizer_for(self.pool)
                try:
                    head = heads_mod.zero_shot_head(self.model, tok, classes, templates).cpu()
                except heads_mod.TokenizerMismatch as exc:
                    hint = ("a real CLIP takes open_clip's (leave tokenizer out)" if tokenizer == "demo"
                            else "the demo's tiny CLIP takes tokenizer: demo")
                    raise PoolError(f"{self.pool.source}: tokenizer {tokenizer}: {exc}: it does not fit this base's "
                                    f"text tower ({hint})") from None
                store.put(key, f"zero-shot head of task {t} ({len(classes)} classes)", {"head": head}, None)
            out[t] = head.to(self.device)
        return out

    def inputs(self, split: str):
        """Preprocessed inputs on the device, grouped by shared image source (built once). Needs no
        model: the session reads a split before taking the work queue (the demo's val split took
        4.7 s, and every other job waited for it)."""
        if split not in SPLITS:
            raise DataError(f"unknown split '{split}'; known: {', '.join(SPLITS)}")
        if split not in self._inputs:
            with self._inputs_lock:
                if split not in self._inputs:
                    self._inputs[split] = self.read_split(split)
        return self._inputs[split]

    def read_split(self, split: str) -> list:
        """A split's images, read and preprocessed, grouped by source (``inputs`` keeps them)."""
        groups: dict[tuple, tuple[torch.Tensor, list]] = {}
        for t in self.pool.tasks:
            d = self.data.split(t, split)
            if d.source not in groups:
                groups[d.source] = (preprocess(d.images, self.pool.preprocess_cfg).to(self.device), [])
            groups[d.source][1].append((t, d.labels.to(self.device)))
        return list(groups.values())

    @on_model_thread
    @torch.no_grad()
    def load(self, weights: Mapping[str, torch.Tensor] | None) -> None:
        """Write merged-key weights into the resident model in place (None: the base)."""
        tv = self.pool.task_vectors
        for k, target in self._targets.items():
            target.copy_(tv.base[k] if weights is None else weights[k])

    @on_model_thread
    @torch.no_grad()
    def load_delta(self, delta: Mapping[str, torch.Tensor]) -> None:
        """θ0 + Δ written straight into the model's tensors (no intermediate copy)."""
        base, keys, targets = self.pool.task_vectors.base, list(self._targets), list(self._targets.values())
        # A Δ's values are read once each: a Scaled Δ computes them as they are read. One at a time
        # (no more than one held beside the model) unless Δ is on the model's GPU.
        first = delta[keys[0]] if keys else None
        values = ([first, *(delta[k] for k in keys[1:])]
                  if first is not None and first.device.type != "cpu" and first.device == targets[0].device else None)
        if values is not None and all(d.device == t.device == base[k].device and base[k].dtype == t.dtype
                                      for k, d, t in zip(keys, values, targets)):
            # θ0 then += Δ: the sums torch.add(θ0, Δ, out=target) makes (one rounding, θ0 being of the
            # target's dtype), in two launches per dtype on a GPU instead of one per tensor (docs/accel.md)
            torch._foreach_copy_(targets, [base[k] for k in keys])
            torch._foreach_add_(targets, values)
            return
        for i, (k, target) in enumerate(zip(keys, targets)):
            d = values[i] if values is not None else first if i == 0 else delta[k]
            first = None
            if d.device == target.device:
                torch.add(base[k], d, out=target)
            else:  # task vectors kept in host memory
                target.copy_(base[k] + d)
            del d  # before the next is computed

    def batches_kept(self, split: str) -> set[tuple]:
        """The image windows of ``split`` kept as one batch each: (0, None) all, (0, n) and (n, None)."""
        return {window for s, window in self._whole if s == split}

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Image features in batches; on out-of-memory: free caches, halve the batch, and at
        batch 1 fall back to the CPU (with a notice the app shows)."""
        while True:
            try:
                with self._autocast():
                    return torch.cat([encode_images(self.model, x[i: i + self.batch_size], self.routed_tower).float()
                                      for i in range(0, x.shape[0], self.batch_size)])
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                if not _is_oom(exc):
                    raise
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                if self.batch_size > 1:
                    self.batch_size = max(1, self.batch_size // 2)
                    self.notices.append(f"out of memory: evaluating in batches of {self.batch_size}")
                elif self.device.type != "cpu":
                    self._move_to("cpu")
                    x = x.cpu()
                    self.notices.append("out of memory on the GPU even at batch 1: evaluating on the CPU")
                else:
                    raise

    @property
    def tower_route(self) -> str:  # eager (the reference, the default), patches or graphs: merger/accel/tower.py
        return self.routed_tower.route if self.routed_tower is not None else "eager"

    @on_model_thread
    @torch.inference_mode()
    def use_tower(self, route: str, split: str = "live", **options) -> str | None:
        """Forward through ``route`` from now on: built (and compiled) on this split's batch, or the
        image tower as written back for eager. What happened in one line, or None."""
        from merger.accel.tower import routed_tower, embed_patches_by_matmul

        if route == self.tower_route:
            return None
        self.routed_tower = None
        embed_patches_by_matmul(self.model, False)
        if route == "eager":
            return None
        x, = self._move_batches(split, ((0, None),))
        with self._autocast():
            self.routed_tower, said = routed_tower(self.model, route, x, **options)
        if self.routed_tower is None:
            self.notices.append(said)
        return said

    @on_model_thread
    @torch.inference_mode()
    def warm_tower(self, split: str, windows: Sequence[tuple]) -> None:
        """Record a chosen route's tower on more batches a move forwards (each window of images per
        task, every task's together): a progressive move's two."""
        if self.routed_tower is None:
            return
        with self._autocast():
            for x in self._move_batches(split, windows):
                if x.shape[0] >= 2:  # a batch of one is not the route's (RoutedTower.fits)
                    self.routed_tower.warm(x)

    def _move_batches(self, split: str, windows: Sequence[tuple]) -> list[torch.Tensor]:
        """Per window of images per task, the batch a move forwards: every task's together."""
        groups = self.inputs(split)
        return [torch.cat([x[a:b] for x, _ in groups])[: self.batch_size] for a, b in windows]

    def tower_copy(self) -> torch.nn.Module:
        """A copy of the image tower as written (a run trains its own)."""
        from merger.accel.tower import embed_patches_by_matmul

        visual = copy.deepcopy(self.model.visual)
        embed_patches_by_matmul(visual, False)
        return visual

    @staticmethod
    def precision_of(autocast: bool | str, device_type: str) -> str:
        """What forwards with this ``autocast`` setting run in on this kind of device: "bf16" (autocast) or "fp32"."""
        return "bf16" if autocast == Evaluator.EVERYWHERE or (autocast is True and device_type == "cuda") else "fp32"

    @property
    def forwards_in_bf16(self) -> bool:  # under bf16 autocast; the merge arithmetic stays fp32 either way
        return self.forward_precision == "bf16"

    @property
    def forward_precision(self) -> str:  # what each result and history row records
        return self.precision_of(self.autocast, self.device.type)

    @staticmethod
    def autocast_keeping(precision: str) -> bool | str:  # the setting that gives this precision on any device
        return Evaluator.EVERYWHERE if precision == "bf16" else False

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.forwards_in_bf16 else nullcontext()

    def _move_to(self, device: str) -> None:
        self.autocast = self.autocast_keeping(self.forward_precision)  # the precision the caches' results had
        self.device = torch.device(device)
        self.use_tower("eager")  # the tower as written
        self.model.to(self.device)
        state = self.model.state_dict()
        self._targets = {k: state[k] for k in self._targets}
        self.heads = {t: h.to(self.device) for t, h in self.heads.items()}
        with self._inputs_lock:
            self._inputs = {s: [(x.to(self.device), [(t, y.to(self.device)) for t, y in m]) for x, m in groups]
                            for s, groups in self._inputs.items()}
        self._whole.clear()

    # Tasks with their own images are forwarded as one batch when all are evaluated (one pass, not
    # one per task), up to these sizes: the concatenation is a second copy of the inputs.
    _CONCAT_MAX_ELEMENTS = 1 << 25
    _CONCAT_MAX_ELEMENTS_GPU = 1 << 28

    def _all_groups_features(self, split: str, groups: list, window: tuple) -> list[torch.Tensor] | None:
        if len(groups) < 2 or len({tuple(x.shape[1:]) for x, _ in groups}) != 1:
            return None
        limit = self._CONCAT_MAX_ELEMENTS if self.device.type == "cpu" else self._CONCAT_MAX_ELEMENTS_GPU
        if sum(x.numel() for x, _ in groups) > limit:
            return None
        source, cached = self.inputs(split), self._whole.get((split, window))
        if cached is None or cached[0] is not source:  # inputs rebuilt or moved since
            cut = window[1] if window[0] == 0 else window[0]  # kept: the whole, and one partial answer's two windows
            self._whole = {k: v for k, v in self._whole.items() if k[0] != split or k[1] == (0, None) or cut in k[1]}
            cached = self._whole[(split, window)] = (source, torch.cat([x for x, _ in groups]))
        return list(self.encode(cached[1]).split([x.shape[0] for x, _ in groups]))

    @on_model_thread
    @torch.inference_mode()
    def forward(self, split: str, tasks: Sequence[str] | None = None, limit: int | None = None,
                per_image: dict | None = None, start: int = 0) -> tuple[dict, dict, dict]:
        """(accuracy, loss, image count) per task with the weights now in the model; ``limit`` and
        ``start``: only images start to limit of each task (a task with none left out);
        ``per_image`` (a dict) receives (correct, loss) per image."""
        groups = self.inputs(split)
        if limit is not None or start:
            groups = [(x[start:limit], [(t, y[start:limit]) for t, y in m]) for x, m in groups if x[start:limit].shape[0]]
        features = self._group_features(split, groups, tasks, window=(start, limit))
        return self._score(groups, features, tasks, per_image)

    @on_model_thread
    @torch.inference_mode()
    def image_features(self, split: str) -> list[torch.Tensor]:
        """The image tower's output (before normalisation, fp32) per input group of a split, with
        the weights now in the model: one forward (the linear estimate's f(θ; x))."""
        return self._group_features(split, self.inputs(split), None, window=(0, None))

    def _group_features(self, split: str, groups, tasks, window: tuple) -> list[torch.Tensor | None]:
        """One forward: features per input group (None for a group none of ``tasks`` reads); all
        groups in one batch when every one is wanted (``window``: which images per task they hold).
        A progressive answer's first images too: per task, 72 ViT-L/14 images took an H200 longer
        than the 1024 of all tasks in one batch."""
        self.forwards += 1
        together = self._all_groups_features(split, groups, window) if tasks is None else None
        return [None if not any(tasks is None or t in tasks for t, _ in members)
                else together[i] if together is not None else self.encode(x)
                for i, (x, members) in enumerate(groups)]

    @torch.inference_mode()
    def score(self, split: str, features: Sequence[torch.Tensor], per_image: dict | None = None):
        """(accuracy, loss, image count) per task from image features per input group (as
        ``image_features`` gives them): the heads, no forward."""
        return self._score(self.inputs(split), features, None, per_image)

    def _score(self, groups, features, tasks, per_image):
        acc, loss, counts = {}, {}, {}
        for (x, members), feats in zip(groups, features):
            if feats is None:
                continue
            feats = F.normalize(feats.to(self.device), dim=-1)
            for t, y in members:
                if tasks is not None and t not in tasks:
                    continue
                y = y.to(feats.device)
                logits = self.logit_scale * feats @ self.heads[t].T
                correct = logits.argmax(-1) == y
                losses = F.cross_entropy(logits, y, reduction="none")
                acc[t] = float(correct.float().mean())
                loss[t] = float(losses.mean())
                counts[t] = int(y.numel())
                if per_image is not None:
                    per_image[t] = (correct.cpu(), losses.float().cpu())
        order = [t for t in self.pool.tasks if t in acc]
        return {t: acc[t] for t in order}, {t: loss[t] for t in order}, {t: counts[t] for t in order}

    @on_model_thread
    def evaluate(self, weights: Mapping[str, torch.Tensor] | None = None, split: str = "live",
                 *, delta: Mapping[str, torch.Tensor] | None = None, limit: int | None = None,
                 start: int = 0) -> Result:
        """Evaluate merged weights (full or merged-key dict), a Δ, or the base (neither). Every
        merged tensor of the model is written first, whatever was there before. The caller holds
        the session's queue; expert references are the session's to add. ``limit``, ``start``: on
        images start to limit of each task only (a partial result)."""
        t0 = time.perf_counter()
        self.inputs(split)  # unknown split fails before any weight is touched
        if delta is not None:
            self.load_delta(delta)
        else:
            self.load(None if weights is None else {k: weights[k] for k in self._targets})
        per_image: dict = {}
        acc, loss, counts = self.forward(split, limit=limit, per_image=per_image, start=start)
        return Result(split, acc, loss, {}, counts, time.perf_counter() - t0, partial=limit is not None or start > 0,
                      per_image=per_image, forward=self.forward_precision)

    def probe_positions(self) -> dict[str, torch.Tensor]:
        """Per task, where the probe split's images sit in the live split (both are fixed subsets
        of the test split, the probe's inside the live one)."""
        if self._probe_positions is None:
            from merger.data.splits import PROBE_SIZE, live_indices

            out = {}
            for t in self.pool.tasks:
                n = self.data.split(t, "live").n_source
                out[t] = torch.searchsorted(live_indices(n), live_indices(n, PROBE_SIZE))
            self._probe_positions = out
        return self._probe_positions


# On the CPU a batch's widest activation (the MLP's hidden layer, fp32) stays within this: a ViT-L/14
# forward of 128 images in one batch held 1.6 GB over the rest of the process at its peak (docs/memory.md).
CPU_BATCH_BYTES = 256 << 20


def cpu_batch(model) -> int:
    """Images per CPU batch: CPU_BATCH_BYTES over one image's MLP activations (tokens × hidden × 4 bytes);
    1024 where the image tower is not a ViT of known shape."""
    visual = getattr(model, "visual", None)
    try:
        tokens, hidden = visual.positional_embedding.shape[0], visual.transformer.resblocks[0].mlp.c_fc.out_features
    except (AttributeError, IndexError, TypeError):
        return 1024
    return max(1, CPU_BATCH_BYTES // (4 * tokens * hidden))


@accelerable
def encode_images(model, x: torch.Tensor, routed=None) -> torch.Tensor:
    """A batch's image features: ``model.encode_image`` as written (the reference). ``routed``, the
    evaluator's tower on a chosen route, is for the drop-in (merger/accel/tower.py) alone."""
    return model.encode_image(x)


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc) or "can't allocate memory" in str(exc)
