"""Writing a merge to disk (merged safetensors + spec YAML) and replaying a spec file."""
from __future__ import annotations

import datetime as _dt
import glob
import os
import re
import shutil
import time
import uuid
from pathlib import Path

import yaml

from merger.api import merge_delta
from merger.errors import MergerError, PoolError
from merger.io import checkpoints, inputs
from merger.spec import Spec, merged_tensor

WEIGHT_KEYS = ("task_weights", "block_weights")  # present only when a weight differs from 1
SPEC_KEYS = {"merger_version", "method", "params", "experts", "pool", "base", "expert_files", "weights", "created",
             "hub_sources", *WEIGHT_KEYS}


def spec_path_for(out: str | Path) -> Path:
    return Path(out).with_suffix(".yaml")


def pool_reference(pool) -> str:
    from merger.pool.pool import demo_pool_path

    if pool.source.startswith("hub:"):  # a known benchmark: its name (the revisions go in hub_sources)
        return pool.source
    try:
        if Path(pool.source).resolve() == demo_pool_path().resolve():
            return "demo"
    except PoolError:
        pass
    return str(Path(pool.source).resolve())


def _expert_file(pool, name: str, hashes: dict) -> dict:
    """Where an expert's weights came from: its file and hash, or, for a lab expert (fine-tuned in
    the app, in memory only), what it was: a replay from files cannot find it."""
    info = pool.expert_info[name]
    if info.get("path") is None:
        return {"lab": f"fine-tuned in the app's expert lab for task {info.get('lab_task', '?')} (in memory, no file: "
                       "this merge cannot be replayed from files)"}
    return {"path": str(info["path"].resolve()), "sha256": hashes[name]}


def spec_record(pool, spec: Spec, weights: Path) -> dict:
    from merger import __version__

    hashes = pool.file_hashes()
    return {
        "merger_version": __version__,
        "method": spec.method,
        "params": spec.kwargs,
        "experts": list(spec.experts),
        **{k: v for k, v in spec.as_dict().items() if k in WEIGHT_KEYS},
        "pool": pool_reference(pool),
        "base": {"path": str(pool.base_path.resolve()), "sha256": hashes["base"]},
        "expert_files": {t: _expert_file(pool, t, hashes) for t in spec.experts},
        "weights": weights.name,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        # each Hub source's repo and the commit it resolved to: a replay fetches exactly these
        **({"hub_sources": dict(pool.hub_sources)} if pool.hub_sources else {}),
    }


def check_export_target(pool, out: str | Path, reads: tuple = ()) -> tuple[Path, Path]:
    """(weights path, spec path) of an export, both writable and neither a file or folder the pool
    reads, nor one of ``reads`` (the spec a replay reads: `--out m.safetensors` would write its
    spec over m.yaml): said before any merge (a data-driven one learns for minutes first)."""
    out = inputs.check_path(out, "--out", MergerError).expanduser()
    if out.suffix != ".safetensors":
        folder = " is a folder, and" if out.is_dir() else ""  # a folder given for the file: said so first
        raise MergerError(f"{out}:{folder} the output must end in .safetensors"
                          + (f" (e.g. {out / 'merged.safetensors'})" if folder else ""))
    yaml_path, keep = spec_path_for(out), (*pool.input_files(), *reads)
    for path, what in ((out, "--out"), (yaml_path, "--out (its spec beside it)")):
        inputs.check_output_file(path, what, MergerError, keep=keep)
    return out, yaml_path


def export_merge(pool, spec: Spec, out: str | Path, delta: dict | None = None) -> tuple[Path, Path]:
    """Merge and write ``out`` (.safetensors) and its spec beside it. Both are written to temporary
    files first and then renamed, the weights first: on a failure the pair on disk is the old one (or
    none). A process killed between the two renames leaves the new weights beside the old spec and the
    new spec in its temporary file: the next export or replay there finishes the job (``settle_pair``). ``delta``: the spec's Δ where the caller holds it (the app's data-driven run:
    the one on screen, not a second run)."""
    out, yaml_path = check_export_target(pool, out)  # before a merge that may take minutes
    settle_pair(out, yaml_path)
    delta = merge_delta(pool, spec) if delta is None else delta  # fails before anything is written
    record = spec_record(pool, spec, out)
    text = yaml.safe_dump(record, sort_keys=False)
    layout = {k: (v.dtype, tuple(v.shape)) for k, v in pool.base.items()}
    weights_tmp = checkpoints.save_safetensors_streamed(  # θ0 + Δ one tensor at a time
        layout, lambda k: merged_tensor(pool.base, pool.task_vectors, delta, k), _temporary(out),
        metadata={"merger_spec": text})
    try:
        spec_tmp = checkpoints.write_text_atomic(_temporary(yaml_path), text)
    except BaseException:
        weights_tmp.unlink(missing_ok=True)
        raise
    _replace_together([(weights_tmp, out), (spec_tmp, yaml_path)])
    return out, yaml_path


def _temporary(path: Path) -> Path:
    """A temporary name beside ``path`` naming this process, so another export can tell an abandoned one."""
    return path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.partial")


def _abandoned(path: Path) -> bool:
    """A temporary file of ``_temporary``'s whose process is gone (on Windows: a day old)."""
    match = re.fullmatch(r"\..+\.(\d+)-[0-9a-f]{8}\.partial", path.name)
    if not match or not path.is_file() or path.is_symlink():
        return False
    pid = int(match.group(1))
    if pid == os.getpid():
        return False
    if os.name == "nt":  # os.kill(pid, 0) would send CTRL_C there
        return time.time() - path.stat().st_mtime > 86400
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def settle_pair(weights: Path, yaml_path: Path) -> None:
    """Finish what an export killed between its two renames left: its new weights beside the old spec,
    and its new spec still in a temporary file (the weights carry that text in their metadata: when the
    two agree, the spec is renamed into place). Then delete what killed exports left there. A spec
    edited by hand is never touched."""
    abandoned = [p for target in (weights, yaml_path)
                 for p in target.parent.glob(f".{glob.escape(target.name)}.*.partial") if _abandoned(p)]
    written = _spec_in(weights) if abandoned else None
    for stray in abandoned:
        if written and stray.name.startswith(f".{yaml_path.name}.") and stray.read_text(errors="replace") == written:
            os.replace(stray, yaml_path)
        else:
            stray.unlink(missing_ok=True)


def _spec_in(weights: Path) -> str | None:
    """The spec YAML an export wrote into its weights' metadata, or None."""
    try:
        from safetensors import safe_open

        with safe_open(str(weights), framework="pt") as fh:
            return (fh.metadata() or {}).get("merger_spec")
    except Exception:  # noqa: BLE001  (absent, or not an export of ours: nothing to settle)
        return None


def _replace_together(moves: list[tuple[Path, Path]]) -> None:
    """Rename every temporary file onto its target; if one rename fails, put back what the earlier
    ones replaced, so the targets stay a consistent set. A target is never moved away first (a hard
    link keeps the old file for the way back): killed at any point, each target is whole, old or new."""
    backups: list[tuple[Path, Path | None]] = []
    try:
        for tmp, target in moves:
            backup = None
            if target.exists():
                backup = _temporary(target)
                try:
                    os.link(target, backup)
                except OSError:  # a file system without hard links
                    shutil.copy2(target, backup)
            backups.append((target, backup))
            os.replace(tmp, target)
    except BaseException:
        for target, backup in reversed(backups):
            if backup is not None:
                os.replace(backup, target)
                backup.unlink(missing_ok=True)  # a rename onto its own hard link leaves both names
            else:
                target.unlink(missing_ok=True)
        for tmp, _ in moves:
            tmp.unlink(missing_ok=True)
        raise
    for _, backup in backups:  # the new pair is in place: a backup left behind is only clutter
        if backup is not None:
            try:
                backup.unlink(missing_ok=True)
            except OSError:
                pass


SPEC_TYPES = {"merger_version": str, "method": str, "params": dict, "experts": list, "pool": str, "base": dict,
              "expert_files": dict, "weights": str, "created": str, "task_weights": dict, "block_weights": dict,
              "hub_sources": dict}


def read_spec_file(path: str | Path) -> dict:
    """A spec YAML written by an export, every key of the expected type (settled with its weights first:
    see ``settle_pair``)."""
    path = Path(path)
    if path.suffix == ".yaml" and path.is_file():
        settle_pair(path.with_suffix(".safetensors"), path)
    record = inputs.load_yaml(path, MergerError, "spec file")
    inputs.mapping(record, f"{path}: the top level", MergerError)
    inputs.known_keys(record, SPEC_KEYS, "the spec", str(path), MergerError)
    for key in ("method", "pool"):
        if key not in record:
            raise MergerError(f"{path}: missing '{key}'")
    for key, kind in SPEC_TYPES.items():
        value = record.get(key)
        if value is not None and not isinstance(value, kind):
            raise MergerError(f"{path}: {key}: expected a {kind.__name__}, got {type(value).__name__} {value!r}"[:300])
    for name, value in (record.get("params") or {}).items():
        if isinstance(value, (dict, list)):
            raise MergerError(f"{path}: params.{name}: expected a number (or auto), got {type(value).__name__}")
    for name, value in (record.get("expert_files") or {}).items():
        if not isinstance(value, dict) or not isinstance(value.get("sha256", ""), str):
            raise MergerError(f"{path}: expert_files.{name}: expected {{path: ..., sha256: ...}}")
    base = record.get("base") or {}
    if not isinstance(base.get("sha256", ""), str):
        raise MergerError(f"{path}: base.sha256: expected a string")
    return record


def spec_pool(record: dict, spec_file: str | Path) -> str:
    """The pool a spec names: "demo", an absolute path (as exports write it), or a path relative to
    the spec's folder (a hand-written spec; it was read from the working directory)."""
    pool = record["pool"]
    if pool == "demo" or pool.startswith("hub:") or Path(pool).expanduser().is_absolute():
        return pool
    return str(Path(spec_file).expanduser().parent / pool)


def hub_pins(record: dict, source: str) -> dict[str, str]:
    """The commit each Hub source of a spec resolved to, {key: revision}: a replay opens exactly those."""
    pins = {}
    for key, value in (record.get("hub_sources") or {}).items():
        if not isinstance(value, dict) or not isinstance(value.get("revision"), str):
            raise MergerError(f"{source}: hub_sources.{key}: expected {{hub: org/name, revision: commit}}")
        pins[str(key)] = value["revision"]
    return pins


def check_hashes(pool, record: dict, source: str) -> None:
    """Refuse to replay when the base or an expert file changed since the spec was written."""
    hashes = pool.file_hashes()
    expected = {"base": (record.get("base") or {}).get("sha256")}
    expected.update({t: v.get("sha256") for t, v in (record.get("expert_files") or {}).items()})
    for name, sha in expected.items():
        if sha and name not in hashes:  # renamed or removed: its file may be unchanged
            raise MergerError(f"{source}: the spec merges expert '{name}', which this pool does not have (it has "
                              f"{', '.join(n for n in hashes if n != 'base')}); a renamed expert keeps its old name "
                              "in the spec: edit experts and expert_files there, or the pool")
        if sha and hashes.get(name) != sha:
            what = "base" if name == "base" else f"expert '{name}'"
            raise MergerError(f"{source}: the {what} file changed since this spec was written (sha256 differs)")
