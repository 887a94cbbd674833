"""Every static method against its formula (METHODS.md), and the identities between them."""
import math

import pytest
import torch

import merger
from merger.methods.lowrank import cart_delta, prepare_cart
from merger.task_vectors import TaskVectors, is_matrix
from helpers import base_and_experts

ATOL = 1e-5


@pytest.fixture(scope="module")
def world():
    base, experts = base_and_experts(n_experts=3, scale=0.05)
    keys = [k for k in base if k.startswith("visual.") and base[k].is_floating_point()]
    taus = [{k: e[k] - base[k] for k in keys} for e in experts]
    return base, experts, keys, taus


def merged_visual(sd, keys):
    return {k: sd[k] for k in keys}


def close(a, b, atol=ATOL):
    for k in b:
        assert torch.allclose(a[k], b[k], atol=atol), k


def kth_threshold(flat_abs, sparsity):
    n = flat_abs.numel()
    keep = max(1, math.floor((1 - sparsity) * n + 1e-6))
    return flat_abs.sort().values[n - keep]


def svd_k(m, k):
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    return u[:, :k] @ torch.diag(s[:k]) @ vh[:k]


def test_weight_averaging_is_mean_of_experts(world):
    base, experts, keys, _ = world
    out = merger.merge_state_dicts(base, experts, "weight_averaging")
    close(out, {k: sum(e[k] for e in experts) / 3 for k in keys})


@pytest.mark.parametrize("lam", [0.3, 1.0, -0.5])
def test_task_arithmetic_formula(world, lam):
    base, experts, keys, taus = world
    out = merger.merge_state_dicts(base, experts, "task_arithmetic", lam=lam)
    close(out, {k: base[k] + lam * sum(t[k] for t in taus) for k in keys})


def test_task_arithmetic_at_one_over_T_is_weight_averaging(world):
    base, experts, keys, _ = world
    ta = merger.merge_state_dicts(base, experts, "task_arithmetic", lam=1 / 3)
    wa = merger.merge_state_dicts(base, experts, "weight_averaging")
    close(ta, merged_visual(wa, keys))


def test_untouched_tensors_come_from_base(world):
    base, experts, keys, _ = world
    out = merger.merge_state_dicts(base, experts, "ties", lam=1.0, sparsity=0.8)
    assert set(out) == set(base)
    for k in base:
        if k not in keys:
            assert torch.equal(out[k], base[k]), k


@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.8, 0.837])
def test_ties_formula(world, sparsity):
    base, experts, keys, taus = world
    lam = 0.9
    trimmed = []
    for t in taus:
        flat = torch.cat([t[k].reshape(-1) for k in keys])
        thr = kth_threshold(flat.abs(), sparsity)
        trimmed.append({k: torch.where(t[k].abs() >= thr, t[k], torch.zeros(())) for k in keys})
    expected = {}
    for k in keys:
        stack = torch.stack([tr[k] for tr in trimmed])
        sign = torch.sign(stack.sum(0))
        agree = (torch.sign(stack) == sign) & (stack != 0)
        mean = (stack * agree).sum(0) / agree.sum(0).clamp(min=1)
        expected[k] = base[k] + lam * mean
    out = merger.merge_state_dicts(base, experts, "ties", lam=lam, sparsity=sparsity)
    close(out, expected)


def test_ties_keeps_the_requested_fraction(world):
    base, experts, keys, taus = world
    out = merger.merge_state_dicts(base, experts[:1], "ties", lam=1.0, sparsity=0.9)
    n = sum(base[k].numel() for k in keys)
    kept = sum(int((out[k] != base[k]).sum()) for k in keys)
    assert abs(kept / n - 0.1) < 0.005


def test_ties_sparsity_zero_one_expert_is_task_arithmetic(world):
    base, experts, keys, _ = world
    ties = merger.merge_state_dicts(base, experts[:1], "ties", lam=0.7, sparsity=0.0)
    ta = merger.merge_state_dicts(base, experts[:1], "task_arithmetic", lam=0.7)
    close(ties, merged_visual(ta, keys))


def test_dare_linear_entries_are_dropped_or_rescaled(world):
    base, experts, keys, taus = world
    p = 0.6
    out = merger.merge_state_dicts(base, experts[:1], "dare_linear", lam=1.0, sparsity=p, seed=3)
    dropped = total = 0
    for k in keys:
        d = out[k] - base[k]
        kept = d != 0
        assert torch.allclose(d[kept], taus[0][k][kept] / (1 - p), atol=ATOL)
        dropped += int((~kept).sum())
        total += d.numel()
    assert abs(dropped / total - p) < 0.02


def test_dare_is_seeded(world):
    base, experts, keys, _ = world
    a = merger.merge_state_dicts(base, experts, "dare_linear", lam=0.3, sparsity=0.9, seed=1)
    b = merger.merge_state_dicts(base, experts, "dare_linear", lam=0.3, sparsity=0.9, seed=1)
    c = merger.merge_state_dicts(base, experts, "dare_linear", lam=0.3, sparsity=0.9, seed=2)
    assert all(torch.equal(a[k], b[k]) for k in keys)
    assert not all(torch.equal(a[k], c[k]) for k in keys)


def test_dare_preserves_the_expectation_of_tau(world):
    base, experts, keys, taus = world
    k = next(k for k in keys if k.endswith("mlp.c_fc.weight"))
    p = 0.7
    runs = [merger.merge_state_dicts(base, experts[:1], "dare_linear", lam=1.0, sparsity=p, seed=s)[k]
            for s in range(400)]
    mean = torch.stack(runs).mean(0) - base[k]
    # std of the mean of 400 draws of τ·B/(1−p): |τ|·sqrt(p/(1−p))/20
    tol = 5 * taus[0][k].abs() * math.sqrt(p / (1 - p)) / 20 + 1e-6
    assert bool(((mean - taus[0][k]).abs() <= tol).all())


def test_dare_ties_formula(world):
    base, experts, keys, taus = world
    p, lam, seed = 0.5, 0.8, 4
    # masks are seeded by task name, so each expert's dropped τ̃ can be read off a one-expert merge
    named = {f"expert_{i + 1}": e for i, e in enumerate(experts)}
    dropped = []
    for i in range(3):
        one = merger.merge_state_dicts(base, named, "dare_linear", lam=1.0, sparsity=p, seed=seed,
                                       experts=[f"expert_{i + 1}"])
        dropped.append({k: one[k] - base[k] for k in keys})
    expected = {}
    for k in keys:
        stack = torch.stack([d[k] for d in dropped])
        sign = torch.sign(stack.sum(0))
        agree = (torch.sign(stack) == sign) & (stack != 0)
        expected[k] = base[k] + lam * (stack * agree).sum(0) / agree.sum(0).clamp(min=1)
    out = merger.merge_state_dicts(base, named, "dare_ties", lam=lam, sparsity=p, seed=seed)
    close(out, expected)


@pytest.mark.parametrize("rank_ratio", [0.1, 0.25, 0.5])
def test_cart_formula(world, rank_ratio):
    base, experts, keys, _ = world
    lam = 1.5
    avg = {k: sum(e[k] for e in experts) / 3 for k in keys}
    expected = {}
    for k in keys:
        if is_matrix(k, base[k].shape):
            kk = max(1, math.floor(rank_ratio * min(base[k].shape)))
            expected[k] = avg[k] + lam * sum(svd_k(e[k] - avg[k], kk) for e in experts)
        else:
            expected[k] = avg[k]
    out = merger.merge_state_dicts(base, experts, "cart", lam=lam, rank_ratio=rank_ratio)
    close(out, expected, atol=1e-4)


@pytest.mark.parametrize("lam", [0.0, 1.0, 2.7])
def test_cart_at_rank_zero_and_full_rank_is_weight_averaging(world, lam):
    base, experts, keys, _ = world
    wa = merger.merge_state_dicts(base, experts, "weight_averaging")
    full = merger.merge_state_dicts(base, experts, "cart", lam=lam, rank_ratio=1.0)
    close(full, merged_visual(wa, keys))
    tv = TaskVectors(base, {str(i): e for i, e in enumerate(experts)})
    prepared = prepare_cart(tv)
    for rank in (lambda m, n: 0, lambda m, n: min(m, n)):
        delta = cart_delta(prepared, lam, rank)
        close({k: base[k] + delta[k] for k in keys}, merged_visual(wa, keys))
    # and the full-rank identity holds in the arithmetic too, not only by the shortcut
    k = tv.matrices[0]
    us, vh = prepared["factors"][k]
    from merger.methods.lowrank import low_rank_sum
    assert torch.allclose(low_rank_sum(us, vh, min(us.shape[1], vh.shape[2])), torch.zeros(()), atol=1e-5)


def test_cart_note_says_lambda_has_no_effect_at_full_rank():
    cart = merger.methods.get("cart")
    assert "no effect" in cart.note({"rank_ratio": 1.0, "lam": 1.0}, None)
    assert cart.note({"rank_ratio": 0.08, "lam": 1.0}, None) is None


def orth(x):
    p, _, qh = torch.linalg.svd(x, full_matrices=False)
    return p @ qh


@pytest.mark.parametrize("rank_ratio", [None, 0.2])
def test_tsv_m_formula(world, rank_ratio):
    base, experts, keys, taus = world
    lam = 1.1
    expected = {}
    ratio = rank_ratio if rank_ratio is not None else 1 / 3
    for k in keys:
        if is_matrix(k, base[k].shape):
            kk = max(1, math.floor(ratio * min(base[k].shape) + 1e-9))
            us, ss, vs = [], [], []
            for t in taus:
                u, s, vh = torch.linalg.svd(t[k], full_matrices=False)
                us.append(u[:, :kk]); ss.append(s[:kk]); vs.append(vh[:kk].T)
            U, S, V = orth(torch.cat(us, 1)), torch.cat(ss), orth(torch.cat(vs, 1))
            expected[k] = base[k] + lam * U @ torch.diag(S) @ V.T
        else:
            expected[k] = base[k] + lam * sum(t[k] for t in taus) / 3
    params = {"lam": lam} if rank_ratio is None else {"lam": lam, "rank_ratio": rank_ratio}
    out = merger.merge_state_dicts(base, experts, "tsv_m", **params)
    close(out, expected, atol=1e-4)


def test_iso_c_formula(world):
    base, experts, keys, taus = world
    lam = 1.3
    expected = {}
    for k in keys:
        total = sum(t[k] for t in taus)
        if is_matrix(k, base[k].shape):
            u, s, vh = torch.linalg.svd(total, full_matrices=False)
            total = s.mean() * u @ vh
        expected[k] = base[k] + lam * total
    close(merger.merge_state_dicts(base, experts, "iso_c", lam=lam), expected, atol=1e-4)


def test_every_static_method_is_deterministic(world):
    base, experts, keys, _ = world
    for name in [m.name for m in merger.methods.all_methods() if m.kind == "static"]:
        a = merger.merge_state_dicts(base, experts, name)
        b = merger.merge_state_dicts(base, experts, name)
        assert all(torch.equal(a[k], b[k]) for k in keys), name


def test_ties_grid_lookup_equals_direct_trimming(world):
    base, experts, keys, _ = world
    grid = merger.merge_state_dicts(base, experts, "ties", lam=1.0, sparsity=0.7)
    direct = merger.merge_state_dicts(base, experts, "ties", lam=1.0, sparsity=0.7 + 1e-8)
    close(grid, merged_visual(direct, keys), atol=1e-6)
