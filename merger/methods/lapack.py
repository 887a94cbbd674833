"""The top eigenpairs of a symmetric matrix alone, by LAPACK's ?syevr (RANGE = 'I'), which torch lacks.

torch.linalg.eigh computes every eigenpair. TSV-M keeps the top ⌊r/T⌋ of each task's Gram (96 of 768
for ViT-B/32 × 8), Iso-CTS about r/40 of each residual's. ?syevr tridiagonalises as eigh does, then
solves for the wanted eigenvectors only. 768², fp32, one thread, on a 2-core AMD EPYC (Zen 4): the top
19 in 15–18 ms, the top 96 in 25–28 ms, the top 192 in 41 ms, the top 384 in 65 ms, against 53 ms for
torch's whole eigh; ``linalg.top_eigh`` takes it up to a quarter of the rank.

The routine is SciPy's LAPACK, reached through the function pointers of ``scipy.linalg.cython_lapack``
(as numba reaches them; their C signature is checked first) and called through ctypes, which lets go of
the GIL, so that the LAPACK workers (``linalg.side_by_side``) run side by side. SciPy's OpenBLAS is set
to one thread for the whole process (its count is the library's, per-thread setter included): two
workers on a threaded OpenBLAS took 56–67 ms each instead of 28. merger makes no other SciPy BLAS call.
Where the routine, its signature or that setting is missing (a SciPy built against another LAPACK, an
ILP64 build, a platform without dladdr), ``ready()`` is False and ``top_eigh`` keeps torch's eigh."""
from __future__ import annotations

import ctypes
import threading

import torch

_P = ctypes.c_void_p
_STATE: dict = {}
_LOADING = threading.Lock()
# ?syevr's arguments as the capsule names them: LP64 ints (an ILP64 SciPy would read 8-byte ints where 4 are
# passed), "R" the real type (SciPy's typedef ..._s for float, ..._d for double)
_SIGNATURE = "char,char,char,int,R,int,R,R,int,int,R,int,R,R,int,int,R,int,int,int,int".split(",")
_CAPSULE_NAME = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", ctypes.pythonapi))
_CAPSULE_POINTER = ctypes.PYFUNCTYPE(_P, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_GetPointer", ctypes.pythonapi))


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", _P), ("dli_sname", ctypes.c_char_p), ("dli_saddr", _P)]


def _pointer(name: str) -> int | None:
    """The address of SciPy's ``name`` (?syevr), or None where its signature is not the LP64 one."""
    from scipy.linalg import cython_lapack

    capsule = cython_lapack.__pyx_capi__[name]
    signature = _CAPSULE_NAME(capsule)
    text = signature.decode()
    args = [a.strip() for a in text[text.find("(") + 1:text.rfind(")")].split(",")]
    real = f"_{name[0]} *"  # ssyevr: ..._s *, dsyevr: ..._d *
    if not text.startswith("void (") or len(args) != len(_SIGNATURE) or not all(
            a.endswith(real) if kind == "R" else a == f"{kind} *" for a, kind in zip(args, _SIGNATURE)):
        return None
    return _CAPSULE_POINTER(capsule, signature)


def _thread_count_setter(address: int):
    """The thread count setter of the BLAS library behind ``address`` (SciPy's OpenBLAS), or None."""
    dladdr = ctypes.CDLL(None).dladdr
    dladdr.argtypes, dladdr.restype = (_P, ctypes.POINTER(_DlInfo)), ctypes.c_int
    info = _DlInfo()
    if not dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    library = ctypes.CDLL(info.dli_fname.decode())  # SciPy's module: dlsym searches the LAPACK it links too
    for name in ("scipy_openblas_set_num_threads", "openblas_set_num_threads"):
        setter = getattr(library, name, None)
        if setter is not None:
            setter.argtypes, setter.restype = (ctypes.c_int,), None
            return setter
    return None


def _load() -> dict:
    """The routines by dtype ({} where they cannot run here), loaded once; whole or not at all."""
    if _STATE:
        return _STATE
    with _LOADING:
        if not _STATE:
            routines = {}
            try:
                addresses = {torch.float32: _pointer("ssyevr"), torch.float64: _pointer("dsyevr")}
                setter = None if None in addresses.values() else _thread_count_setter(addresses[torch.float32])
                if setter is not None:
                    # OpenBLAS's count is the whole library's (its "_local" setter too, in 0.3.30): SciPy's BLAS
                    # runs one thread per call in this process from here on; merger makes no other SciPy BLAS call
                    setter(1)
                    routines = {dtype: ctypes.CFUNCTYPE(None, *[_P] * 21)(address) for dtype, address in addresses.items()}
            except (ImportError, KeyError, AttributeError, OSError, TypeError, ValueError):
                routines = {}
            _STATE["routines"] = routines
    return _STATE


def ready() -> bool:
    """Whether ``top_eigh`` runs here (the routines, and a way to keep each call on one thread)."""
    return bool(_load()["routines"])


def top_eigh(gram: torch.Tensor, q: int):
    """The top q eigenpairs of each symmetric matrix of ``gram`` [..., r, r] (fp32 or fp64, CPU),
    largest first: (values [..., q], vectors [..., r, q]). Only the lower triangle is read, as by
    torch.linalg.eigh. Call where ``ready()``; 0 < q ≤ r."""
    r = gram.shape[-1]
    if not 0 < q <= r:
        raise ValueError(f"top_eigh: q = {q} eigenpairs of a {r}² matrix")
    flat = gram.reshape(-1, r, r)
    pairs = [_one(g, q) for g in flat]
    values = torch.stack([v for v, _ in pairs]) if pairs else gram.new_empty(0, q)
    vectors = torch.stack([w for _, w in pairs]) if pairs else gram.new_empty(0, r, q)
    return values.reshape(*gram.shape[:-2], q), vectors.reshape(*gram.shape[:-2], r, q)


def _one(gram: torch.Tensor, q: int):
    routine = _load()["routines"][gram.dtype]
    n = gram.shape[-1]
    # overwritten. LAPACK reads it column-major, as its transpose: its upper triangle ("U") is torch's lower
    a = gram.clone(memory_format=torch.contiguous_format)
    values = torch.empty(n, dtype=gram.dtype)
    vectors = torch.empty(q, n, dtype=gram.dtype)  # column-major [n, q]: one eigenvector per row here
    support = torch.empty(2 * q, dtype=torch.int32)
    real = ctypes.c_float if gram.dtype == torch.float32 else ctypes.c_double
    size, low, high, found, info = (ctypes.c_int(v) for v in (n, n - q + 1, n, 0, 0))
    bound, tolerance = real(0), real(0)

    def call(work, lwork, iwork, liwork):
        routine(b"V", b"I", b"U", ctypes.byref(size), a.data_ptr(), ctypes.byref(size), ctypes.byref(bound),
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

