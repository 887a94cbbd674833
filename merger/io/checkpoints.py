"""Reading, validating and writing weights.

Loading never unpickles arbitrary objects: safetensors, or ``torch.load(weights_only=True)``
which only rebuilds tensors and plain containers. Writes go to a temporary file in the target
folder and are renamed into place, so a failed or interrupted write leaves no partial file.
"""
from __future__ import annotations

import hashlib
import math
import os
import pickle
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Mapping

import torch

from merger.errors import CheckpointError
from merger.io import hf_clip, inputs

STRIP_PREFIXES = ("module.", "model.")
VISUAL = "visual."
TENSOR_SUFFIXES = (".safetensors",)
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
_WRAPPER_KEYS = ("state_dict", "model", "model_state_dict", "module")


def load_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read a state dict from safetensors or a weights-only torch file (on the CPU)."""
    path = Path(path)
    try:
        inputs.regular_file(path, "weights file", CheckpointError)
    except CheckpointError as exc:
        if str(exc).endswith("weights file not found"):
            raise CheckpointError(f"{path}: file not found") from None
        raise
    suffix = path.suffix.lower()
    if suffix in TENSOR_SUFFIXES:
        return _load_safetensors(path)
    if suffix in PICKLE_SUFFIXES:
        return _load_torch(path)
    raise CheckpointError(
        f"{path}: unknown weights format '{suffix}' (expected .safetensors, .pt, .pth, .bin or .ckpt)"
    )


def load_weights(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], str]:
    """Any supported checkpoint, on open_clip names: (state dict, format).

    Formats: "open_clip", a state dict (file); "hf_clip", a whole Hugging Face CLIPModel (a
    base such as openai/clip-vit-base-patch32), converted to open_clip's full CLIP names; and
    "hf_clip_vision", a Hugging Face CLIP vision model, converted to ``visual.*``. Hugging Face
    weights are a folder with model.safetensors / pytorch_model.bin (or a shard index), or such a file.
    """
    path = inputs.check_path(str(path), "weights path", CheckpointError)
    sd = load_hf_dir(path) if path.is_dir() else load_state_dict(path)
    if hf_clip.is_hf_clip(sd):
        return hf_clip.hf_clip_to_open_clip(sd, str(path)), "hf_clip"
    if hf_clip.is_hf_vision(sd):
        return hf_clip.hf_to_open_clip(sd, str(path)), "hf_clip_vision"
    return sd, "open_clip"


def load_hf_dir(path: Path) -> dict[str, torch.Tensor]:
    """A HF model folder: model.safetensors / pytorch_model.bin, or a sharded index."""
    for name in hf_clip.HF_WEIGHT_FILES:
        if (path / name).exists():
            return load_state_dict(path / name)
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (path / index).exists():
            sd: dict[str, torch.Tensor] = {}
            for shard in _shards(path / index):
                sd.update(load_state_dict(path / shard))
            return sd
    raise CheckpointError(f"{path}: a folder without {' or '.join(hf_clip.HF_WEIGHT_FILES)} (or a shard index)")


def _shards(index: Path) -> list[str]:
    """The shard files a Hugging Face index names: file names inside its folder."""
    doc = inputs.load_json(index, CheckpointError, "shard index")
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: weight_map must map tensor names to shard files, got "
                              f"{type(weight_map).__name__}")
    shards = sorted({v for v in weight_map.values() if isinstance(v, str)})
    bad = [v for v in weight_map.values() if not isinstance(v, str)] + [
        v for v in shards if Path(v).name != v or v in (".", "..")]
    if bad:
        raise CheckpointError(f"{index}: weight_map entries must be file names in its folder, not {bad[0]!r}")
    return shards


def _check_readable(path: Path) -> None:
    """A file we may not read is said so, not reported as corrupt by the loader that tried."""
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror})") from None


def _looks_like_safetensors(path: Path) -> bool:
    """A safetensors file opens with its header's length (8 bytes, little-endian) and then '{'."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(9)
    except OSError:
        return False
    return len(head) == 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") < 100_000_000


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    _check_readable(path)
    try:
        return dict(load_file(str(path), device="cpu"))
    except Exception as exc:  # safetensors raises its own SafetensorError, OSError, ValueError...
        raise CheckpointError(f"{path}: truncated or corrupt safetensors file ({exc})") from None


def _load_torch(path: Path) -> dict[str, torch.Tensor]:
    _check_readable(path)
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if _looks_like_safetensors(path):  # a safetensors file under a .pt/.bin name
            return _load_safetensors(path)
        # torch's message advises weights_only=False; keep only what it names ("Unsupported global:
        # GLOBAL torch.nn.modules.linear.Linear")
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
        reason = f" (it holds a {found.group(1)})" if found else ""
        raise CheckpointError(
            f"{path}: refused: the file holds pickled objects that are not plain tensors, and loading "
            f"it would execute code{reason}. Convert it on a machine where you trust it; for a whole saved "
            "model: `safetensors.torch.save_file(torch.load(p, weights_only=False).state_dict(), 'expert.safetensors')`."
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: truncated or corrupt torch file ({exc})") from None
    for key in _WRAPPER_KEYS:
        if isinstance(obj, Mapping) and key in obj and isinstance(obj[key], Mapping):
            obj = obj[key]
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{path}: holds a {type(obj).__name__}, expected a state dict of tensors")
    named = [k for k in obj if not isinstance(k, str)]
    if named:
        raise CheckpointError(f"{path}: keys that are not tensor names (strings): {', '.join(map(repr, named[:5]))}")
    bad = [k for k, v in obj.items() if not torch.is_tensor(v)]
    if bad:
        raise CheckpointError(f"{path}: entries that are not tensors: {', '.join(map(str, bad[:5]))}")
    return dict(obj)


def strip_prefixes(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove wrapper prefixes (``module.``, ``model.``) that training frameworks add."""
    out = dict(sd)
    changed = True
    while changed and out:
        changed = False
        for prefix in STRIP_PREFIXES:
            if all(k.startswith(prefix) for k in out):
                out = {k[len(prefix):]: v for k, v in out.items()}
                changed = True
    return out


def merge_scope(base: Mapping[str, torch.Tensor]) -> list[str]:
    """The keys that merging touches: the image tower when the base is a full CLIP, else all."""
    visual = [k for k in base if k.startswith(VISUAL)]
    return visual or list(base)


def check_entries(sd, name: str) -> None:
    """A state dict given in Python (the API takes them as they are): names to tensors with values."""
    if not isinstance(sd, Mapping):
        raise CheckpointError(f"{name}: expected a state dict (parameter names to tensors), got {type(sd).__name__}")
    for k, v in sd.items():
        if not isinstance(k, str):
            raise CheckpointError(f"{name}: the key {k!r} ({type(k).__name__}) is not a parameter name (a string)")
        if not isinstance(v, torch.Tensor):
            raise CheckpointError(f"{name}: {k}: expected a tensor, got {type(v).__name__}")
        if v.is_meta:
            raise CheckpointError(f"{name}: {k}: a meta tensor (a shape without values): load the weights first")


def align_to_base(sd: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Bring an expert onto the base's names: strip wrappers, add ``visual.`` to tower-only
    checkpoints, drop the text tower of full-CLIP experts (only the image tower is merged)."""
    sd = strip_prefixes(sd)
    if any(k.startswith(VISUAL) for k in base):
        if not any(k.startswith(VISUAL) for k in sd):
            sd = {VISUAL + k: v for k, v in sd.items()}
        sd = {k: v for k, v in sd.items() if k.startswith(VISUAL) or k not in base}
    return sd


def validate_expert(
    sd: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor], name: str,
    fill_from_base: tuple[str, ...] = (),
) -> dict[str, torch.Tensor]:
    """Align an expert to the base and check it; raise naming every offending key.

    ``fill_from_base``: keys the expert's format cannot hold (a HF CLIPVisionModel has no
    projection); they are taken from the base, so their task vector is zero.
    """
    check_entries(sd, name)
    sd = align_to_base(sd, base)
    sd.update({k: base[k] for k in fill_from_base if k not in sd and k in base})
    scope = merge_scope(base)
    missing = [k for k in scope if k not in sd]
    unexpected = [k for k in sd if k not in base]
    problems = []
    if missing:
        problems.append(f"missing keys: {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_names(unexpected)}")
    shaped = [
        f"{k} {tuple(sd[k].shape)} vs base {tuple(base[k].shape)}"
        for k in scope
        if k in sd and sd[k].shape != base[k].shape
    ]
    if shaped:
        problems.append(f"mis-shaped keys: {_names(shaped)}")
    if problems:
        raise CheckpointError(f"{name}: does not match the base{_architecture_hint(sd, base)}: " + "; ".join(problems))
    for k in scope:
        t, b = sd[k], base[k]
        if b.is_floating_point() and not t.is_floating_point():
            raise CheckpointError(f"{name}: key {k} is {t.dtype}, expected a floating-point weight")
        bad = _non_finite(t)
        if bad:
            raise CheckpointError(f"{name}: key {k} holds {bad} non-finite values (NaN or Inf)")
    return {k: sd[k] for k in scope}


def _non_finite(t: torch.Tensor) -> int:
    """How many NaN/Inf a weight holds (1-byte floats such as float8 are checked in float32, as
    torch has no isfinite for them; they are merged in float32 anyway)."""
    if not t.is_floating_point():
        return 0
    finite = torch.isfinite(t.float() if t.element_size() == 1 else t)
    return int((~finite).sum())


def _architecture_hint(sd, base) -> str:
    """Name the likely architecture mismatch (patch size, width, depth) when there is one."""
    hints = []
    a, b = sd.get("visual.conv1.weight"), base.get("visual.conv1.weight")
    if a is not None and b is not None and a.dim() == b.dim() == 4:
        if a.shape[-1] != b.shape[-1]:
            hints.append(f"patch size {a.shape[-1]} vs the base's {b.shape[-1]}")
        if a.shape[0] != b.shape[0]:
            hints.append(f"width {a.shape[0]} vs the base's {b.shape[0]}")
    depth = lambda d: len({k.split(".")[3] for k in d if k.startswith("visual.transformer.resblocks.")})  # noqa: E731
    if depth(sd) and depth(base) and depth(sd) != depth(base):
        hints.append(f"{depth(sd)} blocks vs the base's {depth(base)}")
    return f" (another architecture? {', '.join(hints)})" if hints else ""


def validate_base(base: Mapping[str, torch.Tensor], name: str) -> None:
    check_entries(base, name)
    for k, t in base.items():
        if _non_finite(t):
            raise CheckpointError(f"{name}: key {k} holds non-finite values (NaN or Inf)")


def _names(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" (+{len(items) - limit} more)" if len(items) > limit else "")


def save_safetensors(
    sd: Mapping[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None
) -> Path:
    """Write atomically: a temporary file beside the target, then a rename."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}
    with _atomic(Path(path)) as tmp:
        save_file(tensors, tmp, metadata=metadata)
    return Path(path)


@contextmanager
def _atomic(path: Path):
    """A temporary file beside ``path`` (mode of an ordinary file), renamed onto it when the block
    ends without error, removed when it fails: a failed or interrupted write leaves no partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, _umask_mode())  # mkstemp makes 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# safetensors' dtype names (its format: an 8-byte little-endian header length, a JSON header of
# dtype, shape and byte offsets per tensor, then the raw little-endian bytes back to back)
_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
                       torch.float8_e5m2: "F8_E5M2", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64"}


def save_safetensors_streamed(layout: Mapping[str, tuple[torch.dtype, tuple]], tensor_of,
                              path: str | os.PathLike, metadata: dict[str, str] | None = None) -> Path:
    """Write a safetensors file one tensor at a time: the header from each name's (dtype, shape) in
    ``layout``, then ``tensor_of(name)`` for each in that order, so the whole state dict is never in
    memory at once (a ViT-L/14 export holds one tensor beside Δ). Atomic, as ``save_safetensors``."""
    import json
    import struct

    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, (dtype, shape) in layout.items():
        if dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor {name} is {dtype}, which safetensors cannot store")
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, padded with spaces as the format allows
    with _atomic(Path(path)) as tmp, open(tmp, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)) + blob)
        for name, (dtype, shape) in layout.items():
            t = tensor_of(name).detach().to("cpu").contiguous()
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise CheckpointError(f"{path}: tensor {name} is {t.dtype} {tuple(t.shape)}, "
                                      f"the header says {dtype} {tuple(shape)}")
            fh.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return Path(path)


def _umask_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    with _atomic(Path(path)) as tmp:
        Path(tmp).write_text(text)
    return Path(path)


def content_hash(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes, or of a folder's files (names and bytes, sorted) (hex). Only
    regular files are read (a FIFO or device would never end)."""
    path = Path(path)
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        inputs.regular_file(f, "file to hash", CheckpointError)
        if path.is_dir():
            h.update(str(f.relative_to(path)).encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def tensors_hash(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over names, shapes, dtypes and bytes of tensors (sorted by name)."""
    h = hashlib.sha256()
    for k in sorted(tensors):
        t = tensors[k].detach().contiguous().cpu()
        h.update(f"{k}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
