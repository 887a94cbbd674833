"""Sums over a model's weights (10⁷ entries and more) against fp64: what the Analysis tab, the landscape
and the data-driven merges show. fp32 norms and dot products over such lengths were 1e-4 to 1e-2 off
on the CPU (a cosine of exactly 1 read 1.018 over a ViT-B/32 tower); small tensors never showed it."""
import pytest
import torch

from devtools.testing import VIT_B32_BLOCK, realistic_task_vectors
from merger import longsum
from merger.analysis import diagnostics
from merger.landscape.surface import task_vector_plane
from merger.methods.adaptive import Combination
from merger.pool.task_vectors import TaskVectors

LONG = 20_000_000  # entries: a quarter of a ViT-B/32 image tower


def vectors(n: int, count: int, seed: int = 0, scale: float = 1e-3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(n, generator=g) for _ in range(count)]


def test_long_sums_equal_fp64():
    a, b = vectors(LONG, 2)
    b = b + a  # correlated: their dot product adds mostly positive terms
    assert longsum.inner(a, b) == pytest.approx(float(a.double() @ b.double()), rel=1e-12)
    assert longsum.norm(a) == pytest.approx(float(a.double().norm()), rel=1e-12)
    rows = torch.stack([a, b])
    assert torch.allclose(longsum.gram(rows), rows.double() @ rows.double().T, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="inner product of 3 and 2 entries"):
        longsum.inner(torch.ones(3), torch.ones(2))


def test_task_vector_norms_and_cosines_at_a_block():
    """T = 8 experts nearly alike (their cosines near 1), stored in bf16, at one ViT-B/32 block."""
    stacks = realistic_task_vectors(8, VIT_B32_BLOCK, "bfloat16", seed=1, apart=0.01)
    g = torch.Generator().manual_seed(2)
    base = {k: 0.02 * torch.randn(v.shape, generator=g) for k, v in stacks.base.items()}
    tv = TaskVectors.from_stacks(base, stacks.tasks, stacks.stacked)
    flat = torch.stack([torch.cat([tv.row(k, i).double().reshape(-1) for k in tv.keys]) for i in range(8)])
    gram = flat @ flat.T
    norms = gram.diagonal().sqrt()
    shown = diagnostics.task_vector_norms(tv)
    assert torch.allclose(torch.tensor(shown["global"], dtype=torch.float64), norms, rtol=1e-10, atol=0)
    base_norm = torch.cat([v.double().reshape(-1) for v in base.values()]).norm()
    assert torch.allclose(torch.tensor(shown["relative"], dtype=torch.float64), norms / base_norm, rtol=1e-10, atol=0)
    layers = sum(torch.tensor(v, dtype=torch.float64) ** 2 for v in shown["layers"].values())
    assert torch.allclose(layers, norms**2, rtol=1e-10, atol=0)  # Σ of the layers' ‖τt,l‖² is ‖τt‖²
    cos = torch.tensor(diagnostics.cosine_matrix(tv), dtype=torch.float64)
    assert (cos - gram / torch.outer(norms, norms)).abs().max() <= 1e-9
    assert (cos.diagonal() - 1).abs().max() <= 1e-12
    assert diagnostics.task_vector_norms(stacks)["relative"] == [float("inf")] * 8  # a zero base: no error


def test_one_step_of_gradient_descent_aligns_with_minus_the_gradient_exactly():
    (grad,) = vectors(LONG, 1)
    assert diagnostics.gradient_alignment(-0.01 * grad, grad) == pytest.approx(1.0, abs=1e-9)


def test_epoch_updates_along_one_direction_have_cosines_of_one():
    base, step = vectors(LONG, 2)
    points = [base + c * step for c in (0.0, 1.0, 3.0, 4.0)]
    out = diagnostics.epoch_dynamics(points)
    assert torch.allclose(torch.tensor(out["cosine"]), torch.ones(3, 3), atol=1e-6, rtol=0)
    assert out["cos_to_first"] == pytest.approx([1.0] * 3, abs=1e-6)
    assert out["shares"] == pytest.approx([0.25, 0.5, 0.25], rel=1e-5)


def test_a_task_vector_plane_holds_both_experts():
    base, tau_a, other = vectors(LONG, 3)
    tau_b = 0.6 * tau_a + other
    plane = task_vector_plane(base, tau_a, tau_b)
    a64, b64 = tau_a.double(), tau_b.double()
    u = a64 / a64.norm()
    v = b64 - (b64 @ u) * u
    x, y, off = plane.coords(base + tau_a)
    assert (x, y) == pytest.approx((float(a64.norm()), 0.0), abs=1e-5 * float(a64.norm()))
    assert off <= 1e-5 * float(a64.norm())
    x, y, off = plane.coords(base + tau_b)
    assert (x, y) == pytest.approx((float(b64 @ u), float(v.norm())), abs=1e-5 * float(b64.norm()))
    assert off <= 1e-5 * float(b64.norm())


@pytest.mark.parametrize("offset", [False, True], ids=["adamerging", "adamerging_cart"])
def test_a_learned_merge_is_summed_apart_from_the_base(offset):
    """Layer-wise coefficients, one small, on a base a thousand times the task vectors' size: θ(c) − θ0
    in fp32 would carry eps·|θ0|."""
    key = "visual.transformer.resblocks.0.mlp.c_fc.weight"
    shape = VIT_B32_BLOCK[key]
    g = torch.Generator().manual_seed(0)
    base = {key: torch.randn(shape, generator=g)}
    taus = {key: 1e-3 * torch.randn((3, *shape), generator=g)}
    mean = {key: taus[key].mean(0)} if offset else None
    comb = Combination(base, taus, [[key]], offset=mean) if offset else Combination(base, taus, [[key]])
    coef = torch.tensor([[0.01], [0.02], [0.005]])
    delta = comb.delta(coef, base)[key].double()
    assert torch.allclose(base[key] + delta.float(), comb.params(coef)[key[len("visual."):]], rtol=0, atol=1e-6)
    expected = (coef.double()[:, 0, None, None] * taus[key].double()).sum(0) + (mean[key].double() if offset else 0)
    assert float((delta - expected).norm() / expected.norm()) <= 1e-6


def test_cross_task_linearity_of_nearly_linear_features_equals_fp64():
    """A ViT-L/14 block's features per image (257 tokens × 1024), the merge's close to the prediction:
    1 − cos is then 4.7e-5, and an fp32 cosine put it 1e-3 (relative) off."""
    g = torch.Generator().manual_seed(0)
    n = 257 * 1024
    experts = [3.0 + torch.randn(16, n, generator=g) for _ in range(2)]
    merged = 0.5 * experts[0] + 0.5 * experts[1] + 0.03 * torch.randn(16, n, generator=g)
    shown = {"merged": merged, "a": experts[0], "b": experts[1]}
    out = diagnostics.cross_task_linearity(lambda weights, x: [shown[weights["name"]]], {"name": "merged"},
                                           [{"name": "a"}, {"name": "b"}], [0.5, 0.5], torch.zeros(1))
    pred = 0.5 * experts[0].double() + 0.5 * experts[1].double()
    m = merged.double()
    expected = 1 - (m * pred).sum(1) / (m.norm(dim=1) * pred.norm(dim=1))
    assert out["mean"][0] == pytest.approx(float(expected.mean()), rel=1e-6)


def test_the_expert_pairs_baseline_equals_fp64_over_slices_of_rows():
    """1 − cos between experts' features (the pairs' baseline) at a ViT-L/14 block's width, over 3
    slices of rows and in one: each equal to the fp64 definition, pair by pair."""
    g = torch.Generator().manual_seed(1)
    n = 257 * 1024
    experts = [3.0 + torch.randn(16, n, generator=g) for _ in range(3)]
    experts[2] = experts[0] + 0.02 * torch.randn(16, n, generator=g)  # a pair nearly alike
    e = [x.double() for x in experts]
    expected = sum(float((1 - (e[a] * e[b]).sum(1) / (e[a].norm(dim=1) * e[b].norm(dim=1))).mean())
                   for a, b in ((0, 1), (0, 2), (1, 2))) / 3
    for budget in (64 << 20, 6 * 8 * 3 * n):  # 16 rows at once; slices of 6, 6 and 4
        assert diagnostics._mean_pairwise_distance(experts, budget) == pytest.approx(expected, rel=1e-9)
