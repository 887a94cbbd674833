"""Computed state on disk (DESIGN's fifth cache level): prepared methods and task-vector stacks,
keyed by the content hashes of the files they were computed from.

An entry is one safetensors file named by its key: the tensors, and in its metadata the key, the
format version and the structure (how the tensors nest in the prepared state). A second open of
the same pool reads it instead of recomputing; a changed file changes its hash, so its entries
are never found again (they age out under the size cap). An entry that cannot be read (truncated,
overwritten, another version) is refused with a warning, deleted and rebuilt.

Hashing a 350 MB checkpoint takes a fraction of a second, a ViT-L/14 pool many seconds, so each
file's sha256 is remembered with its size, mtime, ctime and inode (as git's index does): a file that
is written again, touched or replaced is hashed again.

The folder must be one no one else can write (``merger/io/private.py``), else the cache is off with
a warning; every entry carries an HMAC under a secret kept there, so an entry this cache did not write
is refused; only files named as entries are read or deleted, and no link is followed.

Where: ``computed/`` in ``$MERGER_CACHE_DIR`` (default ``~/.cache/merger``, beside the zero-shot
heads); cap: ``$MERGER_CACHE_GB`` (20 GB); ``MERGER_DISK_CACHE=off`` turns it off.
``python -m merger cache info|clear``.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import inspect
import json
import logging
import os
import re
import secrets
import stat
import threading
import time
from pathlib import Path
from typing import Any, Mapping

import torch

from merger.io import checkpoints
from merger.io.private import is_regular, read_regular, why_not_private

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
ENTRY_NAME = re.compile(r"[0-9a-f]{32,64}" + re.escape(SUFFIX))  # what put() names an entry
# what an interrupted put() leaves (checkpoints._atomic's temporary names); a writer may still hold one this young
PARTIAL_NAME = re.compile(r"\.(?:[0-9a-f]{32,64}" + re.escape(SUFFIX) + r"|hashes\.json)\..+\.tmp")
PARTIAL_AGE_S = 3600
SECRET = "secret"  # 32 random bytes in the folder: each entry carries an HMAC of its contents under it


class DiskCache:
    """Entries in a folder only this user can write (``private.why_not_private``); each one signed
    with the folder's secret, so an entry this cache did not write (copied in, forged, another
    version's) is refused, deleted and rebuilt. Only files named as entries are read or deleted,
    never through a link."""

    def __init__(self, root: Path | None = None, cap: int | None = None):
        self.root = Path(root) if root is not None else cache_root()
        self.cap = cap_bytes() if cap is None else cap
        self._lock = threading.Lock()
        self._secret: bytes | None = None

    @property
    def enabled(self) -> bool:
        """On, and its folder private (a folder not made yet is made by the first write)."""
        return self.root is not None and (not os.path.lexists(self.root) or self.ready())

    def ready(self) -> bool:
        """The folder made if absent, checked, and its secret read or made."""
        if self._secret is not None:
            return True
        reason = why_not_private(self.root)
        if reason is None:
            self._secret = _secret_of(self.root)
            reason = None if self._secret else f"{self.root / SECRET} cannot be read or made"
        if reason is not None:
            _warn_once(f"the disk cache is off: {self.root}: {reason}. merger reads cached tensors only from a folder "
                       "no one else can write (set MERGER_CACHE_DIR to one)")
            return False
        return True

    def path(self, key: str) -> Path:
        return self.root / f"{key}{SUFFIX}"

    def get(self, key: str):
        """(tensors, structure, metadata) of an entry, or None (absent, or not one this cache wrote:
        then deleted)."""
        if not self.enabled:
            return None
        path = self.path(key)
        if not os.path.lexists(path) or not self.ready():
            return None
        try:
            from safetensors import safe_open

            if not is_regular(path):
                raise ValueError("it is not a regular file")
            with safe_open(str(path), framework="pt") as fh:
                meta = fh.metadata() or {}
                if meta.get("key") != key or meta.get("version") != str(VERSION):
                    raise ValueError("its key or format version does not match its name")
                tensors = {name: fh.get_tensor(name) for name in fh.keys()}
            if not hmac.compare_digest(meta.get("tag", ""), self._tag(key, meta, tensors)):
                raise ValueError("it is not signed by this cache's secret")
            structure = json.loads(meta["structure"])
            check_structure(structure, tensors)
        except Exception as exc:  # truncated, overwritten, forged: refuse it, delete it, rebuild
            log.warning("disk cache: %s cannot be read (%s); deleted, it will be rebuilt", path, str(exc)[:200])
            path.unlink(missing_ok=True)  # a link or FIFO named as an entry goes too, never what it points to
            return None
        os.utime(path)  # least recently used goes first under the cap
        return tensors, structure, meta

    def _tag(self, key: str, meta: Mapping[str, str], tensors: Mapping[str, torch.Tensor]) -> str:
        """HMAC-SHA256 under the folder's secret of the key, the structure and every tensor (name,
        dtype, shape, bytes)."""
        mac = hmac.new(self._secret, digestmod=hashlib.sha256)
        mac.update(json.dumps([key, meta.get("version"), meta.get("structure")]).encode())
        for name in sorted(tensors):
            t = tensors[name].detach().cpu().contiguous()
            mac.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            if t.numel():
                mac.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        return mac.hexdigest()

    def put(self, key: str, what: str, tensors: Mapping[str, torch.Tensor], structure, extra: Mapping[str, str] = ()):
        """Write an entry atomically (a temporary file, then a rename), then keep the folder under the cap."""
        if not re.fullmatch(r"[0-9a-f]{32,64}", key):
            raise ValueError(f"a disk-cache key is 32 to 64 hex digits, not {key!r}")
        if not (self.enabled and self.ready()):
            return None
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if size > self.cap:
            return None
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        meta = {"key": key, "version": str(VERSION), "what": what, "structure": json.dumps(structure),
                "written": time.strftime("%Y-%m-%d %H:%M:%S"), **dict(extra)}
        meta["tag"] = self._tag(key, meta, tensors)
        try:
            with self._lock:
                checkpoints.save_safetensors(tensors, self.path(key), metadata=meta)
                self.trim()
        except OSError as exc:  # a full or read-only disk costs speed, never the merge
            log.warning("disk cache: cannot write %s (%s)", self.path(key), exc)
            return None
        return self.path(key)

    def entries(self, partial_age_s: float = PARTIAL_AGE_S) -> list[dict]:
        """The entries (regular files named as entries; no link is followed), and the temporary files of
        interrupted writes older than ``partial_age_s`` (``"partial": True``), least recently used first."""
        if not self.enabled or not os.path.lexists(self.root) or not self.ready():
            return []
        out, now = [], time.time()
        for p in self.root.iterdir():
            partial = bool(PARTIAL_NAME.fullmatch(p.name))
            if not (partial or ENTRY_NAME.fullmatch(p.name)):
                continue
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or (partial and now - st.st_mtime < partial_age_s):
                continue
            out.append({"path": p, "bytes": st.st_size, "used": st.st_mtime, "partial": partial})
        return sorted(out, key=lambda e: (not e["partial"], e["used"]))

    def trim(self) -> int:
        """Delete interrupted writes, then the least recently used entries until the folder is under the
        cap; returns how many files went."""
        entries = self.entries()
        total, removed = sum(e["bytes"] for e in entries), 0
        for e in entries:
            if total <= self.cap and not e["partial"]:
                break
            e["path"].unlink(missing_ok=True)
            total -= e["bytes"]
            removed += 1
        return removed

    def describe(self, path: Path) -> str:
        if PARTIAL_NAME.fullmatch(path.name):
            return "an interrupted write (deleted by the cap and by clear)"
        try:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as fh:
                return (fh.metadata() or {}).get("what", "?")
        except Exception:
            return "unreadable (deleted on next use)"

    def clear(self) -> tuple[int, int]:
        entries = self.entries(partial_age_s=0)
        for e in entries:
            e["path"].unlink(missing_ok=True)
        memo = self.root / HASHES if self.enabled else None
        if memo is not None and is_regular(memo):
            memo.unlink()
        return len(entries), sum(e["bytes"] for e in entries)


def check_structure(structure, tensors: Mapping[str, torch.Tensor]) -> None:
    """Raise ValueError unless ``structure`` is one ``flatten`` writes, naming only these tensors."""
    def walk(node):
        if not (isinstance(node, dict) and len(node) == 1):
            raise ValueError(f"unknown node {str(node)[:60]}")
        (kind, value), = node.items()
        if kind == "x" and value in tensors:
            return
        if kind == "d" and isinstance(value, dict):
            return [walk(v) for v in value.values()]
        if kind in ("t", "l") and isinstance(value, list):
            return [walk(v) for v in value]
        if kind == "v" and (value is None or isinstance(value, (bool, int, float, str))):
            return
        if kind == "tv" and value == 1:
            return
        raise ValueError(f"unknown node {kind!r}")

    if structure is not None:
        walk(structure)


def _secret_of(folder: Path) -> bytes | None:
    """The folder's secret: 32 random bytes in a file only this user can read, made on first use."""
    path = folder / SECRET
    data = read_regular(path, limit=64)
    if data is not None and len(data) == 32 and (not hasattr(os, "getuid") or
                                                 stat.S_IMODE(os.lstat(path).st_mode) & 0o077 == 0):
        return data
    data = secrets.token_bytes(32)
    try:
        if os.path.lexists(path):  # a short, shared or linked secret is replaced: its entries become misses
            path.unlink()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_BINARY", 0), 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
    except OSError:
        return None
    return data


# ---- remembered content hashes ------------------------------------------------------------------------
HASHES = "hashes.json"
_memo_lock = threading.Lock()


def file_hash(path: str | os.PathLike, cache: DiskCache | None = None) -> str:
    """``checkpoints.content_hash``, remembered per (path, size, mtime, ctime, device, inode) in the cache
    folder. The ctime is in the stamp because a file rewritten in place can be given its old mtime back
    (``touch -d``, ``os.utime``) but not its old ctime: every write sets it to now."""
    cache = cache or DiskCache()
    path = Path(path)
    if not (cache.enabled and cache.ready()) or path.is_dir():
        return checkpoints.content_hash(path)
    st = path.stat()
    stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev, st.st_ino]
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
    data = read_regular(path, limit=64 << 20)
    try:
        doc = json.loads(data) if data is not None else {}
        return doc if isinstance(doc, dict) else {}
    except ValueError:
        return {}
