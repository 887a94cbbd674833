"""SciPy's OpenBLAS where it beats torch's routines for the spectral merges, one matrix per thread.

The top eigenpairs of a symmetric matrix alone, by LAPACK's ?syevr (RANGE = 'I'), which torch lacks.
torch.linalg.eigh computes every eigenpair. TSV-M keeps the top ⌊r/T⌋ of each task's Gram (96 of 768
for ViT-B/32 × 8), Iso-CTS about r/40 of each residual's. ?syevr tridiagonalises as eigh does, then
solves for the wanted eigenvectors only. 768², fp32, one thread, on a 2-core AMD EPYC (Zen 4): the top
19 in 15–18 ms, the top 96 in 25–28 ms, the top 192 in 41 ms, the top 384 in 65 ms, against 53 ms for
torch's whole eigh; ``linalg.top_eigh`` takes it up to a quarter of the rank.

Grams by ?syrk and square SVDs by sgesdd: torch has no Gram that computes one triangle alone (its product
runs at the same 100 GFLOP/s a core as OpenBLAS's here), and OpenBLAS's sgesdd is faster than torch's MKL
at 768² on this CPU: 0.8 of torch's time for both.

The routines are SciPy's, reached through the function pointers of ``scipy.linalg.cython_lapack`` and
``cython_blas`` (as numba reaches them; their C signature is checked first) and called through ctypes,
which lets go of the GIL, so that the LAPACK workers (``linalg.side_by_side``) run side by side. SciPy's
OpenBLAS is set to one thread for the whole process (its count is the library's, per-thread setter
included): two workers on a threaded OpenBLAS took 56–67 ms each instead of 28 for ?syevr. merger makes
no other SciPy BLAS call. Where a routine, its signature or that setting is missing (a SciPy built against
another LAPACK, an ILP64 build, a platform without dladdr), ``ready()`` is False and ``linalg`` keeps
torch's routines."""
from __future__ import annotations

import ctypes
import threading

import torch

_P = ctypes.c_void_p
_STATE: dict = {}
_LOADING = threading.Lock()
# each routine's arguments as its capsule names them: LP64 ints (an ILP64 SciPy would read 8-byte ints where 4
# are passed), "R" the real type (SciPy's typedef ..._s for float, ..._d for double)
_SIGNATURES = {routine: kinds.split(",") for routine, kinds in (
    ("syevr", "char,char,char,int,R,int,R,R,int,int,R,int,R,R,int,int,R,int,int,int,int"),
    ("syrk", "char,char,int,int,R,R,int,R,R,int"),
    ("gesdd", "char,int,int,R,int,R,R,int,R,int,R,int,int,int"),
)}
_ROUTINES = (("syevr", "s"), ("syevr", "d"), ("syrk", "s"), ("syrk", "d"), ("gesdd", "s"))
_DTYPES = {"s": torch.float32, "d": torch.float64}
_CAPSULE_NAME = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", ctypes.pythonapi))
_CAPSULE_POINTER = ctypes.PYFUNCTYPE(_P, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_GetPointer", ctypes.pythonapi))


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", _P), ("dli_sname", ctypes.c_char_p), ("dli_saddr", _P)]


def _pointer(routine: str, prefix: str) -> int | None:
    """The address of SciPy's ``prefix + routine`` (ssyevr, dsyrk, ...), or None where its signature is
    not the LP64 one."""
    from scipy.linalg import cython_blas, cython_lapack

    name = prefix + routine
    capsule = (cython_blas if routine == "syrk" else cython_lapack).__pyx_capi__[name]
    signature = _CAPSULE_NAME(capsule)
    text = signature.decode()
    args = [a.strip() for a in text[text.find("(") + 1:text.rfind(")")].split(",")]
    kinds = _SIGNATURES[routine]
    real = f"_{prefix} *"  # ssyevr: ..._s *, dsyevr: ..._d *
    if not text.startswith("void (") or len(args) != len(kinds) or not all(
            a.endswith(real) if kind == "R" else a == f"{kind} *" for a, kind in zip(args, kinds)):
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
    """The routines by name and dtype ({} where they cannot run here), loaded once; all or none."""
    if _STATE:
        return _STATE
    with _LOADING:
        if not _STATE:
            routines = {}
            try:
                addresses = {(routine, _DTYPES[prefix]): _pointer(routine, prefix) for routine, prefix in _ROUTINES}
                setter = None if None in addresses.values() else _thread_count_setter(addresses["syevr", torch.float32])
                if setter is not None:
                    # OpenBLAS's count is the whole library's (its "_local" setter too, in 0.3.30): SciPy's BLAS
                    # runs one thread per call in this process from here on; merger makes no other SciPy BLAS call
                    setter(1)
                    for (routine, dtype), address in addresses.items():
                        fn = ctypes.CFUNCTYPE(None, *[_P] * len(_SIGNATURES[routine]))(address)
                        routines.setdefault(routine, {})[dtype] = fn
            except (ImportError, KeyError, AttributeError, OSError, TypeError, ValueError):
                routines = {}
            _STATE["routines"] = routines
    return _STATE


def ready() -> bool:
    """Whether ``top_eigh``, ``gram_rows`` and ``svd`` run here (the routines, and a way to keep each call
    on one thread)."""
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
    routine = _load()["routines"]["syevr"][gram.dtype]
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


def gram_rows(a: torch.Tensor, lower: bool = False) -> torch.Tensor:
    """a · aᵀ of one matrix [m, n] (fp32 or fp64, CPU), symmetric (``lower``: its lower triangle alone,
    zeros above, what an eigh reads; 1 ms less at 768²), by ?syrk: the triangle
    alone (half a product's work), read from a or from aᵀ where either is contiguous, so a transposed
    view costs no copy. OpenBLAS's AVX-512 kernel, one thread, on this Zen 4: 19.4 ms for 768 × 3072 in
    fp32, against 24.2 for the product's upper blocks in torch (MKL) and 35 for the whole product."""
    m, n = a.shape
    if not m * n:
        return a.new_zeros(m, m)
    if a.stride(-1) == 1 and a.stride(0) >= max(1, n):  # row-major a is column-major aᵀ: C = (aᵀ)ᵀ(aᵀ)
        trans, lead = b"T", a.stride(0)
    elif a.stride(0) == 1 and a.stride(1) >= max(1, m):  # a is column-major itself: C = a · aᵀ
        trans, lead = b"N", a.stride(1)
    else:
        a = a.contiguous()
        trans, lead = b"T", max(1, n)
    out = torch.zeros(m, m, dtype=a.dtype)
    real = ctypes.c_float if a.dtype == torch.float32 else ctypes.c_double
    size, depth, lead_a = (ctypes.c_int(v) for v in (m, n, lead))
    # column-major, the upper triangle of C is the lower of torch's row-major result
    _load()["routines"]["syrk"][a.dtype](b"U", trans, ctypes.byref(size), ctypes.byref(depth), ctypes.byref(real(1)),
                                         a.data_ptr(), ctypes.byref(lead_a), ctypes.byref(real(0)), out.data_ptr(),
                                         ctypes.byref(size))
    return out if lower else out.add_(out.tril(-1).mT)


def svd(x: torch.Tensor):
    """(U, S, Vh) of one fp32 matrix [m, n] by OpenBLAS's sgesdd (thin), or None where it fails to converge
    or x is not finite (sgesdd refuses a NaN but may spin forever on an Inf; torch's then answers as before).
    768², one thread, on this Zen 4: 87 ms against 111 for torch's (MKL's) gesdd; for tall 3072 × 768
    MKL's is faster (273 against 301 ms), so ``linalg.thin_svd`` takes this one for square matrices."""
    m, n = x.shape
    if not bool(torch.isfinite(x).all()):
        return None
    k = min(m, n)
    a = x.clone(memory_format=torch.contiguous_format)  # overwritten; LAPACK reads it as xᵀ [n, m]
    s = torch.empty(k, dtype=torch.float32)
    vh = torch.empty(k, n, dtype=torch.float32)  # xᵀ's U [n, k], column-major: x's Vh
    u = torch.empty(m, k, dtype=torch.float32)  # xᵀ's Vᵀ [k, m], column-major: x's U
    iwork = torch.empty(8 * k, dtype=torch.int32)
    rows, cols, rank, info = ctypes.c_int(n), ctypes.c_int(m), ctypes.c_int(k), ctypes.c_int(0)
    routine = _load()["routines"]["gesdd"][torch.float32]

    def call(work, lwork):
        routine(b"S", ctypes.byref(rows), ctypes.byref(cols), a.data_ptr(), ctypes.byref(rows), s.data_ptr(),
                vh.data_ptr(), ctypes.byref(rows), u.data_ptr(), ctypes.byref(rank), work, ctypes.byref(lwork),
                iwork.data_ptr(), ctypes.byref(info))

    work_size = ctypes.c_float(0)
    call(ctypes.byref(work_size), ctypes.c_int(-1))  # workspace query
    work = torch.empty(max(1, int(work_size.value)), dtype=torch.float32)
    call(work.data_ptr(), ctypes.c_int(work.numel()))
    return None if info.value != 0 else (u, s, vh)
