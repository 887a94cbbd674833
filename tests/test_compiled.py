"""The compiled per-entry kernels (methods/compiled.py) give the eager merge: TIES, DARE, Consensus
and Breadcrumbs on a stack forced over the size where real pools switch to them, in fp32 and bf16."""
import pytest
import torch
from helpers import random_world

import merger
from merger.methods import compiled
from merger.pool.task_vectors import TaskVectors

CASES = [
    ("ties", {"sparsity": 0.7}),
    ("dare_linear", {"sparsity": 0.5, "seed": 3}),
    ("dare_ties", {"sparsity": 0.5, "seed": 3}),
    ("consensus_ta", {"mask_lambda": 0.4, "agree": 2}),
    ("consensus_ta", {"mask_lambda": 0.2, "agree": 3}),
    ("breadcrumbs", {"beta": 0.05, "gamma": 0.6}),
    ("breadcrumbs", {"beta": 0.123, "gamma": 0.77}),  # off the prepared grid: bounds from a sort
]


@pytest.fixture(scope="module")
def stacks():
    base, experts, _, _ = random_world(n_experts=4)
    named = {f"t{i}": e for i, e in enumerate(experts)}
    return {dtype: TaskVectors(base, named, dtype=dtype) for dtype in ("float32", "bfloat16")}


def _merge(tv, name, params, fused: bool, monkeypatch):
    monkeypatch.setattr(compiled, "FUSE_ABOVE", 0 if fused else 1 << 62)
    method = merger.methods.get(name)
    full = method.resolve({**params, "lam": 1.0}, tv.num_tasks)
    prepared = method.prepare_with(tv, **{p: full[p] for p in method.prepare_params})
    return method.delta(prepared, **full)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name,params", CASES)
def test_the_compiled_kernel_gives_the_eager_merge(stacks, name, params, dtype, monkeypatch):
    if compiled.kernel(lambda x: x + 1, (torch.zeros(2),)) is None:
        pytest.skip("torch.compile is unavailable here (no C++ compiler): merges run eagerly")
    tv = stacks[dtype]
    eager = _merge(tv, name, params, False, monkeypatch)
    fused = _merge(tv, name, params, True, monkeypatch)
    assert eager.keys() == fused.keys()
    for k in eager:
        assert torch.allclose(eager[k], fused[k], rtol=1e-5, atol=1e-6), (name, k)
    assert any(v.abs().max() > 0 for v in fused.values())  # not a merge of nothing


def test_without_a_compiler_the_merge_stays_eager(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(compiled, "_KERNELS", {})
    monkeypatch.setattr(compiled, "_STATE", {"failed": False})
    monkeypatch.setattr(torch, "compile", broken)
    assert compiled.kernel(lambda x: x, (torch.zeros(1),)) is None
    assert compiled._STATE["failed"]  # not tried again in this process
