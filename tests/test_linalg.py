"""The linear algebra the spectral merges share (methods/linalg.py): the structured polar factor
against an SVD's, and matrices side by side in order, cancellable, with the threads given back."""
import sys
import threading
import time

import pytest
import torch
from helpers import on_a_worker

from merger.errors import Cancelled
from merger.methods import lapack, linalg, native
from merger.methods.linalg import (each_matrix, gram_rows, inverse_sqrt, polar_extending, polar_rows, refined_inverse_sqrt,
                                   side_by_side, spectral, thin_svd)


def _svd_polar(rows):
    u, _, vh = torch.linalg.svd(rows.double(), full_matrices=False)
    return u @ vh


def test_polar_extending_an_orthonormal_block_is_the_svd_polar_factor():
    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(50, 12, generator=g, dtype=torch.float64))[0].T  # 12 orthonormal rows
    extra = torch.randn(7, 50, generator=g, dtype=torch.float64)
    extra = extra + 3 * torch.randn(7, 12, generator=g, dtype=torch.float64) @ basis  # leaning on the basis
    top, bottom = polar_extending(basis, extra)
    expected = _svd_polar(torch.cat([basis, extra]))
    assert torch.allclose(torch.cat([top, bottom]), expected, atol=1e-10)
    assert torch.allclose(polar_rows(extra), _svd_polar(extra), atol=1e-10)


def test_polar_extending_drops_a_row_inside_the_basis_as_the_pseudo_inverse_does():
    g = torch.Generator().manual_seed(1)
    basis = torch.linalg.qr(torch.randn(30, 6, generator=g, dtype=torch.float64))[0].T
    extra = torch.cat([torch.randn(3, 30, generator=g, dtype=torch.float64), basis[:1] * 2.0])  # a repeated direction
    top, bottom = polar_extending(basis, extra)
    rows = torch.cat([top, bottom])
    full = torch.cat([basis, extra])
    gram = full @ full.T
    evals, evecs = torch.linalg.eigh(gram)
    inv = torch.where(evals > 1e-9 * evals.max(), evals.clamp(min=1e-30).rsqrt(), 0.0)
    assert torch.allclose(rows, (evecs * inv) @ evecs.T @ full, atol=1e-9)
    assert torch.isfinite(rows).all()


def test_thin_svd_of_a_wide_matrix_goes_through_its_transpose():
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(2))
    u, s, vh = thin_svd(x)
    assert u.shape == (6, 6) and vh.shape == (6, 40)
    assert torch.allclose(u @ torch.diag(s) @ vh, x, atol=1e-5)
    assert torch.allclose(vh @ vh.T, torch.eye(6), atol=1e-5)


def test_matrices_side_by_side_come_back_in_order_on_single_threaded_workers():
    threads = torch.get_num_threads()
    out = list(side_by_side(lambda i: (i, torch.get_num_threads()), range(7)))
    assert [i for i, _ in out] == list(range(7))
    assert all(n == 1 for _, n in out)
    assert torch.get_num_threads() == threads
    # nested (a worker asking for more side-by-side work) runs inline instead of waiting on itself
    inner = list(side_by_side(lambda i: list(side_by_side(lambda j: i * 10 + j, range(2))), range(3)))
    assert inner == [[0, 1], [10, 11], [20, 21]]


def test_a_thread_started_during_side_by_side_work_keeps_the_process_thread_count():
    """A worker's one thread is its own: a Gradio worker or Run thread started while matrices are
    computed once took one torch thread for its whole life (found by a review of the warm-up)."""
    threads, seen = torch.get_num_threads(), []

    def work(i):
        if i == 0:
            probe = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
            probe.start()
            probe.join()
        return torch.get_num_threads()

    assert list(side_by_side(work, range(4))) == [1] * 4
    assert seen == [threads] and torch.get_num_threads() == threads


def test_a_cancel_stops_the_matrices_not_yet_started():
    started = []

    def work(key):
        started.append(key)
        time.sleep(0.02)
        return key

    keys = [f"m{i}" for i in range(40)]
    with pytest.raises(Cancelled, match=r"cancelled at spectrum \d+ of 40: nothing was cached"):
        for _ in each_matrix(work, keys, cancel=lambda: len(started) >= 2, what="spectrum"):
            pass
    time.sleep(0.1)  # the calls already running finish; none after them starts
    assert len(started) < 10


@pytest.mark.parametrize("device", [None, "cpu", "cuda"])
def test_each_matrix_goes_to_the_workers_except_on_a_gpu(device):
    """On a GPU one matrix after another in the calling thread: workers making torch's first call to
    its lazily loaded GPU solvers at once broke a ViT-L/14 TSV-M preparation on an H200."""
    import threading

    threads = []

    def work(key):
        threads.append(threading.current_thread().name)
        return key * 2

    keys = list(range(6))
    assert list(each_matrix(work, keys, device=device)) == [(k, 2 * k) for k in keys]
    if device == "cuda":
        assert threads == [threading.current_thread().name] * 6
    else:
        assert all(t.startswith("merger-lapack") for t in threads)
    with pytest.raises(Cancelled):  # a cancel stops it there too
        for _ in each_matrix(work, keys, cancel=lambda: len(threads) >= 8, device=device):
            pass


def _gram_with_condition(n, cond, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))[0]
    return (q * torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), n, dtype=torch.float64)) @ q.T


@pytest.mark.parametrize("cond", [1e2, 1e4, 1e6])
def test_refined_inverse_sqrt_is_fp32_within_1e_5_of_fp64_up_to_a_condition_of_1e6(cond):
    gram = _gram_with_condition(60, cond, 3)
    exact = inverse_sqrt(gram[None])[0]  # fp64
    fast = refined_inverse_sqrt(gram.float())
    assert exact.dtype == torch.float64 and fast.dtype == torch.float32
    assert (fast.double() - inverse_sqrt(gram.float()[None])[0]).abs().max() <= 1e-5 * exact.abs().max()
    # the fp32 eigh alone, unrefined, is far off there: the refinement is what holds it
    evals, evecs = torch.linalg.eigh(gram.float())
    plain = (evecs * evals.rsqrt()) @ evecs.mT
    if cond >= 1e6:
        assert (plain.double() - exact).abs().max() > 1e-4 * exact.abs().max()


def test_a_near_singular_gram_is_refused_by_the_fp32_route():
    """Past REFINED_COND the refinement is refused (None): its caller (TSV-M) takes an SVD instead."""
    ill = _gram_with_condition(60, 1e9, 4)
    assert refined_inverse_sqrt(ill) is None and refined_inverse_sqrt(ill.float()) is None


def test_a_bf16_gram_is_within_1e_5_of_the_exact_product():
    a = (torch.randn(96, 3072, generator=torch.Generator().manual_seed(5)) * 1e-3).bfloat16()
    exact = a.double() @ a.double().T  # products of bf16 numbers, summed in fp64
    got = gram_rows(a)
    assert got.dtype == torch.float32
    assert (got.double() - exact).abs().max() <= 1e-5 * exact.abs().max()  # about 2^-17 with AMX


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-5), (torch.float64, 1e-13)])
def test_a_gram_from_its_upper_blocks_is_the_whole_symmetric_product(dtype, tol):
    a = (torch.randn(301, 517, generator=torch.Generator().manual_seed(7)) * 1e-3).to(dtype)  # uneven blocks
    # a wide matrix's rows and a tall one's columns (spectral's two cases); under 256 rows, one product
    for rows in (a, a.mT, a[:100]):
        exact = rows.double() @ rows.double().mT
        got = gram_rows(rows)
        assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert (got.double() - exact).abs().max() <= tol * exact.abs().max()


def test_spectral_of_stored_bf16_task_vectors_matches_its_fp32_copy():
    x = (torch.randn(3, 40, 24, generator=torch.Generator().manual_seed(6)) * 0.05).bfloat16()
    (l16, r16, s16), (l32, r32, s32) = spectral(x, 6), spectral(x.float(), 6)
    assert torch.allclose(s16, s32, rtol=1e-5)
    assert torch.allclose(l16 @ r16, l32 @ r32, atol=1e-6)
    assert torch.allclose(s16, torch.linalg.svdvals(x.double())[:, :6].float(), rtol=1e-5)


def _scipy_lapack() -> str:
    import scipy

    try:
        return scipy.show_config(mode="dicts")["Build Dependencies"]["lapack"]["name"].lower()
    except (TypeError, KeyError, AttributeError):
        return ""


def test_the_subset_solver_runs_on_scipys_own_openblas():
    """A pip SciPy on Linux carries its OpenBLAS: there the fast path must be live, not a silent
    fallback to torch's whole eigh (elsewhere, e.g. Accelerate or MKL, ready() is False by design)."""
    if "openblas" not in _scipy_lapack() or sys.platform != "linux":
        pytest.skip(f"SciPy's LAPACK here is {_scipy_lapack() or 'unknown'} on {sys.platform}")
    assert lapack.ready()


needs_subset_solver = pytest.mark.skipif(not lapack.ready(), reason="SciPy's LAPACK here is not a usable OpenBLAS")


@needs_subset_solver
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.float64, 1e-13)])
def test_the_subset_solver_gives_the_top_eigenpairs_of_the_whole_eigh(dtype, tol):
    """LAPACK's ?syevr for the top q alone (what TSV-M's and Iso-CTS's top_eigh take): the same values and
    vectors (up to sign) as torch's whole eigh in fp64, largest first, orthonormal, a batch at a time."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 300, 120, generator=g, dtype=torch.float64)
    gram = x.mT @ x
    values, vectors = lapack.top_eigh(gram.to(dtype), 17)
    exact_values, exact_vectors = torch.linalg.eigh(gram)
    top = exact_values[..., -1:]
    assert values.shape == (3, 17) and vectors.shape == (3, 120, 17) and values.dtype == dtype
    assert ((values.double() - exact_values.flip(-1)[..., :17]).abs() / top).max() < tol
    v = vectors.double()
    assert (v.mT @ v - torch.eye(17, dtype=torch.float64)).abs().max() < 50 * tol
    cosines = (v * exact_vectors.flip(-1)[..., :17]).sum(-2).abs()  # each eigenvector up to its sign
    assert (1 - cosines).max() < 50 * tol


@needs_subset_solver
def test_the_subset_solver_reads_the_lower_triangle_as_torch_does_and_refuses_a_bad_count():
    x = torch.randn(200, 60, dtype=torch.float64)
    gram = x.mT @ x
    garbage = torch.tril(gram) + torch.triu(torch.randn(60, 60, dtype=torch.float64), diagonal=1)
    values, vectors = lapack.top_eigh(garbage, 5)
    exact = torch.linalg.eigh(garbage)[0].flip(0)[:5]  # torch reads the lower triangle too
    assert torch.allclose(values, exact, rtol=1e-12) and torch.allclose(values, torch.linalg.eigh(gram)[0].flip(0)[:5])
    for q in (0, 61):
        with pytest.raises(ValueError, match=f"q = {q} eigenpairs of a 60² matrix"):
            lapack.top_eigh(gram, q)
    empty = lapack.top_eigh(gram[None][:0], 5)
    assert empty[0].shape == (0, 5) and empty[1].shape == (0, 60, 5)


@needs_subset_solver
def test_a_matrix_the_subset_solver_fails_on_gets_torchs_eigh(monkeypatch):
    calls = []
    whole = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda g: calls.append(g.shape) or whole(g))
    gram = torch.eye(40)
    gram[5, 3] = float("nan")  # in the triangle read: ?syevr fails, the whole eigh answers as it would have
    values, vectors = lapack.top_eigh(gram, 4)
    assert calls == [(40, 40)]
    assert values.shape == (4,) and vectors.shape == (40, 4) and torch.isnan(values).all()
    lapack.top_eigh(torch.eye(40), 4)
    assert len(calls) == 1  # a sound matrix: no fallback


@needs_subset_solver
def test_top_eigh_takes_the_subset_solver_up_to_a_quarter_of_the_rank(monkeypatch):
    calls = []
    real = lapack.top_eigh
    monkeypatch.setattr(lapack, "top_eigh", lambda g, q: calls.append(q) or real(g, q))
    x = torch.randn(4, 200, 64)
    gram = x.mT @ x
    small, small_vectors = linalg.top_eigh(gram, 16)
    assert len(calls) == 4 and set(calls) == {16}  # one per matrix, on the LAPACK workers
    whole, whole_vectors = linalg.top_eigh(gram, 17)  # over a quarter of 64: torch's eigh
    assert len(calls) == 4
    assert torch.allclose(small, whole[:, :16], rtol=1e-5)
    assert torch.allclose((small_vectors * whole_vectors[..., :16]).sum(-2).abs(), torch.ones(4, 16), atol=1e-4)


def test_without_the_subset_solver_top_eigh_takes_the_whole_eigh(monkeypatch):
    x = torch.randn(2, 100, 40, dtype=torch.float64)
    gram = x.mT @ x
    fast = linalg.top_eigh(gram, 5)
    monkeypatch.setattr(lapack, "ready", lambda: False)
    monkeypatch.setattr(lapack, "top_eigh", lambda *a: pytest.fail("the subset solver ran"))
    slow = linalg.top_eigh(gram, 5)
    assert torch.allclose(fast[0], slow[0], rtol=1e-12)
    assert torch.allclose((fast[1] * slow[1]).sum(-2).abs(), torch.ones(2, 5, dtype=torch.float64), atol=1e-10)


@needs_subset_solver
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float64, 1e-13)])
def test_syrk_gram_is_the_whole_product_from_either_layout_and_its_lower_triangle_alone(dtype, tol):
    """?syrk reads a row-major matrix, a transposed view (a tall matrix's columns, no copy) and a strided
    slice of either; ``lower`` leaves zeros above the diagonal (what an eigh does not read)."""
    a = torch.randn(70, 130, generator=torch.Generator().manual_seed(8), dtype=dtype)
    for rows in (a, a.mT, a[:, :50], a.mT[:, :40], a.mT.contiguous().mT[:30]):
        exact = rows.double() @ rows.double().mT
        whole, lower = lapack.gram_rows(rows), lapack.gram_rows(rows, lower=True)
        assert whole.dtype == dtype and whole.shape == exact.shape
        assert (whole.double() - exact).abs().max() <= tol * exact.abs().max()
        assert torch.equal(whole, whole.mT)
        assert torch.equal(lower, torch.tril(whole)) and not lower.triu(1).any()
    assert lapack.gram_rows(a[:, :0]).shape == (70, 70) and not lapack.gram_rows(a[:, :0]).any()


@needs_subset_solver
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    linalg._AMX, reason="with AMX a bf16 Gram takes two bf16 products instead"))])
def test_gram_rows_on_a_worker_takes_syrk_and_elsewhere_torchs_product(monkeypatch, dtype):
    monkeypatch.setitem(native._STATE, "lib", None)  # bf16 on a worker: ?syrk where the bf16 kernel is not built
    calls = []
    real = lapack.gram_rows
    monkeypatch.setattr(lapack, "gram_rows", lambda a, lower=False: calls.append((a.dtype, lower)) or real(a, lower))
    a = (torch.randn(300, 500, generator=torch.Generator().manual_seed(9)) * 1e-3).to(dtype)
    on_worker = on_a_worker(lambda: gram_rows(a))
    assert calls == [(torch.float32, False)]  # bf16 storage: its exact fp32 copy
    here = gram_rows(a)  # the caller's thread: torch's product on every core
    assert len(calls) == 1
    assert torch.allclose(on_worker, here, rtol=0, atol=1e-6 * float(here.abs().max()))


@needs_subset_solver
@pytest.mark.parametrize("shape", [(60, 60), (80, 50), (50, 80)])
def test_openblas_svd_is_an_svd(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(10))
    u, s, vh = lapack.svd(x)
    k = min(shape)
    assert u.shape == (shape[0], k) and s.shape == (k,) and vh.shape == (k, shape[1])
    assert torch.allclose((u * s) @ vh, x, atol=1e-5)
    assert torch.allclose(u.mT @ u, torch.eye(k), atol=1e-5) and torch.allclose(vh @ vh.mT, torch.eye(k), atol=1e-5)
    assert torch.allclose(s, torch.linalg.svdvals(x.double()).float(), rtol=1e-5)
    assert (s[:-1] >= s[1:]).all()
    for bad in (float("nan"), float("inf"), -float("inf")):  # sgesdd refuses a NaN; an Inf once spun forever
        y = x.clone()
        y[0, 0] = bad
        assert lapack.svd(y) is None  # the caller takes torch's, as before


@needs_subset_solver
def test_a_square_svd_on_a_worker_takes_openblas_and_its_failure_torchs(monkeypatch):
    """What TSV-M's polar factors take (``polar_svd``): OpenBLAS's gesdd on a worker for a square fp32
    matrix; a matrix it fails on (None), a tall one, or the caller's thread get torch's, as before."""
    calls = []
    real = lapack.svd
    monkeypatch.setattr(lapack, "svd", lambda x: calls.append(tuple(x.shape)) or real(x))
    x = torch.randn(40, 40, generator=torch.Generator().manual_seed(11))
    u, s, vh = on_a_worker(lambda: thin_svd(x))
    assert calls == [(40, 40)] and torch.allclose((u * s) @ vh, x, atol=1e-5)
    on_a_worker(lambda: thin_svd(x[:, :30]))
    thin_svd(x)
    assert calls == [(40, 40)]
    monkeypatch.setattr(lapack, "svd", lambda x: calls.append("failed") and None)
    u, s, vh = on_a_worker(lambda: thin_svd(x))
    assert calls[-1] == "failed" and torch.allclose((u * s) @ vh, x, atol=1e-5)
