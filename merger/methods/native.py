"""The bf16 Gram of the stored task vectors at the CPU's bf16 rate: a small C kernel (native/gram_bf16.c),
compiled on first use where the CPU has AVX512-BF16 and a C compiler is at hand.

Why: the Grams of each τt are a third of TSV-M's CPU preparation (8.3 of 32 s of core time on ViT-B/32 × 8)
and a fifth of Iso-CTS'. The task vectors are stored in bf16, whose products are exact in fp32, so a bf16
dot product with fp32 accumulation (vdpbf16ps) gives the fp32 Gram of the same values at twice the fp32
rate. torch's CPU build reaches no such product (``mm``'s ``out_dtype`` is CUDA-only, oneDNN's bf16 matmul
rounds its output to bf16, MKL's ``cblas_gemm_bf16bf16f32`` takes its AVX2 path on AMD), nor does SciPy's
OpenBLAS export ``sbgemm``. On this 2-core Zen 4, one thread, 768 × 3072: 10.2 ms against 21.5 for the fp32
conversion and OpenBLAS's ?syrk, and within 3.8e-7 of the exact Gram (largest entry) against ?syrk's 1.1e-6.

Built once per machine into ``$MERGER_CACHE_DIR/kernels`` (``cc``, or ``$CC``; under a second), checked
against torch's fp64 product on a small matrix before its first use, and called through ctypes (which lets
go of the GIL, so the LAPACK workers run it side by side). No compiler, another CPU, a failed build or check,
or ``MERGER_NO_COMPILE=1``: ``ready()`` is False and ``linalg.gram_rows`` keeps its fp32 route. Products
under about 1e-38 flush to zero (the instruction's rule; task vectors' products are near 1e-6)."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("native") / "gram_bf16.c"
NATIVE_SOURCES = (SOURCE,)  # in the disk cache's code hash of every preparation that imports this module
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-shared", "-fPIC")
_STATE: dict = {}
_LOADING = threading.Lock()
_log = logging.getLogger(__name__)


def ready() -> bool:
    """Whether ``gram_bf16`` computes (the kernel built, loaded and checked); builds it at the first call."""
    if "lib" not in _STATE:
        with _LOADING:
            if "lib" not in _STATE:
                _STATE["lib"] = _load()
    return _STATE["lib"] is not None


def gram_bf16(a: torch.Tensor, lower: bool = False) -> torch.Tensor:
    """a · aᵀ in fp32 of one bf16 CPU matrix [m, n], single-threaded (``lower``: its lower triangle alone,
    zeros above, what an eigh reads). Row- or column-major views are read as they are. Needs ``ready()``."""
    return _gram(_STATE["lib"], a, lower)


def _gram(lib, a: torch.Tensor, lower: bool) -> torch.Tensor:
    m, n = a.shape
    out = torch.zeros(m, m, dtype=torch.float32)  # an empty a: the kernel leaves it so
    if not (a.stride(1) == 1 or a.stride(0) == 1):
        a = a.contiguous()
    code = lib.gram_bf16(a.data_ptr(), m, n, a.stride(0), a.stride(1), out.data_ptr(), m)
    if code == 1:
        raise MemoryError(f"gram_bf16: no memory for the packed copy of a [{m}, {n}] matrix")
    if code:
        raise ValueError(f"gram_bf16: strides {a.stride()} of a [{m}, {n}] matrix: neither rows nor columns contiguous")
    return out if lower else out.add_(out.tril(-1).mT)


def _load():
    """The library, built, loaded and checked, or None; published by ``ready`` only once checked (a second
    thread never calls a library still under its check)."""
    if os.environ.get("MERGER_NO_COMPILE") or not _cpu_has_bf16_dot():
        return None
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
    if not compiler[0]:
        return None
    try:
        lib = _opened(compiler)
        ok = _checks(lib)
    except (OSError, subprocess.SubprocessError, RuntimeError, ValueError) as exc:
        _log.warning("bf16 Gram kernel unavailable (%s); Grams in fp32", str(exc)[:300])
        return None
    if not ok:
        _log.warning("bf16 Gram kernel disagrees with torch's fp64 product; Grams in fp32")
        return None
    return lib


def _opened(compiler: list[str]):
    """The built library loaded; one in the cache that does not load is built again, once."""
    target = _built(compiler)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError:
        target.unlink(missing_ok=True)
        lib = ctypes.CDLL(str(_built(compiler)))
    lib.gram_bf16.restype = ctypes.c_int
    lib.gram_bf16.argtypes = [ctypes.c_void_p] + [ctypes.c_long] * 4 + [ctypes.c_void_p, ctypes.c_long]
    return lib


def _built(compiler: list[str]) -> Path:
    """The shared library of this source and these flags, compiled once into the cache folder (written to a
    temporary name and renamed: two processes building at once each leave a whole file)."""
    from merger.io.disk_cache import cache_dir

    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(compiler + list(FLAGS)).encode()).hexdigest()[:16]
    folder = cache_dir() / "kernels"
    target = folder / f"gram_bf16-{digest}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run([*compiler, *FLAGS, "-o", tmp, str(SOURCE)], check=True, capture_output=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _checks(lib) -> bool:
    """The kernel against the fp64 product on row- and column-major matrices with ragged edges (an odd
    depth, rows not a multiple of its 48-row panels)."""
    g = torch.Generator().manual_seed(0)
    for a in (torch.randn(53, 67, generator=g).bfloat16(), torch.randn(131, 53, generator=g).bfloat16().mT):
        exact = a.double() @ a.double().mT
        if float((_gram(lib, a, False).double() - exact).abs().max()) > 1e-5 * float(exact.abs().max()):
            return False
    return True


def _cpu_has_bf16_dot() -> bool:
    try:
        return bool(torch.cpu._is_avx512_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
