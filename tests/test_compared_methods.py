"""The methods people compare against: each against a direct implementation of its
formula on small random state dicts, the identities between them, and their bad input."""
import math
import re

import pytest
import torch
from helpers import close, random_world, write_pool
from torch.func import vmap

import merger
from merger.errors import MethodError
from merger.methods import fisher as fisher_method
from merger.methods import regmean
from merger.methods.data import Context
from merger.methods.wudi import solve_matrix, wudi_objective
from merger.pool.task_vectors import is_matrix


@pytest.fixture(scope="module")
def world():
    return random_world()


def merged(world, name, experts=None, **params):
    base, all_experts, _, _ = world
    return merger.merge_state_dicts(base, experts if experts is not None else all_experts, name, **params)


def plus_base(world, delta):
    base = world[0]
    return {k: base[k] + d for k, d in delta.items()}


# ---- MagMax ----------------------------------------------------------------------------------

def test_magmax_is_the_largest_magnitude_entry(world):
    _, _, keys, taus = world
    expected = {}
    for k in keys:  # the authors' running selection: |current| ≥ |kept| takes the current one
        running = taus[0][k]
        for t in taus[1:]:
            running = torch.where(t[k].abs() >= running.abs(), t[k], running)
        expected[k] = 0.7 * running
    close(merged(world, "magmax", lam=0.7), plus_base(world, expected))


def test_magmax_takes_the_later_expert_on_a_tie():
    base = {"visual.w": torch.zeros(3)}
    experts = [{"visual.w": torch.tensor([1.0, -2.0, 0.5])}, {"visual.w": torch.tensor([-1.0, 2.0, 0.4])}]
    out = merger.merge_state_dicts(base, experts, "magmax", lam=1.0)
    assert out["visual.w"].tolist() == [-1.0, 2.0, 0.5]


def test_magmax_with_one_expert_is_task_arithmetic(world):
    one = [world[1][0]]
    close(merged(world, "magmax", one, lam=0.6), merged(world, "task_arithmetic", one, lam=0.6))


# ---- Consensus TA ----------------------------------------------------------------------------

@pytest.mark.parametrize("mask_lambda,agree", [(0.4, 2), (0.8, 1), (0.2, 3)])
def test_consensus_formula(world, mask_lambda, agree):
    _, _, keys, taus = world
    expected = {}
    for k in keys:
        total = sum(t[k] for t in taus)
        votes = sum((t[k].abs() >= mask_lambda * (total - t[k]).abs()).int() for t in taus)
        expected[k] = 0.5 * torch.where(votes >= agree, total, torch.zeros_like(total))
    out = merged(world, "consensus_ta", lam=0.5, mask_lambda=mask_lambda, agree=agree)
    close(out, plus_base(world, expected))


def test_consensus_with_one_vote_and_no_threshold_is_task_arithmetic(world):
    close(merged(world, "consensus_ta", lam=0.4, mask_lambda=0.0, agree=1), merged(world, "task_arithmetic", lam=0.4))


def test_consensus_that_no_entry_can_reach_is_the_base(world):
    base, _, keys, _ = world
    out = merged(world, "consensus_ta", lam=0.4, agree=4)  # 3 experts: never 4 votes
    close(out, {k: base[k] for k in keys})


# ---- Model Breadcrumbs -----------------------------------------------------------------------

def _breadcrumbs_reference(tau: torch.Tensor, beta: float, gamma: float) -> torch.Tensor:
    """Row by row (the last dimension), in plain Python: rank by |τ| (stable), keep ranks [⌊βn⌋, n − ⌊(1 − γ)n⌋)."""
    if tau.dim() == 0:
        return tau
    rows = tau.reshape(-1, tau.shape[-1])
    out = torch.zeros_like(rows)
    n = rows.shape[1]
    top, bottom = math.floor(beta * n + 1e-6), math.floor((1 - gamma) * n + 1e-6)
    for r in range(rows.shape[0]):
        order = sorted(range(n), key=lambda j: -abs(float(rows[r, j])))
        for j in order[top:n - bottom]:
            out[r, j] = rows[r, j]
    return out.reshape(tau.shape)


@pytest.mark.parametrize("beta,gamma", [(0.1, 0.6), (0.0, 0.5), (0.25, 1.0)])
def test_breadcrumbs_formula(world, beta, gamma):
    _, _, keys, taus = world
    expected = {k: 0.8 * sum(_breadcrumbs_reference(t[k], beta, gamma) for t in taus) for k in keys}
    close(merged(world, "breadcrumbs", lam=0.8, beta=beta, gamma=gamma), plus_base(world, expected))


def test_breadcrumbs_keeping_everything_is_task_arithmetic(world):
    close(merged(world, "breadcrumbs", lam=0.3, beta=0.0, gamma=1.0), merged(world, "task_arithmetic", lam=0.3))


def test_breadcrumbs_drops_the_outliers_and_the_small_entries():
    base = {"visual.w": torch.zeros(10)}
    tau = torch.tensor([10.0, -9.0, 8.0, 7.0, -6.0, 5.0, 4.0, 3.0, -2.0, 1.0])
    out = merger.merge_state_dicts(base, [{"visual.w": tau}], "breadcrumbs", lam=1.0, beta=0.2, gamma=0.7)
    assert out["visual.w"].tolist() == [0, 0, 8.0, 7.0, -6.0, 5.0, 4.0, 0, 0, 0]


# ---- SLERP -----------------------------------------------------------------------------------

def test_slerp_endpoints_are_the_experts(world):
    base, experts, keys, _ = world
    two = experts[:2]
    close(merged(world, "slerp", two, t=0.0), {k: two[0][k] for k in keys})
    close(merged(world, "slerp", two, t=1.0), {k: two[1][k] for k in keys})


@pytest.mark.parametrize("t", [0.3, 0.5])
def test_slerp_formula(world, t):
    _, experts, keys, taus = world
    expected = {}
    for k in keys:
        a, b = taus[0][k].double(), taus[1][k].double()
        cos = float((a * b).sum() / (a.norm() * b.norm()))
        omega = math.acos(cos)
        expected[k] = (math.sin((1 - t) * omega) * a + math.sin(t * omega) * b).float() / math.sin(omega)
    close(merged(world, "slerp", experts[:2], t=t), plus_base(world, expected))


def test_slerp_keeps_the_norm_of_equal_norm_task_vectors_and_is_linear_when_parallel():
    base = {"visual.w": torch.zeros(2), "visual.p": torch.zeros(2)}
    experts = [{"visual.w": torch.tensor([1.0, 0.0]), "visual.p": torch.tensor([1.0, 1.0])},
               {"visual.w": torch.tensor([0.0, 1.0]), "visual.p": torch.tensor([2.0, 2.0])}]
    out = merger.merge_state_dicts(base, experts, "slerp", t=0.5)
    assert float(out["visual.w"].norm()) == pytest.approx(1.0)  # on the arc, not the chord (0.707)
    assert out["visual.p"].tolist() == pytest.approx([1.5, 1.5])  # parallel: a line


def test_slerp_with_other_than_two_experts_says_so(world, tmp_path):
    with pytest.raises(MethodError, match="slerp merges exactly 2 experts; 3 are selected: pick 2"):
        merged(world, "slerp", t=0.5)
    pool = merger.open_pool(write_pool(tmp_path, n_experts=3))
    with pytest.raises(MethodError, match="slerp merges exactly 2 experts; 1 is selected"):
        merger.merge(pool, "slerp", experts=pool.tasks[:1])


# ---- Iso-CTS ---------------------------------------------------------------------------------

def _iso_cts_reference(taus, keys, fraction, lam):
    """The authors' iso_cts, with full SVDs (fp64)."""
    out = {}
    T = len(taus)
    for k in keys:
        stack = [t[k].double() for t in taus]
        if not is_matrix(k, stack[0].shape):
            out[k] = lam * sum(stack).float() / T
            continue
        r = min(stack[0].shape)
        common = int(r * fraction)
        common = r - round((r - common) / T) * T
        u, s, vh = torch.linalg.svd(sum(stack), full_matrices=False)
        per = (r - common) // T
        us, ss, vs = [], [], []
        for w in stack:
            res = w - u[:, :common] @ u[:, :common].T @ w
            ut, st, vt = torch.linalg.svd(res, full_matrices=False)
            us.append(ut[:, :per]), ss.append(st[:per]), vs.append(vt[:per])
        U = torch.cat(us + [u[:, :common]], 1)
        S = torch.cat(ss + [s[:common]])
        V = torch.cat(vs + [vh[:common]], 0)
        pu, _, pv = torch.linalg.svd(U, full_matrices=False)
        qu, _, qv = torch.linalg.svd(V, full_matrices=False)
        out[k] = lam * (S.mean() * (pu @ pv) @ (qu @ qv)).float()
    return out


@pytest.mark.parametrize("fraction", [0.8, 0.5])
def test_iso_cts_against_the_authors_formula(world, fraction):
    _, _, keys, taus = world
    out = merged(world, "iso_cts", lam=1.5, common_fraction=fraction)
    close(out, plus_base(world, _iso_cts_reference(taus, keys, fraction, 1.5)), atol=2e-4)


def test_iso_cts_of_square_wide_and_tall_matrices_is_the_authors_formula():
    from merger.methods import iso

    g = torch.Generator().manual_seed(7)
    for m, n in ((48, 48), (40, 96), (96, 40)):
        taus = [{"mlp.c_fc.weight": torch.randn(m, n, generator=g) * 1e-2} for _ in range(4)]
        got = iso.iso_cts_matrix(torch.stack([t["mlp.c_fc.weight"] for t in taus]), *iso.split_rank(min(m, n), 4, 0.5),
                                 "a matrix")
        expected = _iso_cts_reference(taus, ["mlp.c_fc.weight"], 0.5, 1.0)["mlp.c_fc.weight"]
        assert (got - expected).abs().max() <= 1e-5 * expected.abs().max(), (m, n)


def test_iso_cts_with_only_the_common_subspace_is_iso_c(world):
    close(merged(world, "iso_cts", lam=1.3, common_fraction=1.0), merged(world, "iso_c", lam=1.3), atol=2e-4)


def test_iso_cts_rank_split_as_the_authors():
    from merger.methods.iso import split_rank

    assert split_rank(768, 8, 0.8) == (616, 19)  # int(614.4) = 614; round(154 / 8) · 8 = 152
    assert split_rank(12, 8, 0.0) == (4, 1)  # round(1.5) = 2 would need 16 > 12 directions: capped at r // T
    assert split_rank(32, 3, 1.0) == (32, 0)


# ---- WUDI ------------------------------------------------------------------------------------

def test_wudi_objective_decreases_and_equals_plain_adam_on_the_direct_loss(world):
    _, _, keys, taus = world
    k = next(k for k in keys if k.endswith("mlp.c_fc.weight"))
    stack = torch.stack([t[k] for t in taus])
    tau, before, after = solve_matrix(stack, steps=50)
    assert after < before
    assert before == pytest.approx(float(wudi_objective(stack.sum(0), stack)), rel=1e-5)
    # FusionBench's loop: autograd through the direct loss
    ref = torch.nn.Parameter(stack.sum(0).clone())
    opt = torch.optim.Adam([ref], lr=1e-5)
    for _ in range(50):
        opt.zero_grad()
        wudi_objective(ref, stack).backward()
        opt.step()
    assert torch.allclose(tau, ref.detach(), atol=1e-7)


def test_wudi_moves_the_matrices_and_leaves_the_rest_at_the_base(world):
    base, _, keys, taus = world
    out = merged(world, "wudi", lam=1.0, steps=20)
    for k in keys:
        if is_matrix(k, base[k].shape):
            total = sum(t[k] for t in taus)
            assert not torch.allclose(out[k], base[k] + total)  # Adam moved it from Σ τ
            assert float((out[k] - base[k] - total).abs().max()) <= 20 * 1e-5 * 1.1  # about lr per step at most
        else:
            assert torch.equal(out[k], base[k])


# ---- RegMean ---------------------------------------------------------------------------------

def _taus_of(world):
    _, _, keys, taus = world
    return keys, [t for t in taus]


def test_regmean_with_identity_grams_is_weight_averaging(world):
    keys, taus = _taus_of(world)
    tv = merger.pool.task_vectors.TaskVectors(world[0], dict(zip("abc", world[1])))
    stats = {}
    for t in taus:
        mats = [k for k in tv.matrices]
        regmean.add_expert(stats, {k: torch.eye(t[k].shape[1], dtype=torch.float64) for k in mats},
                           {k: t[k] for k in mats})
    for alpha in (0.9, 0.3):
        delta = regmean.regmean_delta(tv, stats, alpha)
        close(merged(world, "weight_averaging"), plus_base(world, delta))


@pytest.mark.parametrize("alpha", [1.0, 0.6])
def test_regmean_solves_in_full_weights(world, alpha):
    base, experts, keys, taus = world
    tv = merger.pool.task_vectors.TaskVectors(base, dict(zip("abc", experts)))
    g = torch.Generator().manual_seed(3)
    grams = []
    for _ in taus:
        mats = {}
        for k in tv.matrices:
            x = torch.randn(40, base[k].shape[1], generator=g, dtype=torch.float64)
            mats[k] = x.T @ x / 40
        grams.append(mats)
    stats = {}
    for t, gm in zip(taus, grams):
        regmean.add_expert(stats, gm, {k: t[k] for k in gm})
    delta = regmean.regmean_delta(tv, stats, alpha)
    for k in tv.matrices:
        tilde = [alpha * gm[k] + (1 - alpha) * torch.diag(gm[k].diagonal()) for gm in grams]
        w = torch.linalg.solve(sum(tilde), sum(gt @ e[k].double().T for gt, e in zip(tilde, experts))).T
        assert torch.allclose(base[k] + delta[k], w.float(), atol=1e-4), k


def test_gram_recorder_sees_each_matrix_input(world):
    from devtools.testing import tiny_model

    model = tiny_model().visual
    keys = [k for k in world[2] if is_matrix(k, world[0][k].shape)]
    rec = regmean.GramRecorder(model, keys)
    seen = {}
    block = model.transformer.resblocks[0]
    h = block.mlp.register_forward_pre_hook(lambda mod, args: seen.setdefault("mlp_in", args[0].detach()))
    with torch.no_grad():
        model(torch.randn(5, 3, 16, 16, generator=torch.Generator().manual_seed(1)))
    h.remove()
    rec.close()
    grams = rec.grams()
    assert set(grams) == set(keys)  # the attention's out_proj included (no hook can see its input)
    x = seen["mlp_in"].reshape(-1, seen["mlp_in"].shape[-1]).double()
    assert torch.allclose(grams["visual.transformer.resblocks.0.mlp.c_fc.weight"], x.T @ x / x.shape[0], atol=1e-8)


# ---- Fisher ----------------------------------------------------------------------------------

def test_fisher_with_equal_fishers_is_weight_averaging(world):
    base, experts, keys, _ = world
    tv = merger.pool.task_vectors.TaskVectors(base, dict(zip("abc", experts)))
    same = {k: torch.rand(base[k].shape, generator=torch.Generator().manual_seed(0)) for k in keys}
    delta, share = fisher_method.fisher_delta(tv, [same, same, same])
    close(merged(world, "weight_averaging"), plus_base(world, delta))
    assert share == pytest.approx([1 / 3] * 3)  # equal mass


def test_fisher_formula_with_its_floor(world):
    base, experts, keys, _ = world
    tv = merger.pool.task_vectors.TaskVectors(base, dict(zip("abc", experts)))
    g = torch.Generator().manual_seed(4)
    fishers = [{k: torch.rand(base[k].shape, generator=g) * (torch.rand(base[k].shape, generator=g) > 0.5)
                for k in keys} for _ in experts]
    delta, _ = fisher_method.fisher_delta(tv, fishers)
    for k in keys:
        f = [fi[k].clamp(min=1e-6) for fi in fishers]
        expected = sum(fi * e[k] for fi, e in zip(f, experts)) / sum(f)  # in full weights
        assert torch.allclose(base[k] + delta[k], expected, atol=1e-5), k


# ---- the data-driven ones on a pool with data ---------------------------------------------------

@pytest.fixture(scope="module")
def data_pool(tmp_path_factory):
    return merger.open_pool(write_pool(tmp_path_factory.mktemp("compared"), n_experts=3, scale=0.2, demo_data=True))


def _context(session, experts):
    import copy

    ctx = Context(session.pool, session.evaluator, tuple(experts))
    ctx.model = copy.deepcopy(session.evaluator.model.visual)
    return ctx


def test_per_example_fisher_equals_one_backward_per_image(data_pool):
    import torch.nn.functional as F

    from merger.methods.data import calibration_set, normalized_features

    session = merger.PoolSession(data_pool)
    ctx = _context(session, data_pool.tasks)
    batches = calibration_set(ctx, 6, 0)
    got = fisher_method.empirical_fisher(ctx, 1, batches)
    params = {k: v.clone().requires_grad_(True) for k, v in ctx.expert_params(1).items()}
    head = ctx.heads[data_pool.task_of(ctx.tasks[1])]
    ref = {k: torch.zeros_like(v) for k, v in params.items()}
    n = 0
    for x, y in ctx.expert_batches(batches, 1):
        for j in range(x.shape[0]):
            loss = F.cross_entropy(ctx.scale * normalized_features(ctx.model, params, x[j:j + 1]) @ head.T, y[j:j + 1])
            for k, gr in zip(params, torch.autograd.grad(loss, list(params.values()))):
                ref[k] += gr.square()
            n += 1
    assert n == 6
    for k in ref:
        assert torch.allclose(got["visual." + k], ref[k] / n, rtol=1e-4, atol=1e-9), k


def test_fisher_chunks_fill_the_gradient_budget_and_leave_the_fisher_unchanged(data_pool, monkeypatch):
    """ViT-B/32's 87.8M parameters: 3 images per vmap call in the CPU's 1 GB, up to 64 on a GPU with
    a quarter of its free memory; chunks of 4 + 2 images give the Fisher of one chunk of 6, and so
    do chunks halved after running out of memory."""
    from merger.methods.data import calibration_set

    vit_b32 = 87_849_216
    assert fisher_method.chunk_size(vit_b32, "cpu") == 3
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (130 << 30, 141 << 30))
    assert fisher_method.chunk_size(vit_b32, "cuda") == 64
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 << 30, 141 << 30))
    assert fisher_method.chunk_size(vit_b32, "cuda") == (2 << 30) // (4 * vit_b32) == 6
    assert fisher_method.chunk_size(10 ** 12, "cpu") == 1

    session = merger.PoolSession(data_pool)
    ctx = _context(session, data_pool.tasks)
    batches = calibration_set(ctx, 6, 0)
    whole = fisher_method.empirical_fisher(ctx, 0, batches)
    monkeypatch.setattr(fisher_method, "MAX_CHUNK", 4)
    seen = []
    monkeypatch.setattr(fisher_method, "vmap", lambda f, **kw: (lambda p, x, y: seen.append(len(x)) or vmap(f, **kw)(p, x, y)))
    chunked = fisher_method.empirical_fisher(ctx, 0, batches)
    assert seen == [4, 2]
    for k in whole:
        assert torch.allclose(chunked[k], whole[k], rtol=1e-4, atol=1e-9), k

    def out_of_memory_above_two(f, **kw):  # a GPU whose activations leave room for 2 images
        def call(p, x, y):
            seen.append(len(x))
            if len(x) > 2:
                raise torch.OutOfMemoryError("CUDA out of memory")
            return vmap(f, **kw)(p, x, y)
        return call

    seen.clear()
    monkeypatch.setattr(fisher_method, "vmap", out_of_memory_above_two)
    halved = fisher_method.empirical_fisher(ctx, 0, batches)
    assert seen == [4, 2, 2, 2]  # halved once, then every image once
    for k in whole:
        assert torch.allclose(halved[k], whole[k], rtol=1e-4, atol=1e-9), k


def test_regmean_run_reuses_its_grams_when_alpha_moves(data_pool, monkeypatch):
    session = merger.PoolSession(data_pool)
    calls = []
    real = regmean.gram_statistics
    monkeypatch.setattr(regmean, "gram_statistics", lambda *a, **k: calls.append(1) or real(*a, **k))
    a = session.run(session.spec("regmean", alpha=0.9, samples=32))
    b = session.run(session.spec("regmean", alpha=0.5, samples=32))
    assert len(calls) == 1  # one pass of forwards for both α
    ctx = _context(session, data_pool.tasks)
    stats = real(ctx, 32, 0)
    for alpha, run in ((0.9, a), (0.5, b)):
        expected = regmean.regmean_delta(ctx.tv, stats, alpha)
        close(run.delta, expected, atol=1e-6)
    assert session.run(session.spec("regmean", alpha=0.5, samples=16)) is not b and len(calls) == 2
    res = session.preview(session.spec("regmean", alpha=0.9, samples=32), "live")
    assert 0.0 <= res.average_accuracy <= 1.0


@pytest.mark.parametrize("batch_first", [False, True])
def test_regmean_reads_the_attention_inputs_of_either_layout(batch_first):
    """The attention's out_proj input (its context before projection), which no hook can see, against
    attention written out by hand; in_proj's input is the query."""
    g = torch.Generator().manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=batch_first)

        def forward(self, x):
            return self.attn(x, x, x, need_weights=False)[0]

    block = Block().eval()
    x = torch.randn(3, 5, 8, generator=g)  # [N, L, D]
    keys = ["visual.attn.in_proj_weight", "visual.attn.out_proj.weight"]
    rec = regmean.GramRecorder(block, keys)
    with torch.no_grad():
        block(x if batch_first else x.transpose(0, 1))
    rec.close()
    grams = rec.grams()
    mha = block.attn
    q, k, v = (x @ w.T + b for w, b in zip(mha.in_proj_weight.chunk(3), mha.in_proj_bias.chunk(3)))
    heads = lambda z: z.reshape(3, 5, 2, 4).transpose(1, 2)  # noqa: E731
    att = torch.softmax(heads(q) @ heads(k).transpose(-1, -2) / 2.0, -1) @ heads(v)
    context = att.transpose(1, 2).reshape(15, 8).double()
    flat = x.reshape(15, 8).double()
    assert torch.allclose(grams[keys[0]], flat.T @ flat / 15, atol=1e-6)
    assert torch.allclose(grams[keys[1]], context.T @ context / 15, atol=1e-5)


def test_a_batch_with_slerp_over_three_experts_is_refused_before_it_starts(data_pool):
    from merger.evaluation.tuning import auto_tune, sweep

    session = merger.PoolSession(data_pool)
    with pytest.raises(merger.MergerError, match="slerp merges exactly 2 experts; 3 are selected"):
        auto_tune(session, ["task_arithmetic", "slerp"])
    with pytest.raises(merger.MergerError, match="slerp merges exactly 2 experts"):
        sweep(session, ["task_arithmetic", "slerp"], "t", [0.5])
    assert session.counts["applies"] == 0  # nothing ran before the refusal
    two = data_pool.tasks[:2]
    out = sweep(session, ["slerp"], "t", [0.0, 0.5, 1.0], experts=two)
    assert out["slerp"]["x"] == [0.0, 0.5, 1.0]


def test_a_job_is_as_large_as_the_methods_it_names_whatever_the_list(data_pool, monkeypatch):
    """["ties"] × 100,000 (and its aliases) is one TIES grid: its points on validation, its best on test."""
    from merger.evaluation import tuning

    session = merger.PoolSession(data_pool)
    points = []
    real = tuning.evaluate_all
    monkeypatch.setattr(tuning, "evaluate_all", lambda s, items, *a, **k: points.extend(items) or real(s, items, *a, **k))
    monkeypatch.setattr(tuning, "grid_points", lambda m: [{"lam": 0.3}, {"lam": 0.5}])
    rows = tuning.auto_tune(session, ["ties"] * 100_000 + ["TIES", "task_arithmetic", "ties"])
    assert [r["method"] for r in rows] == ["ties", "task_arithmetic"] and len(points) == 2 * 2 + 2
    said = []
    out = tuning.sweep(session, ["task_arithmetic"] * 1000, "lam", [0.2, 0.4, 0.6], progress=lambda f, m: said.append(m))
    assert list(out) == ["task_arithmetic"] and out["task_arithmetic"]["x"] == [0.2, 0.4, 0.6]
    # each point says how long the rest should take, at the pace so far (the last: nothing left)
    assert [re.search(r" · about \d+ s left$", m) is not None for m in said] == [True, True, False]


def test_a_preparation_on_disk_is_keyed_by_the_helpers_it_calls_too():
    """Iso-CTS prepares through spectral's SVDs and the drop-ins that may replace them: an edit of either
    must miss its disk entries."""
    from merger.accel import gram, registry
    from merger.evaluation.merges import code_of
    from merger.methods import iso, spectral

    assert {iso, spectral, gram, registry} <= set(code_of(merger.methods.get("iso_cts").prepare))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_breadcrumbs_rows_sorted_as_integers_are_the_float_sort(dtype):
    """numpy sorts the magnitudes' bits (vectorised); the order must be the floats' own, ties and zeros too."""
    from merger.methods.breadcrumbs import _sorted_rows

    torch.manual_seed(0)
    stack = (torch.randn(3, 5, 257) * 1e-3).to(dtype)
    stack[0, 0, :100] = 0.0
    stack[1, 2, ::3] = -stack[1, 2, 1]  # ties across signs
    ranked = _sorted_rows(stack)
    assert ranked.dtype == dtype and ranked.shape == (3, 5, 257)
    assert torch.equal(ranked, stack.abs().sort(dim=-1, descending=True).values)


def test_breadcrumbs_prepared_bounds_equal_a_sort_at_a_typed_value(world):
    on_grid = merged(world, "breadcrumbs", lam=1.0, beta=0.1, gamma=0.6)
    typed = merged(world, "breadcrumbs", lam=1.0, beta=0.1 + 1e-9, gamma=0.6 - 1e-9)  # off the 0.01 steps
    close(on_grid, {k: typed[k] for k in world[2]}, atol=0)
