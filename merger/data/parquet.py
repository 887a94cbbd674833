"""Task data from parquet image datasets, as the Hugging Face Hub stores them: an image column (a
struct of encoded bytes, or the bytes themselves) and an integer label column, one or more files
per split. ``data: {parquet: {train: FILES, test: FILES, image: image, label: label}}``; a
``{hub: org/dataset}`` source becomes one (merger/pool/hub.py).

Class names come from the dataset's own label feature (a ``ClassLabel``'s names, kept in the files'
``huggingface`` schema metadata) unless the pool names them. Only the rows a split uses are decoded
(val, live and probe are drawn from train and test by their labels' count); undecodable images are
skipped and counted, as in image folders. Needs pyarrow (the ``hub`` extra).
"""
from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from merger.data.splits import source_split
from merger.errors import DataError, PoolError

MAX_SPLIT_BYTES = 8 << 30  # uint8 pixels of one split held in memory (as image folders)
log = logging.getLogger(__name__)


def _pyarrow():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("parquet task data needs pyarrow: pip install 'pyarrow>=14' (the hub extra: "
                        "pip install -e '.[hub]')") from None
    return pq


def _integers(kind) -> bool:
    import pyarrow.types

    return pyarrow.types.is_integer(kind)


def _files(pool, task: str, entry: Mapping, split: str) -> list[Path]:
    where = f"tasks.{task}.data.parquet.{split}"
    value = entry.get(split)
    if not value:
        raise PoolError(f"{pool.source}: {where}: no files for the {split} split")
    paths = [pool.resolve(v, where) for v in ([value] if isinstance(value, (str, Path)) else value)]
    for p in paths:
        if not p.is_file():
            raise DataError(f"{pool.source}: {where}: {p} is not a file")
    return paths


def _check_columns(pq, path: Path, task: str, *columns: str) -> None:
    names = pq.read_schema(path).names
    for col in columns:
        if col not in names:
            raise DataError(f"tasks.{task}: {path}: no column '{col}' (columns: {', '.join(names)}); name the "
                            f"columns with tasks.{task}.data image: / label:")


def dataset_classes(pool, task: str, entry: Mapping) -> list[str] | None:
    """The label feature's class names, from the test files' metadata; None when it has none."""
    pq = _pyarrow()
    label = entry.get("label", "label")
    first = _files(pool, task, entry, "test")[0]
    _check_columns(pq, first, task, entry.get("image", "image"), label)
    meta = pq.read_schema(first).metadata or {}
    try:
        features = json.loads(meta[b"huggingface"])["info"]["features"]
        names = features[label].get("names")
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return [str(n) for n in names] if isinstance(names, list) and names else None


def load_parquet_split(pool, task: str, entry: Mapping, split: str, select):
    """(uint8 images [n, 3, S, S], labels [n], source key, rows of the stored split, its labels) for
    ``split``; ``select(split, rows)`` gives the rows a drawn split uses (None: all)."""
    pq = _pyarrow()
    stored = source_split(split)
    files = _files(pool, task, entry, stored)
    image_col, label_col = entry.get("image", "image"), entry.get("label", "label")
    size = int(entry.get("image_size", pool.preprocess_cfg.get("image_size", 224)))
    labels = []
    for f in files:
        _check_columns(pq, f, task, image_col, label_col)
        column = pq.read_table(f, columns=[label_col]).column(0)
        if not _integers(column.type):
            raise DataError(f"tasks.{task}: {f}: column '{label_col}' holds {column.type}, not integer labels")
        labels.append(torch.from_numpy(column.to_numpy(zero_copy_only=False).astype(np.int64)))
    source_labels = torch.cat(labels)
    rows = source_labels.numel()
    idx = select(split, rows)
    chosen = torch.arange(rows) if idx is None else idx
    if chosen.numel() * 3 * size * size > MAX_SPLIT_BYTES:  # refused before decoding, not halfway
        raise DataError(f"tasks.{task}: the {split} split has {chosen.numel()} images; at {size}×{size} that is "
                        f"{chosen.numel() * 3 * size * size / 2**30:.1f} GiB (at most {MAX_SPLIT_BYTES / 2**30:g} GiB)")
    images, kept, skipped = _decode(pq, files, image_col, chosen.tolist(), size)
    if skipped:
        log.warning("tasks.%s: skipped %d undecodable image(s) of the %s split", task, skipped, stored)
    if not images:
        raise DataError(f"tasks.{task}: no decodable images in the {stored} split ({', '.join(map(str, files))})")
    key = ("parquet", tuple(str(f) for f in files), image_col, size) + ((split,) if idx is not None else ())
    return (torch.from_numpy(np.stack(images)), source_labels[torch.tensor(kept, dtype=torch.int64)], key, rows,
            source_labels)


def _decode(pq, files: list[Path], column: str, rows: list[int], size: int):
    """The chosen rows' images, decoded file by file (a file's image column is read once)."""
    from PIL import Image

    wanted, images, kept, skipped, start = sorted(rows), [], [], 0, 0
    order = {r: i for i, r in enumerate(rows)}
    decoded: dict[int, np.ndarray] = {}
    for f in files:
        table = pq.read_table(f, columns=[column])
        stop = start + table.num_rows
        local = [r - start for r in wanted if start <= r < stop]
        values = table.column(0).take(local).to_pylist() if local else []
        for r, value in zip((start + i for i in local), values):
            data = value.get("bytes") if isinstance(value, dict) else value
            try:
                with Image.open(io.BytesIO(data)) as im:
                    im = im.convert("RGB").resize((size, size), Image.BICUBIC)
                    decoded[r] = np.asarray(im, dtype=np.uint8).transpose(2, 0, 1).copy()
            except (OSError, ValueError, TypeError, SyntaxError, Image.DecompressionBombError):
                skipped += 1
        start = stop
    for r in sorted(decoded, key=order.get):  # the order the split asked for
        images.append(decoded[r])
        kept.append(r)
    return images, kept, skipped
