"""The pool YAML's schema: every key's type and bounds, checked before anything is loaded or
allocated. Messages name the file and the key path (``pool.yaml: tasks.cars.data.demo.train.n``)."""
from __future__ import annotations

import logging
from typing import Any, Mapping

from merger.errors import PoolError
from merger.io import inputs

TOKENIZERS = ("open_clip", "demo")
TOP_KEYS = {"name", "description", "architecture", "tokenizer", "preprocess", "base", "experts", "tasks"}
ARCH_KEYS = {"model", "config"}
EXPERT_KEYS = {"path", "trajectory", "hparams"}
TASK_KEYS = {"classes", "templates", "data"}
PREPROCESS_KEYS = {"image_size", "mean", "std"}
DEMO_KEYS = {"train", "test", "domain"}
FOLDER_KEYS = {"root", "image_size"}
PARQUET_KEYS = {"train", "test", "image", "label", "image_size"}

IMAGE_SIZE = (8, 1024)  # input sides a pool may ask for (ViT-L/14-336 needs 336)
MAX_DEMO_IMAGES = 200_000  # per split of a demo task: 600 MB of 32-pixel images
MAX_EXPERTS = 1000
MAX_CLASSES = 100_000
MAX_TEMPLATES = 1000
# Sizes in an inline open_clip config: (min, max); a larger value would allocate without bound.
CONFIG_INTS = {"embed_dim": (1, 16384), "width": (1, 16384), "layers": (1, 256), "heads": (1, 256),
               "head_width": (1, 4096), "patch_size": (1, 1024), "context_length": (1, 4096),
               "vocab_size": (1, 1_000_000)}

E = PoolError


def check(spec: Any, source: str, in_memory: bool = False) -> dict:
    """The spec with every value checked (types, bounds, paths); raises PoolError naming the key."""
    inputs.mapping(spec, f"{source}: the top level", E)
    inputs.known_keys(spec, TOP_KEYS, "the pool", source, E)
    for required in ("architecture", "base", "experts"):
        if required not in spec:
            raise E(f"{source}: missing required key '{required}'")
    out = dict(spec)
    if spec.get("name") is not None:
        out["name"] = inputs.string(spec["name"], f"{source}: name", E)
    if spec.get("description") is not None:
        out["description"] = inputs.string(spec["description"], f"{source}: description", E, max_len=10_000)
    out["architecture"] = _architecture(spec["architecture"], source)
    if spec.get("tokenizer") is not None:
        out["tokenizer"] = inputs.string(spec["tokenizer"], f"{source}: tokenizer", E)
        if out["tokenizer"] not in TOKENIZERS:
            raise E(f"{source}: tokenizer: {out['tokenizer']!r} unknown; one of {', '.join(TOKENIZERS)} (absent: "
                    f"open_clip's, for real CLIP checkpoints; demo: the demo's tiny text tower)")
    if spec.get("preprocess") is not None:
        out["preprocess"] = _preprocess(spec["preprocess"], source)
    if not in_memory:
        inputs.check_path(spec["base"], f"{source}: base", E)
    out["experts"] = _experts(spec["experts"], source, in_memory)
    tasks = spec.get("tasks")
    if tasks is not None:
        inputs.mapping(tasks, f"{source}: tasks", E)
        out["tasks"] = {inputs.string(t, f"{source}: tasks (a task name)", E, 100): _task(v, f"tasks.{t}", source, in_memory)
                        for t, v in tasks.items()}
    return out


def _architecture(arch: Any, source: str) -> dict:
    if isinstance(arch, str):
        return {"model": inputs.string(arch, f"{source}: architecture", E)}
    if not isinstance(arch, Mapping):
        raise E(f"{source}: architecture must be an open_clip model name or {{config: ...}}, "
                f"got {type(arch).__name__}")
    inputs.known_keys(arch, ARCH_KEYS, "architecture", source, E)
    if ("model" in arch) == ("config" in arch):
        raise E(f"{source}: architecture needs exactly one of 'model' or 'config'")
    if "model" in arch:
        return {"model": inputs.string(arch["model"], f"{source}: architecture.model", E)}
    return {"config": _config(arch["config"], f"{source}: architecture.config")}


def _config(config: Any, where: str) -> dict:
    """Sizes of an inline open_clip config within bounds; open_clip itself checks the rest when the
    pool builds the model on the meta device (its errors are reported under this key)."""
    inputs.mapping(config, where, E)
    for tower in ("vision_cfg", "text_cfg"):
        cfg = config.get(tower)
        if cfg is None:
            continue
        inputs.mapping(cfg, f"{where}.{tower}", E)
        for key, (lo, hi) in CONFIG_INTS.items():
            if key in cfg:
                inputs.integer(cfg[key], f"{where}.{tower}.{key}", E, lo, hi)
        if "image_size" in cfg:
            _image_size(cfg["image_size"], f"{where}.{tower}.image_size")
        if "mlp_ratio" in cfg:
            inputs.number(cfg["mlp_ratio"], f"{where}.{tower}.mlp_ratio", E, 0, 64, lo_open=True)
    if "embed_dim" in config:
        inputs.integer(config["embed_dim"], f"{where}.embed_dim", E, *CONFIG_INTS["embed_dim"])
    return dict(config)


def _image_size(value: Any, where: str) -> int:
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise E(f"{where}: expected a side or [height, width], got {len(value)} values")
        sides = [inputs.integer(v, f"{where}[{i}]", E, *IMAGE_SIZE) for i, v in enumerate(value)]
        if sides[0] != sides[1]:  # it was read as [h, h]: the width went unused, silently
            raise E(f"{where}: {sides[0]} × {sides[1]}: the image tower takes square images; give one side")
        return sides[0]
    return inputs.integer(value, where, E, *IMAGE_SIZE)


def _preprocess(value: Any, source: str) -> dict:
    inputs.mapping(value, f"{source}: preprocess", E)
    inputs.known_keys(value, PREPROCESS_KEYS, "preprocess", source, E)
    out = dict(value)
    if "image_size" in value:
        out["image_size"] = _image_size(value["image_size"], f"{source}: preprocess.image_size")
    for key in ("mean", "std"):
        if key in value:
            v = value[key]
            if not isinstance(v, (list, tuple)) or len(v) != 3:
                raise E(f"{source}: preprocess.{key}: expected three numbers (one per RGB channel), got {v!r}"[:300])
            lo_open = key == "std"
            out[key] = [inputs.number(x, f"{source}: preprocess.{key}[{i}]", E, 0 if lo_open else -10, 10,
                                      lo_open=lo_open) for i, x in enumerate(v)]
    return out


def _experts(experts: Any, source: str, in_memory: bool) -> dict:
    if not isinstance(experts, Mapping) or not experts:
        got = "zero experts given" if not experts else f"got a {type(experts).__name__}: write 'task: path' lines"
        raise E(f"{source}: experts must map task names to checkpoint paths ({got})")
    if len(experts) > MAX_EXPERTS:
        raise E(f"{source}: experts: {len(experts)} experts (at most {MAX_EXPERTS})")
    out = {}
    for task, value in experts.items():
        name = inputs.string(task, f"{source}: experts (an expert name)", E, 100)
        odd = [c for c in ",=" if c in name]
        if odd or name != name.strip():
            why = f"contains {odd[0]!r}" if odd else "begins or ends with a space"
            raise E(f"{source}: experts: the name {name!r} {why}: names are listed with ',' and weighted with "
                    "'=' (--experts a,b, --task-weights a=2, the History's experts column); rename it")
        where = f"{source}: experts.{name}"
        if isinstance(value, Mapping):
            inputs.known_keys(value, EXPERT_KEYS, f"experts.{name}", source, E)
            if "path" not in value:
                raise E(f"{where} has no 'path'")
            info = dict(value)
            if value.get("trajectory"):
                inputs.check_path(value["trajectory"], f"{where}.trajectory", E)
            if value.get("hparams") is not None:
                info["hparams"] = _hparams(value["hparams"], f"{where}.hparams")
        else:
            info = {"path": value}
        if not in_memory:
            inputs.check_path(info["path"], where, E)
        out[name] = info
    return out


HPARAM_NUMBERS = ("lr", "data_fraction", "momentum", "weight_decay")
HPARAM_INTEGERS = ("epochs", "batch_size", "seed")


def _hparams(value: Any, where: str) -> dict:
    """How an expert was fine-tuned (what the lab and the reports read): the known settings typed,
    anything else a plain scalar."""
    inputs.mapping(value, where, E)
    out = {}
    for key, v in value.items():
        name = inputs.string(key, f"{where} (a key)", E)
        if name in HPARAM_NUMBERS:
            out[name] = inputs.number(v, f"{where}.{name}", E, 0, 1e6)
        elif name in HPARAM_INTEGERS:
            out[name] = inputs.integer(v, f"{where}.{name}", E, 0, 2**63 - 1)
        elif isinstance(v, (dict, list, tuple)):
            raise E(f"{where}.{name}: expected a single value, got {type(v).__name__}")
        else:
            out[name] = v
    return out


def _task(value: Any, where: str, source: str, in_memory: bool) -> dict:
    inputs.mapping(value, f"{source}: {where}", E)
    inputs.known_keys(value, TASK_KEYS, where, source, E)
    out = dict(value)
    classes = value.get("classes")
    if isinstance(classes, str):
        inputs.check_path(classes, f"{source}: {where}.classes", E)
    elif classes is not None:
        out["classes"] = inputs.string_list(classes, f"{source}: {where}.classes", E, MAX_CLASSES)
    templates = value.get("templates")
    if isinstance(templates, str):
        if templates != "standard":
            inputs.check_path(templates, f"{source}: {where}.templates", E)
    elif templates is not None:
        out["templates"] = inputs.string_list(templates, f"{source}: {where}.templates", E, MAX_TEMPLATES)
    if value.get("data") is not None:
        out["data"] = _data(value["data"], f"{where}.data", source, in_memory)
    return out


def _data(data: Any, where: str, source: str, in_memory: bool) -> dict:
    kinds = ("demo", "folder", "parquet", "memory") if in_memory else ("demo", "folder", "parquet")
    if not isinstance(data, Mapping) or len(data) != 1 or next(iter(data)) not in kinds:
        raise E(f"{source}: {where}: expected one of {', '.join(kinds)} (e.g. {{folder: data/cars}})")
    kind, entry = next(iter(data.items()))
    if kind == "demo":
        inputs.mapping(entry, f"{source}: {where}.demo", E)
        inputs.known_keys(entry, DEMO_KEYS, f"{where}.demo", source, E)
        for split in ("train", "test"):
            cfg = entry.get(split)
            if not isinstance(cfg, Mapping) or "n" not in cfg or "seed" not in cfg:
                raise E(f"{source}: {where}.demo.{split}: expected {{n: ..., seed: ...}}")
            inputs.known_keys(cfg, {"n", "seed"}, f"{where}.demo.{split}", source, E)
            inputs.integer(cfg["n"], f"{source}: {where}.demo.{split}.n", E, 0, MAX_DEMO_IMAGES)
            inputs.integer(cfg["seed"], f"{source}: {where}.demo.{split}.seed", E, 0, 2**63 - 1)
    elif kind == "folder":
        if isinstance(entry, Mapping):
            inputs.known_keys(entry, FOLDER_KEYS, f"{where}.folder", source, E)
            if "root" not in entry:
                raise E(f"{source}: {where}.folder: expected a path or {{root: path, image_size: N}}")
            inputs.check_path(entry["root"], f"{source}: {where}.folder.root", E)
            if "image_size" in entry:  # one side from here on ([32, 32] reached int() as a list)
                entry = {**entry, "image_size": _image_size(entry["image_size"], f"{source}: {where}.folder.image_size")}
        else:
            inputs.check_path(entry, f"{source}: {where}.folder", E)
    elif kind == "parquet":
        entry = _parquet(entry, f"{where}.parquet", source)
    return {kind: entry}


def _parquet(entry: Any, key: str, source: str) -> dict:
    where = f"{source}: {key}"
    inputs.mapping(entry, where, E)
    inputs.known_keys(entry, PARQUET_KEYS, key, source, E)
    out = dict(entry)
    for split in ("train", "test"):
        files = entry.get(split)
        if files is None:
            raise E(f"{where}.{split}: missing (a parquet file, or a list of them)")
        files = [files] if isinstance(files, str) else inputs.string_list(files, f"{where}.{split}", E, 10_000)
        out[split] = [str(inputs.check_path(f, f"{where}.{split}", E)) for f in files]
    for column in ("image", "label"):
        if column in entry:
            out[column] = inputs.string(entry[column], f"{where}.{column}", E, 200)
    if "image_size" in entry:
        out["image_size"] = _image_size(entry["image_size"], f"{where}.image_size")
    return out


def say_default_statistics(spec: Mapping, source: str) -> None:
    """Warn when a pool whose tasks read images gives no mean and std: OpenAI CLIP's are used (a demo
    pool without its own scored an expert 92.0 % instead of 95.7 %, and nothing said why)."""
    reads_images = any(isinstance(t, Mapping) and t.get("data") for t in (spec.get("tasks") or {}).values())
    if reads_images and not {"mean", "std"} <= set(spec.get("preprocess") or {}):
        logging.getLogger("merger.pool.pool").warning(
            "%s: preprocess gives no mean and std: images are normalised with OpenAI CLIP's (mean 0.481, 0.458, "
            "0.408, std 0.269, 0.261, 0.276); if the experts were trained with others, set preprocess: "
            "{image_size, mean, std}", source)
