"""Every static method against its formula (docs/methods.md), and the identities between them."""
import math

import pytest
import torch
from helpers import base_and_experts, close, random_world

import merger
from merger.methods.cart import low_rank_sum, prepare_cart, rank_sums
from merger.pool.task_vectors import TaskVectors, is_matrix

ATOL = 1e-5


@pytest.fixture(scope="module")
def world():
    return random_world()


def merged_visual(sd, keys):
    return {k: sd[k] for k in keys}


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


def test_ties_keeps_exactly_the_requested_share_of_entries(world):
    """⌊(1 − sparsity)·N⌋ entries of one expert's N, counted: not the authors' code's one more
    (docs/methods.md, TIES' conventions)."""
    base, experts, keys, taus = world
    n = sum(base[k].numel() for k in keys)
    for p in (10, 20, 25, 43, 50, 69, 75):  # sparsity 0.9, 0.8, 0.75, 0.57, ...: N·p/100 whole at 25, 50, 75
        out = merger.merge_state_dicts(base, experts[:1], "ties", lam=1.0, sparsity=(100 - p) / 100)
        assert sum(int((out[k] != base[k]).sum()) for k in keys) == p * n // 100, p


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


def test_dare_keeps_each_entry_with_probability_one_minus_p(world):
    """DARE's draws are uniform integers in [FIRST, FIRST + LEVELS): the keep rule draw ≥ level(p) keeps 1 − p
    of them at every rate, and the levels are ordered. Read as bf16 (the compiled merges do) they are
    positive, normal, finite and in the same order."""
    from merger.methods.ties import FIRST, LEVELS, dare_level, prepare_dare

    base, experts, keys, _ = world
    tv = TaskVectors(base, {str(i): e for i, e in enumerate(experts)})
    draws = torch.cat([d.reshape(-1) for d in prepare_dare(tv, 5)["draws"].values()])
    assert draws.dtype == torch.int16 and int(draws.min()) >= FIRST and int(draws.max()) < FIRST + LEVELS
    every = torch.arange(FIRST, FIRST + LEVELS, dtype=torch.int16).view(torch.bfloat16).float()
    assert bool(every.isfinite().all()) and float(every[0]) >= torch.finfo(torch.bfloat16).tiny
    assert bool((every[1:] > every[:-1]).all())
    assert bool((draws >= dare_level(0.0)).all())
    for p in (0.1, 0.5, 0.9, 0.99):
        assert abs(float((draws >= dare_level(p)).float().mean()) - (1 - p)) < 0.01, p
    levels = [int(dare_level(p)) for p in (0.0, 0.25, 0.5, 0.75, 0.999)]
    assert levels == sorted(levels) and len(set(levels)) == 5


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
            kk = math.ceil(rank_ratio * min(base[k].shape))  # CART (arXiv 2412.12153), Algorithm 1, line 6: k = ⌈γ · r⌉
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
    for ratio in (1e-9, 1.0):  # k = 1 is the least a positive ratio keeps; full rank: the sum is zero
        sums = rank_sums(prepared, ratio)["sums"]
        assert all(s is None for s in sums.values()) == (ratio == 1.0)
    close({k: base[k] + prepared["mean"][k] for k in keys}, merged_visual(wa, keys))
    # and the full-rank identity holds in the arithmetic too, not only by the shortcut
    k = tv.matrices[0]
    basis = prepared["basis"][k]
    assert torch.allclose(low_rank_sum(tv.fp32(k) - prepared["mean"][k], basis, basis.shape[-1]), torch.zeros(()),
                          atol=1e-5)


def test_cart_keeps_the_ceiling_of_the_rank_ratio():
    from merger.methods.registry import kept_rank

    # the demo's matrices have min dimension 96: 8 % keeps 8 (not 7), 1 % and 2 % keep 1 and 2
    assert [kept_rank(r, 96, 288) for r in (0.01, 0.02, 0.08, 0.5, 1.0)] == [1, 2, 8, 48, 96]
    assert kept_rank(0.08, 100, 100) == 8  # a product that lands on an integer is not pushed up
    assert kept_rank(0.08, 768, 768) == 62  # ViT-B/32 (the authors' code keeps 61)


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
    for k in keys:
        if is_matrix(k, base[k].shape):
            r = min(base[k].shape)
            kk = r // 3 if rank_ratio is None else math.floor(rank_ratio * r + 1e-9)
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


def iso_c_reference(base, taus, keys, lam):
    """The Iso authors' iso_c: the mean task vector, and on matrices the sum with its spectrum
    flattened to the mean singular value."""
    out = {}
    for k in keys:
        mean = sum(t[k] for t in taus) / len(taus)
        if is_matrix(k, base[k].shape):
            u, s, vh = torch.linalg.svd(mean * len(taus), full_matrices=False)
            mean = torch.linalg.multi_dot((u, torch.diag(torch.ones_like(s) * s.mean()), vh))
        out[k] = base[k] + lam * mean
    return out


def test_iso_c_formula(world):
    base, experts, keys, taus = world
    lam = 1.3
    out = merger.merge_state_dicts(base, experts, "iso_c", lam=lam)
    close(out, iso_c_reference(base, taus, keys, lam), atol=1e-4)
    bias = next(k for k in keys if k.endswith("ln_1.bias"))  # an "other" tensor moves by λ · mean τ
    assert torch.allclose(out[bias] - base[bias], lam * sum(t[bias] for t in taus) / 3, atol=1e-6)


# Widths divisible by every T tested below (168 = 8 · 3 · 7): r / T is a whole number, where a
# rank rule that is one short shows.
WIDE = {"embed_dim": 16, "vision_cfg": {"image_size": 16, "patch_size": 8, "width": 168, "layers": 1, "head_width": 24,
                                        "mlp_ratio": 2},
        "text_cfg": {"context_length": 8, "vocab_size": 64, "width": 32, "heads": 2, "layers": 1}}


@pytest.fixture(scope="module")
def wide():
    base, experts = base_and_experts(n_experts=12, scale=0.05, config=WIDE)
    keys = [k for k in base if k.startswith("visual.") and base[k].is_floating_point()]
    return base, experts, keys, [{k: e[k] - base[k] for k in keys} for e in experts]


def tsv_m_reference(base, taus, keys, lam, k_of):
    """The TSV authors' merge: per matrix, the top-k triplets of every task side by side, U and V
    replaced by their nearest orthogonal matrices; the mean task vector elsewhere."""
    out = {}
    for key in keys:
        if not is_matrix(key, base[key].shape):
            out[key] = base[key] + lam * sum(t[key] for t in taus) / len(taus)
            continue
        k = k_of(min(base[key].shape))
        svds = [torch.linalg.svd(t[key], full_matrices=False) for t in taus]
        U = torch.cat([u[:, :k] for u, _, _ in svds], 1)
        S = torch.cat([s[:k] for _, s, _ in svds])
        V = torch.cat([vh[:k] for _, _, vh in svds], 0)
        uu, _, vu = torch.linalg.svd(U, full_matrices=False)
        uv, _, vv = torch.linalg.svd(V, full_matrices=False)
        out[key] = base[key] + lam * torch.linalg.multi_dot((uu @ vu, torch.diag(S), uv @ vv))
    return out


@pytest.mark.parametrize("T", [3, 6, 7, 8, 12])
def test_tsv_m_default_rank_is_exactly_r_over_T(wide, T):
    base, experts, keys, taus = wide
    out = merger.merge_state_dicts(base, experts[:T], "tsv_m", lam=1.0)
    expected = tsv_m_reference(base, taus[:T], keys, 1.0, lambda r: r // T)  # the authors' int(r · 1/T)
    close(out, expected, atol=2e-4)
    # 1/T given as a number is the same merge; one step of the slider above 1/T is refused
    same = merger.merge_state_dicts(base, experts[:T], "tsv_m", lam=1.0, rank_ratio=1 / T)
    close(same, merged_visual(out, keys), atol=1e-6)
    with pytest.raises(merger.MethodError, match=rf"rank_ratio=.* is above {1 / T:.6g} with {T} experts"):
        merger.merge_state_dicts(base, experts[:T], "tsv_m", lam=1.0, rank_ratio=round(1 / T, 2) + 0.01)


def test_tsv_m_rank_is_not_one_short_where_rounding_1_over_T_was(wide):
    base, experts, keys, taus = wide
    from merger.methods.tsv_m import tsv_rank

    assert tsv_rank("auto", 768, 768, 3) == 256 and tsv_rank(round(1 / 3, 6), 768, 768, 3) == 255
    assert tsv_rank("auto", 768, 3072, 8) == 96
    spec = merger.Spec.make("tsv_m", {}, None, [f"t{i}" for i in range(8)])
    assert spec.kwargs["rank_ratio"] == "auto" and spec.snap().kwargs["rank_ratio"] == "auto"


def test_tsv_m_with_more_experts_than_a_rank_keeps_no_direction_there():
    """T > r: ⌊r/T⌋ = 0 singular vectors per task, so the matrices stay at θ0 (the preparation used to
    fail reshaping its empty factors); the other tensors get λ · mean τ, and the state survives the disk."""
    from merger.io.disk_cache import flatten, unflatten
    from merger.methods.tsv_m import prepare_tsv, tsv_direction

    narrow = {"embed_dim": 8, "vision_cfg": {"image_size": 16, "patch_size": 8, "width": 16, "layers": 1,
                                             "head_width": 8, "mlp_ratio": 2},
              "text_cfg": {"context_length": 8, "vocab_size": 64, "width": 16, "heads": 2, "layers": 1}}
    base, experts = base_and_experts(n_experts=20, scale=0.05, config=narrow)
    out = merger.merge_state_dicts(base, experts, "tsv_m", lam=0.5)
    matrices = [k for k in out if k.startswith("visual.") and is_matrix(k, base[k].shape)]
    assert len(matrices) == 4 and all(torch.equal(out[k], base[k]) for k in matrices)
    bias = next(k for k in out if k.startswith("visual.") and k.endswith("ln_1.bias"))
    expected = base[bias] + 0.5 * sum(e[bias] - base[bias] for e in experts) / 20
    assert torch.allclose(out[bias], expected, atol=1e-6)
    state = prepare_tsv(TaskVectors(base, {str(i): e for i, e in enumerate(experts)}))
    again = unflatten(*reversed(flatten(state)))
    assert all(not tsv_direction(again, "auto")[k].any() for k in state["factors"])
    assert all(not tsv_direction(again, 0.05)[k].any() for k in state["factors"])


def test_iso_c_against_the_authors_formula_on_a_wide_tower(wide):
    base, experts, keys, taus = wide
    for T in (3, 8):
        out = merger.merge_state_dicts(base, experts[:T], "iso_c", lam=1.4)
        close(out, iso_c_reference(base, taus[:T], keys, 1.4), atol=2e-4)


def test_every_static_method_is_deterministic(world):
    base, experts, keys, _ = world
    for m in [m for m in merger.methods.all_methods() if m.data_driven is False]:
        name, chosen = m.name, m.experts_for(experts)  # SLERP: two
        a = merger.merge_state_dicts(base, chosen, name)
        b = merger.merge_state_dicts(base, chosen, name)
        assert all(torch.equal(a[k], b[k]) for k in keys), name


def test_ties_grid_lookup_equals_direct_trimming(world):
    base, experts, keys, _ = world
    grid = merger.merge_state_dicts(base, experts, "ties", lam=1.0, sparsity=0.7)
    direct = merger.merge_state_dicts(base, experts, "ties", lam=1.0, sparsity=0.7 + 1e-8)
    close(grid, merged_visual(direct, keys), atol=1e-6)
