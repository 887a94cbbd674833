"""Pool: an architecture, a base θ0, experts θ1..θT (one per task) and the tasks, described by a
YAML file (paths relative to it; its keys: merger/pool/schema.py and docs/formats.md). A source may
name a Hugging Face Hub repository instead of a file (merger/pool/hub.py). ``open_pool("demo")``
opens the built-in demo pool, ``open_pool("hub:NAME")`` a known benchmark (merger/pool/known.py).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch

from merger.errors import CheckpointError, PoolError
from merger.io import checkpoints, disk_cache, hf_clip, inputs
from merger.pool import schema as pool_schema
from merger.pool.devices import check_memory, resolve_device
from merger.pool.task_vectors import TaskVectors

DEMO_DIR = Path(__file__).resolve().parents[1] / "demo" / "assets"
MAX_PARAMETERS = 3_000_000_000  # a full CLIP ViT-bigG-14 has 2.5 billion


class Pool:
    """An opened pool. Experts are validated against the base when the pool opens."""

    def __init__(self, spec: Mapping[str, Any], root: Path, source: str, device: str | torch.device = "cpu",
                 tv_device: str | torch.device | None = None, preloaded: Mapping[str, Any] | None = None,
                 roots: list | None = None, tv_dtype: str = "auto"):
        self.source, self.root = source, root
        self.hub_sources: dict[str, dict] = {}  # key -> {hub, revision}: the Hub sources it was opened from
        # When set (the app sets it), every file the pool names must lie under one of these folders.
        self.roots = [Path(r).expanduser().resolve() for r in roots] if roots is not None else None
        self.device = resolve_device(device)
        # Task vectors may stay in host memory when the GPU cannot hold them (slower merges).
        self.tv_device = resolve_device(tv_device) if tv_device else self.device
        spec = pool_schema.check(spec, source, in_memory=preloaded is not None)
        self.name = str(spec.get("name") or Path(source).stem)
        self.architecture = spec["architecture"]
        self.tokenizer_name = spec.get("tokenizer")
        self.preprocess_cfg = dict(spec.get("preprocess") or {})
        self.preprocess_cfg.setdefault("image_size", self._image_size())
        self._reference = self._meta_state_dict()  # the architecture, checked before any file is read
        self.base_path = self._path(spec["base"], "base")
        self.expert_info = self._experts(spec["experts"])
        if preloaded is not None:  # an in-memory pool (benchmarks): same checks, no files
            self.base_path = None
        self.tasks: list[str] = list(self.expert_info)
        self.retired: set[str] = set()  # names of experts removed (Pool.remove_experts): never given again
        self.task_info = self._tasks(spec.get("tasks") or {})
        if preloaded is not None:
            self.base, self.base_format = dict(preloaded["base"]), "open_clip"
        else:
            self.base, self.base_format = self._load(self.base_path, "base")
        self.base = checkpoints.strip_prefixes(self.base)
        checkpoints.validate_base(self.base, str(self.base_path))
        if self.base_format == "hf_clip":  # its config.json says its activation
            hf_clip.check_activation(self.base_path, self.architecture, source)
        self._check_architecture()
        check_memory(self.base, len(self.expert_info), self.tv_device, self.source, tv_dtype)
        self.tv_dtype = tv_dtype
        self._hashes: dict[str, str] = {}
        self.task_vectors = self._task_vectors(preloaded)
        pool_schema.say_default_statistics(spec, source)  # once the pool opened: an error comes alone

    # ---- parsing ------------------------------------------------------------------------
    def load_expert(self, task: str, preloaded: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
        """One expert's weights, read and checked against the base."""
        info = self.expert_info[task]
        if preloaded is not None:
            sd, info["format"] = preloaded["experts"][task], "open_clip"
        else:
            sd, info["format"] = self._load(info["path"], f"experts.{task}")
        fill = ("visual.proj",) if info["format"] == "hf_clip_vision" else ()
        return checkpoints.validate_expert(sd, self.base, f"{info['path']} (expert '{task}')", fill)

    def _task_vectors(self, preloaded) -> TaskVectors:
        """The stacked task vectors: from the disk cache when these very files were opened before,
        else built reading one expert at a time (a ViT-L/14 × 8 pool never holds 8 checkpoints)."""
        experts = _Experts(self, preloaded)
        cache = disk_cache.DiskCache() if preloaded is None else None
        entries = len(experts) * sum(v.numel() for v in self.base.values() if v.is_floating_point())
        if cache is None or not cache.enabled or entries < disk_cache.WORTH_ENTRIES:
            return TaskVectors(self.base, experts, device=self.tv_device, dtype=self.tv_dtype)
        key = disk_cache.key_of({"kind": "task_vectors", "files": self.file_hashes(), "tasks": self.tasks,
                                 "dtype": self.tv_dtype})
        hit = cache.get(key)
        if hit is not None:
            try:
                return TaskVectors.from_stacks(self.base, self.tasks, hit[0], self.tv_device)
            except PoolError:
                raise
            except Exception as exc:  # a stale entry of another layout: rebuilt below
                disk_cache.log.warning("disk cache: task vectors entry %s refused (%s)", key[:12], exc)
        tv = TaskVectors(self.base, experts, device=self.tv_device, dtype=self.tv_dtype)
        cache.put(key, f"task vectors of {self.name} ({', '.join(self.tasks)})", tv.stacked, None)
        return tv

    def _load(self, path: Path, field: str):
        """Weights a key of the pool names; a file that cannot be read is reported with that key."""
        try:
            return checkpoints.load_weights(path)
        except CheckpointError as exc:
            raise CheckpointError(f"{self.source}: {field}: {exc}") from None

    def _path(self, value: Any, field: str) -> Path:
        return self.resolve(value, field)

    def resolve(self, value, field: str) -> Path:
        """A path named by the pool (relative to its YAML), checked against the allowed roots."""
        p = inputs.check_path(value, f"{self.source}: {field}", PoolError).expanduser()
        p = p if p.is_absolute() else (self.root / p)
        if self.roots is not None:
            real = p.resolve()
            if not any(real == r or r in real.parents for r in self.roots):
                raise PoolError(f"{self.source}: {field} = {value}: outside the allowed roots "
                                f"({', '.join(map(str, self.roots))}); add its folder with --roots")
        return p

    def _experts(self, experts: Mapping) -> dict[str, dict]:
        out = {}
        for task, info in experts.items():
            info = dict(info)
            info["path"] = self._path(info["path"], f"experts.{task}")
            if info.get("trajectory"):
                info["trajectory"] = self._path(info["trajectory"], f"experts.{task}.trajectory")
            out[task] = info
        return out

    def _tasks(self, tasks: Mapping) -> dict[str, dict]:
        unknown = [t for t in tasks if t not in self.expert_info]
        if unknown:
            raise PoolError(f"{self.source}: tasks.{unknown[0]} has no expert (experts: {', '.join(self.expert_info)})")
        return {t: dict(v) for t, v in tasks.items()}

    def _meta_state_dict(self) -> dict:
        """The architecture's own state dict on the meta device (shapes only): open_clip's refusal of
        a config is reported under its key, and a model too large to hold is refused here."""
        try:
            model = self.build_model(load_base=False, device="meta")
        except PoolError:
            raise
        except Exception as exc:  # open_clip raises TypeError/ValueError/AssertionError/KeyError...
            where = "architecture.config" if "config" in self.architecture else "architecture"
            raise PoolError(f"{self.source}: {where}: open_clip cannot build this architecture "
                            f"({type(exc).__name__}: {str(exc)[:200]})") from None
        state = model.state_dict()
        params = sum(v.numel() for v in state.values())
        if params > MAX_PARAMETERS:
            raise PoolError(f"{self.source}: architecture: {params / 1e9:.1f} billion parameters (at most "
                            f"{MAX_PARAMETERS / 1e9:g} billion)")
        return state

    def _check_architecture(self) -> None:
        """Compare the base with the architecture's own state dict (built on the meta device)."""
        ref = self._reference
        missing = [k for k in ref if k not in self.base]
        extra = [k for k in self.base if k not in ref]
        shaped = [k for k in ref if k in self.base and ref[k].shape != self.base[k].shape]
        if missing or extra or shaped:
            parts = []
            for label, keys in (("missing", missing), ("unexpected", extra), ("mis-shaped", shaped)):
                if keys:
                    parts.append(f"{label} keys: {checkpoints._names(keys)}")
            raise CheckpointError(
                f"{self.base_path}: does not match architecture {self.architecture_name}: " + "; ".join(parts)
            )

    def _image_size(self) -> int:
        """The architecture's input size (inline config, or open_clip's config of the model name)."""
        if "config" in self.architecture:
            size = self.architecture["config"].get("vision_cfg", {}).get("image_size", 224)
        else:
            from merger._compat import open_clip

            cfg = open_clip().get_model_config(self.architecture["model"]) or {}
            size = cfg.get("vision_cfg", {}).get("image_size", 224)
        return int(size[0] if isinstance(size, (list, tuple)) else size)

    # ---- models -------------------------------------------------------------------------
    @property
    def architecture_name(self) -> str:
        return self.architecture.get("model") or "inline config"

    def build_model(self, load_base: bool = True, device: str = "cpu") -> torch.nn.Module:
        """A fresh open_clip model of the pool's architecture, with the base weights
        (on the meta device: shapes only, for checking checkpoints against the architecture)."""
        from merger._compat import create_model, no_random_init, open_clip

        oc = open_clip()
        with no_random_init(load_base and device != "meta"):
            if "config" in self.architecture:
                with torch.device(device):
                    model = oc.CLIP(**self.architecture["config"])
            else:
                name = self.architecture["model"]
                try:
                    model = create_model(name, device)
                except RuntimeError as exc:
                    raise PoolError(f"{self.source}: architecture {name!r}: {exc}") from None
        if load_base:
            model.load_state_dict(self.base)  # strict: every parameter and persistent buffer is overwritten
        return model.eval()

    # ---- experts ------------------------------------------------------------------------
    @property
    def experts(self) -> list[str]:
        """Every expert that can be merged: one per task, then experts added later (the lab's).
        The tasks (what results are reported on) never change."""
        return list(self.task_vectors.tasks)

    def task_of(self, expert: str) -> str:
        """The task an expert was fine-tuned for (its own name for the pool's experts)."""
        if expert in self.expert_info:
            return self.expert_info[expert].get("lab_task", expert)
        raise PoolError(f"experts: unknown expert '{expert}'; known: {', '.join(self.experts)}")

    def add_expert(self, name: str, task: str, weights: Mapping[str, torch.Tensor], info: Mapping[str, Any]) -> None:
        """Another expert for one of the pool's tasks (checked against the base). Call it through
        ``PoolSession.add_expert``, which holds the model while the task vectors grow."""
        if name in self.expert_info:
            raise PoolError(f"an expert named '{name}' already exists")
        if task not in self.tasks:
            raise PoolError(f"unknown task '{task}'; the pool's tasks: {', '.join(self.tasks)}")
        sd = checkpoints.validate_expert(weights, self.base, f"expert '{name}'")
        self.task_vectors = self.task_vectors.extended(name, sd)
        self.expert_info[name] = {"path": None, **dict(info), "lab_task": task}

    def remove_experts(self, names) -> None:
        """Remove experts added later (the lab's; the pool's own stay). Call it through
        ``PoolSession.remove_experts``. Their names go to ``retired``: never given again, since
        results computed with them may still be cached under those names."""
        names = list(names)
        own = [n for n in names if n in self.tasks or n not in self.expert_info]
        if own:
            raise PoolError(f"cannot remove {', '.join(own)}: only experts added to the pool can go")
        gone = set(names)
        self.task_vectors = self.task_vectors.subset([e for e in self.task_vectors.tasks if e not in gone])
        for n in names:
            del self.expert_info[n]
        self.retired.update(names)

    def make_spec(self, method: str, params: Mapping[str, Any], experts=None, task_weights=None, block_weights=None):
        """A spec over this pool's experts (None: one per task, the pool's own), with per-task and
        per-block weights where given."""
        from merger.spec import Spec

        blocks = self.blocks if block_weights else ()
        return Spec.make(method, params, experts, self.experts, default=self.tasks, task_weights=task_weights,
                         block_weights=block_weights, blocks=blocks)

    @property
    def blocks(self) -> list[str]:
        """The image tower's block groups, shallow to deep (what block weights name)."""
        from merger.pool.blocks import block_groups

        return block_groups(self.task_vectors.keys)

    def input_files(self) -> list[Path]:
        """What this pool reads (its YAML and manifest, base, experts, trajectories, class and
        template lists): files no output may replace, folders none may write into."""
        files = [self.base_path, *(info.get(k) for info in self.expert_info.values() for k in ("path", "trajectory")),
                 *(v for info in self.task_info.values() for k in ("classes", "templates")
                   if isinstance(v := (info or {}).get(k), (str, Path)))]
        files += [Path(self.source), Path(self.source).parent / "manifest.json"] if Path(self.source).is_file() else []
        return [Path(f) if Path(f).is_absolute() else self.root / f for f in files if f is not None]

    def file_hashes(self) -> dict[str, str]:
        """Content hashes of the base and every expert file (computed once)."""
        if not self._hashes:
            self._hashes["base"] = disk_cache.file_hash(self.base_path)
            for t, info in self.expert_info.items():
                if info.get("path") is not None:  # a lab expert lives in memory only
                    self._hashes[t] = disk_cache.file_hash(info["path"])
        return dict(self._hashes)

    def file_hashes_of(self, experts) -> dict[str, str] | None:
        """Content hashes of the base and these experts' files, or None where one of them is not
        a file (an in-memory pool, a lab expert): nothing on disk names what is computed from it."""
        if self.base_path is None or any(self.expert_info[e].get("path") is None for e in experts):
            return None
        hashes = self.file_hashes()
        return {"base": hashes["base"], **{e: hashes[e] for e in experts}}

    def __repr__(self) -> str:
        return f"Pool({self.name!r}, {self.architecture_name}, tasks={self.tasks})"


class _Experts(Mapping):
    """The pool's experts by task, each read from disk when asked for (and not kept)."""

    def __init__(self, pool: Pool, preloaded):
        self.pool, self.preloaded = pool, preloaded

    def __getitem__(self, task: str):
        return self.pool.load_expert(task, self.preloaded)

    def __iter__(self):
        return iter(self.pool.expert_info)

    def __len__(self) -> int:
        return len(self.pool.expert_info)


def read_pool_yaml(path: str | os.PathLike) -> tuple[dict, Path]:
    path = inputs.check_path(path, "pool", PoolError).expanduser()
    if path.is_dir():
        path = path / "pool.yaml"
    if path.suffix.lower() in (".safetensors", ".bin", ".pt", ".pth", ".ckpt"):  # it read as "not UTF-8 text"
        raise PoolError(f"{path}: a checkpoint, not a pool file: a pool is a YAML naming the base and the experts "
                        "(docs/formats.md); merger.merge_state_dicts takes checkpoint files as they are")
    return inputs.load_yaml(path, PoolError, "pool file"), path


def pool_from_state_dicts(name: str, architecture, base, experts: Mapping[str, Mapping], tasks: Mapping | None = None,
                          device="cpu", tv_device=None, tv_dtype: str = "auto") -> Pool:
    """A pool held in memory (no files): for benchmarks and scripts. Tasks may use
    ``data: {memory: {train: (images, labels), test: (images, labels)}}``."""
    spec = {"name": name, "architecture": architecture, "base": "<memory>",
            "experts": {t: f"<memory:{t}>" for t in experts}, "tasks": dict(tasks or {})}
    return Pool(spec, Path("."), f"<memory pool {name}>", device, tv_device, {"base": base, "experts": experts},
                tv_dtype=tv_dtype)


def require_open(pool, where: str):
    """A pool as the API takes it: opened (a name or a path is refused with how to open it)."""
    if isinstance(pool, (str, os.PathLike)):
        raise PoolError(f"{where}: expected an open pool, got {str(pool)[:60]!r}; open it once with "
                        f"pool = merger.open_pool({str(pool)[:60]!r}) and pass the pool")
    return pool


def open_pool(path: str | os.PathLike = "demo", device: str | torch.device = "cpu",
              tv_device: str | torch.device | None = None, roots: list | None = None, tv_dtype: str = "auto",
              pins: Mapping[str, str] | None = None) -> Pool:
    """Open a pool from a YAML file (or a folder holding pool.yaml); "demo" is the built-in pool,
    "hub:NAME" a known benchmark. Hub sources are fetched first (``pins``: {key: revision})."""
    from merger.pool import hub

    if str(path).startswith("hub:"):
        from merger.pool.known import pool_spec

        spec, source, root = pool_spec(str(path)[4:]), str(path), hub.cache_dir()
    else:
        spec, yaml_path = read_pool_yaml(demo_pool_path() if str(path) == "demo" else path)
        verify_manifest(yaml_path.parent)
        source, root = str(yaml_path), yaml_path.parent
    spec, sources = hub.resolve_sources(spec, source, pins)
    if roots is not None:  # the Hub's files are in its cache, fetched by merger
        roots = list(roots) + [root] + ([hub.cache_dir()] if sources else [])
    pool = Pool(spec, root, source, device=device, tv_device=tv_device, roots=roots, tv_dtype=tv_dtype)
    pool.hub_sources = {s.key: s.record() for s in sources}
    return pool


def verify_manifest(root: Path) -> None:
    """A built pool (the demo zoo) lists every file's sha256 in manifest.json: check them all,
    so a corrupt or edited zoo is refused instead of silently used. Only regular files inside
    the pool's folder are read."""
    import re

    manifest = root / "manifest.json"
    if not manifest.exists():
        return
    rebuild = (f"rebuild with `python -m merger demo build --out {root}`, or delete {manifest} to open the folder "
               f"as your own pool")
    doc = inputs.load_json(manifest, PoolError, "manifest")
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, dict):
        raise PoolError(f"{manifest}: 'files' must map relative paths to sha256 digests, got "
                        f"{type(files).__name__}; {rebuild}")
    for rel, sha in files.items():
        where = f"{manifest}: files.{rel}"
        rel_path = inputs.check_path(rel, where, PoolError)
        if rel_path.is_absolute() or ".." in rel_path.parts:
            raise PoolError(f"{where}: must be a path inside the pool's folder")
        if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise PoolError(f"{where}: expected a sha256 digest (64 hex digits), got {sha!r}"[:300])
        path = root / rel_path
        if not path.exists():
            raise PoolError(f"{path}: listed in {manifest.name} but missing; {rebuild}")
        inputs.regular_file(path, f"file listed in {manifest.name}", PoolError)
        if checkpoints.content_hash(path) != sha:
            raise PoolError(
                f"{path}: sha256 differs from {manifest.name}: the zoo is corrupt or was modified; "
                f"refusing to use it. Rebuild it with `python -m merger demo build --out {root}` (which replaces "
                f"the folder), or, if you changed it on purpose, delete {manifest} to open it as your own pool"
            )


def demo_pool_path() -> Path:
    override = os.environ.get("MERGER_DEMO_DIR")
    root = Path(override) if override else DEMO_DIR
    if not (root / "pool.yaml").exists():
        raise PoolError(
            f"{root}: the demo pool is not there; build it with `python -m merger demo build --out {root}`"
        )
    return root / "pool.yaml"
