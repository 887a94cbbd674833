"""Computed state on disk (DESIGN's fifth cache level): prepared methods and task-vector stacks,
keyed by the content hashes of the files they were computed from.

An entry is one safetensors file named by its key: the tensors, and in its metadata the key, the
format version and the structure (how the tensors nest in the prepared state). A second open of
the same pool reads it instead of recomputing; a changed file changes its hash, so its entries
are never found again (they age out under the size cap). An entry that cannot be read (truncated,
overwritten, another version) is refused with a warning, deleted and rebuilt.

Hashing a 350 MB checkpoint takes a fraction of a second, a ViT-L/14 pool many seconds, so each
file's sha256 is remembered with its size, mtime and inode (as git's index does): a file that is
written again, touched or replaced is hashed again.

Where: ``computed/`` in ``$MERGER_CACHE_DIR`` (default ``~/.cache/merger``, beside the zero-shot
heads); cap: ``$MERGER_CACHE_GB`` (20 GB); ``MERGER_DISK_CACHE=off`` turns it off.
``python -m merger cache info|clear``.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Mapping

import torch

from merger.io import checkpoints

VERSION = 1
# Worth a file: stacks and preparations of pools above this many task-vector entries (all experts).
# The demo pool (about 3 M) recomputes in milliseconds; ViT-B/32 × 8 is 700 M.
WORTH_ENTRIES = 20_000_000
DEFAULT_CAP_GB = 20.0
SUFFIX = ".safetensors"
log = logging.getLogger(__name__)


def cache_root() -> Path | None:
    """The cache folder, or None when it is turned off."""
    if os.environ.get("MERGER_DISK_CACHE", "").strip().lower() == "off":
        return None
    return cache_dir() / "computed"


def cache_dir() -> Path:
    """``$MERGER_CACHE_DIR`` (default ``~/.cache/merger``): prepared methods under computed/,
    zero-shot heads under heads/."""
    return Path(os.environ.get("MERGER_CACHE_DIR", Path.home() / ".cache" / "merger")).expanduser()


def cap_bytes() -> int:
    text = os.environ.get("MERGER_CACHE_GB")
    if text is None:
        return int(DEFAULT_CAP_GB * 2**30)
    try:
        gb = float(text)
    except ValueError:
        gb = -1.0
    if not 0 <= gb < float("inf"):
        _warn_once(f"MERGER_CACHE_GB={text!r}: not a size in GB (a number ≥ 0); the cache keeps its default cap "
                   f"of {DEFAULT_CAP_GB:g} GB")
        return int(DEFAULT_CAP_GB * 2**30)
    return int(gb * 2**30)


@functools.lru_cache(maxsize=None)  # what was said: a user-facing warning once per process, not a result
def _warn_once(message: str) -> None:
    import sys

    print(f"warning: {message}", file=sys.stderr, flush=True)


def key_of(parts: Mapping[str, Any]) -> str:
    """The key of an entry: sha256 of its description (kind, hashes, parameters) as canonical JSON."""
    text = json.dumps({"version": VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def source_hash(*objects) -> str:
    """sha256 of the source files defining these functions, classes or modules: an entry keyed by it is
    never found again once that code is edited."""
    h = hashlib.sha256()
    for obj in objects:
        with open(inspect.getsourcefile(obj), "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()


# ---- nested state <-> flat tensors (the task vectors, the pool's, are a {"tv": 1} node) ----------
def flatten(state) -> tuple[dict[str, torch.Tensor], Any]:
    """(tensors by name, the structure that names them). A tensor met twice is written once and
    read back as one tensor (a preparation may hold it in two places); distinct tensors that share
    memory (views of one buffer) are copied apart, since safetensors refuses shared memory."""
    tensors: dict[str, torch.Tensor] = {}
    names: dict[int, str] = {}  # id(tensor) -> its name
    buffers: set[int] = set()  # the storages already written

    def walk(x):
        if isinstance(x, torch.Tensor):
            if id(x) in names:
                return {"x": names[id(x)]}
            name = names[id(x)] = f"t{len(tensors)}"
            t = x.detach().cpu().contiguous()
            if t.untyped_storage().data_ptr() in buffers:
                t = t.clone()
            buffers.add(t.untyped_storage().data_ptr())
            tensors[name] = t
            return {"x": name}
        if isinstance(x, dict):
            if not all(isinstance(k, str) for k in x):
                raise TypeError("only string keys can be cached")
            return {"d": {k: walk(v) for k, v in x.items()}}
        if isinstance(x, (list, tuple)):
            return {"t" if isinstance(x, tuple) else "l": [walk(v) for v in x]}
        if x is None or isinstance(x, (bool, int, float, str)):
            return {"v": x}
        if type(x).__name__ == "TaskVectors":
            return {"tv": 1}
        raise TypeError(f"cannot cache a {type(x).__name__}")

    return tensors, walk(state)


def unflatten(structure, tensors: Mapping[str, torch.Tensor], task_vectors=None, device=None):
    moved: dict[str, torch.Tensor] = {}  # a tensor named twice comes back as one tensor

    def walk(node):
        (kind, value), = node.items()
        if kind == "x":
            if value not in moved:
                moved[value] = tensors[value] if device is None else tensors[value].to(device)
            return moved[value]
        if kind == "d":
            return {k: walk(v) for k, v in value.items()}
        if kind in ("t", "l"):
            items = [walk(v) for v in value]
            return tuple(items) if kind == "t" else items
        if kind == "v":
            return value
        if kind == "tv":
            return task_vectors
        raise ValueError(f"unknown node {kind!r}")

    return walk(structure)


# ---- the store ---------------------------------------------------------------------------------------
class DiskCache:
    def __init__(self, root: Path | None = None, cap: int | None = None):
        self.root = Path(root) if root is not None else cache_root()
        self.cap = cap_bytes() if cap is None else cap
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.root is not None

    def path(self, key: str) -> Path:
        return self.root / f"{key}{SUFFIX}"

    def get(self, key: str):
        """(tensors, structure, metadata) of an entry, or None (absent, or corrupt: then deleted)."""
        if not self.enabled:
            return None
        path = self.path(key)
        if not path.exists():
            return None
        try:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as fh:
                meta = fh.metadata() or {}
                if meta.get("key") != key or meta.get("version") != str(VERSION):
                    raise ValueError("its key or format version does not match its name")
                structure = json.loads(meta["structure"])
                tensors = {name: fh.get_tensor(name) for name in fh.keys()}
        except Exception as exc:  # a truncated or overwritten file: refuse it, delete it, rebuild
            log.warning("disk cache: %s cannot be read (%s); deleted, it will be rebuilt", path, str(exc)[:200])
            path.unlink(missing_ok=True)
            return None
        os.utime(path)  # least recently used goes first under the cap
        return tensors, structure, meta

    def put(self, key: str, what: str, tensors: Mapping[str, torch.Tensor], structure, extra: Mapping[str, str] = ()):
        """Write an entry atomically (a temporary file, then a rename), then keep the folder under the cap."""
        if not self.enabled:
            return None
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if size > self.cap:
            return None
        meta = {"key": key, "version": str(VERSION), "what": what, "structure": json.dumps(structure),
                "written": time.strftime("%Y-%m-%d %H:%M:%S"), **dict(extra)}
        try:
            with self._lock:
                checkpoints.save_safetensors(dict(tensors), self.path(key), metadata=meta)
                self.trim()
        except OSError as exc:  # a full or read-only disk costs speed, never the merge
            log.warning("disk cache: cannot write %s (%s)", self.path(key), exc)
            return None
        return self.path(key)

    def entries(self) -> list[dict]:
        if not self.enabled or not self.root.exists():
            return []
        out = []
        for p in self.root.glob(f"*{SUFFIX}"):
            try:
                st = p.stat()
            except OSError:
                continue
            out.append({"path": p, "bytes": st.st_size, "used": st.st_mtime})
        return sorted(out, key=lambda e: e["used"])

    def trim(self) -> int:
        """Delete the least recently used entries until the folder is under the cap; returns how many."""
        entries = self.entries()
        total, removed = sum(e["bytes"] for e in entries), 0
        for e in entries:
            if total <= self.cap:
                break
            e["path"].unlink(missing_ok=True)
            total -= e["bytes"]
            removed += 1
        return removed

    def describe(self, path: Path) -> str:
        try:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as fh:
                return (fh.metadata() or {}).get("what", "?")
        except Exception:
            return "unreadable (deleted on next use)"

    def clear(self) -> tuple[int, int]:
        entries = self.entries()
        for e in entries:
            e["path"].unlink(missing_ok=True)
        memo = self.root / HASHES if self.enabled else None
        if memo is not None and memo.exists():
            memo.unlink()
        return len(entries), sum(e["bytes"] for e in entries)


# ---- remembered content hashes ------------------------------------------------------------------------
HASHES = "hashes.json"
_memo_lock = threading.Lock()


def file_hash(path: str | os.PathLike, cache: DiskCache | None = None) -> str:
    """``checkpoints.content_hash``, remembered per (path, size, mtime, inode) in the cache folder."""
    cache = cache or DiskCache()
    path = Path(path)
    if not cache.enabled or path.is_dir():
        return checkpoints.content_hash(path)
    st = path.stat()
    stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
    memo_path = cache.root / HASHES
    with _memo_lock:
        memo = _read_memo(memo_path)
        known = memo.get(str(path.resolve()))
        if known and known.get("stamp") == stamp:
            return known["sha256"]
    digest = checkpoints.content_hash(path)
    with _memo_lock:
        memo = _read_memo(memo_path)
        memo[str(path.resolve())] = {"stamp": stamp, "sha256": digest}
        try:
            checkpoints.write_text_atomic(memo_path, json.dumps(memo))
        except OSError:
            pass
    return digest


def _read_memo(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}
