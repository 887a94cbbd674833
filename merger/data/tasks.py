"""Task data: images and labels per split, as tensors.

Two sources, one shape: the demo world (``data: {demo: {train: {n, seed}, test: {n, seed},
domain: {attribute: class index, ...}}}``, regenerated deterministically; ``domain`` is
optional) and, for real pools, image folders or parquet datasets (merger/data/parquet.py). Tasks whose data entries are identical share one
image tensor, so the evaluator forwards those images once for all of them. Splits: train
(without validation), val (10 % of train, seed 0), test, live (fixed subset of test) and probe
(a subset of live: the first images of the same draw, merger/data/splits.py).
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F

from merger.data import splits as split_rules
from merger.errors import DataError, PoolError
from merger.io import inputs

DATA_KINDS = ("demo", "folder", "parquet", "memory")


@dataclass
class SplitData:
    images: torch.Tensor  # uint8 [N, 3, H, W] on the CPU (shared between tasks with the same source)
    labels: torch.Tensor  # int64 [N]
    source: tuple  # identical for tasks that share images
    n_source: int = 0  # images in the split this one was drawn from (live and probe: the test split)


def _demo_split(entry: Mapping, split: str, task: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], tuple]:

    base_split = split_rules.source_split(split)
    cfg = entry.get(base_split)
    if not isinstance(cfg, Mapping) or "n" not in cfg or "seed" not in cfg:
        raise PoolError(f"tasks.{task}.data.demo.{base_split}: expected {{n: ..., seed: ...}}")
    n, seed = int(cfg["n"]), int(cfg["seed"])
    if n <= 0:
        raise DataError(f"tasks.{task}: the {base_split} split has no images (n = {n})")
    domain = demo_domain(entry, task)
    images, labels = _generate_cached(n, seed, domain)
    if task not in labels:
        raise DataError(f"tasks.{task}: the demo world has no task '{task}' (it has {', '.join(labels)})")
    return images, labels, ("demo", n, seed, domain)


def demo_domain(entry: Mapping, task: str) -> tuple[tuple[str, int], ...]:
    """The checked ``domain`` of a demo data entry: sorted (attribute, class index) pairs."""
    from merger.demo import world

    domain = entry.get("domain") or {}
    if not isinstance(domain, Mapping):
        raise PoolError(f"tasks.{task}.data.demo.domain: expected {{attribute: class index}}")
    out = []
    for attr, value in domain.items():
        if attr not in world.TASKS:
            raise PoolError(f"tasks.{task}.data.demo.domain: unknown attribute '{attr}' "
                            f"(known: {', '.join(world.TASKS)})")
        if attr == task:
            raise PoolError(f"tasks.{task}.data.demo.domain: cannot hold the task's own attribute '{attr}' fixed")
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(world.TASKS[attr]):
            raise PoolError(f"tasks.{task}.data.demo.domain.{attr}: expected a class index 0..{len(world.TASKS[attr]) - 1}, "
                            f"got {value!r}")
        out.append((str(attr), int(value)))
    return tuple(sorted(out))


# The demo world's images are a pure function of (n, seed, domain): every pool of the process that draws
# the same ones shares them (the demo's 49,000 take 10 s to draw; the tests open it dozens of times).
# Bounded; ARCHITECTURE.md lists the module-level state that stays, and why.
@functools.lru_cache(maxsize=32)
def _generate_cached(n: int, seed: int, domain: tuple[tuple[str, int], ...] = ()):
    from merger.demo import world

    return world.generate(n, seed, fixed=dict(domain))


def _select(split: str, n: int) -> torch.Tensor | None:
    if split == "train":
        return split_rules.train_val_indices(n)[0]
    if split == "val":
        return split_rules.train_val_indices(n)[1]
    if split == "live":
        return split_rules.live_indices(n)
    if split == "probe":
        return split_rules.live_indices(n, split_rules.PROBE_SIZE)
    return None


class TaskDataStore:
    """Loads each (task, split) once; checks classes and labels."""

    def __init__(self, pool):
        self.pool = pool
        self._cache: dict[tuple[str, str], SplitData] = {}

    @contextmanager
    def _naming_the_pool(self):
        """A refusal of a task's key path ("tasks.b.templates: …") names the pool's file first."""
        try:
            yield
        except DataError as exc:
            if str(exc).startswith("tasks."):
                raise DataError(f"{self.pool.source}: {exc}") from None
            raise

    def classes(self, task: str) -> list[str]:
        with self._naming_the_pool():
            return self._classes(task)

    def templates(self, task: str) -> list[str]:
        with self._naming_the_pool():
            return self._templates(task)

    def split(self, task: str, split: str) -> SplitData:
        with self._naming_the_pool():
            return self._split(task, split)

    def _classes(self, task: str) -> list[str]:
        """Class names in label order: a list in the YAML, or a file with one name per line."""
        info = self.pool.task_info.get(task)
        classes = (info or {}).get("classes") or self._dataset_classes(task, info)
        if not classes:
            raise DataError(f"task '{task}' has no class names (tasks.{task}.classes in {self.pool.source})")
        if isinstance(classes, str):
            classes = self._lines(task, "classes", classes, "class-names file")
            if not classes:
                raise DataError(f"tasks.{task}.classes: the file holds no class names")
        if len(set(map(str, classes))) != len(classes):
            raise DataError(f"tasks.{task}.classes: a class name appears twice")
        return [str(c) for c in classes]

    def _dataset_classes(self, task: str, info) -> list[str] | None:
        """A parquet dataset's own class names (its label feature's), where the pool names none."""
        data = (info or {}).get("data") or {}
        if "parquet" not in data:
            return None
        from merger.data.parquet import dataset_classes

        return dataset_classes(self.pool, task, data["parquet"])

    def _templates(self, task: str) -> list[str]:
        """Prompt templates: a list, a file (one per line), or the standard CLIP set (default)."""
        from merger.data.heads import STANDARD_TEMPLATES

        value = (self.pool.task_info.get(task) or {}).get("templates")
        if value in (None, "standard"):
            return list(STANDARD_TEMPLATES)
        if isinstance(value, str):
            value = self._lines(task, "templates", value, "templates file (or use 'standard')")
        bad = [t for t in value if not _takes_a_class_name(str(t))]
        if not value or bad:
            raise DataError(f"tasks.{task}.templates: every template needs one '{{}}' for the class name, and "
                            "other braces doubled ('{{' for '{')" + (f" (not: {bad[0]!r})" if bad else ""))
        return [str(t) for t in value]

    def _lines(self, task: str, key: str, value: str, what: str) -> list[str]:
        """The non-empty lines of a class-names or templates file (a bounded read of a regular file)."""
        from merger.pool.schema import MAX_CLASSES

        path = self.pool.resolve(value, f"tasks.{task}.{key}")
        lines = [line.strip() for line in inputs.read_text(path, f"tasks.{task}.{key}: {what}", DataError).splitlines()
                 if line.strip()]
        if len(lines) > MAX_CLASSES:
            raise DataError(f"tasks.{task}.{key}: {path} has {len(lines)} lines (at most {MAX_CLASSES})")
        return lines

    def _split(self, task: str, split: str) -> SplitData:
        if split not in split_rules.SPLITS:
            raise DataError(f"unknown split '{split}'; known: {', '.join(split_rules.SPLITS)}")
        key = (task, split)
        if key not in self._cache:
            self._cache[key] = self._load(task, split)
        return self._cache[key]

    def _load(self, task: str, split: str) -> SplitData:
        info = self.pool.task_info.get(task)
        if not info or not info.get("data"):
            raise DataError(f"task '{task}' has an expert but no data (add tasks.{task}.data to {self.pool.source})")
        data = info["data"]
        if not isinstance(data, Mapping) or len(data) != 1 or next(iter(data)) not in DATA_KINDS:
            raise PoolError(f"tasks.{task}.data: expected one of {', '.join(DATA_KINDS)}")
        kind, entry = next(iter(data.items()))
        if kind == "demo":
            # a lab expert scores on the data of the task it was fine-tuned for
            label_task = info.get("labels_of", task)
            images, labels, source = _demo_split(entry, split, label_task)
            labels = labels[label_task]
        elif kind == "memory":  # in-memory pools (benchmarks): {train: (images, labels), test: ...}
            base_split = split_rules.source_split(split)
            images, labels = entry[base_split]
            source = ("memory", task, base_split)
        elif kind == "parquet":  # only the rows the split uses are decoded
            from merger.data.parquet import load_parquet_split

            images, labels, source, n_source, source_labels = load_parquet_split(self.pool, task, entry, split, _select)
        else:
            from merger.data.folders import load_folder_split

            images, labels, source = load_folder_split(self.pool, task, entry, split, self.classes(task))
        if kind != "parquet":
            n_source, source_labels = images.shape[0], labels
            idx = _select(split, n_source)
            if idx is not None:
                images, labels = images[idx], labels[idx]
                source = source + (split,)
        self._check(task, split, labels)
        if split not in ("train", "test"):  # val, live and probe are drawn from a stored split: it has every class
            self._check_classes(task, split_rules.source_split(split), source_labels,
                                f" (the {split} split is drawn from it)")
        return SplitData(images, labels, source, n_source)

    def _check(self, task: str, split: str, labels: torch.Tensor) -> None:
        n_classes = len(self.classes(task))
        if labels.numel() == 0:
            raise DataError(f"task '{task}': the {split} split has no images")
        if int(labels.min()) < 0 or int(labels.max()) >= n_classes:
            raise DataError(f"tasks.{task}.classes: {n_classes} names, but the {split} split of its data has labels "
                            f"{int(labels.min())}..{int(labels.max())}: name every class of the data, in label order")
        if split in ("train", "test"):
            self._check_classes(task, split, labels)

    def _check_classes(self, task: str, split: str, labels: torch.Tensor, note: str = "") -> None:
        n_classes = len(self.classes(task))
        counts = torch.bincount(labels.clamp(0, n_classes - 1), minlength=n_classes)
        empty = [self.classes(task)[i] for i in range(n_classes) if counts[i] == 0]
        if empty:
            raise DataError(f"tasks.{task}.classes: class(es) {', '.join(empty)} have no images in the {split} split"
                            f"{note}: a class the data lacks, or more names than the data has classes")


def preprocess(images: torch.Tensor, cfg: Mapping) -> torch.Tensor:
    """uint8 images -> float, resized to the model's input size, normalised (mean/std per channel)."""
    x = images.float().div_(255.0)
    size = cfg.get("image_size")
    if size and tuple(x.shape[-2:]) != (int(size), int(size)):
        x = F.interpolate(x, size=(int(size), int(size)), mode="bicubic", align_corners=False).clamp_(0, 1)
    mean = torch.tensor(cfg.get("mean", (0.48145466, 0.4578275, 0.40821073)), dtype=x.dtype).view(1, 3, 1, 1)
    std = torch.tensor(cfg.get("std", (0.26862954, 0.26130258, 0.27577711)), dtype=x.dtype).view(1, 3, 1, 1)
    return (x - mean) / std


def _takes_a_class_name(template: str) -> bool:
    """A template that str.format fills with the class name, as the zero-shot heads do ('a {} {}' or
    'a {name}' raised mid-evaluation, naming no file)."""
    try:
        return "\x00" in template.format("\x00")
    except (IndexError, KeyError, ValueError):
        return False
