"""The bf16 Gram kernel (methods/native.py): the exact Gram of bf16 values from either layout and ragged
sizes, taken by linalg.gram_rows on a LAPACK worker, built once into the cache folder, and left for the
fp32 route, with the same answers, where it cannot be built."""
import logging
import os
import shutil

import pytest
import torch
from helpers import on_a_worker

from merger.methods import lowrank, native
from merger.methods.iso_cts import iso_cts_matrix
from merger.methods.linalg import gram_rows, spectral, unit_factors

needs_kernel = pytest.mark.skipif(not native.ready(), reason="no AVX512-BF16 CPU or no C compiler here")


@pytest.mark.skipif(not native._cpu_has_bf16_dot() or bool(os.environ.get("MERGER_NO_COMPILE"))
                    or not (shutil.which("cc") or shutil.which("gcc")), reason="no AVX512-BF16 CPU or no C compiler here")
def test_where_the_cpu_and_a_compiler_allow_it_the_kernel_is_built_and_passes_its_check():
    """The kernel's other tests skip where it is not ready: here a kernel that fails to build or its own
    check against fp64 is a failure, not a skip."""
    assert native.ready()


def _ragged(rows: int, depth: int, seed: int) -> torch.Tensor:
    return (torch.randn(rows, depth, generator=torch.Generator().manual_seed(seed)) * 1e-3).bfloat16()


@needs_kernel
@pytest.mark.parametrize("rows, depth", [(1, 1), (15, 7), (47, 130), (48, 2), (49, 131), (100, 1), (131, 3000)])
def test_the_kernel_is_the_exact_gram_from_either_layout_and_its_lower_triangle_alone(rows, depth):
    """Row-major rows, a tall matrix's columns (a transposed view, no copy), an odd depth (the last pair
    half empty), rows past a 48-row panel; fp32 accumulation of exact products: within 1e-6 of the fp64
    sum, as OpenBLAS's fp32 ?syrk (1.1e-6 at 768 × 3072)."""
    a = _ragged(rows, depth, rows + depth)
    for view in (a, a.mT.contiguous().mT, a[:, : max(1, depth - 1)]):
        exact = view.double() @ view.double().mT
        whole, lower = native.gram_bf16(view), native.gram_bf16(view, lower=True)
        assert whole.dtype == torch.float32 and whole.shape == (rows, rows)
        assert float((whole.double() - exact).abs().max()) <= 1e-6 * float(exact.abs().max())
        assert torch.equal(whole, whole.mT)
        assert torch.equal(lower, torch.tril(whole)) and not lower.triu(1).any()


@needs_kernel
def test_a_768_by_3072_gram_stays_below_fp32_syrks_rounding():
    """Sums of 64 pairs join the running sums (CHUNK): one running sum over 1536 pairs was 5e-6 off."""
    a = _ragged(768, 3072, 1)
    exact = a.double() @ a.double().mT
    err = float((native.gram_bf16(a).double() - exact).abs().max()) / float(exact.abs().max())
    assert err <= 6e-7


@needs_kernel
def test_gram_rows_takes_the_kernel_for_bf16_on_a_worker_only(monkeypatch):
    calls = []
    real = native.gram_bf16
    monkeypatch.setattr(native, "gram_bf16", lambda a, lower=False: calls.append((tuple(a.shape), lower)) or real(a, lower))
    a = _ragged(300, 500, 2)
    on_worker = on_a_worker(lambda: gram_rows(a.mT, lower=True))
    assert calls == [((500, 300), True)]  # the transposed view as it is
    on_a_worker(lambda: gram_rows(a.float()))  # fp32: never the kernel
    here = gram_rows(a.mT)  # the caller's thread: torch's product on every core
    assert len(calls) == 1
    assert torch.allclose(on_worker, torch.tril(here), rtol=0, atol=1e-6 * float(here.abs().max()))


def test_without_a_compiler_or_with_compiling_off_grams_take_the_fp32_route(monkeypatch, tmp_path, caplog):
    """CC that fails: a warning, ready() False, and gram_rows on a worker still the exact Gram (?syrk)."""
    monkeypatch.setenv("MERGER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    monkeypatch.delitem(native._STATE, "lib", raising=False)
    with caplog.at_level(logging.WARNING, logger="merger.methods.native"):
        ready = native.ready()
    if native._cpu_has_bf16_dot() and not os.environ.get("MERGER_NO_COMPILE"):
        assert "bf16 Gram kernel unavailable" in caplog.text
    assert ready is False and not list(tmp_path.glob("kernels/*.so"))
    a = _ragged(90, 200, 3)
    exact = a.double() @ a.double().mT
    assert float((on_a_worker(lambda: gram_rows(a)).double() - exact).abs().max()) <= 1e-6 * float(exact.abs().max())
    monkeypatch.delenv("CC")
    monkeypatch.setenv("MERGER_NO_COMPILE", "1")
    monkeypatch.delitem(native._STATE, "lib")
    assert native.ready() is False


@needs_kernel
def test_the_kernel_is_built_once_into_the_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("MERGER_CACHE_DIR", str(tmp_path))
    monkeypatch.delitem(native._STATE, "lib")
    assert native.ready()
    (built,) = tmp_path.glob("kernels/gram_bf16-*.so")
    stamp = built.stat().st_mtime_ns
    monkeypatch.delitem(native._STATE, "lib")
    assert native.ready() and built.stat().st_mtime_ns == stamp  # loaded, not compiled again
    assert not list(tmp_path.glob("kernels/*.tmp"))


@pytest.mark.parametrize("shape", [(60, 24), (24, 60), (32, 32)])
def test_tsvm_grams_from_the_stored_factors_are_the_unit_factors_grams(shape):
    """_concatenated_grams takes the stored (bf16) factors and scales the side holding S afterwards: the
    Grams of the unit factors (fp64 reference), on a worker (the kernel where built) and off it."""
    T, (m, n) = 4, shape
    x = (torch.randn(T, m, n, generator=torch.Generator().manual_seed(m + n)) * 1e-3).bfloat16()
    left, right, s = spectral(x, min(m, n) // T, dtype=torch.bfloat16)
    u, vh = unit_factors(left.double(), right.double(), s.double())
    K = left.shape[2]
    exact = [u.permute(0, 2, 1).reshape(T * K, m), vh.reshape(T * K, n)]
    exact = torch.stack([e @ e.mT for e in exact])
    for got in (lowrank._concatenated_grams(left, right, s), on_a_worker(lambda: lowrank._concatenated_grams(left, right, s))):
        assert got.shape == (2, T * K, T * K)
        assert float((got.double() - exact).abs().max()) <= 2e-6 * float(exact.abs().max())


def test_iso_cts_of_the_stored_bf16_stack_is_that_of_its_fp32_copy():
    """Iso-CTS' residual Grams from the stored bf16 stack (the kernel's exact products) on a tall matrix,
    a wide one and a square one: the same direction as from the fp32 copy."""
    for m, n in ((72, 40), (40, 72), (48, 48)):
        stack = (torch.randn(4, m, n, generator=torch.Generator().manual_seed(m * n)) * 1e-2).bfloat16()
        got = on_a_worker(lambda: iso_cts_matrix(stack, 0.5))
        want = on_a_worker(lambda: iso_cts_matrix(stack.float(), 0.5))
        assert torch.allclose(got, want, rtol=0, atol=2e-5 * float(want.abs().max()))


@needs_kernel
def test_an_empty_matrix_of_any_strides_has_a_zero_gram():
    a = torch.zeros(5, 10, dtype=torch.bfloat16)
    for view in (a[:, 0:0:2], a[:0], a[:, :0].mT.mT):
        assert torch.equal(native.gram_bf16(view), torch.zeros(view.shape[0], view.shape[0]))


@needs_kernel
def test_a_corrupt_library_in_the_cache_is_built_again_and_cc_may_carry_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("MERGER_CACHE_DIR", str(tmp_path / "first"))
    monkeypatch.setenv("CC", f"{shutil.which('cc') or shutil.which('gcc')} -std=gnu11")
    monkeypatch.delitem(native._STATE, "lib")
    assert native.ready()
    (built,) = (tmp_path / "first").glob("kernels/gram_bf16-*.so")
    # the same name in another cache, not a library (a library loaded here is never written over: SIGBUS)
    corrupt = tmp_path / "second" / "kernels" / built.name
    corrupt.parent.mkdir(parents=True)
    corrupt.write_bytes(b"not a shared library")
    monkeypatch.setenv("MERGER_CACHE_DIR", str(tmp_path / "second"))
    monkeypatch.delitem(native._STATE, "lib")
    assert native.ready()
    assert corrupt.read_bytes()[:4] == b"\x7fELF"
    a = _ragged(50, 70, 4)
    exact = a.double() @ a.double().mT
    assert float((native.gram_bf16(a).double() - exact).abs().max()) <= 1e-6 * float(exact.abs().max())


def test_an_edit_of_the_kernels_source_misses_the_disk_cache(monkeypatch, tmp_path):
    """The preparations' cache key hashes their modules' sources; TSV-M's reach native.py, whose C source
    counts too: a changed kernel never reads Grams an older one left on disk."""
    from merger.evaluation.merges import code_of
    from merger.io.disk_cache import source_hash

    modules = code_of(lowrank.prepare_tsv)
    assert native in modules
    source = tmp_path / "gram_bf16.c"
    source.write_text("/* one */")
    monkeypatch.setattr(native, "NATIVE_SOURCES", (source,))
    before = source_hash.__wrapped__(*modules)  # (cached per process: sources do not change under it)
    source.write_text("/* two */")
    assert source_hash.__wrapped__(*modules) != before
