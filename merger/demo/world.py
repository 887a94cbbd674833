"""The demo world: procedurally drawn 32x32 scenes with many independent attributes.

Every image shows one main object (shape, colour, size, quadrant) on a coloured, textured
background, plus one to four small dots, all black or all white. Each attribute is one classification
task. Pretraining sees the whole world; each task's dataset comes from its own domain (``DOMAINS``:
some other attributes held fixed), and the experts fine-tuned on different tasks pull one image
tower towards different features (local form, hue, extent, location, high frequency texture,
background hue): that is what makes merging them non-trivial.

Everything is vectorised over the batch with numpy and driven by one ``numpy.random.Generator``
seeded from ``seed``, so ``generate(n, seed)`` is bit-identical across calls and machines.
"""
from __future__ import annotations

import numpy as np
import torch

SIZE = 32  # image side in pixels

# Task name -> class names, in label order. Class names are plain words used in prompts.
TASKS: dict[str, tuple[str, ...]] = {
    "shape": ("circle", "square", "triangle", "cross"),
    "colour": ("red", "green", "blue", "yellow", "purple", "orange"),
    "size": ("small", "medium", "large"),
    "position": ("top left", "top right", "bottom left", "bottom right"),
    "texture": ("plain", "striped", "checkered", "speckled"),
    "background": ("pink", "brown", "grey", "teal"),
    "dots": ("black", "white"),
}

# Per task prompt templates ("{}" is the class name). Worded like the pretraining captions,
# so the base model has *some* zero-shot ability, but each only names one attribute.
TEMPLATES: dict[str, tuple[str, ...]] = {
    "shape": ("a {}.", "a picture of a {}.", "a {} shape.", "a picture with a {} on a background."),
    "colour": ("a {} object.", "a picture of a {} shape.", "something {}.", "the object is {}."),
    "size": ("a {} object.", "a picture of a {} shape.", "the object is {}.", "a {} thing."),
    "position": ("an object in the {}.", "a picture with a shape in the {}.", "the object is in the {}.",
                 "something at the {}."),
    "texture": ("a {} background.", "a picture on a {} background.", "the background is {}.",
                "a shape on a {} background."),
    "background": ("a {} background.", "a picture on a {} background.", "the background is {}.",
                   "a shape on a {} background."),
    "dots": ("{} dots.", "a picture with {} dots.", "the dots are {}.", "an object with {} dots."),
}

# Each task's dataset is collected in its own setting (a *domain*): four of the other
# attributes are held at one class there, as real benchmark datasets each come from their own
# source (digits, satellite tiles, cars). Images stay of one kind, and every attribute is still
# drawn, but the experts now see different inputs: their task vectors change the tower where
# their own data lives, which is what lets task arithmetic add them (weight disentanglement,
# Ortiz-Jimenez et al. 2023). With all tasks on the same images, every expert re-aligned the
# same embeddings and the best task arithmetic stayed within +3 points of the base.
DOMAINS: dict[str, dict[str, int]] = {
    "shape": {"background": 0, "texture": 0, "colour": 0, "size": 2},
    "colour": {"background": 1, "texture": 1, "shape": 1, "size": 1},
    "size": {"background": 2, "texture": 2, "colour": 2, "position": 0},
    "position": {"background": 3, "texture": 3, "shape": 3, "size": 0},
    "texture": {"background": 1, "shape": 0, "colour": 3, "position": 1},
    "background": {"texture": 2, "shape": 1, "colour": 4, "position": 2},
    "dots": {"background": 2, "shape": 2, "colour": 5, "position": 3},
}

# RGB palettes (0..255). Background hues are deliberately muted and distinct from object hues.
_OBJ_RGB = np.array([[220, 40, 40], [40, 180, 60], [50, 80, 230],
                     [230, 210, 40], [150, 60, 200], [240, 140, 30]], dtype=np.float32)
_BG_RGB = np.array([[225, 150, 170], [125, 85, 50], [128, 128, 128], [40, 130, 130]], dtype=np.float32)
_RADIUS = np.array([3.5, 5.0, 6.5], dtype=np.float32)  # small / medium / large half extent
_QUAD_CENTRE = np.array([[8, 8], [24, 8], [8, 24], [24, 24]], dtype=np.float32)  # (x, y)


def _eval_case(k: int, dx: np.ndarray, dy: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Normalised distance per pixel for shape k: <= 1 inside the shape of half extent r."""
    ax, ay, up = np.abs(dx), np.abs(dy), -dy
    if k == 0:
        return np.sqrt(dx * dx + dy * dy) / r
    if k == 1:
        return np.maximum(ax, ay) / (0.85 * r)
    if k == 2:
        return np.maximum(-(up - 0.15 * r) / (0.6 * r), (up + 1.73 * ax) / (1.15 * r))
    return np.minimum(np.maximum(ax / (0.38 * r), ay / r), np.maximum(ax / r, ay / (0.38 * r)))


def _coverage(shape: np.ndarray, dx: np.ndarray, dy: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Anti-aliased coverage in [0, 1] (about one pixel of soft edge); shape, r: [n] per image."""
    d = np.empty_like(dx)
    for k in range(len(TASKS["shape"])):
        idx = np.flatnonzero(shape == k)  # whole images at a time: cheap first-axis indexing
        if idx.size:
            d[idx] = _eval_case(k, dx[idx], dy[idx], r[idx, None, None])
    return np.clip(0.5 + (1.0 - d) * r[:, None, None], 0.0, 1.0)


def generate(n: int, seed: int, fixed: dict[str, int] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Draw ``n`` scenes: uint8 images [n, 3, 32, 32] and int64 labels per task [n].

    ``fixed`` holds some attributes at one class (attribute -> class index): a task's *domain*,
    the setting its dataset was collected in. The random stream is the same with or without it.
    """
    rng = np.random.default_rng(seed)
    labels = {t: rng.integers(0, len(c), size=n) for t, c in TASKS.items()}
    for attr, value in (fixed or {}).items():
        if attr not in TASKS or not 0 <= int(value) < len(TASKS[attr]):
            raise ValueError(f"fixed: {attr}={value!r} is not a class of the demo world")
        labels[attr] = np.full(n, int(value), dtype=labels[attr].dtype)
    n_dots = rng.integers(1, 5, size=n)  # a nuisance, not a task (a 3-layer tower cannot count)
    f32 = np.float32
    yy, xx = np.meshgrid(np.arange(SIZE, dtype=f32) + 0.5, np.arange(SIZE, dtype=f32) + 0.5, indexing="ij")

    # --- background: hue (task) with jitter, then a texture (task) of random phase/orientation
    bg = _BG_RGB[labels["background"]] + rng.uniform(-18, 18, size=(n, 3)).astype(f32)
    tex = np.zeros((n, SIZE, SIZE), dtype=f32)
    t = labels["texture"]
    amp = rng.uniform(28, 45, size=n).astype(f32)[:, None, None]
    period = rng.uniform(4.0, 6.5, size=n).astype(f32)[:, None, None]
    phase = rng.uniform(0, 2 * np.pi, size=n).astype(f32)[:, None, None]
    ang = rng.choice(np.array([0, np.pi / 2, np.pi / 4, -np.pi / 4], dtype=f32), size=n)[:, None, None]
    proj = xx * np.cos(ang) + yy * np.sin(ang)
    stripes = np.sign(np.sin(2 * np.pi * proj / period + phase))
    cell = rng.integers(3, 6, size=n).astype(f32)[:, None, None]
    off = rng.integers(0, 6, size=(n, 2)).astype(f32)
    checks = ((((xx[None] + off[:, 0, None, None]) // cell) + ((yy[None] + off[:, 1, None, None]) // cell)) % 2) * 2 - 1
    speckle = rng.random((n, SIZE, SIZE), dtype=f32) * 2 - 1
    tex = np.where((t == 1)[:, None, None], stripes, tex)
    tex = np.where((t == 2)[:, None, None], checks, tex)
    tex = np.where((t == 3)[:, None, None], speckle * 1.3, tex)
    img = bg[:, :, None, None] + (amp * tex)[:, None]

    # --- main object: shape, colour, size, quadrant; small rotation / jitter as nuisances
    r = (_RADIUS[labels["size"]] + rng.uniform(-0.3, 0.3, size=n).astype(f32))[:, None, None]
    centre = _QUAD_CENTRE[labels["position"]] + rng.uniform(-1.5, 1.5, size=(n, 2)).astype(f32)
    rot = rng.uniform(-0.25, 0.25, size=n).astype(f32)[:, None, None]  # radians: small, so a square stays a square
    px, py = xx[None] - centre[:, 0, None, None], yy[None] - centre[:, 1, None, None]
    dx = px * np.cos(rot) + py * np.sin(rot)
    dy = -px * np.sin(rot) + py * np.cos(rot)
    alpha = _coverage(labels["shape"], dx, dy, r[:, 0, 0])
    obj = _OBJ_RGB[labels["colour"]] + rng.uniform(-22, 22, size=(n, 3)).astype(f32)
    img = img * (1 - alpha[:, None]) + obj[:, :, None, None] * alpha[:, None]

    # --- dots: 1..4 two-pixel squares, each in a distinct 8x8 cell of a 4x4 grid
    k = n_dots
    cells = np.argsort(rng.random((n, 16)), axis=1)[:, :4]  # 4 distinct cells per image
    jit = rng.integers(1, 6, size=(n, 4, 2))
    dot_x = (cells % 4) * 8 + jit[..., 0]
    dot_y = (cells // 4) * 8 + jit[..., 1]
    dot_val = np.where(labels["dots"] == 0, 15.0, 240.0).astype(f32)  # black or white dots
    dmask = np.zeros((n, SIZE, SIZE), dtype=bool)
    rows = np.arange(n)
    for j in range(4):
        on = k > j
        for ox in (0, 1):
            for oy in (0, 1):
                dmask[rows[on], dot_y[on, j] + oy, dot_x[on, j] + ox] = True
    img = np.where(dmask[:, None], dot_val[:, None, None, None], img)

    # --- sensor noise, then quantise
    img += 6.0 * rng.standard_normal(img.shape, dtype=f32)
    images = torch.from_numpy(np.clip(np.rint(img), 0, 255).astype(np.uint8))
    return images, {t: torch.from_numpy(v.astype(np.int64)) for t, v in labels.items()}


# ---------------------------------------------------------------- captions (pretraining text)
# Each caption mentions only SOME attributes (each kept with probability p), so the contrastive
# base learns a partial, noisy alignment: zero-shot works, but clearly below fine-tuned experts.
# How often each attribute is named. Salient attributes (hues, texture) are named rarely: if
# every caption named them, they alone would tell images apart within a batch and contrastive
# pretraining would never learn the small, spatial ones (position, dots, shape).
CAPTION_P: dict[str, float] = {"shape": 0.5, "colour": 0.5, "size": 0.5, "position": 0.5,
                               "texture": 0.5, "background": 0.5, "dots": 0.5}
CAPTION_WORDS = ("a", "an", "the", "picture", "of", "object", "shape", "with", "and", "dots", "in",
                 "at", "on", "background", "thing", "something", "there", "are", "is")


def captions(labels: dict[str, torch.Tensor], seed: int, p: float | dict[str, float] | None = None) -> list[str]:
    """One caption per image naming a random subset of its attributes (at least one).

    Noun phrase: "[size] [colour] <shape|object>"; then optional "in the <position>",
    "on a [background] [texture] background", "with [count] [dots] dots".
    """
    p = CAPTION_P if p is None else p
    probs = p if isinstance(p, dict) else {t: p for t in TASKS}
    rng = np.random.default_rng(seed)
    names = {t: [TASKS[t][i] for i in labels[t].tolist()] for t in TASKS}
    n = len(names["shape"])
    keep = {t: rng.random(n) < probs.get(t, 0.5) for t in TASKS}
    # guarantee at least one attribute per caption, drawn in proportion to the probabilities (an
    # attribute with probability 0 is never named: its class words stay unseen in pretraining)
    w = np.array([max(0.0, float(probs.get(t, 0.5))) for t in TASKS]) + 1e-12
    forced = rng.choice(len(TASKS), size=n, p=w / w.sum())
    for j, t in enumerate(TASKS):
        keep[t] |= forced == j
    out = []
    for i in range(n):
        words = ["a"]
        for t in ("size", "colour"):
            if keep[t][i]:
                words.append(names[t][i])
        words.append(names["shape"][i] if keep["shape"][i] else "object")
        tail = []
        if keep["position"][i]:
            tail.append(("in the " if rng.random() < 0.5 else "at the ") + names["position"][i])
        if keep["background"][i] or keep["texture"][i]:
            bgw = [names["background"][i]] if keep["background"][i] else []
            bgw += [names["texture"][i]] if keep["texture"][i] else []
            tail.append("on a " + " ".join(bgw) + " background")
        if keep["dots"][i]:
            tail.append("with " + names["dots"][i] + " dots")
        rng.shuffle(tail)
        out.append(" ".join(words + tail) + ".")
    return out


def vocabulary_words() -> list[str]:
    """Every word captions and templates can produce (sorted, for a deterministic tokenizer)."""
    words = set(CAPTION_WORDS)
    for t, classes in TASKS.items():
        for c in classes:
            words.update(c.split())
        for tpl in TEMPLATES[t]:
            words.update(w for w in tpl.replace("{}", " ").replace(".", " ").split())
    return sorted(words)
