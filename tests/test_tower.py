"""The image tower's GPU routes (merger/accel/tower.py) against the reference, ``model.encode_image`` as
written. Here on the CPU: the patch embedding as a matmul against the convolution at ViT-B/32's and
ViT-L/14's sizes; the graphs route with dynamo's eager backend (the same operations, so the same
numbers): which forwards take the route, and what happens where it cannot run. The route a GPU takes
(inductor and CUDA graphs) is compared with the reference in tests/test_cuda.py."""
import pytest
import torch

import merger
from merger.accel import reference_only
from merger.accel.tower import RoutedTower, PatchEmbedding, embed_patches_by_matmul


@pytest.fixture(scope="module")
def session():
    return merger.PoolSession(merger.open_pool("demo"))


@pytest.fixture()
def routed(session, monkeypatch):
    """The demo's tower on the graphs route (dynamo's eager backend), with the calls that went through it
    counted."""
    calls = []
    call = RoutedTower.__call__
    monkeypatch.setattr(RoutedTower, "__call__", lambda self, x: calls.append(x.shape[0]) or call(self, x))
    ev = session.evaluator
    session.expert_accuracy("live")  # forwards of their own, made once, before the moves counted below
    yield ev, ev.use_tower("graphs", backend="eager"), calls
    ev.use_tower("eager")
    assert ev.routed_tower is None and type(ev.model.visual.conv1) is torch.nn.Conv2d


def test_the_tower_is_the_reference_unless_a_route_is_chosen(session):
    ev = session.evaluator
    assert ev.tower_route == "eager" and ev.routed_tower is None  # the routes did not pay (docs/accel.md)
    assert ev.use_tower("eager") is None and type(ev.model.visual.conv1) is torch.nn.Conv2d


def test_a_move_goes_through_the_routed_tower_and_equals_the_reference(session, routed):
    ev, said, calls = routed
    assert said.startswith("image tower compiled (graphs) in ")
    assert isinstance(ev.model.visual.conv1, PatchEmbedding)
    n_live = sum(x.shape[0] for x, _ in ev.inputs("live"))
    assert calls == [n_live] * 3  # the warm-up on one batch of every task's images: warm, record, replay
    for lam in (0.45, 1.2):  # two moves: the weights each writes in place are the ones read
        spec = session.spec("task_arithmetic", lam=lam)
        forwards, before = ev.forwards, len(calls)
        fast = session.preview(spec)
        assert ev.forwards - forwards == 1 and calls[before:] == [n_live]
        with reference_only("tower"):
            ref = session.evaluate_exact(spec)
        assert len(calls) == before + 1  # the reference run did not use it
        assert fast.accuracy == ref.accuracy
        for t in ref.loss:  # the patch matmul sums in another order than the convolution
            assert fast.loss[t] == pytest.approx(ref.loss[t], rel=1e-5), t
    assert session.preview(session.spec("task_arithmetic", lam=0.45)).accuracy != fast.accuracy


def test_the_routed_tower_runs_only_in_the_state_it_was_warmed_in(session, routed):
    ev, _, calls = routed
    x = torch.cat([x for x, _ in ev.inputs("live")])
    assert ev.routed_tower.fits(x)
    assert not ev.routed_tower.fits(x[:1])  # a batch of one is specialised: it would compile again
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not ev.routed_tower.fits(x)  # another autocast state would compile again


def test_a_progressive_pool_warms_both_batches_of_a_move(session, routed):
    ev, _, calls = routed
    session.measure_live(budget_s=0.0)  # as if a full live forward were slow
    n, groups = session.partial_images, len(ev.inputs("live"))
    per_task = ev.inputs("live")[0][0].shape[0]
    assert calls[-6:] == [groups * n] * 3 + [groups * (per_task - n)] * 3  # after the base's timed forwards
    session.partial_images = None


def test_a_tower_that_cannot_compile_forwards_eagerly_and_says_so(session, monkeypatch):
    from merger.accel import tower

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Cannot find a working triton installation")

    monkeypatch.setattr(tower, "compiling", lambda: True)  # whatever this machine's own settings
    monkeypatch.setattr(tower, "why_not_compiled_here", lambda: None)
    monkeypatch.setattr(torch, "compile", no_compiler)
    ev = session.evaluator
    said = ev.use_tower("graphs")
    assert said == "image tower not compiled (RuntimeError): forwarding eagerly"
    assert ev.tower_route == "eager" and ev.routed_tower is None and said in ev.notices
    assert type(ev.model.visual.conv1) is torch.nn.Conv2d  # the patch matmul went with it
    spec = session.spec("task_arithmetic", lam=0.55)
    with reference_only("tower"):
        ref = session.evaluate_exact(spec)
    assert session.preview(spec).accuracy == ref.accuracy
    ev.notices.remove(said)


@pytest.mark.parametrize("width, patch", [(768, 32), (1024, 14)])  # ViT-B/32's and ViT-L/14's
def test_the_patch_embedding_as_a_matmul_is_the_convolution(width, patch):
    g = torch.Generator().manual_seed(patch)
    conv = torch.nn.Conv2d(3, width, kernel_size=patch, stride=patch, bias=False)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) / 40)
    x = torch.randn(4, 3, 224, 224, generator=g, dtype=torch.float64)
    truth = torch.nn.functional.conv2d(x, conv.weight.double(), stride=patch)  # the fp64 definition
    emb = PatchEmbedding(conv)
    assert emb.weight is conv.weight and list(dict(emb.named_parameters())) == ["weight"]
    with torch.no_grad():
        out, ref = emb(x.float()), conv(x.float())
        with reference_only("tower"):
            assert torch.equal(emb(x.float()), ref)
    assert out.shape == ref.shape
    for got in (out, ref):  # per image, as the contract is per matrix
        rel = ((got.double() - truth).flatten(1).norm(dim=1) / truth.flatten(1).norm(dim=1)).max()
        assert rel <= 1e-6, float(rel)


def test_the_patch_embedding_keeps_the_models_weights_and_goes_back(session):
    model = session.evaluator.model
    before = model.state_dict()
    weight = model.visual.conv1.weight
    assert embed_patches_by_matmul(model, True)
    after = model.state_dict()
    assert list(after) == list(before) and after["visual.conv1.weight"].data_ptr() == weight.data_ptr()
    assert embed_patches_by_matmul(model, False)
    assert type(model.visual.conv1) is torch.nn.Conv2d and model.visual.conv1.weight is weight
    assert not embed_patches_by_matmul(torch.nn.Linear(2, 2), True)


def test_weights_given_to_the_tower_reach_the_patch_embedding_on_either_branch(session, routed):
    """Runs and diagnostics pass weights with torch.func.functional_call: both branches of the patch
    embedding read them; a run's own copy of the tower is the tower as written."""
    ev, _, _ = routed
    visual = ev.model.visual
    x = torch.cat([x for x, _ in ev.inputs("live")])[:8]
    other = {"conv1.weight": torch.randn_like(visual.conv1.weight)}
    with torch.no_grad():
        fast = torch.func.functional_call(visual, other, (x,))
        with reference_only("tower"):
            ref = torch.func.functional_call(visual, other, (x,))
        mine = visual(x)
    assert torch.allclose(fast, ref, rtol=1e-4, atol=1e-5) and not torch.allclose(fast, mine, atol=1e-3)
    copied = ev.tower_copy()
    assert type(copied.conv1) is torch.nn.Conv2d and isinstance(visual.conv1, PatchEmbedding)


def test_the_route_has_one_owner(session, routed):
    ev, _, calls = routed
    assert ev.tower_route == "graphs"
    ev.use_tower("eager")
    before = len(calls)
    session.preview(session.spec("task_arithmetic", lam=0.95))
    assert ev.tower_route == "eager" and len(calls) == before  # the route gone is not used


def test_the_load_writes_the_sums_of_the_reference_bit_for_bit(session):
    ev = session.evaluator
    delta = session.delta(session.spec("ties", lam=0.7))
    ev.load_delta(delta)
    base = session.pool.task_vectors.base
    for k, target in ev.model.state_dict().items():
        if k in delta:
            assert torch.equal(target, torch.add(base[k], delta[k])), k


def test_an_unknown_route_is_refused():
    with pytest.raises(ValueError, match="tower route 'fast'"):
        RoutedTower(torch.nn.Linear(2, 2), "fast")
