"""Linear algebra the spectral merges share: LAPACK one matrix per thread, spectra through Gram
matrices, top eigenpairs, inverse square roots and orthogonal (polar) factors.

CPU figures on this 2-core machine, 768² matrices, single-threaded: an fp64 eigh 57 ms, fp32 29 ms
(two side by side: 13 ms each); an SVD is 4× dearer than a Gram and its eigh."""
from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import torch

from merger.methods import lapack, native
from merger.methods.registry import each
_LAPACK_LOCK = threading.RLock()  # re-entered by a caller that runs more work inside an each_matrix loop
_LAPACK_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0
_WORKER = "merger-lapack"


def per_matrix(fn, x: torch.Tensor):
    """``fn`` (a LAPACK routine: eigh, svd) on each matrix of a batch [B, ...], each single-
    threaded on a worker thread, as many at once as there are workers; the results stacked as
    ``fn`` returns them. A GPU solves the batch at once.

    LAPACK's syevd and gesdd fork and join their OpenMP team many times per matrix. Once a second
    thread of this process has run torch work (the model thread's forwards always have), libgomp
    has more threads than cores and throttles its spin-wait, and each join pays a sleep: a batched
    eigh of 8 Grams of 768² then took 0.80 s instead of 0.17 s on this 2-core machine. One matrix
    per worker, single-threaded, takes 0.13 s in either state."""
    if x.device.type != "cpu" or _on_worker():  # a worker is single-threaded already
        _load_gpu_solvers(x.device)
        return tuple(fn(x))
    return tuple(torch.stack(p) for p in zip(*side_by_side(fn, x.unbind(0))))


def side_by_side(fn, items) -> Iterator:
    """fn(item) for each item, in order, computed as many at once as torch had threads when the first
    call came, each call single-threaded on a worker thread (see ``per_matrix``). Closing the
    iterator early cancels the calls not yet started."""
    if _on_worker():  # nested: this worker goes on alone (the pool is busy with its caller)
        yield from map(fn, items)
        return
    with _LAPACK_LOCK:
        yield from _workers().map(fn, items)


def _workers() -> ThreadPoolExecutor:
    """The worker threads, each set to one torch thread once, when it starts. Setting a thread's count
    also sets the count threads started from then on take for their whole life (a Gradio worker
    started during a warm-up once ran its applies at half speed), so that is put back at once, with
    every worker started, under the lock; no later call changes it."""
    global _LAPACK_POOL, _POOL_SIZE
    with _LAPACK_LOCK:
        if _LAPACK_POOL is None:
            threads = max(1, torch.get_num_threads())
            started = threading.Barrier(threads)
            pool = ThreadPoolExecutor(threads, thread_name_prefix=_WORKER, initializer=_one_thread)
            list(pool.map(lambda _: started.wait(timeout=60), range(threads)))
            torch.set_num_threads(threads)
            _LAPACK_POOL, _POOL_SIZE = pool, threads
        return _LAPACK_POOL


def _one_thread() -> None:
    # torch reads the count a thread starts with at its first call (get_num_threads included): that
    # read first, or it would take the count put back after the workers started
    torch.get_num_threads()
    torch.set_num_threads(1)


def workers() -> int:
    """How many matrices ``side_by_side`` computes at once."""
    _workers()
    return _POOL_SIZE


def each_matrix(fn, keys, progress=None, cancel=None, what: str = "matrix", device=None) -> Iterator[tuple]:
    """(key, fn(key)) for each key, in order, computed side by side: a preparation's work on whole
    matrices (its matmuls and its LAPACK calls together) keeps every core busy, where a matrix at a
    time leaves one idle during each routine that cannot split. Progress and cancel as
    ``registry.each``: a cancel stops the matrices not yet started.

    On a GPU (``device``) one matrix after another in the calling thread: the GPU runs them in turn
    anyway, and torch loads its GPU solvers lazily at their first call, which workers making it at
    once broke ("lazy wrapper should be called at most once": TSV-M, the first method prepared on a
    ViT-L/14 pool on an H200)."""
    keys = list(keys)
    on_gpu = device is not None and torch.device(device).type != "cpu"
    if on_gpu:
        _load_gpu_solvers(device)
    with contextlib.closing((fn(k) for k in keys) if on_gpu else side_by_side(fn, keys)) as results:
        for key in each(keys, progress, cancel, what):
            yield key, next(results)


_GPU_SOLVERS_LOADED: set = set()


def _load_gpu_solvers(device) -> None:
    """One solver call under the lock before any other on a CUDA device: torch loads its GPU solvers
    at their first call, and two threads making it at once fail (a preparation beside a move)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or device in _GPU_SOLVERS_LOADED:
        return
    with _LAPACK_LOCK:
        if device not in _GPU_SOLVERS_LOADED:
            torch.linalg.eigh(torch.eye(2, device=device))
            _GPU_SOLVERS_LOADED.add(device)


def largest_first(tv) -> list[str]:
    """The task vectors' matrices, the largest first (else in order): side by side, the last to finish
    are then the smallest, and no worker waits long for the other at the end."""
    return sorted(tv.matrices, key=lambda k: -tv.base[k].numel())


def _on_worker() -> bool:
    return threading.current_thread().name.startswith(_WORKER)


def thin_svd(x: torch.Tensor):
    """(U, S, Vh) with x = U diag(S) Vh; a wide matrix through its transpose (gesdd on 768 × 3072
    takes 0.59 s single-threaded, on 3072 × 768 0.17 s). A square fp32 matrix on a LAPACK worker takes
    OpenBLAS's gesdd (``lapack.svd``: 0.8 of MKL's time at 768²)."""
    if x.shape[-2] == x.shape[-1] > 0 and x.dim() == 2 and x.dtype == torch.float32 and _single_cpu(x):
        factors = lapack.svd(x)
        if factors is not None:  # else (no convergence) torch's answers, as it would have
            return factors
    if x.shape[-2] >= x.shape[-1]:
        return torch.linalg.svd(x, full_matrices=False)
    v, s, uh = torch.linalg.svd(x.mT, full_matrices=False)
    return uh.mT, s, v.mT


def _single_cpu(x: torch.Tensor) -> bool:
    """Whether SciPy's OpenBLAS takes x's routine: on a CPU, on a LAPACK worker (its routines run on one
    thread, which a worker is; elsewhere torch's use every core)."""
    return x.device.type == "cpu" and _on_worker() and lapack.ready()


def spectral(x: torch.Tensor, keep: int | None = None, dtype: torch.dtype = torch.float32):
    """Batched SVD of x [T, m, n] through the Gram matrix of its smaller side (an eigh: 4× faster
    than an SVD on this CPU): (left [T, m, q], right [T, q, n], s [T, q]) with the top q = keep
    directions, largest first, and x ≈ left @ right.

    One factor is exact given the other (left = x·V, or right = Uᵀ·x), so at q = min(m, n) the
    product is x itself up to rounding; the split of S between them is the Gram's side (read ``s``
    for the singular values). x is fp32, or the stored bf16 task vectors (see ``gram_rows``).
    Factors are stored in ``dtype`` (the task vectors' storage dtype). On a CPU each matrix's whole
    work runs on one single-threaded worker (``side_by_side``), its Gram included."""
    T, m, n = x.shape
    r = min(m, n)
    q = r if keep is None else max(0, min(r, keep))
    tall = m >= n

    def one(xt):
        evals, top = top_eigh(gram_rows(xt.mT if tall else xt, lower=True)[None], q)  # [1, q], [1, r, q]
        top, s, xt = top[0].float(), evals[0].clamp(min=0).sqrt().float(), xt.float()
        left, right = (xt @ top, top.mT) if tall else (top, top.mT @ xt)  # x ≈ (x V)(Vᵀ), or (U)(Uᵀ x)
        return left.to(dtype), right.to(dtype), s

    run = side_by_side if x.device.type == "cpu" else map
    left, right, s = (torch.stack(p) for p in zip(*run(one, x.unbind(0))))
    return left, right, s


def gram_rows(a: torch.Tensor, lower: bool = False, exact: bool = False) -> torch.Tensor:
    """a · aᵀ of a matrix [m, n] in fp32 (fp64 for an fp64 ``a``). A bf16 ``a`` on a CPU with AMX
    takes two bf16 products with fp32 accumulation: the product rounded to bf16, then its rounding
    error (a · aᵀ − that, rounded again); their sum is within about 2^-17 (8e-6) of the exact
    product, relative to its largest entry, and 2.4× faster single-threaded (5.5 against 13 ms for
    768 × 3072, both from blocks). That holds for entries between about 1e-18 and 1e18 (task vectors
    are near 1e-3): AMX flushes subnormal products to zero. A bf16 ``a`` on a LAPACK worker of a CPU with
    AVX512-BF16 but no AMX takes ``native.gram_bf16`` (fp32 accumulation, half ?syrk's time). Elsewhere: the fp32 product. On a CPU,
    from 256 rows, only the blocks on and above the diagonal are multiplied (``_upper_blocks``); on a
    LAPACK worker, OpenBLAS's ?syrk multiplies the triangle alone (``lapack.gram_rows``: 0.8 of that time).
    ``lower``: only the lower triangle is read (by an eigh), so that one need not be mirrored. ``exact``: a
    bf16 ``a`` never takes AMX's two rounded products (a Gram whose small eigenvalues are inverted)."""
    cpu_bf16 = a.dtype == torch.bfloat16 and a.device.type == "cpu"
    amx = cpu_bf16 and _AMX and not exact
    if cpu_bf16 and not amx and _on_worker() and native.ready():
        return native.gram_bf16(a, lower)
    if amx:
        def product(x, y):
            hi = x @ y
            return hi.float().add_(torch.addmm(hi, x, y, beta=-1))
    else:
        product = torch.mm
        if a.dtype == torch.bfloat16:
            a = a.float()
        if _single_cpu(a) and a.dtype in (torch.float32, torch.float64):
            return lapack.gram_rows(a, lower)
    return _upper_blocks(a, product) if a.device.type == "cpu" else product(a, a.mT)


def _upper_blocks(a: torch.Tensor, product, blocks: int = 4) -> torch.Tensor:
    """a · aᵀ from the 10 of its 16 blocks on and above the diagonal (each block row of a against
    the rows from its own on), mirrored below: the same sums, 0.7 of the time of the whole product
    on this CPU (12.1 against 16.9 ms for 768 × 3072, fp32, single-threaded)."""
    m = a.shape[0]
    if m < 64 * blocks:  # blocks under 64 rows multiply slower than they save
        return product(a, a.mT)
    edges = [m * i // blocks for i in range(blocks + 1)]
    out = None
    for lo, hi in zip(edges, edges[1:]):
        row = product(a[lo:hi], a[lo:].mT)  # [hi - lo, m - lo]
        if out is None:
            out = row.new_empty(m, m)
        out[lo:hi, lo:] = row
        out[hi:, lo:hi] = row[:, hi - lo:].mT
    return out


def _amx() -> bool:
    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):  # a torch without the probe: the fp32 product
        return False


_AMX = _amx()


def _bf16_matmul() -> bool:
    """Whether the CPU multiplies bf16 natively (AVX512-BF16 or AMX): a bf16 product is then 2.4× faster
    than fp32's on a Zen 4. (oneDNN's own bf16 probe also says yes on AVX-512 CPUs without those units,
    where it emulates bf16.)"""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported()) or _AMX
    except (AttributeError, RuntimeError):
        return _AMX


BF16_MATMUL = _bf16_matmul()


def divided(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x / s with a zero singular value's direction set to zero (not inf or NaN); s broadcasts."""
    return x * torch.where(s > 0, 1.0 / s.clamp(min=1e-30), 0.0)


def unit_factors(left: torch.Tensor, right: torch.Tensor, s: torch.Tensor):
    """(U, Vh) of ``spectral``'s factors: the singular vectors with S divided out of its side."""
    if left.shape[1] >= right.shape[2]:  # S sits in left
        return divided(left.float(), s[:, None, :]), right.float()
    return left.float(), divided(right.float(), s[:, :, None])


def inverse_sqrt(gram: torch.Tensor) -> torch.Tensor:
    """G^(-1/2) of each PSD Gram matrix of a batch [B, q, q] (a pseudo-inverse on a null space), in fp64."""
    gram = gram.double()
    evals, evecs = per_matrix(torch.linalg.eigh, gram)
    top = evals.max(-1, keepdim=True).values.clamp(min=1e-30)
    floor = top * gram.shape[-1] * torch.finfo(gram.dtype).eps
    inv = torch.where(evals > floor, evals.clamp(min=1e-30).rsqrt(), 0.0)
    return (evecs * inv[..., None, :]) @ evecs.mT


REFINE_BELOW = 1e-2  # eigenpairs under this fraction of the largest are solved again in fp64
REFINED_COND = 1e7  # a condition above this: refused (TSV-M then takes an SVD of the concatenation);
# the refinement held to 3e-5 at 1e8


def refined_inverse_sqrt(gram: torch.Tensor) -> torch.Tensor | None:
    """G^(-1/2) of one PSD Gram [q, q] in fp32, within about 1e-5 of fp64's (largest entry), or None where
    an eigenvalue lies under λmax / REFINED_COND. The Gram of concatenated singular vectors can be
    ill-conditioned (tasks sharing directions), and an fp32 eigh alone was 5e-4 off at a condition of
    1e5, 0.1 at 1e7.

    One fp32 eigh (half the time of fp64's), whose eigenpairs below REFINE_BELOW of the largest are
    solved again in fp64 on the subspace they span (Rayleigh–Ritz: its q × s projection and an s × s
    eigh). That subspace is accurate to about eps32 · λmax / gap, which the large eigenvalues' share of
    G^(-1/2) keeps small, while the fp32 eigenvalues there are what was off (an absolute error of about
    eps32 · λmax). Within 5e-6 of fp64 from a condition of 1e2 to 1e6 and 3e-5 at 1e8 (tests/test_linalg.py)."""
    evals, evecs = torch.linalg.eigh(gram.float())  # ascending
    top = float(evals[-1])
    if not top > 0:
        return None
    s = int((evals < top * REFINE_BELOW).sum())
    large = evecs[:, s:]
    out = (large * evals[s:].rsqrt()) @ large.mT
    if s:
        small = evecs[:, :s].double()
        ritz, rotation = torch.linalg.eigh(small.mT @ (gram.double() @ small))
        if float(ritz[0]) < top / REFINED_COND:
            return None
        small = small @ rotation
        out += ((small * ritz.rsqrt()) @ small.mT).float()
    return out


SUBSET_SHARE = 0.25  # up to this share of the rank, LAPACK's subset solver beats a whole eigh (lapack.py)


def top_eigh(gram: torch.Tensor, q: int):
    """The top q eigenpairs of each symmetric matrix of a batch [B, r, r], largest first:
    (values [B, q], vectors [B, r, q]); one matrix per worker (``per_matrix``). On a CPU, for q up
    to SUBSET_SHARE of r, only those (``lapack.top_eigh``: the top 96 of 768 in half the time)."""
    r = gram.shape[-1]
    if gram.device.type == "cpu" and 0 < q <= SUBSET_SHARE * r and lapack.ready():
        return per_matrix(lambda g: lapack.top_eigh(g, q), gram)
    evals, evecs = per_matrix(torch.linalg.eigh, gram)  # ascending
    return evals[..., r - q:].flip(-1), evecs[..., r - q:].flip(-1)


def polar_svd(x: torch.Tensor) -> torch.Tensor:
    """The orthogonal factor U·Vh of x [p, q] from its fp32 SVD (the TSV authors' way). Where x is near
    singular its Gram's condition is the square of x's, beyond fp32 (a Gram rounded to fp32 moved a
    ViT-B/32 polar factor by 8 %); the SVD of x itself stays within about 5e-6 of fp64's (relative) there
    at conditions up to 7e4 (Grams to 4e9), in 0.8 of the time of an fp64 eigh of the Gram and its products."""
    u, _, vh = thin_svd(x.float())
    return u @ vh


def polar_rows(rows: torch.Tensor) -> torch.Tensor:
    """The orthogonal factor of a [p, n] matrix (U·Vᵀ of its SVD; rows on a null space → 0), in fp64."""
    rows = rows.double()
    return inverse_sqrt(gram_rows(rows)[None])[0] @ rows


def polar_extending(basis: torch.Tensor, extra: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The orthogonal factor of the rows [basis; extra] where ``basis`` [c, n] already has orthonormal
    rows, split back into its two blocks; fp64.

    Its Gram is I + L with L = [[0, C], [Cᵀ, D − I]] (C = basis·extraᵀ, D = extra·extraᵀ) of rank
    ≤ 2p, p the extra rows; on W = diag(Q_C, I) (C = Q_C·R_C) it reads M = [[0, R_C], [R_Cᵀ, D − I]],
    so G^(-1/2) = I + W((I + M)^(-1/2) − I)Wᵀ: one [2p, 2p] eigh instead of one of the full rank."""
    basis, extra = basis.double(), extra.double()
    p = extra.shape[0]
    q_c, r_c = torch.linalg.qr(basis @ extra.mT)  # [c, k], [k, p], k = min(c, p)
    k = q_c.shape[1]
    m = torch.zeros(k + p, k + p, dtype=torch.float64, device=basis.device)
    m[:k, k:], m[k:, :k] = r_c, r_c.mT
    m[k:, k:] = extra @ extra.mT
    m[:k, :k] += torch.eye(k, dtype=torch.float64, device=basis.device)
    step = inverse_sqrt(m[None])[0] - torch.eye(k + p, dtype=torch.float64, device=basis.device)
    moved = step @ torch.cat([q_c.mT @ basis, extra])  # [k + p, n]
    return basis + q_c @ moved[:k], extra + moved[k:]
