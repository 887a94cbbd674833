"""Two routes for the image tower, written for a GPU, each the same sums as the reference. Neither is the
default: on an H200 patches made a ViT-B/32 move 1.14–1.17× faster and graphs at most 1.07× more, short
of the 1.5× a drop-in must give to be kept (docs/accel.md), and graphs adds a compile of 47–85 s at
open. They stay as routes to choose (``Evaluator.use_tower``) and to measure (``python -m devtools
bench scale --tower``):

- ``patches``: a ViT's patch embedding, a convolution whose stride is its kernel, as one matmul over the
  image's patches. cuDNN's kernel for that convolution took 6.3 ms of a ViT-B/32 move's 34 ms of GPU
  time on an H200 (bf16 autocast; `devtools/gpu_profile.py`), for 0.24 TFLOP.
- ``graphs``: the same, torch.compile'd (inductor fuses the layer norms, casts, residual adds and GELUs
  that eager autocast makes separate passes over the fp32 residual stream) and replayed as CUDA graphs.
  The graph reads the parameters where they live, so the weights a move writes in place are the ones
  the next replay reads.

The reference is ``merger.evaluation.evaluator.encode_images`` (``model.encode_image`` as written).
What a route builds is the evaluator's own (``Evaluator.use_tower``). Under ``reference_only("tower")``
and where compiling is off or failed, the reference runs; in another autocast state or on a batch of
one, the model's own forward (with the patch matmul in place)."""
from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from merger.accel.compiled import compiling, why_not_compiled_here
from merger.accel.registry import drop_in, references_asked

# eager: the reference alone; patches: the patch embedding as a matmul; graphs: that, compiled and replayed
ROUTES = ("eager", "patches", "graphs")


class PatchEmbedding(torch.nn.Module):
    """A convolution whose stride is its kernel (no bias, no padding) as one matmul over the patches, in
    the convolution's place. Its weight is the convolution's own parameter (state-dict key and storage
    unchanged, so ``torch.func.functional_call`` reaches it); ``reference_only("tower")`` runs the
    convolution on it."""

    def __init__(self, conv: torch.nn.Conv2d):
        super().__init__()
        self.conv = (conv,)  # the module replaced (a tuple: not a submodule, so no second state-dict key)
        self.weight = conv.weight
        self.patch = conv.kernel_size[0]

    @staticmethod
    def fits(conv) -> bool:
        return (isinstance(conv, torch.nn.Conv2d) and conv.bias is None and conv.groups == 1
                and conv.kernel_size[0] == conv.kernel_size[1] == conv.stride[0] == conv.stride[1]
                and conv.padding in ((0, 0), "valid") and conv.dilation == (1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling() and references_asked("tower"):  # (a constant to the compiler)
            return F.conv2d(x, self.weight, None, self.patch)  # the convolution, on this module's parameter
        b, c, h, w = x.shape
        p, gh, gw = self.patch, x.shape[2] // self.patch, x.shape[3] // self.patch
        x = x[:, :, : gh * p, : gw * p]  # what a strided convolution reads
        patches = x.reshape(b, c, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5).reshape(b, gh * gw, c * p * p)
        out = F.linear(patches, self.weight.reshape(self.weight.shape[0], -1))
        return out.transpose(1, 2).reshape(b, -1, gh, gw)  # the convolution's layout, as a view


def embed_patches_by_matmul(model: torch.nn.Module, on: bool) -> bool:
    """Put a ``PatchEmbedding`` in place of the image tower's patch convolution (``on``), or the
    convolution back; whether the tower (``model.visual``, or ``model`` itself) has one."""
    visual = getattr(model, "visual", model)
    conv = getattr(visual, "conv1", None)
    if isinstance(conv, PatchEmbedding):
        if not on:
            visual.conv1 = conv.conv[0]
        return True
    if not PatchEmbedding.fits(conv):
        return False
    if on:
        visual.conv1 = PatchEmbedding(conv)
    return True


class RoutedTower:
    """``model.encode_image`` as a route runs it: for graphs compiled with a dynamic batch size, for the
    autocast state it was warmed under."""

    def __init__(self, model: torch.nn.Module, route: str, **options):
        if route not in ROUTES[1:]:
            raise ValueError(f"tower route {route!r}: expected one of {', '.join(ROUTES[1:])}")
        self.route = route
        self.device: torch.device | None = None  # where it was warmed, and the autocast state there:
        self.autocast: bool | None = None  # the only ones it runs under (any other would compile again)
        embed_patches_by_matmul(model, True)
        if route == "patches":
            self._fn = model.encode_image
        else:
            mode = None if "backend" in options else "reduce-overhead"  # (a test's backend takes no mode)
            self._fn = torch.compile(model.encode_image, dynamic=True, mode=mode, **options)

    def warm(self, x: torch.Tensor) -> float:
        """Compile (and, for graphs, record) on a real batch: three calls, as CUDA graph trees warm up
        once, record once, then replay. Seconds taken."""
        t = time.perf_counter()
        for _ in range(3 if self.route == "graphs" else 1):
            self(x)
        self.device, self.autocast = x.device, torch.is_autocast_enabled(x.device.type)
        return time.perf_counter() - t

    def fits(self, x: torch.Tensor) -> bool:
        return (x.device == self.device and x.shape[0] >= 2
                and torch.is_autocast_enabled(x.device.type) == self.autocast)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.route == "patches":
            return self._fn(x)
        torch.compiler.cudagraph_mark_step_begin()  # each call a new step: the last replay's output is ours
        return self._fn(x).clone()  # a replay overwrites its output buffer


def routed_tower(model: torch.nn.Module, route: str, x: torch.Tensor, **options) -> tuple[RoutedTower | None, str]:
    """The tower built (for graphs, compiled) and warmed on ``x`` for ``route``, with what happened in one
    line; None where that failed (the reference then runs)."""
    unsafe = why_not_compiled_here() if route == "graphs" and "backend" not in options else None
    if route == "graphs" and (unsafe or not compiling()):
        return None, f"image tower not compiled ({unsafe or 'compiling is off here'}): forwarding eagerly"
    try:
        tower = RoutedTower(model, route, **options)
        seconds = tower.warm(x)
    except Exception as exc:  # noqa: BLE001  (no Triton, an unsupported op: the eager tower is the reference)
        embed_patches_by_matmul(model, False)
        logging.getLogger(__name__).warning("the image tower could not be compiled (%s); forwarding eagerly",
                                            str(exc)[:200])
        return None, f"image tower not compiled ({type(exc).__name__}): forwarding eagerly"
    return tower, f"image tower {'compiled (graphs)' if route == 'graphs' else 'route ' + route} in {seconds:.1f} s"


@drop_in("merger.evaluation.evaluator.encode_images",
         "patch embedding as a matmul; the tower compiled and replayed as CUDA graphs (chosen by hand; else the reference)")
def routed_encode(reference, model, x: torch.Tensor, routed: RoutedTower | None = None) -> torch.Tensor:
    if routed is None or not routed.fits(x):
        return reference(model, x, routed)
    return routed(x)
