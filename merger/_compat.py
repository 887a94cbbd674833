"""Compatibility shim: import open_clip next to a CPU-only torch.

The only torchvision on the package registry is a CUDA build. Next to the CPU build of torch
its compiled ops (``torchvision/_C*.so``) fail to load, and ``import torchvision`` then crashes
while registering fake kernels for ``torchvision::nms`` / ``torchvision::qnms``, operators that
were never defined. open_clip imports torchvision, so it would crash too.

``ensure_torchvision()`` tries the compiled ops first; only when they are absent does it define
the two missing operator *schemas* (no kernels). Calling nms then raises a clear "no kernel"
error; merger never calls it (open_clip only needs torchvision's transforms).
"""
from __future__ import annotations

import glob
import importlib.util
import os

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
