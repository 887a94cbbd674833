"""Writing a merge to disk (merged safetensors + spec YAML) and replaying a spec file."""
from __future__ import annotations

import datetime as _dt
from pathlib import Path

import yaml

from . import checkpoints
from .errors import MergerError, PoolError
from .merging import Spec, merge_spec

SPEC_KEYS = {"merger_version", "method", "params", "experts", "pool", "base", "expert_files", "weights", "created"}


def spec_path_for(out: str | Path) -> Path:
    return Path(out).with_suffix(".yaml")


def pool_reference(pool) -> str:
    from .pool import demo_pool_path

    try:
        if Path(pool.source).resolve() == demo_pool_path().resolve():
            return "demo"
    except PoolError:
        pass
    return str(Path(pool.source).resolve())


def spec_record(pool, spec: Spec, weights: Path) -> dict:
    from . import __version__

    hashes = pool.file_hashes()
    return {
        "merger_version": __version__,
        "method": spec.method,
        "params": spec.kwargs,
        "experts": list(spec.experts),
        "pool": pool_reference(pool),
        "base": {"path": str(pool.base_path.resolve()), "sha256": hashes["base"]},
        "expert_files": {
            t: {"path": str(pool.expert_info[t]["path"].resolve()), "sha256": hashes[t]} for t in spec.experts
        },
        "weights": weights.name,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def export_merge(pool, spec: Spec, out: str | Path) -> tuple[Path, Path]:
    """Merge and write ``out`` (.safetensors) and its spec beside it; nothing is left on failure."""
    out = Path(out)
    if out.suffix != ".safetensors":
        raise MergerError(f"{out}: the output must end in .safetensors")
    merged = merge_spec(pool, spec)  # fails before anything is written
    record = spec_record(pool, spec, out)
    meta = {"merger_spec": yaml.safe_dump(record, sort_keys=False)}
    checkpoints.save_safetensors(merged, out, metadata=meta)
    yaml_path = checkpoints.write_text_atomic(spec_path_for(out), yaml.safe_dump(record, sort_keys=False))
    return out, yaml_path


def read_spec_file(path: str | Path) -> dict:
    path = Path(path)
    record = checkpoints.read_yaml(path, MergerError, "spec file")
    if not isinstance(record, dict):
        raise MergerError(f"{path}: expected a mapping")
    unknown = sorted(set(record) - SPEC_KEYS)
    if unknown:
        raise MergerError(f"{path}: unknown key(s) {', '.join(unknown)}")
    for key in ("method", "pool"):
        if key not in record:
            raise MergerError(f"{path}: missing '{key}'")
    return record


def check_hashes(pool, record: dict, source: str) -> None:
    """Refuse to replay when the base or an expert file changed since the spec was written."""
    hashes = pool.file_hashes()
    expected = {"base": (record.get("base") or {}).get("sha256")}
    expected.update({t: v.get("sha256") for t, v in (record.get("expert_files") or {}).items()})
    for name, sha in expected.items():
        if sha and hashes.get(name) != sha:
            what = "base" if name == "base" else f"expert '{name}'"
            raise MergerError(f"{source}: the {what} file changed since this spec was written (sha256 differs)")
