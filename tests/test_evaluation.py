"""Evaluator and explorer on a random pool over demo-world data."""
import re

import pytest
import torch
import torch.nn.functional as F
import yaml
from helpers import write_pool

import merger
from merger.data import splits as split_rules
from merger.data.tasks import preprocess
from merger.errors import DataError, PoolError
from merger.data.heads import tokenizer_for


@pytest.fixture(scope="module")
def demo_like(tmp_path_factory):
    path = write_pool(tmp_path_factory.mktemp("pool"), n_experts=3, scale=0.2, demo_data=True)
    pool = merger.open_pool(path)
    return path, pool, merger.PoolSession(pool)


def test_heads_follow_the_protocol(demo_like):
    _, pool, ex = demo_like
    model, tok = pool.build_model(), tokenizer_for(pool)  # the base, fresh: the resident one keeps no text tower
    for t in pool.tasks:
        info = pool.task_info[t]
        rows = []
        for c in info["classes"]:
            with torch.no_grad():
                e = model.encode_text(tok([tpl.format(c) for tpl in info["templates"]]))
            rows.append(F.normalize(F.normalize(e, dim=-1).mean(0), dim=-1))
        assert torch.allclose(ex.evaluator.heads[t], torch.stack(rows), atol=1e-6)


def reference_accuracy(pool, state_dict, split="live", bf16=False):
    """A fresh model, no caches: load the weights, preprocess, forward (under bf16 autocast: ``bf16``), score."""
    model = pool.build_model()
    model.load_state_dict(state_dict)
    ev = merger.Evaluator(pool)  # only for its data store and heads
    out = {}
    with torch.no_grad():
        for t in pool.tasks:
            d = ev.data.split(t, split)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                f = model.encode_image(preprocess(d.images, pool.preprocess_cfg)).float()
            f = F.normalize(f, dim=-1)
            logits = model.logit_scale.exp() * f @ ev.heads[t].T
            out[t] = (float((logits.argmax(-1) == d.labels).float().mean()), float(F.cross_entropy(logits, d.labels)))
    return out


def test_evaluate_matches_a_fresh_model(demo_like):
    _, pool, _ = demo_like
    merged = merger.merge(pool, "ties", lam=1.0, sparsity=0.8)
    res = merger.evaluate(pool, merged, split="live")
    ref = reference_accuracy(pool, merged)
    for t in pool.tasks:
        assert res.accuracy[t] == pytest.approx(ref[t][0], abs=1e-6)
        assert res.loss[t] == pytest.approx(ref[t][1], rel=1e-4)
    assert res.average_accuracy == pytest.approx(sum(r[0] for r in ref.values()) / 3)


def test_bf16_forwards_no_faster_than_fp32_are_said_at_start(demo_like, monkeypatch):
    """app --forward bf16 on a CPU times a forward in each precision, alike: where bf16 is no faster (its
    products emulated), it says so; the app's precision stays bf16."""
    from merger.cli_jobs import set_forward
    from merger.serve import bf16_warning, forward_seconds

    ev = merger.PoolSession(merger.open_pool(demo_like[0])).evaluator
    set_forward(ev, "bf16")
    seen = []
    monkeypatch.setattr(ev, "forward", lambda split: seen.append((split, ev.forwards_in_bf16)))
    assert forward_seconds(ev, False) >= 0 and seen == [("live", False)] * 2  # a warm-up, then the one timed
    assert ev.forwards_in_bf16
    monkeypatch.setattr(ev, "forward", lambda split: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        forward_seconds(ev, False)
    assert ev.forwards_in_bf16  # kept on a failure too
    assert bf16_warning(0.05, 0.08) is None
    assert bf16_warning(0.2, 0.08) == (
        "warning: --forward bf16: a live forward took 200 ms, and 80 ms in fp32: this CPU seems to lack bf16 "
        "matrix instructions (AVX512-BF16, AMX, Arm's BF16), so its bf16 forwards are no faster than fp32's, "
        "and less precise; --forward auto runs fp32 here")


def test_bf16_forwards_on_the_cpu_are_a_fresh_model_under_bf16_autocast(demo_like):
    """--forward bf16: the same protocol, every forward under torch.autocast("cpu", bfloat16); the
    default stays fp32 on the CPU."""
    from merger.cli_jobs import set_forward

    path, pool, ex = demo_like
    merged = merger.merge(pool, "ties", lam=1.0, sparsity=0.8)
    half = merger.PoolSession(merger.open_pool(path))
    set_forward(half.evaluator, "bf16")
    assert half.evaluator.forwards_in_bf16 and not ex.evaluator.forwards_in_bf16
    res, fp32 = half.evaluator.evaluate(merged, "live"), ex.evaluator.evaluate(merged, "live")
    ref = reference_accuracy(pool, merged, bf16=True)
    for t in pool.tasks:
        assert res.accuracy[t] == pytest.approx(ref[t][0], abs=1e-6)
        assert abs(res.loss[t] - ref[t][1]) < abs(fp32.loss[t] - ref[t][1]) / 10, t  # bf16's rounding, not fp32's
    set_forward(half.evaluator, "fp32")
    assert half.evaluator.evaluate(merged, "live").loss == fp32.loss


def test_a_fallback_to_the_cpu_keeps_the_forwards_precision(demo_like):
    """Out of memory on a GPU even at batch 1, the evaluator moves to the CPU (``Evaluator.encode``): its
    later forwards stay in the precision of the results already cached (bf16 by default on a GPU)."""
    path, _, _ = demo_like
    for autocast, bf16 in ((True, True), (False, False)):
        ev = merger.PoolSession(merger.open_pool(path)).evaluator
        ev.autocast, ev.device = autocast, torch.device("cuda")  # as if it had forwarded there
        assert ev.forwards_in_bf16 == bf16
        ev._move_to("cpu")  # what encode() calls then
        assert ev.device.type == "cpu" and ev.forwards_in_bf16 == bf16


def test_expert_weights_reproduce_expert_accuracy(demo_like):
    _, pool, ex = demo_like
    experts = ex.expert_accuracy("live")
    for i, t in enumerate(pool.tasks):
        full = dict(pool.base)
        full.update({k: v for k, v in pool.task_vectors.expert(i).items()})
        res = merger.evaluate(pool, full, split="live")
        assert res.accuracy[t] == experts[t]
        assert res.normalized[t] == pytest.approx(1.0)


def test_in_place_loading_leaves_nothing_stale(demo_like):
    _, pool, _ = demo_like
    a = merger.merge(pool, "task_arithmetic", lam=0.3)
    b = merger.merge(pool, "cart", lam=2.0, rank_ratio=0.25)
    ra1 = merger.evaluate(pool, a).to_dict()
    rb = merger.evaluate(pool, b).to_dict()
    ra2 = merger.evaluate(pool, a).to_dict()
    assert ra1 == ra2
    assert ra1 != rb


def test_preview_cache(demo_like):
    _, pool, ex = demo_like
    s1 = ex.spec("task_arithmetic", lam=0.3)
    r1 = ex.preview(s1)
    assert ex.preview(ex.spec("task_arithmetic", lam=0.3)) is r1
    assert ex.preview(ex.spec("task_arithmetic", lam=0.31)) is r1  # snapped to the 0.05 slider step
    r2 = ex.preview(ex.spec("task_arithmetic", lam=0.5))
    assert r2 is not r1 and r2.accuracy != r1.accuracy
    assert ex.preview(ex.spec("task_arithmetic", lam=0.3, experts=pool.tasks[:2])) is not r1
    # a preview equals evaluating the merged weights of the snapped spec
    res = merger.evaluate(pool, merger.merge(pool, "task_arithmetic", lam=0.3))
    assert res.accuracy == r1.accuracy


def test_a_value_near_an_end_its_method_refuses_snaps_to_the_nearest_step_inside(demo_like):
    """Snapping to a slider step must not leave the range: TIES' sparsity 0.995 once computed at 1.0
    (IndexError), DARE's at 1.0 (division by zero), CART's rank 0.001 at 0 (refused if typed)."""
    from merger.evaluation.tuning import computed_at

    _, pool, ex = demo_like
    for method, name, given, computed in (("ties", "sparsity", 0.995, 0.99), ("dare_linear", "sparsity", 0.996, 0.99),
                                          ("cart", "rank_ratio", 0.001, 0.01), ("breadcrumbs", "beta", 0.999, 0.99),
                                          ("breadcrumbs", "gamma", 0.001, 0.01), ("task_arithmetic", "lam", 2.99, 3.0)):
        spec = ex.spec(method, **{name: given})
        assert spec.snap().snapping() == {name: (given, computed)} and computed_at(spec, name) == computed
        result = ex.preview(spec)
        assert result is ex.preview(ex.spec(method, **{name: computed}))  # the same point, cached once
    assert ex.preview(ex.spec("ties", sparsity=0.995)).average_accuracy >= 0
    # a range that depends on the number of experts: TSV-M's rank ratio is at most 1/T (1/6 here)
    from merger.spec import Spec

    six = Spec.make("tsv_m", {"rank_ratio": 0.166}, None, [f"e{i}" for i in range(6)])
    assert six.snap().snapping() == {"rank_ratio": (0.166, 0.16)} and computed_at(six, "rank_ratio") == 0.16


def test_normalized_accuracy_is_mean_of_ratios(demo_like):
    _, pool, ex = demo_like
    r = ex.preview(ex.spec("weight_averaging"))
    ratios = [r.accuracy[t] / r.expert_accuracy[t] for t in pool.tasks]
    assert r.normalized_accuracy == pytest.approx(sum(ratios) / len(ratios))


def test_splits_protocol(demo_like):
    _, pool, ex = demo_like
    t = pool.tasks[0]
    train, val = ex.evaluator.data.split(t, "train"), ex.evaluator.data.split(t, "val")
    test, live = ex.evaluator.data.split(t, "test"), ex.evaluator.data.split(t, "live")
    assert val.labels.numel() == 40 and train.labels.numel() == 360  # 10 % of 400
    assert live.labels.numel() == 96 and test.labels.numel() == 300
    # the landscape's probe is the start of the live subset
    probe = ex.evaluator.data.split(t, "probe")
    assert probe.labels.numel() == 48
    assert torch.isin(split_rules.live_indices(300, 48), split_rules.live_indices(300)).all()


def test_unknown_split(demo_like):
    _, pool, ex = demo_like
    with pytest.raises(DataError, match="unknown split 'dev'; known: train, val, test, live"):
        ex.preview(ex.spec("task_arithmetic"), split="dev")
    assert ex.preview(ex.spec("task_arithmetic"), split="live")  # still works


def _edit(path, fn):
    spec = yaml.safe_load(path.read_text())
    fn(spec)
    path.write_text(yaml.safe_dump(spec))
    return merger.open_pool(path)


def test_task_with_no_images(tmp_path):
    path = write_pool(tmp_path, n_experts=2, demo_data=True)
    t = None

    def empty(spec):
        nonlocal t
        t = next(iter(spec["tasks"]))
        spec["tasks"][t]["data"]["demo"]["test"]["n"] = 0

    pool = _edit(path, empty)
    with pytest.raises(DataError, match=f"tasks.{t}: the test split has no images"):
        merger.Evaluator(pool).evaluate(None, "test")


def test_class_with_no_images(tmp_path):
    path = write_pool(tmp_path, n_experts=2, demo_data=True)

    def extra_class(spec):
        t = next(iter(spec["tasks"]))
        spec["tasks"][t]["classes"].append("unicorn")

    pool = _edit(path, extra_class)
    with pytest.raises(DataError, match="class\\(es\\) unicorn have no images in the test split"):
        merger.Evaluator(pool).evaluate(None, "test")
    # the live split (96 test images) is drawn from that test split: refused the same way, not scored without it
    with pytest.raises(DataError, match="unicorn have no images in the test split \\(the live split is drawn from it\\)"):
        merger.Evaluator(pool).evaluate(None, "live")


def test_a_class_list_shorter_than_the_data_names_the_pool_file_and_key(tmp_path):
    path = write_pool(tmp_path, n_experts=2, demo_data=True)
    task = {}

    def one_class_fewer(spec):
        task["name"] = t = next(iter(spec["tasks"]))
        spec["tasks"][t]["classes"].pop()

    pool = _edit(path, one_class_fewer)
    with pytest.raises(DataError, match=f"^{pool.source}: tasks.{task['name']}.classes: .* names, but the live split "
                                        "of its data has labels .*: name every class of the data, in label order"):
        merger.Evaluator(pool).evaluate(None, "live")


def _with_domain(spec, task, domain):
    # the tasks share one YAML data entry (an alias): give this task its own
    spec["tasks"][task]["data"] = {"demo": {**spec["tasks"][task]["data"]["demo"], "domain": domain}}


def test_task_domain_draws_its_own_images(tmp_path):
    from merger.data.tasks import TaskDataStore
    from merger.demo import world

    path = write_pool(tmp_path, n_experts=2, demo_data=True)
    a, b = list(world.TASKS)[:2]
    pool = _edit(path, lambda spec: _with_domain(spec, a, {"background": 3, "dots": 1}))
    store = TaskDataStore(pool)
    da, db = store.split(a, "test"), store.split(b, "test")
    assert da.source != db.source and not torch.equal(da.images, db.images)
    # the images are the world's draw with those attributes held, labels of the task unchanged
    images, labels = world.generate(300, 12, fixed={"background": 3, "dots": 1})
    assert torch.equal(da.images, images) and torch.equal(da.labels, labels[a])
    assert torch.equal(db.labels, world.generate(300, 12)[1][b])


@pytest.mark.parametrize("domain, message", [
    ({"weather": 0}, "domain: unknown attribute 'weather'"),
    ({"background": 9}, "domain.background: expected a class index 0..3, got 9"),
    ({"background": "teal"}, "domain.background: expected a class index 0..3, got 'teal'"),
    ("pink", "domain: expected {attribute: class index}"),
])
def test_bad_task_domain_is_named(tmp_path, domain, message):
    path = write_pool(tmp_path, n_experts=2, demo_data=True)
    t = "shape"
    pool = _edit(path, lambda spec: _with_domain(spec, t, domain))
    with pytest.raises(PoolError, match=re.escape(f"tasks.{t}.data.demo.{message}")):
        merger.Evaluator(pool).evaluate(None, "test")


def test_domain_cannot_hold_the_task_attribute(tmp_path):
    path = write_pool(tmp_path, n_experts=2, demo_data=True)
    pool = _edit(path, lambda spec: _with_domain(spec, "shape", {"shape": 1}))
    with pytest.raises(PoolError, match="cannot hold the task's own attribute 'shape' fixed"):
        merger.Evaluator(pool).evaluate(None, "test")


def test_expert_without_data(tmp_path):
    path = write_pool(tmp_path, n_experts=2, demo_data=True)
    pool = _edit(path, lambda spec: spec["tasks"].pop(next(iter(spec["tasks"]))))
    with pytest.raises(DataError, match="have an expert but no data"):
        merger.Evaluator(pool)


def test_task_without_expert_is_refused(tmp_path):
    path = write_pool(tmp_path, n_experts=2, demo_data=True)
    with pytest.raises(PoolError, match="tasks.ghost has no expert"):
        _edit(path, lambda spec: spec["tasks"].update(ghost={"classes": ["a"]}))


def test_corrupt_zoo_is_refused(tmp_path):
    import json

    from merger.io.checkpoints import content_hash

    path = write_pool(tmp_path, n_experts=2, demo_data=True)
    files = {str(p.relative_to(tmp_path)): content_hash(p) for p in tmp_path.rglob("*.safetensors")}
    (tmp_path / "manifest.json").write_text(json.dumps({"files": files}))
    merger.open_pool(path)  # intact: opens
    victim = sorted(tmp_path.glob("experts/*.safetensors"))[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(PoolError, match=f"{victim.name}: sha256 differs from manifest.json.*refusing"):
        merger.open_pool(path)


def test_out_of_memory_retries_with_smaller_batches(demo_like, monkeypatch):
    _, pool, _ = demo_like
    ev = merger.Evaluator(pool, batch_size=512)
    expected = ev.evaluate(None, "live").accuracy
    real = ev.model.encode_image

    def tight(x):
        if x.shape[0] > 50:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(x)

    monkeypatch.setattr(ev.model, "encode_image", tight)
    assert ev.evaluate(None, "live").accuracy == expected
    assert ev.batch_size <= 50 and any("batches of" in n for n in ev.notices)


def test_cuda_request_without_cuda_is_a_clear_error(demo_like):
    path, _, _ = demo_like
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(PoolError, match="CUDA is not available"):
        merger.open_pool(path, device="cuda")


def test_the_resident_model_skips_the_random_init_and_equals_a_fully_built_one(tiny_pool, monkeypatch):
    """build_model leaves torch.nn.init out (the base is loaded strictly right after): every
    parameter and buffer, the non-persistent causal mask included, equals a model built with it."""
    import contextlib

    from merger import _compat as compat

    pool = merger.open_pool(tiny_pool)
    fast = pool.build_model()
    assert torch.nn.init.normal_(torch.zeros(3)).abs().sum() > 0  # the initialisers are back afterwards
    monkeypatch.setattr(compat, "no_random_init", lambda skip: contextlib.nullcontext())
    slow = pool.build_model()
    fast_buffers, slow_buffers = dict(fast.named_buffers()), dict(slow.named_buffers())
    assert fast_buffers.keys() == slow_buffers.keys() and "attn_mask" in fast_buffers
    assert all(torch.equal(fast_buffers[k], slow_buffers[k]) for k in slow_buffers)
    fs, ss = fast.state_dict(), slow.state_dict()
    assert fs.keys() == ss.keys() and all(torch.equal(fs[k], ss[k]) for k in ss)
