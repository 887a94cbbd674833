"""Pool sources on the Hugging Face Hub: ``{hub: org/name, revision: R}`` wherever a pool YAML names
a file (the base: an open_clip CLIP or a Hugging Face ``CLIPModel``; an expert: a ``CLIPVisionModel``
repo, as FusionBench publishes them; a task's data: a parquet image dataset), and the known
benchmarks, ``hub:NAME`` (merger/pool/known.py).

Each source is fetched once into the Hugging Face cache, and read from there afterwards, offline
too. Before anything downloads, the files and their sizes are said and the free disk is checked; each
file then has its own progress bar (huggingface_hub's). Only weights and configs are fetched:
safetensors where the repo has them, else a PyTorch file read with ``weights_only=True``; nothing in
a repo is executed. Every refusal names the pool file and the key of the source.
"""
from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, Mapping

from merger.errors import PoolError

SOURCE_KEYS = {"hub", "revision"}
DATA_KEYS = SOURCE_KEYS | {"train", "test", "image", "label", "image_size"}
MODEL_FILES = ("open_clip_model.safetensors", "model.safetensors", "model.safetensors.index.json",
               "pytorch_model.bin", "pytorch_model.bin.index.json")
DISK_MARGIN = 1.1  # free space asked beyond the bytes to fetch (the cache's own files, a partial download)


@dataclass
class Source:
    key: str  # where the pool names it ("experts.cars")
    repo: str
    revision: str
    kind: str  # "model" or "dataset"
    commit: str = ""  # the commit the revision resolved to
    files: tuple = ()  # (path in the repo, bytes or None)
    sha256: dict = field(default_factory=dict)  # path -> the Hub's sha256 of a large (LFS) file

    def record(self) -> dict:
        return {"hub": self.repo, "revision": self.commit or self.revision}


def names_hub(spec: Any) -> bool:
    """Whether a pool's spec (or any part of it) names a Hub source."""
    if isinstance(spec, Mapping):
        return "hub" in spec or any(names_hub(v) for v in spec.values())
    return isinstance(spec, (list, tuple)) and any(names_hub(v) for v in spec)


def sources_of(spec: Mapping, where: str, pins: Mapping[str, str] | None = None) -> list[Source]:
    """The Hub sources a pool spec names, checked (a pinned revision per key overrides the spec's)."""
    from merger.io import inputs

    found, pins = [], pins or {}

    def source(value, key, kind, allowed):
        inputs.known_keys(value, allowed, key, where, PoolError)
        repo = inputs.string(value["hub"], f"{where}: {key}.hub", PoolError, 200)
        if repo.count("/") != 1 or not all(part.strip() for part in repo.split("/")):
            raise PoolError(f"{where}: {key}.hub: {repo!r} is not a repository name (org/name)")
        revision = inputs.string(value.get("revision", "main"), f"{where}: {key}.revision", PoolError, 200)
        found.append(Source(key, repo, pins.get(key, revision), kind))

    if not isinstance(spec, Mapping):  # the pool's schema names what is wrong with it
        return found
    if isinstance(spec.get("base"), Mapping):
        source(spec["base"], "base", "model", SOURCE_KEYS)
    experts, tasks = spec.get("experts"), spec.get("tasks")
    for name, value in (experts.items() if isinstance(experts, Mapping) else ()):
        if isinstance(value, Mapping) and "hub" in value:
            source(value, f"experts.{name}", "model", SOURCE_KEYS | {"hparams"})
    for name, task in (tasks.items() if isinstance(tasks, Mapping) else ()):
        data = task.get("data") if isinstance(task, Mapping) else None
        if isinstance(data, Mapping) and "hub" in data:
            source(data, f"tasks.{name}.data", "dataset", DATA_KEYS)
    return found


def _hf():
    import huggingface_hub
    import huggingface_hub.constants  # noqa: F401  (a submodule the package does not import eagerly)
    import huggingface_hub.errors  # noqa: F401

    return huggingface_hub


def offline() -> bool:
    return bool(_hf().constants.HF_HUB_OFFLINE)


def plan(sources: list[Source], where: str) -> None:
    """Each source's commit and the files merger reads from it, with their sizes (asks the Hub)."""
    hf = _hf()
    api = hf.HfApi()
    for s in sources:
        try:
            info = (api.model_info if s.kind == "model" else api.dataset_info)(s.repo, revision=s.revision,
                                                                                files_metadata=True)
        except Exception as exc:  # noqa: BLE001  the Hub's answer, said in one line with the key
            error = PoolError(f"{where}: {s.key}: {_said(exc, s, where)}")
            error.answered = isinstance(exc, _hf().errors.HfHubHTTPError)  # the Hub answered (a 4xx)
            raise error from None
        sizes = {f.rfilename: f.size for f in info.siblings or ()}
        s.commit, s.files = info.sha, tuple((f, sizes[f]) for f in _wanted(s, list(sizes), where))
        s.sha256 = {f.rfilename: f.lfs.sha256 for f in info.siblings or () if getattr(f, "lfs", None)}


def _wanted(s: Source, files: list[str], where: str) -> list[str]:
    if s.kind == "dataset":
        chosen = [f for f in files if f.endswith(".parquet")]
        if not chosen:
            raise PoolError(f"{where}: {s.key}: {s.repo} holds no parquet files (an image dataset with train and "
                            "test splits in parquet, as the Hub converts datasets)")
        return sorted(chosen)
    configs = [f for f in files if f in ("config.json", "open_clip_config.json")]
    for name in MODEL_FILES:
        if name in files:
            if name.endswith(".index.json"):
                shard = name.replace(".index.json", "")
                stem, ext = shard.rsplit(".", 1)
                return configs + [name] + sorted(f for f in files if fnmatch(f, f"{stem}-*-of-*.{ext}"))
            return configs + [name]
    raise PoolError(f"{where}: {s.key}: {s.repo} has no weights merger reads (one of {', '.join(MODEL_FILES)})")


def check_disk(sources: list[Source], cache: Path, where: str, out=sys.stderr) -> None:
    """Say what will be fetched (files not cached yet) and refuse it when the disk cannot hold it."""
    hf = _hf()
    missing = [(s, f, n) for s in sources for f, n in s.files
               if not isinstance(hf.try_to_load_from_cache(s.repo, f, revision=s.commit,
                                                           repo_type=s.kind), str)]
    if not missing:
        return
    total = sum(n or 0 for _, _, n in missing)
    cache.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(cache).free
    print(f"{where}: fetching {len(missing)} files, {total / 2**30:.2f} GB, into {cache} "
          f"({free / 2**30:.1f} GB free)", file=out, flush=True)
    if total * DISK_MARGIN > free:
        raise PoolError(f"{where}: {len(missing)} files to fetch take {total / 2**30:.2f} GB and {cache} has "
                        f"{free / 2**30:.2f} GB free: free some space or set HF_HUB_CACHE to a larger disk")


def fetch(s: Source, where: str) -> Path:
    """The source's files in the cache (fetched where missing): the snapshot folder of its commit."""
    hf = _hf()
    kw = {"repo_type": s.kind, "revision": s.revision}  # by its name: the cache then maps it to the commit
    try:
        paths = [hf.hf_hub_download(s.repo, f, **kw) for f, _ in s.files]
        folder = Path(hf.snapshot_download(s.repo, local_files_only=True, **kw)) if not paths else None
    except Exception as exc:  # noqa: BLE001
        raise PoolError(f"{where}: {s.key}: {_said(exc, s, where)}") from None
    if paths:
        _verify(s, paths, where)
        folder = _snapshot(Path(paths[0]), s.files[0][0])
        s.commit = folder.name  # the commit the files came from, should the branch have moved since
        return folder
    s.commit = s.commit or folder.name
    if s.kind == "model":
        s.files = tuple((f, None) for f in _wanted(s, [str(p.relative_to(folder)) for p in folder.rglob("*")
                                                          if p.is_file()], where))
    else:
        s.files = tuple((str(p.relative_to(folder)), None) for p in sorted(folder.rglob("*.parquet")))
    return folder


def _verify(s: Source, paths: list[str], where: str) -> None:
    """Each large file against the Hub's sha256 (huggingface_hub checks sizes only): remembered per
    file stamp (io/disk_cache.file_hash), so a later fetch of the same files reads no byte again."""
    from merger.io.disk_cache import file_hash

    for (f, _), path in zip(s.files, paths):
        want = s.sha256.get(f)
        if want and file_hash(path) != want:
            raise PoolError(f"{where}: {s.key}: {s.repo}/{f}: the file in the cache ({Path(path).resolve()}) "
                            f"differs from the Hub's sha256 {want[:12]}…: delete it and fetch again")


def _snapshot(path: Path, name: str) -> Path:
    """The snapshot folder of a file downloaded as ``name`` (which may lie in a sub-folder)."""
    for _ in Path(name).parts:
        path = path.parent
    return path


def resolved(s: Source, folder: Path, value: Mapping) -> Any:
    """What the pool reads in place of the source: a weights file or folder, or a parquet entry."""
    if s.kind == "dataset":
        splits = {split: [str(folder / f) for f, _ in s.files if _split_of(f) == value.get(split, split)]
                  for split in ("train", "test")}
        for split, files in splits.items():
            if not files:
                raise PoolError(f"{s.key}: {s.repo} has no parquet files of its '{value.get(split, split)}' split "
                                f"(files: {', '.join(f for f, _ in s.files)[:300]}); name it with {s.key}.{split}:")
        extra = {k: value[k] for k in ("image", "label", "image_size") if k in value}
        return {"parquet": {**splits, **extra}}
    weights = next(f for f, _ in s.files if not f.endswith("config.json"))
    return str(folder / weights) if weights == "open_clip_model.safetensors" else str(folder)


def _split_of(path: str) -> str:
    """The split a Hub parquet file holds: data/train-00000-of-00001.parquet, test/0000.parquet, …"""
    stem = Path(path)
    name = stem.name.split("-")[0].split(".")[0]
    return name if name in ("train", "test", "validation") and stem.parent.name in ("data", "", ".") \
        else stem.parent.name if stem.parent.name in ("train", "test", "validation") else name


def _said(exc: Exception, s: Source, where: str) -> str:
    hf = _hf()
    errors = hf.errors
    name = f"{s.repo} (revision {s.revision})"
    if isinstance(exc, errors.GatedRepoError):
        return f"{name}: the Hub asks for access (a gated or private repository): log in (hf auth login) with access"
    if isinstance(exc, errors.RepositoryNotFoundError):
        return f"{name}: the Hub has no such {s.kind} repository, or it is private"
    if isinstance(exc, errors.RevisionNotFoundError):
        return f"{name}: the repository has no revision '{s.revision}'"
    if isinstance(exc, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)):  # before its base class
        return (f"{name} is not in the Hugging Face cache and the Hub cannot be reached here"
                f"{' (HF_HUB_OFFLINE=1)' if offline() else ''}: fetch it where there is a network "
                f"(merger pools fetch {where[4:] if where.startswith('hub:') else where}, or open the pool there "
                "once) and copy the cache")
    if isinstance(exc, errors.EntryNotFoundError):
        return f"{name}: a file is missing from the repository ({str(exc).splitlines()[0][:200]})"
    detail = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    if not isinstance(exc, errors.HfHubHTTPError):  # no answer at all: a network, a proxy, a name
        return f"{name}: the Hub cannot be reached ({detail})"
    return f"{name}: {detail}"


def cache_dir() -> Path:
    return Path(_hf().constants.HF_HUB_CACHE)


def resolve_sources(spec: Mapping, where: str, pins: Mapping[str, str] | None = None,
                    out=sys.stderr) -> tuple[dict, list[Source]]:
    """The spec with every Hub source replaced by its files in the cache (fetched first where
    missing, unless offline), and the sources with their resolved commits."""
    sources = sources_of(spec, where, pins)
    if not sources:
        return spec, []
    if not offline():
        try:
            plan(sources, where)
            check_disk(sources, cache_dir(), where, out)
        except PoolError as exc:
            if getattr(exc, "answered", True):
                raise
            for s in sources:  # no answer from the Hub (no network): what the cache holds, as offline
                s.commit, s.files = "", ()
    folders = {s.key: fetch(s, where) for s in sources}
    spec = {**spec, "experts": dict(spec.get("experts") or {}),
            "tasks": {t: dict(v) if isinstance(v, Mapping) else v for t, v in (spec.get("tasks") or {}).items()}}
    for s in sources:
        section, _, rest = s.key.partition(".")
        try:
            if s.key == "base":
                spec["base"] = resolved(s, folders[s.key], spec["base"])
            elif section == "experts":
                value = spec["experts"][rest]
                spec["experts"][rest] = {"path": resolved(s, folders[s.key], value),
                                         **{k: v for k, v in value.items() if k == "hparams"}}
            else:
                task = rest.rsplit(".", 1)[0]
                spec["tasks"][task]["data"] = resolved(s, folders[s.key], spec["tasks"][task]["data"])
        except PoolError as exc:
            raise PoolError(f"{where}: {exc}") from None
    return spec, sources


def status(sources: list[Source], ask_hub: bool = True) -> tuple[int | None, int | None, str]:
    """(files, bytes, whether here) of a pool's sources: sizes from the Hub, or unknown offline."""
    hf = _hf()
    if offline() or not ask_hub:
        here = 0
        for s in sources:
            try:
                hf.snapshot_download(s.repo, repo_type=s.kind, revision=s.revision, local_files_only=True)
                here += 1
            except Exception:  # noqa: BLE001  not in the cache
                pass
        return None, None, _here(here, len(sources))
    try:
        plan(sources, "hub")
    except PoolError as exc:
        if not getattr(exc, "answered", False):
            raise  # no answer: the caller lists what the cache holds instead
        return None, None, "not on the Hub: " + str(exc).split(": ", 2)[-1].split(" (revision")[0]
    cached = sum(all(isinstance(hf.try_to_load_from_cache(s.repo, f, revision=s.commit, repo_type=s.kind), str)
                     for f, _ in s.files) for s in sources)
    return (sum(len(s.files) for s in sources), sum(n or 0 for s in sources for _, n in s.files),
            _here(cached, len(sources)))


def _here(n: int, total: int) -> str:
    return "yes" if n == total else "no" if n == 0 else f"{n} of {total} sources"


def describe(sources: list[Source]) -> str:
    """A line per source: its key, repo, commit, files and bytes (and rows per split for datasets)."""
    lines = []
    for s in sources:
        size = sum(n or 0 for _, n in s.files)
        line = f"{s.key:<28}{s.repo:<48}{s.commit[:12]:<14}{len(s.files):>4} files {size / 2**20:9.1f} MB"
        if s.kind == "dataset":
            rows = _rows(s)
            order = sorted(rows, key=lambda k: ("train", "validation", "test", k).index(k) if k in
                           ("train", "validation", "test") else 3)
            line += "  " + ", ".join(f"{split} {rows[split]}" for split in order)
        lines.append(line)
    return "\n".join(lines)


def _rows(s: Source) -> dict[str, int]:
    import pyarrow.parquet as pq

    hf, out = _hf(), {}
    for f, _ in s.files:
        path = hf.try_to_load_from_cache(s.repo, f, revision=s.commit, repo_type=s.kind)
        if isinstance(path, str):
            out[_split_of(f)] = out.get(_split_of(f), 0) + pq.ParquetFile(path).metadata.num_rows
    return out
