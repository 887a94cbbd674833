"""CART's spectrum in two stages (issue 18): the preparation takes each task's top eighth of directions per
matrix; a rank move that needs more, or the warm-up ahead of it, makes that matrix's spectrum whole. Every
rank's merge equals the one from a whole spectrum, and a sum from the first stage is never updated with the
second's directions."""
import math

import pytest
import torch
from helpers import ui_controller

from merger.methods import cart
from merger.methods.cart import apply_cart, cart_sums, cart_warm, prepare_cart
from merger.pool.task_vectors import TaskVectors

W = "visual.transformer.resblocks.0.mlp.c_fc.weight"
V = "visual.transformer.resblocks.0.attn.out_proj.weight"


def _tv(dtype="float32"):
    g = torch.Generator().manual_seed(5)
    base = {W: torch.randn(192, 96, generator=g), V: torch.randn(40, 40, generator=g)}
    experts = {str(t): {k: b + 1e-2 * torch.randn(b.shape, generator=g) for k, b in base.items()} for t in range(6)}
    return TaskVectors(base, experts, dtype=dtype)


def _columns(prepared):
    return {k: us.shape[2] for k, (us, _) in prepared["factors"].items()}


def _close(a, b, rel=2e-5):
    for k in b:
        if b[k] is None:
            assert a[k] is None, k
        else:
            assert (a[k] - b[k]).norm() <= rel * b[k].norm(), k


def test_the_preparation_keeps_the_top_eighth_and_a_rank_move_past_it_makes_the_spectrum_whole():
    tv = _tv()
    prepared, whole = prepare_cart(tv), prepare_cart(tv, share=1.0)
    assert _columns(prepared) == {W: 12, V: 5} and prepared["tv"] is tv  # ⌈96/8⌉, ⌈40/8⌉
    assert _columns(whole) == {W: 96, V: 40} and "tv" not in whole
    for ratio in (0.05, 0.12):  # within the first stage: nothing more is computed
        _close(cart_sums(prepared, ratio)["sums"], cart_sums(whole, ratio)["sums"])
        assert _columns(prepared) == {W: 12, V: 5}
    # 0.13 keeps 13 of 96 (more than 12) and 6 of 40 (more than 5): both made whole, and the task vectors let go
    _close(cart_sums(prepared, 0.13)["sums"], cart_sums(whole, 0.13)["sums"])
    assert _columns(prepared) == {W: 96, V: 40} and "tv" not in prepared
    for ratio in (0.3, 0.7):  # the complement above half the rank takes the bottom directions
        _close(cart_sums(prepared, ratio)["sums"], cart_sums(whole, ratio)["sums"])


def test_only_the_matrices_that_lack_the_directions_are_made_whole(monkeypatch):
    prepared = prepare_cart(_tv())
    calls, real = [], cart.spectral
    monkeypatch.setattr(cart, "spectral", lambda x, *a, **k: calls.append(x.shape) or real(x, *a, **k))
    cart_sums(prepared, 0.11)  # 11 of 96 (first stage: 12), 5 of 40 (first stage: 5)
    assert calls == []
    cart_sums(prepared, 0.125)  # 12 of 96, 5 of 40: still nothing
    assert calls == []
    cart.cart_task_parts(prepared, 0.14)  # AdaMerging+CART's parts: 14 of 96 and 6 of 40
    per_matrix = math.ceil(6 / cart.workers())  # 6 tasks, a worker's share of them a call
    assert sorted(c[1:] for c in calls) == [(40, 40)] * per_matrix + [(192, 96)] * per_matrix
    assert _columns(prepared) == {W: 96, V: 40}


def test_a_sum_from_the_first_stage_is_not_updated_with_the_whole_spectrums_directions():
    tv = _tv()
    prepared = prepare_cart(tv)
    start = cart_sums(prepared, 0.1)
    moved = cart_sums(prepared, 0.12, near=[start])  # both in the first stage: an update
    assert moved["chains"][W] == 1 and moved["stage"][W] == 12
    cart_sums(prepared, 0.3)  # makes every spectrum whole
    again = cart_sums(prepared, 0.11, near=[start, moved])
    assert again["chains"][W] == 0 and again["stage"][W] == 96  # computed from scratch
    on = cart_sums(prepared, 0.12, near=[again])
    assert on["chains"][W] == 1  # a sum from the whole spectrum is a starting point again
    _close(apply_cart(on, 1.5, 0.12), apply_cart(cart_sums(prepare_cart(tv, share=1.0), 0.12), 1.5, 0.12))


def test_the_warm_up_step_makes_whole_only_what_a_rank_needs_and_stops_at_its_gate():
    prepared = prepare_cart(_tv())
    cart_warm(prepared, None, lambda: True, rank_ratio=0.1)
    assert _columns(prepared) == {W: 12, V: 5}
    closed = iter([True, False])  # one share of tasks, then the gate closes: nothing half done is kept
    cart_warm(prepared, None, lambda: next(closed), rank_ratio=0.5)
    assert _columns(prepared) == {W: 12, V: 5} and "tv" in prepared
    cart_warm(prepared, None, lambda: True, rank_ratio=0.5)
    assert _columns(prepared) == {W: 96, V: 40} and "tv" not in prepared


@pytest.fixture()
def session(tmp_path):
    s = ui_controller(tmp_path).session
    s.PREPARE_INLINE_ENTRIES = 0  # this small pool stands for a ViT-B/32 one
    return s


def test_after_the_apps_preparation_the_warm_up_makes_every_spectrum_whole(session, monkeypatch):
    spec = session.spec("cart", lam=1.5, rank_ratio=0.08)
    session.prepare(spec)
    assert session.merges.warm_up.wait(timeout=120)
    _, state = session.merges.prepared_for(spec)
    assert all(us.shape[2] == min(us.shape[1], vh.shape[2]) for us, vh in state["factors"].values())
    assert "tv" not in state
    calls, real = [], cart.spectral
    monkeypatch.setattr(cart, "spectral", lambda *a, **k: calls.append(1) or real(*a, **k))
    far = session.spec("cart", lam=1.5, rank_ratio=0.6)
    delta = session.merges.delta(far)  # no spectrum computed in the move
    assert calls == []
    k = next(iter(state["factors"]))
    us, vh = state["factors"][k]
    r = min(us.shape[1], vh.shape[2])
    expected = torch.add(state["mean"][k], cart.rank_k_sum(us, vh, math.ceil(0.6 * r - 1e-9)), alpha=1.5)
    assert torch.equal(delta[k], expected)


def test_the_disk_cache_keeps_the_first_stage_and_a_reopened_preparation_completes_it(session):
    """The state written to disk holds the task vectors by reference (not their tensors): read back, its
    spectrum is completed from the pool's own."""
    from merger.io import disk_cache

    state = prepare_cart(session.pool.task_vectors)
    tensors, structure = disk_cache.flatten(state)
    assert sum(t.numel() for t in tensors.values()) < sum(v.numel() for v in session.pool.task_vectors.stacked.values())
    back = disk_cache.unflatten(structure, tensors, session.pool.task_vectors)
    assert back["tv"] is session.pool.task_vectors
    _close(cart_sums(back, 0.5)["sums"], cart_sums(prepare_cart(session.pool.task_vectors, share=1.0), 0.5)["sums"],
           rel=1e-4)


def test_full_rank_and_rank_zero_take_no_direction_and_a_sum_never_reads_past_its_factors():
    prepared = prepare_cart(_tv())
    sums = cart_sums(prepared, 1.0)["sums"]  # CART at full rank is θavg: nothing to compute
    assert all(v is None for v in sums.values()) and _columns(prepared) == {W: 12, V: 5}
    us, vh = prepared["factors"][W]
    with pytest.raises(ValueError, match="13 directions asked of factors holding 12"):
        cart.low_rank_sum(us, vh, 13)
    with pytest.raises(ValueError, match="a rank-60 sum of 96 takes 96 directions; the factors hold 12"):
        cart.rank_k_sum(us, vh, 60)


def test_a_merge_asked_at_a_rank_past_the_first_stage_prepares_every_direction_at_once(session, monkeypatch):
    tv = _tv()
    assert _columns(prepare_cart(tv, rank_ratio=0.1)) == {W: 12, V: 5}
    assert _columns(prepare_cart(tv, rank_ratio=0.3)) == {W: 96, V: 40}
    calls, real = [], cart.whole_spectrum
    monkeypatch.setattr(cart, "whole_spectrum", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    _, state = session.merges.prepared_for(session.spec("cart", rank_ratio=0.3))  # the API's and the CLI's way
    assert all(us.shape[2] == min(us.shape[1], vh.shape[2]) for us, vh in state["factors"].values())
    session.merges.delta(session.spec("cart", rank_ratio=0.3))
    assert calls == []  # no second stage: the preparation had every direction


def test_the_preparations_key_on_disk_follows_the_eigh_code_it_runs():
    from merger.evaluation.merges import code_of
    from merger.methods import lapack, linalg

    assert {cart, linalg, lapack} <= set(code_of(prepare_cart))  # lapack is imported as a module by linalg
