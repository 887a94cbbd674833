"""The GPU path against the CPU path: every method merges on a CUDA pool to what
it merges on the CPU, evaluation under bf16 autocast stays near the fp32 CPU answer, data-driven
runs train there, and an export from a CUDA pool is written. Skipped where CUDA is absent (CI);
run on a GPU machine with ``pytest tests/test_cuda.py``."""
import math

import pytest
import torch
from helpers import write_pool
from safetensors.torch import load_file

import merger
from merger import methods
from merger.analysis.coefficients import effective_weights
from merger.io.export import export_merge

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STATIC = [m.name for m in methods.all_methods() if not m.data_driven]
DATA_DRIVEN = [m.name for m in methods.all_methods() if m.data_driven]
# settings off the defaults, where the method has the parameter: the low-rank and sparse paths
OFF_DEFAULT = {"rank_ratio": 0.3, "sparsity": 0.7, "lam": 0.8}


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    path = write_pool(tmp_path_factory.mktemp("cuda"), n_experts=3, scale=0.2, demo_data=True)
    cpu, gpu = merger.open_pool(path), merger.open_pool(path, device="cuda")
    return merger.PoolSession(cpu), merger.PoolSession(gpu)


def _relative(a: dict, b: dict) -> float:
    num = sum(float((a[k].double().cpu() - b[k].double().cpu()).pow(2).sum()) for k in b)
    den = sum(float(b[k].double().cpu().pow(2).sum()) for k in b)
    return math.sqrt(num / max(den, 1e-30))


@pytest.mark.parametrize("name", STATIC)
@pytest.mark.parametrize("setting", ["defaults", "off_default"])
def test_every_static_method_merges_on_the_gpu_as_on_the_cpu(pools, name, setting):
    cpu, gpu = pools
    m = methods.get(name)
    experts = m.experts_for(cpu.tasks)
    params = {k: v for k, v in OFF_DEFAULT.items() if k in m.param_names} if setting == "off_default" else {}
    d_cpu = cpu.delta(cpu.spec(name, experts=experts, **params))
    d_gpu = gpu.delta(gpu.spec(name, experts=experts, **params))
    assert set(d_gpu) == set(d_cpu)
    for k, v in d_gpu.items():
        assert v.device.type == "cuda", (name, k)
        assert torch.isfinite(v).all(), (name, k)
    assert _relative(d_gpu, d_cpu) <= 1e-3, name


@pytest.mark.parametrize("name", ["task_arithmetic", "ties", "cart", "tsv_m"])
def test_gpu_evaluation_under_bf16_autocast_is_near_the_cpu_answer(pools, name):
    cpu, gpu = pools
    r_cpu, r_gpu = cpu.preview(cpu.spec(name)), gpu.preview(gpu.spec(name))
    assert r_gpu.counts == r_cpu.counts
    for t in r_cpu.tasks:
        assert abs(r_gpu.accuracy[t] - r_cpu.accuracy[t]) <= 0.03, (name, t)  # a few of 300 images flip
        assert r_gpu.loss[t] == pytest.approx(r_cpu.loss[t], rel=0.03, abs=0.01), (name, t)


def test_a_gpu_move_costs_the_forwards_a_cpu_move_costs(pools):
    counts = []
    for session in pools:
        session.preview(session.spec("task_arithmetic", lam=0.3))
        calls = []
        hook = session.evaluator.model.visual.register_forward_hook(lambda *a: calls.append(1))
        try:
            session.preview(session.spec("task_arithmetic", lam=0.35))
        finally:
            hook.remove()
        counts.append(len(calls))
    assert counts[1] == counts[0] >= 1  # one batch of each image set, no hidden second forward


@pytest.mark.parametrize("name", DATA_DRIVEN)
def test_data_driven_methods_run_on_the_gpu(pools, name):
    _, gpu = pools
    m = methods.get(name)
    params = {"steps": 3} if "steps" in m.param_names else {}
    spec = gpu.spec(name, **params)
    run = gpu.run(spec)
    delta = gpu.delta(spec)
    assert all(torch.isfinite(v).all() for v in delta.values()), name
    assert run.trace, name
    weights, _ = effective_weights(gpu, spec)
    assert all(math.isfinite(w) for w in weights)


def test_export_from_a_gpu_pool_equals_the_cpu_export(pools, tmp_path):
    cpu, gpu = pools
    a, _ = export_merge(cpu.pool, cpu.spec("ties"), tmp_path / "cpu.safetensors")
    b, _ = export_merge(gpu.pool, gpu.spec("ties"), tmp_path / "gpu.safetensors")
    wa, wb = load_file(a), load_file(b)
    assert set(wa) == set(wb)
    assert all(wb[k].device.type == "cpu" for k in wb)
    assert _relative(wb, wa) <= 1e-5


def test_the_landscape_evaluates_on_the_gpu(pools):
    from merger.landscape.surface import pca_plane

    surfaces = []
    for session in pools:
        land = session.landscape
        plane = pca_plane(land.named_points(["base", "experts"]))
        surfaces.append(land.surface(plane, (-1.0, 1.0, -1.0, 1.0), 3))
    s_cpu, s_gpu = surfaces
    assert s_gpu.xs == pytest.approx(s_cpu.xs, abs=1e-4) and s_gpu.ys == pytest.approx(s_cpu.ys, abs=1e-4)
    for t in s_cpu.loss:
        for row_c, row_g in zip(s_cpu.loss[t], s_gpu.loss[t]):
            assert row_g == pytest.approx(row_c, rel=0.05, abs=0.02), t


def test_tasks_with_their_own_images_are_forwarded_as_one_batch_on_the_gpu(tmp_path):
    path = write_pool(tmp_path, n_experts=3, scale=0.2, demo_data=True, own_images=True)
    sessions = [merger.PoolSession(merger.open_pool(path, device=d)) for d in ("cpu", "cuda")]
    results, calls = [], []
    for s in sessions:
        spec = s.spec("task_arithmetic", lam=0.4)
        assert len(s.evaluator.inputs("live")) == 3  # three image sets
        s.expert_accuracy("live")  # the experts' own forwards, before the move's
        hook = s.evaluator.model.visual.register_forward_hook(lambda *a: calls.append(1))
        try:
            results.append(s.preview(spec))
        finally:
            hook.remove()
    assert calls == [1, 1]  # one batch on either device, not one per image set
    for t in results[0].tasks:
        assert abs(results[1].accuracy[t] - results[0].accuracy[t]) <= 0.03, t


@pytest.mark.parametrize("route", ["patches", "graphs"])
def test_the_tower_routes_give_the_eager_answer_with_each_moves_weights(pools, route):
    """The GPU's tower routes (the patch matmul; that, compiled and replayed as CUDA graphs) against the
    reference under the same bf16 autocast: features close, the same accuracy within a few images, and
    each move's weights (written in place) read by the replayed graph."""
    from merger.accel import reference_only

    _, gpu = pools
    ev = gpu.evaluator
    assert ev.tower_route == "eager"  # the default
    try:
        said = ev.use_tower(route)
        assert said.startswith("image tower compiled (graphs) in " if route == "graphs" else
                               "image tower route patches in "), said
        features = {}
        for lam in (0.3, 1.5):
            delta = gpu.delta(gpu.spec("task_arithmetic", lam=lam))
            fast = ev.evaluate(delta=delta)
            fast_features = torch.cat(ev.image_features("live"))
            with reference_only("tower"):
                ref = ev.evaluate(delta=delta)
                ref_features = torch.cat(ev.image_features("live"))
            rel = float((fast_features - ref_features).norm() / ref_features.norm())
            assert rel <= 2e-2, (lam, rel)
            for t in ref.accuracy:
                assert abs(fast.accuracy[t] - ref.accuracy[t]) <= 0.03, (lam, t)
            features[lam] = (fast_features, rel)
        moved = float((features[1.5][0] - features[0.3][0]).norm() / features[0.3][0].norm())
        assert moved > 10 * max(features[0.3][1], features[1.5][1]), moved  # not the first move's weights again
    finally:
        ev.use_tower("eager")
