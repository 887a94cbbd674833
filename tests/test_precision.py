"""The precision contract (docs/precision.md): every static merge within 1e-4 relative Frobenius error per
matrix of an fp64 evaluation of its definition (devtools/definitions.py, written apart from the
methods), on ViT-B/32's matrix shapes (2304 × 768, 768 × 768, 3072 × 768, 768 × 3072) with T = 3 and
T = 8, task vectors stored in fp32 and in bf16, each at its default and two other settings. The
merges run as the app runs them (drop-ins included); tests/test_accel.py holds each drop-in to its
reference."""
import pytest
import torch

from devtools.definitions import DEFINITIONS, relative_errors
from devtools.testing import VIT_B32_BLOCK, realistic_task_vectors

CONTRACT = 1e-4
IN_PROJ, OUT_PROJ, C_FC, C_PROJ, BIAS = VIT_B32_BLOCK
# (tensors, T, storage[, settings]): between its two cases each method meets every shape, both T, both dtypes
# and its default and two other settings
CASES = {
    "tsv_m": [((C_FC, OUT_PROJ, BIAS), 8, "bfloat16", 0), ((IN_PROJ, C_PROJ), 3, "float32")],
    "cart": [((C_PROJ, IN_PROJ, BIAS), 8, "float32", 0), ((OUT_PROJ, C_FC), 3, "bfloat16")],
    "iso_cts": [((IN_PROJ, C_PROJ, BIAS), 8, "bfloat16", 0), ((C_FC, OUT_PROJ), 3, "float32")],
    "wudi": [((OUT_PROJ,), 3, "float32", 0), ((OUT_PROJ, BIAS), 8, "bfloat16", 1, 2)],
}
EVERY_SHAPE = [((OUT_PROJ, C_PROJ, BIAS), 8, "bfloat16"), ((IN_PROJ, C_FC, BIAS), 3, "float32")]


def cases():
    for d in DEFINITIONS:
        for keys, T, dtype, *which in CASES.get(d.method.name, EVERY_SHAPE):
            T = d.method.num_experts or T  # SLERP: two
            settings = d.settings(T)
            settings = [settings[i] for i in which] if which else settings  # the slowest: fewer in one case
            yield pytest.param(d, keys, T, dtype, settings, id=f"{d.method.name}-T{T}-{dtype}")


@pytest.fixture(scope="module")
def pools():
    made = {}

    def get(keys, T, dtype):
        if (keys, T, dtype) not in made:
            made[(keys, T, dtype)] = realistic_task_vectors(T, {k: VIT_B32_BLOCK[k] for k in keys}, dtype, seed=T)
        return made[(keys, T, dtype)]
    return get


@pytest.mark.parametrize("definition, keys, T, dtype, settings", cases())
def test_every_static_merge_is_its_fp64_definition_within_1e_4_per_matrix(definition, keys, T, dtype, settings, pools):
    tv = pools(keys, T, dtype)
    m = definition.method
    prepared, memo = {}, {}
    for params in settings:
        resolved = m.resolve(params, T)
        prepare_key = tuple(resolved[k] for k in m.prepare_params)
        if prepare_key not in prepared:  # one preparation per prepare parameters, as the session keeps it
            prepared[prepare_key] = m.prepare(tv, **{k: resolved[k] for k in m.prepare_params})
        errors = relative_errors(definition, tv, params, prepared[prepare_key], memo)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= CONTRACT, (m.name, params, worst, errors[worst])


def test_every_static_method_has_a_definition_and_settings():
    import merger

    static = {m.name for m in merger.methods.all_methods() if not m.data_driven}
    assert {d.method.name for d in DEFINITIONS} == static
    for d in DEFINITIONS:
        for T in (2, 3, 8):
            settings = d.settings(T)
            assert settings[0] == {k: v for k, v in d.method.resolve({}, d.method.num_experts or T).items()
                                   if k in settings[0]}, d.method.name  # the first is the default
            for params in settings:
                d.method.resolve(params, d.method.num_experts or T)  # each one a valid setting


SPECTRAL = [d for d in DEFINITIONS if d.method.name in ("tsv_m", "cart", "iso_c", "iso_cts")]


@pytest.mark.parametrize("definition", SPECTRAL, ids=lambda d: d.method.name)
def test_experts_nearly_alike_keep_the_spectral_merges_within_the_contract(definition):
    """Experts that share almost all of their task vectors (each one's own part 1 % of the shared one): the
    residuals Iso-CTS takes past the common subspace are then small, and a residual Gram formed as
    τᵀτ − bᵀb in fp32 cancelled away (2e-2 off on this tall matrix)."""
    tv = realistic_task_vectors(3, {C_FC: VIT_B32_BLOCK[C_FC]}, "bfloat16", seed=3, apart=0.01)
    errors = relative_errors(definition, tv, definition.settings(3)[0])
    assert max(errors.values()) <= CONTRACT, errors


def test_model_stock_of_experts_fine_tuned_apart_is_within_the_contract():
    """Task vectors that share 1 % of their direction are nearly orthogonal: cos θ ≈ 1e-4, and t ∝ cos θ.
    Their cosines summed in fp32 over 2.4 M products put this merge 1.2e-4 off (1.1e-3 on a random
    ViT-B/32 × 8 pool, `report precision`)."""
    from merger.pool.task_vectors import TaskVectors

    g = torch.Generator().manual_seed(0)
    shape = VIT_B32_BLOCK[C_FC]
    shared = torch.randn(shape, generator=g)
    experts = {f"task{t}": {C_FC: 1e-3 * (0.01 * shared + torch.randn(shape, generator=g))} for t in range(8)}
    tv = TaskVectors({C_FC: torch.zeros(shape)}, experts, dtype="bfloat16")
    definition = next(d for d in DEFINITIONS if d.method.name == "model_stock")
    errors = relative_errors(definition, tv, {})
    assert max(errors.values()) <= CONTRACT, errors


def grams_of_layer_inputs(n: int, count: int, g: torch.Generator, rank: int = 64, noise: float = 1e-3):
    """Grams (the mean of xxᵀ over tokens) of inputs that mostly share a few directions, as LayerNorm and
    GELU outputs do, with four outlier dimensions: condition numbers of 1e9 to 1e11."""
    out = []
    for _ in range(count):
        basis = torch.randn(rank, n, generator=g, dtype=torch.float64)
        z = torch.randn(4 * rank, rank, generator=g, dtype=torch.float64)
        gram = basis.T @ (z.T @ z / (4 * rank)) @ basis + noise**2 * torch.eye(n, dtype=torch.float64)
        scale = torch.ones(n, dtype=torch.float64)
        scale[:4] = 30.0
        out.append(scale[:, None] * gram * scale[None, :])
    return out


@pytest.mark.parametrize("key, T, dtype", [(IN_PROJ, 8, "bfloat16"), (C_PROJ, 3, "float32")], ids=["in_proj", "c_proj"])
def test_regmean_is_its_fp64_solve_within_1e_4_on_ill_conditioned_grams(key, T, dtype):
    """RegMean at ViT-B/32's shapes against W = (Σt G̃t)⁻¹ Σt G̃t Wt in fp64 (the base is zero: Wt = τt).
    At α = 1 the solve divides by the Grams' small eigenvalues (condition numbers near 7e10 here): with
    Σt Gt τtᵀ kept in fp32 the merge was off by 2.5 (in_proj) and 28 (c_proj) times its own norm."""
    from merger.methods import regmean

    tv = realistic_task_vectors(T, {key: VIT_B32_BLOCK[key]}, dtype, seed=T)
    grams = grams_of_layer_inputs(VIT_B32_BLOCK[key][1], T, torch.Generator().manual_seed(T))
    stats = {}
    for i, gram in enumerate(grams):
        regmean.add_expert(stats, {key: gram}, {key: tv.row(key, i)})
    experts = [tv.row(key, i).double() for i in range(T)]
    for alpha in (1.0, 0.999, 0.9, 0.5):
        ours = regmean.regmean_delta(tv, stats, alpha)[key].double()
        tilde = [alpha * gram + (1 - alpha) * torch.diag(gram.diagonal()) for gram in grams]
        expected = torch.linalg.solve(sum(tilde), sum(gt @ w.T for gt, w in zip(tilde, experts))).T
        error = float((ours - expected).norm() / expected.norm())
        assert error <= CONTRACT, (alpha, error)
