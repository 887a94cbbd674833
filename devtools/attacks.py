"""The bad-input catalogue: small files a user (or an attacker) might hand to merger, and what
each must get: a refusal whose message names the file, key and reason, or a correct answer.
Shared by the tests (tests/test_attacks.py) and ``python -m devtools bench attacks``.

Each case writes its files under a fresh folder and returns the action to run; the runner
(devtools/attacks_run.py) gives it a time limit and sorts the outcome.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import runpy
import struct
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import yaml

from merger.errors import MergerError
from merger.methods.basic import TASK_ARITHMETIC
from merger.methods.ties import TIES
from devtools.attacks_app import at, clamp_after_refusal, first_weight, inflated_auto_tune, sent, slot
from devtools.attacks_disk import cache_linked_to_models, cached, fifos_for_entries, forge_entries, other_history


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[Path], Callable[[], object]]  # writes files under a folder, returns the action
    refuse: str | None  # a regex the refusal's message must match; None: the action must succeed


# ---- building blocks --------------------------------------------------------------------------

def _pool(root: Path, n_experts: int = 2) -> tuple[Path, dict]:
    from devtools.testing import write_pool

    path = write_pool(root, n_experts=n_experts, scale=0.1, demo_data=True)
    return path, yaml.safe_load(path.read_text())


def _save(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump(spec))
    return path


def use_pool(path: Path):
    """What a user does with a pool: open it, evaluate every task, merge."""
    import merger

    pool = merger.open_pool(path)
    ev = merger.Evaluator(pool)
    ev.evaluate(None, "live")
    return merger.evaluate(pool, merger.merge(pool, TASK_ARITHMETIC.name, lam=0.3), "live")


def _mutated(mutate: Callable[[Path, dict], None]):
    def build(root: Path):
        path, spec = _pool(root)
        mutate(root, spec)
        _save(path, spec)
        return lambda: use_pool(path)
    return build


def _raw_yaml(edit: Callable[[str], bytes | str]):
    """Rewrite the pool file's text (for what yaml.safe_dump cannot write)."""
    def build(root: Path):
        path, _ = _pool(root)
        out = edit(path.read_text())
        path.write_bytes(out if isinstance(out, bytes) else out.encode())
        return lambda: use_pool(path)
    return build


def _first(spec: dict) -> str:
    return next(iter(spec["experts"]))


def _set(keys: str, value):
    """Set spec[a][b]... = value; a '*' key means the first task."""
    def mutate(root: Path, spec: dict):
        node = spec
        parts = [(_first(spec) if k == "*" else k) for k in keys.split(".")]
        for k in parts[:-1]:
            node = node.setdefault(k, {})
        node[parts[-1]] = value
    return mutate


def _laughs(levels: int = 9) -> str:
    """A billion-laughs alias chain: a few lines that expand to 9^levels strings."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def _with_laughs(key_line: Callable[[str], str]):
    def edit(text: str) -> str:
        return _laughs() + key_line(text)
    return _raw_yaml(edit)


def _expert_file(root: Path, spec: dict, name: str, write: Callable[[Path, dict], None]):
    path = root / name
    write(path, spec)
    spec["experts"][_first(spec)] = name


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _png(width: int, height: int) -> bytes:
    """A PNG whose header claims width × height (its data is a single empty row: the size check
    happens when the header is read)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


def _folder_task(root: Path, spec: dict, extra: Callable[[Path], None] | None = None, image_size=None) -> None:
    """The first task's data from an image folder of small PNGs (two per class and split)."""
    from PIL import Image

    t = _first(spec)
    for split in ("train", "test"):
        for i, c in enumerate(spec["tasks"][t]["classes"]):
            d = root / "imgs" / split / c
            d.mkdir(parents=True, exist_ok=True)
            for j in range(2):
                Image.new("RGB", (32, 32), (40 * i, 20 * j, 100)).save(d / f"{j}.png")
            if extra is not None and split == "test" and i == 0:
                extra(d)
    entry = "imgs" if image_size is None else {"root": "imgs", "image_size": image_size}
    spec["tasks"][t]["data"] = {"folder": entry}


def _cli(args_of: Callable[[Path, Path], list[str]], prepare: Callable[[Path, Path], None] | None = None):
    """Run the CLI in-process; a non-zero exit becomes a MergerError carrying its stderr line (and
    its exit status), a traceback a raw exception."""
    def build(root: Path):
        path, _ = _pool(root)
        if prepare is not None:
            prepare(root, path)

        def action():
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                code = run_cli(args_of(root, path))
            if code != 0:
                raise MergerError(f"exit {code}: {err.getvalue().strip()}")
            return code
        return action
    return build


def run_cli(argv: list[str]) -> int:
    """``python -m merger ARGV`` as a user runs it, in this process (no new interpreter per case):
    its exit status."""
    saved = sys.argv
    sys.argv = ["merger", *argv]
    try:
        runpy.run_module("merger", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = saved
    return 0


def _spec_file(root: Path, pool: Path) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        run_cli(["merge", "--pool", str(pool), "--method", TASK_ARITHMETIC.name, "--out", str(root / "m.safetensors")])


def _replay(root: Path, pool: Path) -> list[str]:
    return ["merge", "--spec", str(root / "m.yaml"), "--out", str(root / "again.safetensors")]


def _bad_spec(field: str, value):
    def prepare(root: Path, pool: Path):
        _spec_file(root, pool)
        record = yaml.safe_load((root / "m.yaml").read_text())
        record[field] = value
        (root / "m.yaml").write_text(yaml.safe_dump(record))
    return prepare


def _float8(root: Path, spec: dict) -> None:
    from merger.io.checkpoints import load_state_dict, save_safetensors

    p = root / spec["experts"][_first(spec)]
    sd = load_state_dict(p)
    save_safetensors({k: v.to(torch.float8_e4m3fn) if v.is_floating_point() else v for k, v in sd.items()}, p)


def _int_keys(path: Path, spec: dict) -> None:
    torch.save({1: torch.zeros(2), 2: torch.ones(2)}, path)


def _hf_index(path: Path, spec: dict) -> None:
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["a.safetensors"]}))


def _manifest(files) -> Callable[[Path, dict], None]:
    def mutate(root: Path, spec: dict):
        (root / "manifest.json").write_text(json.dumps({"files": files(root)}))
    return mutate


def _symlink_dev_zero(root: Path) -> dict:
    (root / "zeros.bin").symlink_to("/dev/zero")
    return {"zeros.bin": "0" * 64}


# ---- the catalogue ---------------------------------------------------------------------------

CASES = [
    # pool YAML: every value checked, named by its key path
    Case("nested 50 000 levels", _raw_yaml(lambda t: t + "description: " + "[" * 50_000 + "]" * 50_000 + "\n"),
         r"pool\.yaml.*nested deeper than"),
    Case("unknown kwarg in architecture.config", _mutated(_set("architecture.config.bogus_option", 1)),
         r"pool\.yaml: architecture\.config: open_clip cannot build this architecture \(TypeError"),
    Case("vision_cfg.image_size: big", _mutated(_set("architecture.config.vision_cfg.image_size", "big")),
         r"architecture\.config\.vision_cfg\.image_size: expected a whole number"),
    Case("preprocess.image_size: abc", _mutated(_set("preprocess.image_size", "abc")),
         r"pool\.yaml: preprocess\.image_size: expected a whole number"),
    Case("classes: 3", _mutated(_set("tasks.*.classes", 3)), r"tasks\.\w+\.classes: expected a list of strings"),
    Case("templates: 3", _mutated(_set("tasks.*.templates", 3)), r"tasks\.\w+\.templates: expected a list of strings"),
    Case("preprocess as a list", _mutated(_set("preprocess", [32, 32])), r"pool\.yaml: preprocess: expected a mapping"),
    Case("preprocess.mean with 2 values", _mutated(_set("preprocess.mean", [0.5, 0.5])),
         r"preprocess\.mean: expected three numbers"),
    Case("std of zero", _mutated(_set("preprocess.std", [0.2, 0.0, 0.2])), r"preprocess\.std\[1\]: 0\.0 is out of range \(0"),
    Case("invalid UTF-8 in the YAML", _raw_yaml(lambda t: t.encode() + b"description: caf\xe9\n"),
         r"pool\.yaml: pool file is not UTF-8 text \(invalid byte 0xe9 on line \d+\)"),
    Case("top level is a list", _raw_yaml(lambda t: "- a\n- b\n"), r"pool\.yaml: the top level: expected a mapping"),
    Case("python tag in the YAML", _raw_yaml(lambda t: t + "description: !!python/object/apply:os.system [echo]\n"),
         r"pool\.yaml: not valid YAML"),
    Case("hparams with lr: fast", _mutated(_set("experts.*", {"path": "experts/x.safetensors", "hparams": {"lr": "fast"}})),
         r"experts\.\w+\.hparams\.lr: expected a finite number, got 'fast'"),
    Case("memory data in a YAML pool", _mutated(_set("tasks.*.data", {"memory": {"train": 1}})),
         r"tasks\.\w+\.data: expected one of demo, folder"),
    Case("expert name is a list", _raw_yaml(lambda t: t.replace("experts:\n", "experts:\n  [a, b]: x.safetensors\n", 1)),
         r"pool\.yaml: not valid YAML|experts \(an expert name\): expected a string"),
    Case("an expert given twice (a pasted line)",
         _raw_yaml(lambda t: t.replace("experts:\n", "experts:\n  colour: experts/shape.safetensors\n", 1)),
         r"pool\.yaml: not valid YAML: line \d+, column 3: 'colour' given twice in one mapping \(first on line \d+\)"),
    Case("an expert name with a comma", _raw_yaml(lambda t: t.replace("experts:\n", "experts:\n  sh,ape: x.safetensors\n", 1)),
         r"pool\.yaml: experts: the name 'sh,ape' contains ',': names are listed with ','"),
    # paths
    Case("expert file missing", _mutated(_set("experts.*", "experts/colur.safetensors")),
         r"pool\.yaml: experts\.\w+: .*colur\.safetensors: file not found"),
    Case("expert path with a NUL byte", _mutated(_set("experts.*", "ex\0pert.safetensors")),
         r"pool\.yaml: experts\.\w+: the path contains a NUL byte"),
    Case("300-character file name", _mutated(_set("experts.*", "e" * 300 + ".safetensors")),
         r"pool\.yaml: experts\.\w+: the name e+… is 312 bytes long \(at most 255 per name\)"),
    # checkpoints
    Case("weights-only .pt with int keys", _mutated(lambda r, s: _expert_file(r, s, "ints.pt", _int_keys)),
         r"ints\.pt: keys that are not tensor names \(strings\): 1, 2"),
    Case("float8 expert weights", _mutated(_float8), None),
    Case("HF shard index with a list weight_map", _mutated(lambda r, s: _expert_file(r, s, "hf", _hf_index)),
         r"model\.safetensors\.index\.json: weight_map must map tensor names to shard files, got list"),
    Case("expert is a FIFO named .safetensors",
         _mutated(lambda r, s: _expert_file(r, s, "fifo.safetensors", lambda p, _: _fifo(p))),
         r"fifo\.safetensors: weights file is not a regular file"),
    # the built zoo's manifest
    Case("manifest with files as a list", _mutated(_manifest(lambda r: ["base.safetensors"])),
         r"manifest\.json: 'files' must map relative paths to sha256 digests, got list"),
    Case("manifest naming /dev/zero", _mutated(_manifest(lambda r: {"/dev/zero": "0" * 64})),
         r"manifest\.json: files\./dev/zero: must be a path inside the pool's folder"),
    Case("manifest entry linked to /dev/zero", _mutated(_manifest(_symlink_dev_zero)),
         r"zeros\.bin: file listed in manifest\.json is not a regular file"),
    # data
    Case("folder task with image_size: abc", _mutated(lambda r, s: _folder_task(r, s, image_size="abc")),
         r"tasks\.\w+\.data\.folder\.image_size: expected a whole number"),
    Case("folder task with image_size: [32, 32]", _mutated(lambda r, s: _folder_task(r, s, image_size=[32, 32])),
         None),
    Case("folder task with image_size: [32, 16]", _mutated(lambda r, s: _folder_task(r, s, image_size=[32, 16])),
         r"tasks\.\w+\.data\.folder\.image_size: 32 × 16: the image tower takes square images; give one side"),
    Case("an image that is a FIFO named .png", _mutated(lambda r, s: _folder_task(r, s, lambda d: _fifo(d / "fifo.png"))),
         None),
    Case("a 20000×20000 PNG among good images",
         _mutated(lambda r, s: _folder_task(r, s, lambda d: (d / "bomb.png").write_bytes(_png(20_000, 20_000)))), None),
    # sizes refused before allocating
    Case("n: 10**12 demo images", _mutated(_set("tasks.*.data.demo.train.n", 10**12)),
         r"tasks\.\w+\.data\.demo\.train\.n: 1000000000000 is out of range \[0, 200000\]"),
    Case("preprocess.image_size: 20000", _mutated(_set("preprocess.image_size", 20000)),
         r"preprocess\.image_size: 20000 is out of range \[8, 1024\]"),
    Case("folder image_size: 30000", _mutated(lambda r, s: _folder_task(r, s, image_size=30000)),
         r"data\.folder\.image_size: 30000 is out of range \[8, 1024\]"),
    Case("a width of a billion", _mutated(_set("architecture.config.vision_cfg.width", 10**9)),
         r"vision_cfg\.width: 1000000000 is out of range \[1, 16384\]"),
    Case("alias bomb as the pool name", _with_laughs(  # in place of its name (a second 'name' is refused first)
        lambda t: re.sub(r"(?m)^name:.*$", "name: *a8", t, count=1)),
         r"pool\.yaml: more than 1000000 values once its aliases are expanded"),
    Case("alias bomb as a task's classes", _with_laughs(
        lambda t: re.sub(r"(\n    classes:)\n(    - .*\n)+", r"\1 *a8\n", t, count=1)),
        r"pool\.yaml: more than 1000000 values once its aliases are expanded"),
    Case("recursive alias", _raw_yaml(lambda t: t + "description: &r [*r]\n"),
         r"pool\.yaml: a value refers to itself|not valid YAML"),
    # the command line: one line, exit 2 for bad input, never a traceback
    Case("CLI: --out in /proc", _cli(lambda r, p: ["merge", "--pool", str(p), "--method", TIES.name,
                                                    "--out", "/proc/x.safetensors"]),
         r"exit 2: error: --out: cannot write in /proc: creating a file there failed"),
    Case("CLI: --out under a regular file", _cli(lambda r, p: ["merge", "--pool", str(p), "--method", TIES.name,
                                                               "--out", str(p) + "/x.safetensors"]),
         r"exit 2: error: --out: cannot write in .*pool\.yaml: .*pool\.yaml is a file, not a folder"),
    Case("CLI: landscape --out in /proc", _cli(lambda r, p: ["landscape", "--pool", str(p), "--grid", "3",
                                                            "--out", "/proc/l.html"]),
         r"exit 2: error: --out: cannot write in /proc"),
    Case("CLI: landscape --points, 3000 of them", _cli(lambda r, p: [
        "landscape", "--pool", str(p), "--grid", "3", "--out", str(r / "l.html"),
        "--points", ",".join(f"{TASK_ARITHMETIC.name}:lam={i / 1000}" for i in range(3000))]),
         r"exit 2: error: landscape points: 3000 named; at most 64 \(each is a merge to compute\)"),
    Case("CLI: landscape --paths, 9000 of them", _cli(lambda r, p: [
        "landscape", "--pool", str(p), "--grid", "3", "--out", str(r / "l.html"), "--paths", ",".join(["x"] * 9000)]),
         r"exit 2: error: landscape paths: 9000 named; at most 64"),
    Case("CLI: spec params as a list", _cli(_replay, _bad_spec("params", [1, 2])),
         r"exit 2: error: .*m\.yaml: params: expected a dict, got list"),
    Case("CLI: spec expert_files as a string", _cli(_replay, _bad_spec("expert_files", "all of them")),
         r"exit 2: error: .*m\.yaml: expert_files: expected a dict, got str"),
    Case("CLI: spec experts as a number", _cli(_replay, _bad_spec("experts", 3)),
         r"exit 2: error: .*m\.yaml: experts: expected a list, got int"),
    Case("CLI: eval --lam of 401 digits", _cli(lambda r, p: ["eval", "--pool", str(p), "--method", TASK_ARITHMETIC.name,
                                                              "--lam", "1" + "0" * 400]),
         r"exit 2: error: task_arithmetic: parameter lam=an integer of 401 digits is not a finite number"),
    Case("CLI: spec lam of 401 digits", _cli(_replay, _bad_spec("params", {"lam": 10**400})),
         r"exit 2: error: .*m\.yaml: not valid YAML: .*a number of 401 characters \(at most 100\)"),
    Case("CLI: a history of another program", _cli(lambda r, p: ["sweep", "--pool", str(p), "--methods",
                                                                 TASK_ARITHMETIC.name, "--history",
                                                                 str(r / "other.sqlite")], other_history),
         r"exit 2: error: --history .*other\.sqlite: its table 'evaluations' has the columns id, score"),
    Case("CLI: --ray local --workers 1000000", _cli(lambda r, p: ["sweep", "--pool", str(p), "--ray", "local",
                                                                  "--workers", "1000000", "--history", ""]),
         r"exit 2: .*argument --workers: '1000000': at most 1024 workers"),
    Case("cache: forged entries and heads", cached(forge_entries), None),
    Case("cache: FIFOs named as entries", cached(fifos_for_entries), None),
    Case("cache: computed/ a link to models", cached(cache_linked_to_models), None),
    # the Merge tab's listener takes the values as sent: one warning naming the field, nothing computed
    Case("app: λ = 5 typed in its box", sent(at("lam", 5)), r"^λ \(merge coefficient\): 5 is outside \[-3, 3\]$"),
    Case("app: the browser's clamp of λ = 5 to 3", clamp_after_refusal, None),
    Case("app: a task weight of 7", sent(first_weight(7)), r"^w · \w+: 7 is outside \[-3, 3\]$"),
    Case("app: λ box emptied", sent(at("lam", None)), r"^λ \(merge coefficient\): empty or not a number"),
    Case("app: λ of 401 digits", sent(at("lam", 10**400)), r"^λ \(merge coefficient\): an integer of 401 digits is not a number$"),
    Case("app: λ as a list", sent(at("lam", [0.3])), r"^λ \(merge coefficient\): \[0\.3\] is not a number$"),
    Case("app: experts as nested lists", sent(slot(0, [["a"]])), r"^experts: expected a list of expert names"),
    Case("app: method as a mapping", sent(slot(1, {"name": TIES.name})), r"^method: expected a method's name"),
    Case("app: auto-tune of one method × 100 000", inflated_auto_tune, None),
]
