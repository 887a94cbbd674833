"""One validation layer for every file a user names (pool YAML, spec YAML, manifest, class and
template lists, checkpoints, data folders): regular files only, bounded reads, YAML with bounded
nesting and alias expansion, typed values within stated bounds. Every refusal names the file,
the key path and the reason; nothing is allocated before its size is checked.
"""
from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any, Mapping

from merger.errors import shown_value

MAX_TEXT_BYTES = 16 << 20  # a pool, spec or manifest file, a class or template list
MAX_DEPTH = 64  # nesting of a YAML/JSON document
MAX_NODES = 1_000_000  # values in a document once every alias is expanded
MAX_NAME_BYTES = 255  # one path component (the usual file-system limit)
MAX_PATH_BYTES = 4096


# ---- paths and files ----------------------------------------------------------------------

def check_path(value: Any, where: str, error: type[Exception]) -> Path:
    """A path a user wrote: a non-empty string, no NUL byte, components and total within the
    file system's limits (so the OS is never asked, and never answers with a raw OSError)."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise error(f"{where}: expected a file path, got {shown_value(value)}")
    if "\0" in value:
        raise error(f"{where}: the path contains a NUL byte")
    encoded = value.encode("utf-8", "surrogateescape")
    if len(encoded) > MAX_PATH_BYTES:
        raise error(f"{where}: the path is {len(encoded)} bytes long (at most {MAX_PATH_BYTES})")
    long = [part for part in Path(value).parts if len(part.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES]
    if long:
        raise error(f"{where}: the name {long[0][:40]}… is {len(long[0].encode())} bytes long "
                    f"(at most {MAX_NAME_BYTES} per name)")
    return Path(value)


def regular_file(path: Path, what: str, error: type[Exception]) -> os.stat_result:
    """The path is an existing regular file (not a folder, FIFO, device or socket): reading it
    ends, and its size is known before it is read."""
    check_path(str(path), what, error)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{path}: {what} not found") from None
    except OSError as exc:
        raise error(f"{path}: {what} cannot be opened ({exc.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        raise error(f"{path}: {what} is a folder, expected a file")
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path}: {what} is not a regular file (a FIFO, device or socket); refusing to read it")
    return st


def read_bytes(path: Path, what: str, error: type[Exception], limit: int = MAX_TEXT_BYTES) -> bytes:
    st = regular_file(path, what, error)
    if st.st_size > limit:
        raise error(f"{path}: {what} is {st.st_size} bytes (at most {limit})")
    try:
        with open(path, "rb") as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise error(f"{path}: {what} cannot be read ({exc.strerror})") from None
    if len(data) > limit:
        raise error(f"{path}: {what} is larger than {limit} bytes")
    return data


def read_text(path: Path, what: str, error: type[Exception], limit: int = MAX_TEXT_BYTES) -> str:
    data = read_bytes(path, what, error, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise error(f"{path}: {what} is not UTF-8 text (invalid byte 0x{data[exc.start]:02x} on line {line})") from None


def check_writable(folder: Path, what: str, error: type[Exception]) -> None:
    """An output folder exists (or can be made) and takes a new file: said before any work is
    done. Tried with a real temporary file, as permissions alone do not tell (root, /proc,
    read-only mounts)."""
    import tempfile

    probe = Path(folder)
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        raise error(f"{what}: cannot write in {folder}: {probe} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        raise error(f"{what}: cannot write in {folder}: creating a file there failed ({exc.strerror})") from None


def check_output_file(path: Any, what: str, error: type[Exception], keep: tuple = ()) -> Path:
    """A file the program is about to write: a sane path, not an existing folder (or FIFO, device),
    neither one of ``keep`` (what the job reads: a pool's YAML, base, experts) nor inside a folder
    of ``keep`` (a Hugging Face expert, a trajectory), in a folder that takes a new file; said
    before any work is done. An existing regular file is replaced."""
    out = check_path(path, what, error).expanduser()
    if out.exists() or out.is_symlink():
        st = os.stat(out) if out.exists() else None
        if st is not None and stat.S_ISDIR(st.st_mode):
            raise error(f"{what}: {out} is a folder; name a file to write")
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise error(f"{what}: {out} is not a regular file (a FIFO, device or socket); name a file to write")
    resolved = out.resolve()
    for kept in keep:  # a file the job reads, or a folder of them (a Hugging Face expert, a trajectory)
        kept = Path(kept).resolve() if kept is not None else None
        if kept is not None and (kept == resolved or (kept in resolved.parents and kept.is_dir())):
            raise error(f"{what}: {out} is {'a file' if kept == resolved else f'inside {kept}, a folder'} this job "
                        f"reads; writing there would change what it holds. Name another file")
    check_writable(out.parent, what, error)
    return out


# ---- documents ----------------------------------------------------------------------------

def check_document(doc: Any, source: str, error: type[Exception]) -> Any:
    """Nesting depth and the number of values once aliases are expanded, both bounded: a YAML
    alias bomb is a few lines that expand to billions of values wherever they are walked."""
    sizes: dict[int, tuple[int, int]] = {}
    active: set[int] = set()

    def walk(node) -> tuple[int, int]:  # (expanded values, depth)
        if not isinstance(node, (list, tuple, dict)):
            return 1, 0
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise error(f"{source}: a value refers to itself (a recursive YAML alias)")
        active.add(key)
        children = list(node.keys()) + list(node.values()) if isinstance(node, dict) else list(node)
        total, depth = 1, 0
        for child in children:
            n, d = walk(child)
            total, depth = total + n, max(depth, d + 1)
            if total > MAX_NODES:
                raise error(f"{source}: more than {MAX_NODES} values once its aliases are expanded "
                            "(an alias bomb?); refusing it")
            if depth > MAX_DEPTH:
                raise error(f"{source}: nested deeper than {MAX_DEPTH} levels")
        active.discard(key)
        sizes[key] = (total, depth)
        return sizes[key]

    try:
        walk(doc)
    except RecursionError:
        raise error(f"{source}: nested deeper than {MAX_DEPTH} levels") from None
    return doc


MAX_INT_CHARS = 100  # an integer in a YAML file (a count, a seed, a λ) is far shorter


def load_yaml(path: Path, error: type[Exception], what: str) -> Any:
    """Safe YAML (no Python tags), bounded in bytes, nesting and alias expansion; a key given twice
    in one mapping is refused (YAML keeps the last silently: a pasted expert line merged another
    expert's file under a task's name)."""
    import yaml

    return _load(path, error, what, lambda text: yaml.load(text, Loader=_unique_key_loader()), yaml.YAMLError, "YAML")


def _unique_key_loader():
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                first: dict = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":  # << merges may be overridden
                        continue
                    key = self.construct_object(key_node, deep=True)
                    try:
                        mark = first.setdefault(key, key_node.start_mark)
                    except TypeError:  # an unhashable key: SafeLoader's own error names it
                        continue
                    if mark is not key_node.start_mark:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"{key!r} given twice in one mapping (first on line {mark.line + 1})",
                            key_node.start_mark)
            return super().construct_mapping(node, deep)

        def construct_yaml_int(self, node):  # Python refuses to read an int of over 4,300 digits
            if len(str(node.value)) > MAX_INT_CHARS:
                raise yaml.constructor.ConstructorError(
                    None, None, f"a number of {len(str(node.value))} characters (at most {MAX_INT_CHARS})",
                    node.start_mark)
            return super().construct_yaml_int(node)

    UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", UniqueKeyLoader.construct_yaml_int)
    return UniqueKeyLoader


def load_json(path: Path, error: type[Exception], what: str) -> Any:
    return _load(path, error, what, json.loads, ValueError, "JSON")


def _load(path: Path, error: type[Exception], what: str, parse, parse_error, kind: str) -> Any:
    text = read_text(path, what, error)
    try:
        doc = parse(text)
    except RecursionError:
        raise error(f"{path}: {what} is nested deeper than {MAX_DEPTH} levels") from None
    except parse_error as exc:
        mark = getattr(exc, "problem_mark", None)  # YAML's: where, in one line (its text spans four)
        if mark is not None:
            problem = getattr(exc, "problem", None) or "syntax error"
            raise error(f"{path}: not valid {kind}: line {mark.line + 1}, column {mark.column + 1}: {problem}") from None
        raise error(f"{path}: not valid {kind} ({exc})") from None
    return check_document(doc, str(path), error)


# ---- values -------------------------------------------------------------------------------



def mapping(value: Any, where: str, error: type[Exception]) -> Mapping:
    if not isinstance(value, Mapping):
        raise error(f"{where}: expected a mapping (key: value lines), got {type(value).__name__} {shown_value(value)}")
    return value


def string(value: Any, where: str, error: type[Exception], max_len: int = 200, allow_number: bool = True) -> str:
    """A scalar that names something (numbers are accepted as their text, lists and mappings not)."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float) if allow_number else str):
        raise error(f"{where}: expected a string, got {type(value).__name__} {shown_value(value)}")
    text = str(value)
    if not text.strip():
        raise error(f"{where}: is empty")
    if len(text) > max_len:
        raise error(f"{where}: is {len(text)} characters long (at most {max_len})")
    if any(ord(c) < 32 for c in text):
        raise error(f"{where}: contains control characters")
    return text


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond a float's range
        return False


def integer(value: Any, where: str, error: type[Exception], lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and math.isfinite(value) and value == int(value):
            value = int(value)
        else:
            raise error(f"{where}: expected a whole number in [{lo}, {hi}], got {shown_value(value)}")
    if not lo <= value <= hi:
        raise error(f"{where}: {value} is out of range [{lo}, {hi}]")
    return value


def number(value: Any, where: str, error: type[Exception], lo: float = -math.inf, hi: float = math.inf,
           lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        raise error(f"{where}: expected a finite number, got {shown_value(value)}")
    if value < lo or value > hi or (lo_open and value == lo):
        raise error(f"{where}: {value} is out of range {'(' if lo_open else '['}{lo:g}, {hi:g}]")
    return float(value)


def string_list(value: Any, where: str, error: type[Exception], max_items: int, max_len: int = 1000) -> list[str]:
    if not isinstance(value, (list, tuple)):
        raise error(f"{where}: expected a list of strings (or a file path), got {type(value).__name__} {shown_value(value)}")
    if not value:
        raise error(f"{where}: the list is empty")
    if len(value) > max_items:
        raise error(f"{where}: {len(value)} entries (at most {max_items})")
    return [string(v, f"{where}[{i}]", error, max_len) for i, v in enumerate(value)]


def known_keys(value: Mapping, allowed, where: str, source: str, error: type[Exception]) -> None:
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        raise error(f"{source}: unknown key(s) {', '.join(unknown)} in {where}; allowed: {', '.join(sorted(allowed))}")
