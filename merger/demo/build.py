"""Build the demo pool: pretrain the tiny CLIP, fine-tune one expert per task, write the pool.

Recipe (as the field's CLIP experts are made):
  1. Backbone warm-up: the image tower is first trained supervised on every attribute of a
     separate pretraining draw (one linear probe per attribute on the image embedding, a few
     epochs; the probes are dropped), as LiT/ALIGN-style CLIPs start from a pretrained image
     backbone. Its features then encode every attribute.
  2. Contrastive (CLIP) stage: both towers on image-caption pairs, the image tower at a tenth of
     the learning rate. It is kept short (``n_contrastive`` pairs, one epoch) and captions name
     each attribute only with probability ``caption_p``: the text tower learns a partial
     alignment, so the zero-shot base is moderate, well above chance and well below experts.
  3. Experts: image tower only, the task's zero-shot head frozen, AdamW with a small learning
     rate for a few epochs, so task vectors stay small relative to the weights (||tau||/||theta0||
     of the image tower about 2e-2).

    python -m merger.demo.build [out_dir] [--small]     (default out_dir: merger/demo/assets)

Pool layout (the loader reads exactly this):
    pool.yaml, base.safetensors (full CLIP, fp32), experts/<task>.safetensors (image tower,
    "visual." keys, fp32), trajectories/<task>/epoch_XXX.safetensors, manifest.json (sha256 of
    every file + the DemoConfig). Files are written into a temporary sibling directory that is
    renamed into place at the end, so a crashed build never leaves a half-written pool.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from merger import runtime
from merger.demo import world
from merger.demo.model import CLIP_CONFIG, MEAN, STD, create_model
from merger.demo.train import accuracy, finetune_expert, image_features, pretrain, task_head

SHIPPED = Path(__file__).resolve().parent / "assets"  # the pool that ships with the package


@dataclass
class DemoConfig:
    """Everything that determines the demo pool (stored in manifest.json)."""

    # world splits: (size, seed) of the images; pretraining images are a separate draw of the
    # whole world, each task's train/test images a draw of its domain (seed * 1000 + task index)
    n_pretrain: int = 20000
    pretrain_data_seed: int = 0
    n_train: int = 5000
    train_seed: int = 1
    n_test: int = 2000
    test_seed: int = 2
    tasks: tuple[str, ...] = tuple(world.TASKS)
    domains: dict = field(default_factory=lambda: {t: dict(d) for t, d in world.DOMAINS.items()})
    # supervised warm-up of the image tower on all n_pretrain images
    warmup_epochs: int = 5
    warmup_lr: float = 3e-3
    # contrastive pretraining of the base on the first n_contrastive images (short on purpose)
    n_contrastive: int = 2000
    pretrain_epochs: int = 1
    pretrain_batch_size: int = 128
    pretrain_lr: float = 1e-3
    visual_lr_scale: float = 0.1
    caption_p: dict = field(default_factory=lambda: dict(world.CAPTION_P))
    model_seed: int = 0
    # expert fine-tuning (image tower only, frozen zero-shot head)
    ft_lr: float = 5e-5
    ft_epochs: int = 4
    ft_batch_size: int = 128
    ft_data_fraction: float = 1.0
    ft_seed: int = 0
    trajectory_dtype: str = "float16"  # keeps merger/demo/assets under 30 MB
    extra: dict = field(default_factory=dict)

    @classmethod
    def small(cls) -> "DemoConfig":
        """A reduced pool that builds in about a minute on 2 cores (CI checks the targets on it)."""
        return cls(n_pretrain=12000, warmup_epochs=4, n_train=3000, n_test=1000)

    def task_data(self, task: str) -> dict:
        """The pool.yaml ``data.demo`` entry of one task: its train/test draws and its domain."""
        i = list(world.TASKS).index(task)
        entry = {"train": {"n": self.n_train, "seed": self.train_seed * 1000 + i},
                 "test": {"n": self.n_test, "seed": self.test_seed * 1000 + i}}
        if self.domains.get(task):
            entry["domain"] = dict(self.domains[task])
        return entry

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["tasks"] = list(self.tasks)
        return d


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _save(state: dict[str, torch.Tensor], path: Path, dtype: torch.dtype = torch.float32) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in state.items()},
              str(path))


@contextmanager
def _on_threads(n: int):
    """Torch on n threads for the block (the demo's numbers then do not depend on the machine's cores), and
    the caller's count put back after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@_on_threads(2)
def build(out_dir: str | Path = SHIPPED, config: DemoConfig | None = None, progress: bool = True) -> Path:
    """Build the pool into ``out_dir`` (replacing any previous one); returns its path."""
    config = config or DemoConfig()
    out = Path(out_dir).expanduser()
    _check_replaceable(out)  # before minutes of training
    out.parent.mkdir(parents=True, exist_ok=True)
    # progress in "units": one per pretraining epoch and one per fine-tuning epoch
    units = 1 + config.pretrain_epochs + config.ft_epochs * len(config.tasks)
    bar = tqdm(total=units, desc="demo pool", disable=not progress, unit="ep",
               bar_format="{l_bar}{bar}| {n:.1f}/{total} [{elapsed}<{remaining}] {postfix}")
    done = [0.0]

    def tick(offset: float, span: float):
        def cb(frac: float, msg: str) -> None:
            runtime.stop_if_killed()  # each training step: a kill whose exception was lost stops the build here
            bar.update(offset + span * frac - done[0])
            done[0] = offset + span * frac
            bar.set_postfix_str(msg, refresh=False)
        return cb

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:  # right after the folder is made: a kill (SIGTERM unwinds) in between would leave it behind
        started = time.time()
        pre_x, pre_y = world.generate(config.n_pretrain, config.pretrain_data_seed)
        n_con = min(config.n_contrastive, config.n_pretrain)
        base = pretrain(pre_x[:n_con], {t: v[:n_con] for t, v in pre_y.items()}, epochs=config.pretrain_epochs,
                        batch_size=config.pretrain_batch_size, lr=config.pretrain_lr, seed=config.model_seed,
                        caption_p=config.caption_p, warmup_epochs=config.warmup_epochs,
                        warmup_lr=config.warmup_lr, visual_lr_scale=config.visual_lr_scale,
                        warmup_images=pre_x, warmup_labels=pre_y, progress=tick(0, 1 + config.pretrain_epochs))
        _save(base, tmp / "base.safetensors")
        ft_dtype = getattr(torch, config.trajectory_dtype)
        experts, offset = {}, float(1 + config.pretrain_epochs)
        for task in config.tasks:
            spec = config.task_data(task)
            train_x, train_y = world.generate(spec["train"]["n"], spec["train"]["seed"], fixed=spec.get("domain"))
            final, traj, hp = finetune_expert(
                base, task, lr=config.ft_lr, epochs=config.ft_epochs, batch_size=config.ft_batch_size,
                data_fraction=config.ft_data_fraction, seed=config.ft_seed, images=train_x,
                labels=train_y, progress=tick(offset, config.ft_epochs))
            offset += config.ft_epochs
            _save(final, tmp / "experts" / f"{task}.safetensors")
            for e, state in enumerate(traj, 1):
                _save(state, tmp / "trajectories" / task / f"epoch_{e:03d}.safetensors", ft_dtype)
            experts[task] = {"path": f"experts/{task}.safetensors", "trajectory": f"trajectories/{task}",
                             "hparams": hp}
        pool = {
            "name": "demo",
            "architecture": {"config": CLIP_CONFIG},
            "tokenizer": "demo",
            "preprocess": {"image_size": CLIP_CONFIG["vision_cfg"]["image_size"], "mean": list(MEAN),
                           "std": list(STD)},
            "base": "base.safetensors",
            "experts": experts,
            "tasks": {t: {"classes": list(world.TASKS[t]), "templates": list(world.TEMPLATES[t]),
                          "data": {"demo": config.task_data(t)}} for t in config.tasks},
        }
        (tmp / "pool.yaml").write_text(yaml.safe_dump(pool, sort_keys=False, default_flow_style=None))
        files = {p.relative_to(tmp).as_posix(): _sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        manifest = {"files": files, "config": config.to_dict(),
                    "build_seconds": round(time.time() - started, 1)}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        bar.close()
        # mkdtemp/mkstemp create private (0700/0600) entries; a built pool is an ordinary folder
        for path in [tmp, *tmp.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        # swap into place: the old pool (if any) is moved aside first, then removed
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{int(time.time())}"
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return out
    except BaseException:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise


CLUTTER = {".DS_Store", "Thumbs.db", "desktop.ini"}  # a file browser's, not the person's


def _check_replaceable(out: Path) -> None:
    """A build replaces its folder: only a new or empty one, or a demo pool built before (every
    file in it listed by its manifest.json) may be replaced; anything else would be deleted. The
    folder is walked only until its first file that is not the demo's."""
    from merger.errors import MergerError
    from merger.io import inputs

    if not out.exists():
        return
    if not out.is_dir():
        raise MergerError(f"--out {out}: is a file; name a folder for the demo pool")
    manifest = out / "manifest.json"
    listed = None
    if manifest.is_file():
        try:
            listed = set(inputs.load_json(manifest, MergerError, "manifest")["files"])
        except (MergerError, KeyError, TypeError):
            listed = None
    for path in out.rglob("*"):
        rel = path.relative_to(out).as_posix()
        if path.is_dir() or path.name in CLUTTER or rel == "manifest.json" or (listed is not None and rel in listed):
            continue
        if listed is None:
            raise MergerError(f"--out {out}: holds files ({rel}, ...) and no demo manifest: building there would "
                              f"delete them. Name a new or empty folder")
        raise MergerError(f"--out {out}: holds a file the demo pool does not ({rel}): building there would delete "
                          f"it. Move it, or name another folder")


# ------------------------------------------------------------------------------ checking
def _merge(base: dict[str, torch.Tensor], experts: list[dict[str, torch.Tensor]], lam: float) -> dict:
    """Task arithmetic on the image tower: base + lam * sum_t (expert_t - base), floats only."""
    out = {}
    for k, v in base.items():
        if k.startswith("visual.") and v.is_floating_point():
            out[k] = v + lam * sum(e[k].float() - v for e in experts)
    return out


@torch.inference_mode()
@_on_threads(2)
def quick_report(pool_dir: str | Path, lams: tuple[float, ...] | None = None) -> dict:
    """Test-split accuracies: base and expert per task, task arithmetic average per lambda."""
    pool_dir = Path(pool_dir)
    pool = yaml.safe_load((pool_dir / "pool.yaml").read_text())
    tasks = list(pool["tasks"])
    test = {}
    for t in tasks:
        entry = pool["tasks"][t]["data"]["demo"]
        x, y = world.generate(entry["test"]["n"], entry["test"]["seed"], fixed=entry.get("domain"))
        test[t] = (x, y[t])
    model = create_model(pool["architecture"]["config"])
    base = load_file(str(pool_dir / pool["base"]))
    model.load_state_dict(base)
    heads = {t: task_head(model, t) for t in tasks}
    scale = model.logit_scale.detach().clone()

    def accs(only=None):
        return {t: accuracy(image_features(model, test[t][0]), heads[t], scale, test[t][1])
                for t in (only or tasks)}

    experts = {t: load_file(str(pool_dir / pool["experts"][t]["path"])) for t in tasks}
    base_acc = accs()
    expert_acc = {}
    for t in tasks:
        model.load_state_dict(experts[t], strict=False)
        expert_acc[t] = accs([t])[t]
    lams = lams or tuple(round(0.05 * i, 2) for i in range(1, 31))
    ta = {}
    for lam in lams:
        model.load_state_dict(_merge(base, list(experts.values()), lam), strict=False)
        ta[lam] = accs()
    avg = lambda d: sum(d.values()) / len(d)  # noqa: E731
    best = max(ta, key=lambda lam: avg(ta[lam]))
    return {
        "chance": {t: 100.0 / len(pool["tasks"][t]["classes"]) for t in tasks},
        "base": base_acc, "expert": expert_acc, "by_lam": ta, "best_lam": best, "ta_best": ta[best],
        "avg": {"chance": avg({t: 100.0 / len(pool["tasks"][t]["classes"]) for t in tasks}),
                "base": avg(base_acc), "expert": avg(expert_acc), "ta_best": avg(ta[best])},
    }


def format_report(r: dict) -> str:
    """A small text table of ``quick_report``'s numbers."""
    lines = [f"{'task':<11}{'chance':>8}{'base':>8}{'expert':>8}{'TA':>8}"]
    for t in r["base"]:
        lines.append(f"{t:<11}{r['chance'][t]:8.1f}{r['base'][t]:8.1f}{r['expert'][t]:8.1f}{r['ta_best'][t]:8.1f}")
    a = r["avg"]
    lines.append(f"{'average':<11}{a['chance']:8.1f}{a['base']:8.1f}{a['expert']:8.1f}{a['ta_best']:8.1f}"
                 f"   (best lam {r['best_lam']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Build the demo model pool.")
    ap.add_argument("out_dir", nargs="?", default=str(SHIPPED))
    ap.add_argument("--small", action="store_true", help="the reduced CI configuration")
    ap.add_argument("--report", action="store_true", help="print quick_report after building")
    args = ap.parse_args(argv)
    t0 = time.time()
    out = build(args.out_dir, DemoConfig.small() if args.small else DemoConfig())
    print(f"built {out} in {time.time() - t0:.0f} s")
    if args.report:
        print(format_report(quick_report(out)))


if __name__ == "__main__":
    main()
