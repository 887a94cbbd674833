"""Training of the demo zoo: contrastive pretraining (the base) and per-task expert fine-tuning.

Fine-tuning follows the task-vector literature (Ilharco et al.): only the image tower moves; the
task's zero-shot head, built once from the BASE text tower and the task's templates, stays
frozen and serves as the linear classifier; AdamW, cosine schedule with a short warm-up,
cross-entropy. A checkpoint of the image tower is kept after every epoch (the trajectory).
Everything is deterministic for a seed (one generator drives shuffling; no dropout).
"""
from __future__ import annotations

import copy
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from merger.data.heads import logits as head_logits
from merger.data.heads import zero_shot_head
from merger.data.splits import train_val_indices
from merger.demo import world
from merger.demo.model import CLIP_CONFIG, create_model, preprocess
from merger.demo.tokenizer import CONTEXT_LENGTH, DemoTokenizer
from merger.errors import Cancelled

Progress = Optional[Callable[[float, str], None]]
Cancel = Optional[Callable[[], bool]]


def _check(cancel: Cancel) -> None:
    if cancel is not None and cancel():
        raise Cancelled("training cancelled")


def _cosine(step: int, total: int, warmup: int) -> float:
    """Learning-rate factor: linear warm-up, then cosine decay to zero."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def visual_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The image tower's state dict with the ``visual.`` prefix (detached fp32 copies)."""
    return {k: v.detach().clone().float() if v.is_floating_point() else v.detach().clone()
            for k, v in model.state_dict().items() if k.startswith("visual.")}


# ------------------------------------------------------------------------------ pretraining
def warmup_visual(model: torch.nn.Module, images: torch.Tensor, labels: dict[str, torch.Tensor], *,
                  epochs: int, batch_size: int, lr: float, seed: int, weight_decay: float = 0.05,
                  progress: Progress = None, cancel: Cancel = None) -> torch.nn.ModuleDict:
    """Supervised warm-up of the image tower (its "pretrained backbone"), in place; returns the probes.

    One linear probe per attribute on the image embedding, summed cross-entropies, AdamW with
    a cosine schedule. The probes are thrown away afterwards: only the tower keeps what it
    learnt, so its features encode every attribute (as an ImageNet-pretrained tower does)
    before the contrastive stage aligns the text tower with them.
    """
    gen = torch.Generator().manual_seed(seed + 7)
    dim = model.visual.output_dim
    probes = torch.nn.ModuleDict({t: torch.nn.Linear(dim, len(c)) for t, c in world.TASKS.items() if t in labels})
    model.visual.train()
    params = list(model.visual.parameters()) + list(probes.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    n = len(images)
    steps_per_epoch = n // batch_size
    total = max(1, epochs * steps_per_epoch)
    step = 0
    for epoch in range(epochs):
        perm = torch.randperm(n, generator=gen)
        for b in range(steps_per_epoch):
            _check(cancel)
            idx = perm[b * batch_size:(b + 1) * batch_size]
            for g in opt.param_groups:
                g["lr"] = lr * _cosine(step, total, max(1, total // 20))
            f = model.visual(preprocess(images[idx]))
            loss = sum(F.cross_entropy(probes[t](f), labels[t][idx]) for t in probes)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if progress is not None:
                progress(step / total, f"warm-up epoch {epoch + 1}/{epochs} loss {loss.item():.3f}")
    return probes


def pretrain(images: torch.Tensor, labels: dict[str, torch.Tensor], *, epochs: int, batch_size: int,
             lr: float, seed: int, caption_p: float | dict | None = None, weight_decay: float = 0.1,
             config: dict = CLIP_CONFIG, progress: Progress = None, cancel: Cancel = None,
             warmup_epochs: int = 0, warmup_lr: float = 2e-3, visual_lr_scale: float = 1.0,
             warmup_images: torch.Tensor | None = None, warmup_labels: dict[str, torch.Tensor] | None = None
             ) -> dict[str, torch.Tensor]:
    """Pretraining of the whole tiny model: optional supervised warm-up, then contrastive (CLIP).

    With ``warmup_epochs`` > 0 the image tower first gets a supervised warm-up on every
    attribute (``warmup_visual``; on ``warmup_images``/``warmup_labels`` when given, else on
    ``images``), as LiT/ALIGN-style CLIPs start from a pretrained image backbone. The
    contrastive stage then trains both towers on image-caption pairs, the image tower at
    ``visual_lr_scale`` times ``lr``. Captions are redrawn every epoch and name only a random
    subset of attributes (probability ``caption_p``, a float or a per-task dict; default
    ``world.CAPTION_P``): the base learns a partial alignment, the headroom experts then fill.
    """
    torch.manual_seed(seed)
    model = create_model(config, seed=seed).train()
    n_warm = warmup_epochs * (len(warmup_images if warmup_images is not None else images) // batch_size)
    n_con = epochs * (len(images) // batch_size)
    share = n_warm / max(1, n_warm + n_con)

    outer = progress

    def sub(lo: float, span: float) -> Progress:
        if outer is None:
            return None
        return lambda frac, msg: outer(lo + span * frac, msg)

    if warmup_epochs > 0:
        warmup_visual(model, warmup_images if warmup_images is not None else images,
                      warmup_labels if warmup_labels is not None else labels, epochs=warmup_epochs,
                      batch_size=batch_size, lr=warmup_lr, seed=seed, progress=sub(0.0, share), cancel=cancel)
    progress = sub(share, 1.0 - share)
    tok = DemoTokenizer(config["text_cfg"]["context_length"])
    visual = [p for name, p in model.named_parameters() if name.startswith("visual.")]
    rest = [p for name, p in model.named_parameters() if not name.startswith("visual.")]
    groups = [{"params": rest, "scale": 1.0}, {"params": visual, "scale": visual_lr_scale}]
    opt = torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(seed)
    n = len(images)
    steps_per_epoch = n // batch_size  # drop the last partial batch (contrastive batch size matters)
    total = max(1, epochs * steps_per_epoch)
    step = 0
    for epoch in range(epochs):
        caps = world.captions(labels, seed=seed * 1000 + epoch, p=caption_p)
        tokens = tok(caps)
        perm = torch.randperm(n, generator=gen)
        for b in range(steps_per_epoch):
            _check(cancel)
            idx = perm[b * batch_size:(b + 1) * batch_size]
            for g in opt.param_groups:
                g["lr"] = lr * g["scale"] * _cosine(step, total, max(1, total // 20))
            img = F.normalize(model.encode_image(preprocess(images[idx])), dim=-1)
            txt = F.normalize(model.encode_text(tokens[idx]), dim=-1)
            scale = model.logit_scale.exp()
            lg = scale * img @ txt.T
            target = torch.arange(len(idx))
            loss = 0.5 * (F.cross_entropy(lg, target) + F.cross_entropy(lg.T, target))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            with torch.no_grad():  # as in CLIP: keep the temperature in a sane range
                model.logit_scale.clamp_(0, math.log(100))
            step += 1
            if progress is not None:
                progress(step / total, f"pretrain epoch {epoch + 1}/{epochs} loss {loss.item():.3f}")
    model.eval()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------ fine-tuning
def task_head(model: torch.nn.Module, task: str) -> torch.Tensor:
    """The frozen zero-shot head of one demo task (base text tower + the task's templates)."""
    tok = DemoTokenizer(getattr(model, "context_length", CONTEXT_LENGTH))
    return zero_shot_head(model, tok, world.TASKS[task], world.TEMPLATES[task])


def finetune_expert(base_state_dict: dict[str, torch.Tensor], task: str, *, lr: float, epochs: int,
                    batch_size: int, data_fraction: float, seed: int, images: torch.Tensor,
                    labels: dict[str, torch.Tensor] | torch.Tensor, progress: Progress = None,
                    cancel: Cancel = None, weight_decay: float = 0.1, config: dict = CLIP_CONFIG,
                    optimizer: str = "adamw", momentum: float = 0.9, schedule: str = "cosine"
                    ) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]], dict]:
    """Fine-tune the image tower on one task with its zero-shot head frozen.

    ``images``/``labels`` are the whole train split; the validation indices of
    ``merger.splits.train_val_indices`` are removed first, then a ``data_fraction`` of the rest
    is drawn with ``seed``. ``batch_size`` 0 is the whole (drawn) train split: full-batch
    training. ``schedule``: "cosine" (short linear warm-up, then cosine decay) or "constant".
    SGD with momentum 0, weight decay 0, a constant schedule, one epoch and a full batch is one
    step of gradient descent: τ(1) = −lr ∇L(θ0). Returns (final visual state, per-epoch visual
    states, hparams).
    """
    if schedule not in ("cosine", "constant"):
        raise ValueError(f"unknown schedule {schedule!r} (cosine or constant)")
    if task not in world.TASKS:
        raise KeyError(f"unknown demo task {task!r}")
    y_all = labels[task] if isinstance(labels, dict) else labels
    torch.manual_seed(seed)
    model = create_model(config, seed=0)
    model.load_state_dict(base_state_dict)
    model.eval()
    head = task_head(model, task)  # frozen: built once from the base text tower
    scale = model.logit_scale.detach().clone()
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("visual."))
    model.visual.train()

    gen = torch.Generator().manual_seed(seed)
    train_idx, _ = train_val_indices(len(images))
    if data_fraction < 1.0:
        # the fraction asked, even under one batch (it was topped up to a batch: a scaling view over
        # small fractions then trained on the same images at each)
        keep = max(1, int(round(data_fraction * len(train_idx))))
        train_idx = train_idx[torch.randperm(len(train_idx), generator=gen)[:keep]].sort().values
    full_batch = batch_size <= 0
    batch_size = len(train_idx) if full_batch else batch_size
    x_all = preprocess(images[train_idx])
    y_all = y_all[train_idx]

    params = [p for p in model.visual.parameters() if p.requires_grad]
    if optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    elif optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    else:
        raise ValueError(f"unknown optimizer {optimizer!r} (adamw or sgd)")
    steps_per_epoch = math.ceil(len(train_idx) / batch_size)
    total = epochs * steps_per_epoch
    trajectory: list[dict[str, torch.Tensor]] = []
    step = 0
    for epoch in range(epochs):
        perm = torch.randperm(len(train_idx), generator=gen)
        for b in range(steps_per_epoch):
            _check(cancel)
            idx = perm[b * batch_size:(b + 1) * batch_size]
            factor = _cosine(step, total, max(1, total // 20)) if schedule == "cosine" else 1.0
            for g in opt.param_groups:
                g["lr"] = lr * factor
            loss = F.cross_entropy(head_logits(model.encode_image(x_all[idx]), head, scale), y_all[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if progress is not None:
                progress(step / total, f"{task} epoch {epoch + 1}/{epochs} loss {loss.item():.3f}")
        trajectory.append(visual_state(model))
    hparams = {"lr": lr, "epochs": epochs, "batch_size": 0 if full_batch else batch_size,
               "data_fraction": data_fraction, "seed": seed, "weight_decay": weight_decay, "optimizer": optimizer,
               "schedule": schedule, "images": len(train_idx)}
    if optimizer == "sgd":
        hparams["momentum"] = momentum
    return copy.deepcopy(trajectory[-1]), trajectory, hparams


# ------------------------------------------------------------------------------ evaluation
@torch.inference_mode()
def image_features(model: torch.nn.Module, images: torch.Tensor, batch: int = 500) -> torch.Tensor:
    """Image embeddings of uint8 images, in batches (eval mode)."""
    model.eval()
    return torch.cat([model.encode_image(preprocess(images[i:i + batch])) for i in range(0, len(images), batch)])


def accuracy(feats: torch.Tensor, head: torch.Tensor, logit_scale: torch.Tensor, y: torch.Tensor) -> float:
    """Top-1 accuracy (%) of precomputed image features under a zero-shot head."""
    return 100.0 * (head_logits(feats, head, logit_scale).argmax(-1) == y).float().mean().item()
