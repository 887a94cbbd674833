"""The top eigenpairs of a symmetric matrix alone, by LAPACK's ?syevr (RANGE = 'I'), which torch lacks.

torch.linalg.eigh computes every eigenpair. TSV-M keeps the top ⌊r/T⌋ of each task's Gram (96 of 768
for ViT-B/32 × 8), Iso-CTS about r/40 of each residual's. ?syevr tridiagonalises as eigh does, then
solves for the wanted eigenvectors only. 768², fp32, one thread, on a 2-core AMD EPYC (Zen 4): the top
19 in 15–18 ms, the top 96 in 25–28 ms, the top 192 in 41 ms, the top 384 in 65 ms, against 53 ms for
torch's whole eigh; ``linalg.top_eigh`` takes it up to a quarter of the rank.

The routine is SciPy's LAPACK, reached through the function pointers of ``scipy.linalg.cython_lapack``
(as numba reaches them) and called through ctypes, which lets go of the GIL, so that the LAPACK workers
(``linalg.side_by_side``) run side by side. Each worker's calls into that library are set to one
thread (OpenBLAS's ``openblas_set_num_threads_local``): two workers on a threaded OpenBLAS took 56–67 ms
each instead of 28. Where that setting or the routine is missing (a SciPy built against another
LAPACK, a platform without dladdr), ``ready()`` is False and ``top_eigh`` keeps torch's eigh."""
from __future__ import annotations

import ctypes
import threading

import torch

_P = ctypes.c_void_p
_STATE: dict = {}
_LOCAL = threading.local()


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", _P), ("dli_sname", ctypes.c_char_p), ("dli_saddr", _P)]


def _pointer(name: str) -> int:
    from scipy.linalg import cython_lapack

    capsule = cython_lapack.__pyx_capi__[name]
    api = ctypes.pythonapi
    api.PyCapsule_GetName.restype, api.PyCapsule_GetName.argtypes = ctypes.c_char_p, [ctypes.py_object]
    api.PyCapsule_GetPointer.restype, api.PyCapsule_GetPointer.argtypes = _P, [ctypes.py_object, ctypes.c_char_p]
    return api.PyCapsule_GetPointer(capsule, api.PyCapsule_GetName(capsule))


def _thread_setting(address: int):
    """The per-thread thread count setter of the library that holds ``address``, or None."""
    dladdr = ctypes.CDLL(None).dladdr
    dladdr.argtypes, dladdr.restype = (_P, ctypes.POINTER(_DlInfo)), ctypes.c_int
    info = _DlInfo()
    if not dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    library = ctypes.CDLL(info.dli_fname.decode())  # SciPy's module: dlsym searches the LAPACK it links too
    for name in ("openblas_set_num_threads_local", "scipy_openblas_set_num_threads_local"):
        setter = getattr(library, name, None)
        if setter is not None:
            setter.argtypes, setter.restype = (ctypes.c_int,), ctypes.c_int
            return setter
    # an OpenBLAS before 0.3.27 (no per-thread count): its count for every thread, which only these calls use
    # (merger runs no other SciPy BLAS; numpy's OpenBLAS is another library)
    for name in ("scipy_openblas_set_num_threads", "openblas_set_num_threads"):
        setter = getattr(library, name, None)
        if setter is not None:
            setter.argtypes, setter.restype = (ctypes.c_int,), None
            return setter
    return None


def _load() -> dict:
    if not _STATE:
        try:
            subset = {torch.float32: _pointer("ssyevr"), torch.float64: _pointer("dsyevr")}
            setter = _thread_setting(subset[torch.float32])
        except (ImportError, KeyError, AttributeError, OSError, TypeError, ValueError):
            subset, setter = {}, None
        _STATE.update(routines={dtype: ctypes.CFUNCTYPE(None, *[_P] * 21)(address) for dtype, address in subset.items()}
                      if setter else {}, one_thread=setter)
    return _STATE


def ready() -> bool:
    """Whether ``top_eigh`` runs here (the routines, and a way to keep each call on one thread)."""
    return bool(_load()["routines"])


def top_eigh(gram: torch.Tensor, q: int):
    """The top q eigenpairs of each symmetric matrix of ``gram`` [..., r, r] (fp32 or fp64, CPU),
    largest first: (values [..., q], vectors [..., r, q]). Only the lower triangle is read."""
    r = gram.shape[-1]
    flat = gram.reshape(-1, r, r)
    pairs = [_one(g, q) for g in flat]
    return (torch.stack([v for v, _ in pairs]).reshape(*gram.shape[:-2], q),
            torch.stack([w for _, w in pairs]).reshape(*gram.shape[:-2], r, q))


def _one(gram: torch.Tensor, q: int):
    state = _load()
    routine = state["routines"][gram.dtype]
    if getattr(_LOCAL, "set", False) is False:
        state["one_thread"](1)
        _LOCAL.set = True
    n = gram.shape[-1]
    a = gram.contiguous().clone()  # overwritten; symmetric, so its row-major layout is its column-major one
    values = torch.empty(n, dtype=gram.dtype)
    vectors = torch.empty(q, n, dtype=gram.dtype)  # column-major [n, q]: one eigenvector per row here
    support = torch.empty(2 * q, dtype=torch.int32)
    real = ctypes.c_float if gram.dtype == torch.float32 else ctypes.c_double
    size, low, high, found, info = (ctypes.c_int(v) for v in (n, n - q + 1, n, 0, 0))
    bound, tolerance = real(0), real(0)

    def call(work, lwork, iwork, liwork):
        routine(b"V", b"I", b"L", ctypes.byref(size), a.data_ptr(), ctypes.byref(size), ctypes.byref(bound),
                ctypes.byref(bound), ctypes.byref(low), ctypes.byref(high), ctypes.byref(tolerance), ctypes.byref(found),
                values.data_ptr(), vectors.data_ptr(), ctypes.byref(size), support.data_ptr(), work,
                ctypes.byref(lwork), iwork, ctypes.byref(liwork), ctypes.byref(info))

    work_size, iwork_size = real(0), ctypes.c_int(0)
    call(ctypes.byref(work_size), ctypes.c_int(-1), ctypes.byref(iwork_size), ctypes.c_int(-1))  # workspace query
    work = torch.empty(int(work_size.value), dtype=gram.dtype)
    iwork = torch.empty(iwork_size.value, dtype=torch.int32)
    call(work.data_ptr(), ctypes.c_int(work.numel()), iwork.data_ptr(), ctypes.c_int(iwork.numel()))
    if info.value != 0 or found.value != q:  # a failure to converge: the whole eigh, as before
        evals, evecs = torch.linalg.eigh(gram)
        return evals[n - q:].flip(0), evecs[:, n - q:].flip(1)
    return values[:q].flip(0), vectors.flip(0).mT

