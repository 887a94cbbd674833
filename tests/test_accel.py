"""Each drop-in in merger/accel equals the reference it replaces, under the precision contract (1e-4
relative per matrix; most hold far closer), on inputs of ViT-B/32's sizes; where its own route does not
hold it hands the call back to the reference; references can be asked for instead."""
import os
import subprocess
import sys

import pytest
import torch

from merger.accel import drop_ins, reference_only, references_asked
from merger.accel.registry import accelerable, drop_in
from merger.methods import cart, entries, iso, spectral, ties
from devtools.testing import VIT_B32_BLOCK, realistic_task_vectors

IN_PROJ, OUT_PROJ, C_FC, C_PROJ, BIAS = VIT_B32_BLOCK


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def both(fn, *args, **kwargs):
    """(the drop-in's result, the reference's) of an accelerable function."""
    fast = fn(*args, **kwargs)
    with reference_only():
        return fast, fn(*args, **kwargs)


@pytest.fixture(scope="module")
def block():
    return realistic_task_vectors(3, VIT_B32_BLOCK, "bfloat16", seed=11)


def test_every_drop_in_names_an_accelerable_reference():
    import importlib

    assert len(drop_ins()) == 9
    for d in drop_ins():
        module, name = d.reference.rsplit(".", 1)
        fn = getattr(importlib.import_module(module), name)
        assert callable(getattr(fn, "reference", None)), d.reference
        assert d.how


@pytest.mark.parametrize("key", [IN_PROJ, OUT_PROJ, C_FC, C_PROJ])
def test_gram_spectra_are_the_fp64_svds(block, key):
    """Top triplets (as their rank-k sum), singular bases (as their rank-k projectors) and orthogonal
    factors from fp64 Grams, against fp64 SVDs: within 1e-8."""
    tau = block.stacked[key][0]
    for k in (96, 256):
        (u, s, vh), (u0, s0, vh0) = both(spectral.top_svd, tau, k)
        assert rel(s, s0) < 1e-10 and rel((u * s) @ vh, (u0 * s0) @ vh0) < 1e-8, k
    basis, basis0 = both(spectral.singular_basis, tau)
    for k in (62, 384, 700):
        assert rel(basis[:, :k] @ basis[:, :k].mT, basis0[:, :k] @ basis0[:, :k].mT) < 1e-8, k
    concatenated = torch.cat([spectral.top_svd(t, 256)[0] for t in block.stacked[key]], 1)  # [m, 768], TSV-M's U
    (s, factor), (s0, factor0) = both(spectral.polar_factor, concatenated)
    assert rel(s, s0) < 1e-10 and rel(factor, factor0) < 1e-8


def test_a_gram_hands_back_what_it_cannot_resolve():
    """A matrix of rank 40: its 64th singular value is rounding, which a Gram cannot tell from a small one;
    the top 64 triplets, the orthogonal factor and the refusal are then the reference's own."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(768, 40, generator=g, dtype=torch.float64) @ torch.randn(40, 768, generator=g, dtype=torch.float64)
    (u, s, vh), (u0, s0, vh0) = both(spectral.top_svd, x, 64)
    assert torch.equal(u, u0) and torch.equal(s, s0) and torch.equal(vh, vh0)
    (s, factor), (s0, factor0) = both(spectral.polar_factor, x)
    assert torch.equal(s, s0) and torch.equal(factor, factor0) and factor.shape == (768, 768)
    with pytest.raises(Exception, match="nearly\\) linearly dependent"):
        spectral.polar(x, "the test's matrix")


def test_histogram_thresholds_are_the_partitions_bit_for_bit(block):
    rows = [v[2] for v in block.stacked.values()]
    n = sum(r.numel() for r in rows)
    kept = [ties.kept_count(n, j / 100) for j in range(0, 100, 7)] + [1, n]
    fast, reference = both(ties.magnitude_thresholds, rows, kept)
    assert torch.equal(fast, reference)
    fp32 = [r.float() for r in rows]  # not bf16: the reference itself
    assert torch.equal(*both(ties.magnitude_thresholds, fp32, kept))


@pytest.mark.parametrize("name", ["ties", "dare_linear", "dare_ties", "consensus_ta", "breadcrumbs"])
def test_compiled_entrywise_merges_are_the_eager_ones(name):
    """The entry-by-entry merges over a whole stack compiled (where a compiler works; eager otherwise)
    against the sliced eager reference, on the largest ViT-B/32 stack (above the compile threshold)."""
    import merger
    from merger.accel.compiled import FUSE_ABOVE

    m = merger.methods.get(name)
    tv = realistic_task_vectors(8, {C_FC: VIT_B32_BLOCK[C_FC]}, "bfloat16", seed=2)
    assert tv.stacked[C_FC].numel() > FUSE_ABOVE
    params = m.resolve({}, tv.num_tasks)
    prepared = m.prepare(tv, **{k: params[k] for k in m.prepare_params})
    fast, reference = both(m.delta, prepared, **params)
    assert rel(fast[C_FC], reference[C_FC]) < 1e-6, name


def test_without_a_compiler_the_entrywise_merges_stay_eager_and_say_so_once(monkeypatch, caplog):
    from merger.accel import compiled

    monkeypatch.setitem(compiled._FAILED, "compile", False)

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(torch, "compile", no_compiler)
    stack = torch.randn(8, 600_000)
    args = (torch.full((8,), 0.5), torch.ones(8))
    with caplog.at_level("WARNING"):
        out = entries.entrywise(ties.ties_entries, stack, args=args)
    assert compiled._FAILED["compile"] and "merging eagerly" in caplog.text
    with reference_only():
        assert torch.equal(out, entries.entrywise(ties.ties_entries, stack, args=args))


def test_cart_rank_sums_from_a_nearby_rank_are_the_sums_from_scratch(block):
    """Up and down from a rank derived before, across half the rank (the complement), and from a sum that
    was itself updated: the sums from scratch within 1e-5; a chain of updates is cut at CHAIN."""
    from merger.accel import cart_ranks

    tv = realistic_task_vectors(8, {k: VIT_B32_BLOCK[k] for k in (OUT_PROJ, C_PROJ)}, "bfloat16", seed=5)
    prepared = cart.prepare_cart(tv)
    previous, matrix = cart.rank_sums(prepared, 0.3), OUT_PROJ
    assert previous["chains"][matrix] == 0
    for ratio, chain in ((0.32, 1), (0.34, 2), (0.3, 3), (0.55, 4), (0.08, 0), (0.1, 1), (0.7, 0)):
        moved = cart.rank_sums(prepared, ratio, near=[previous])  # a far jump starts over
        assert moved["chains"][matrix] == chain, ratio
        with reference_only():
            scratch = cart.rank_sums(prepared, ratio)
        for key in scratch["sums"]:
            assert rel(moved["sums"][key], scratch["sums"][key]) < 1e-5, (ratio, key)
        previous = moved
    capped = dict(previous, chains={k: cart_ranks.CHAIN for k in previous["chains"]})
    assert cart.rank_sums(prepared, 0.71, near=[capped])["chains"][matrix] == 0


@pytest.mark.parametrize("keys, T", [((C_PROJ, OUT_PROJ), 8), ((IN_PROJ,), 3)])
def test_iso_cts_from_its_structure_is_the_reference(keys, T):
    tv = realistic_task_vectors(T, {k: VIT_B32_BLOCK[k] for k in keys}, "bfloat16", seed=T)
    for key in keys:
        c, q = iso.split_rank(768, T, 0.8)
        fast, reference = both(iso.iso_cts_matrix, tv.stacked[key], c, q, key)
        assert rel(fast, reference) < 1e-8, key


def test_references_can_be_asked_for_in_a_block_or_by_the_environment(monkeypatch):
    from merger.accel import registry

    monkeypatch.setattr(registry, "_DROP_INS", dict(registry._DROP_INS))  # the test's drop-in goes with it
    calls = []

    @accelerable
    def plain(x):
        return ("reference", x)

    drop_in(f"{__name__}.{plain.__qualname__}", "a test's drop-in")(lambda reference, x: calls.append(x) or ("fast", x))
    assert plain(1) == ("fast", 1) and calls == [1]
    with reference_only():
        assert references_asked() and plain(2) == ("reference", 2)
    assert plain(3) == ("fast", 3)
    with pytest.raises(ValueError, match="two drop-ins"):
        drop_in(f"{__name__}.{plain.__qualname__}", "again")(lambda reference, x: x)
    out = subprocess.run([sys.executable, "-c", "from merger.accel import references_asked; print(references_asked())"],
                         capture_output=True, text=True, env={**os.environ, "MERGER_REFERENCE": "1"}, timeout=120)
    assert out.stdout.strip() == "True", out.stderr
