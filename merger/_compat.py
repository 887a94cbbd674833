"""Compatibility shim: import open_clip next to a CPU-only torch.

The only torchvision on the package registry is a CUDA build. Next to the CPU build of torch
its compiled ops (``torchvision/_C*.so``) fail to load, and ``import torchvision`` then crashes
while registering fake kernels for ``torchvision::nms`` / ``torchvision::qnms``, operators that
were never defined. open_clip imports torchvision, so it would crash too.

``ensure_torchvision()`` tries the compiled ops first; only when they are absent does it define
the two missing operator *schemas* (no kernels). Calling nms then raises a clear "no kernel"
error; merger never calls it (open_clip only needs torchvision's transforms).

``no_random_init`` builds an open_clip model without running torch.nn.init (for a model whose
every weight the base overwrites right after).
"""
from __future__ import annotations

import glob
import importlib.util
import logging
import os
import threading
from contextlib import contextmanager

import torch

_fallback_lib = None  # keeps the schema-only library alive for the life of the process


def _has_op(name: str) -> bool:
    try:
        getattr(torch.ops.torchvision, name)
        return True
    except (AttributeError, RuntimeError):
        return False


def ensure_torchvision() -> bool:
    """Make ``import torchvision`` safe. Returns True when the schema fallback was installed."""
    global _fallback_lib
    if _fallback_lib is not None or _has_op("nms"):
        return _fallback_lib is not None
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    for lib in glob.glob(os.path.join(spec.submodule_search_locations[0], "_C*.so")):
        try:
            torch.ops.load_library(lib)
        except (OSError, RuntimeError):
            pass
    if _has_op("nms"):
        return False
    _fallback_lib = torch.library.Library("torchvision", "DEF")
    _fallback_lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _fallback_lib.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")
    return True


def open_clip():
    """Import open_clip (after the shim) and return the module."""
    ensure_torchvision()
    import open_clip as _open_clip

    return _open_clip


_INIT_LOCK = threading.Lock()


@contextmanager
def no_random_init(skip: bool):
    """While a model is built only to receive the base's weights (a strict load right after),
    torch.nn.init's initialisers do nothing: the random init of ViT-B/32 alone takes 0.8 s of a
    second open. Non-persistent buffers (the text tower's causal mask) are not built by them, so
    they stay right. Process-wide while it lasts, hence the lock (models are built one at a time)."""
    if not skip:
        yield
        return
    names = [n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_")]
    with _INIT_LOCK:
        saved = {n: getattr(torch.nn.init, n) for n in names}
        try:
            for n in names:
                setattr(torch.nn.init, n, _keep)
            yield
        finally:
            for n, f in saved.items():
                setattr(torch.nn.init, n, f)


def _keep(tensor, *args, **kwargs):
    return tensor


def unknown_model(name: str) -> str | None:
    """Why open_clip has no model of this name (with the nearest names), or None. Its own message
    lists every model it knows: 3000 characters on one line. A schema:name (local-dir:, hf-hub:)
    is left to open_clip."""
    import difflib

    known = open_clip().list_models()
    if name in known or ":" in name:
        return None
    near = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    return ("not an open_clip model" + (f"; did you mean {', '.join(near)}?" if near else "")
            + ' (`python -c "import open_clip; print(open_clip.list_models())"` lists them)')


class _NoPretrainedNotice(logging.Filter):
    """open_clip's warning that no pretrained weights were loaded: we never ask it for any (the
    pool's base is loaded next), so the warning only misleads."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("No pretrained weights loaded")


def create_model(name: str, device="cpu"):
    """open_clip's model of that name (its weights are the caller's: random, or the base's loaded
    next); an unknown name raises RuntimeError with ``unknown_model``'s reason."""
    why = unknown_model(name)
    if why:
        raise RuntimeError(why)
    root = logging.getLogger()
    if not any(isinstance(f, _NoPretrainedNotice) for f in root.filters):
        root.addFilter(_NoPretrainedNotice())
    return open_clip().create_model(name, pretrained=None, device=device)
