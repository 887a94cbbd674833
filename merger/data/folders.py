"""Task data from image folders: ``<root>/<split>/<class>/*.png|jpg``.

Class folders must match the task's class names (a class-names file can rename them: one name
per line, in label order, matched to the sorted folder names). Unreadable images are skipped
and counted, never a crash.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from merger.data.splits import source_split
from merger.errors import DataError, PoolError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")
MAX_SPLIT_BYTES = 8 << 30  # uint8 pixels of one split held in memory
log = logging.getLogger(__name__)


def _entry_root(pool, task: str, entry) -> tuple[Path, int]:
    if isinstance(entry, (str, Path)):
        entry = {"root": entry}
    if not isinstance(entry, Mapping) or "root" not in entry:
        raise PoolError(f"{pool.source}: tasks.{task}.data.folder: expected a path or {{root: path, image_size: N}}")
    root = pool.resolve(entry["root"], f"tasks.{task}.data.folder")
    if not root.is_dir():
        raise DataError(f"{pool.source}: tasks.{task}.data.folder: {root} is not a folder")
    return root, int(entry.get("image_size", pool.preprocess_cfg.get("image_size", 224)))


def load_folder_split(pool, task: str, entry, split: str, classes: list[str]):
    """(uint8 images [N, 3, S, S], labels [N], source key) for train/test (val/live come from them)."""
    from PIL import Image

    root, size = _entry_root(pool, task, entry)
    base_split = source_split(split)
    folder = root / base_split
    if not folder.is_dir():
        present = ", ".join(sorted(p.name for p in root.iterdir() if p.is_dir())) or "nothing"
        raise DataError(f"tasks.{task}: {folder} is missing (expected <root>/{base_split}/<class>/*.png; found {present})")
    # hidden folders (.ipynb_checkpoints, .DS_Store's kin) are no classes, unless one is named so
    found = sorted(p.name for p in folder.iterdir() if p.is_dir() and (not p.name.startswith(".") or p.name in classes))
    missing = [c for c in classes if c not in found]
    extra = [c for c in found if c not in classes]
    if missing or extra:
        raise DataError(f"tasks.{task}: class folders in {folder} do not match the class names"
                        + (f"; missing: {', '.join(missing)}" if missing else "")
                        + (f"; unexpected: {', '.join(extra)}" if extra else ""))
    images, labels, skipped = [], [], 0
    per_class = [sorted(p for p in (folder / c).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES) for c in classes]
    total = sum(len(files) for files in per_class)
    if total * 3 * size * size > MAX_SPLIT_BYTES:  # refuse before allocating, not halfway through
        raise DataError(f"tasks.{task}: {folder} holds {total} images; at {size}×{size} that is "
                        f"{total * 3 * size * size / 2**30:.1f} GiB (at most {MAX_SPLIT_BYTES / 2**30:g} GiB per split)")
    for label, files in enumerate(per_class):
        for f in files:
            if not f.is_file():  # a FIFO, socket or device named like an image would never end
                skipped += 1
                continue
            try:
                with Image.open(f) as im:
                    im = im.convert("RGB").resize((size, size), Image.BICUBIC)
                    images.append(np.asarray(im, dtype=np.uint8).transpose(2, 0, 1).copy())
                labels.append(label)
            except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
                skipped += 1
    if skipped:
        log.warning("%s: skipped %d unreadable image(s)", folder, skipped)
    if not images:
        raise DataError(f"tasks.{task}: no readable images in {folder}")
    return torch.from_numpy(np.stack(images)), torch.tensor(labels, dtype=torch.int64), ("folder", str(folder), size)
