"""The server's memory budget (app --memory-gb): past it, the caches of what can be computed again
are dropped and freed memory goes back to the system; the pool, lab experts and the newest run stay."""
import sys

import pytest
from helpers import write_pool

import merger
from merger.evaluation import memory
from merger.evaluation.memory import MemoryKeeper
from merger.methods import regmean


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    pool = merger.open_pool(write_pool(tmp_path_factory.mktemp("memory"), n_experts=3, scale=0.2, demo_data=True))
    return merger.PoolSession(pool)


def test_over_the_budget_the_caches_go_and_what_cannot_be_remade_stays(session, capsys, monkeypatch):
    gram_statistics = regmean.gram_statistics
    for lam in (0.2, 0.4, 0.6):
        session.preview(session.spec("task_arithmetic", lam=lam))
    session.preview(session.spec("ties", lam=0.5, sparsity=0.7))
    older, newest = (session.spec("adamerging_task", steps=steps, samples=4) for steps in (1, 2))
    for run in (session.spec("regmean", samples=4), older, newest):  # runs are minutes of work on a real pool
        session.run(run)
    experts = list(session.pool.experts)
    held = memory.resident_gb()
    keeper = MemoryKeeper(session, budget_gb=1e6)
    assert (keeper.check() is None) == (held is None)
    assert len(session.results()) == 4 and keeper.shrinks == 0  # under the budget: nothing dropped
    if held is None:
        pytest.skip("this system does not say the resident memory cheaply (no /proc): the keeper only trims")
    keeper = MemoryKeeper(session, budget_gb=0.01)
    keeper.check()
    assert keeper.shrinks == 1 and session.results() == []
    assert session.cached_run(older) is None and session.cached_run(newest) is not None
    assert session.merges.kept() == {"prepared": 1, "derived": 0, "deltas": 0}
    assert list(session.pool.experts) == experts
    said = capsys.readouterr().err
    assert "over the 0.01 GB budget (--memory-gb): caches dropped" in said
    # the next move computes again, as after a restart; RegMean's Grams too (a forward per expert)
    assert session.preview(session.spec("task_arithmetic", lam=0.2)).average_accuracy >= 0
    grams = []
    monkeypatch.setattr(regmean, "gram_statistics", lambda *a, **k: grams.append(1) or gram_statistics(*a, **k))
    session.run(session.spec("regmean", samples=4, alpha=0.5))
    assert grams == [1]


def test_freed_memory_goes_back_and_arenas_are_capped_on_glibc_only():
    import platform

    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert memory.release_freed_memory() is glibc
    assert memory.limit_arenas(memory.ARENAS) is glibc  # the app's start-up setting; import merger makes none
    assert memory.default_budget_gb(None) == memory.DEFAULT_GB
    assert memory.default_budget_gb(3.0) == 6.0 and memory.default_budget_gb(1.0) == memory.DEFAULT_GB


def test_the_budget_flag_is_checked(capsys):
    from merger import serve

    for bad in ("0", "-1", "nan", "lots"):
        with pytest.raises(SystemExit):
            serve.parse_args(["--memory-gb", bad])
        assert "--memory-gb" in capsys.readouterr().err
    assert serve.parse_args(["--memory-gb", "2.5"]).memory_gb == 2.5
    assert serve.parse_args([]).memory_gb is None


def test_other_methods_states_go_past_their_budget_and_come_back_equal(tmp_path):
    from merger.evaluation.merges import held_bytes

    session = merger.PoolSession(merger.open_pool(write_pool(tmp_path, n_experts=3, scale=0.2, demo_data=True)))
    merges = session.merges
    ties, tsv, ties_again = (session.spec("ties", lam=0.5, sparsity=0.7), session.spec("tsv_m", lam=0.8),
                             session.spec("ties", lam=0.6, sparsity=0.7))
    first = {k: v.clone() for k, v in merges.delta(ties).items()}
    merges.delta(tsv)
    assert session.counts["evicted"] == 0  # a small pool's states fit the default budget: all stay
    merges.others_bytes = 0  # as a ViT-B/32 × 8 pool's do not fit it
    merges.delta(tsv.snap())
    pool_storages = {t.untyped_storage().data_ptr() for t in session.pool.task_vectors.stacked.values()}
    others = [(key, value) for key, value in merges._prepared.items() if key[0] != "tsv_m"]
    assert session.counts["evicted"] > 0 and not others  # only what the merge on screen needs is held
    assert {k.method for k in merges._deltas} == {"tsv_m"} and held_bytes(dict(merges._deltas), pool_storages) > 0
    merges.delta(ties_again)  # TIES again: prepared anew, and the same merge as before, bit for bit
    again = merges.delta(ties)
    assert all(again[k].equal(first[k]) for k in first)
    assert {key[0] for key in merges._prepared} == {"ties"}


def test_freed_states_go_back_to_the_system_only_when_a_move_frees_some(tmp_path, monkeypatch):
    """What a move drops goes back to the system before it makes its own states; a λ move that drops
    the last λ's Δ frees nothing (its direction stays) and hands nothing back."""
    from merger.evaluation import merges as merges_module

    trims = []
    monkeypatch.setattr(merges_module, "release_freed_memory", lambda: trims.append(1))
    session = merger.PoolSession(merger.open_pool(write_pool(tmp_path, n_experts=3, scale=0.2, demo_data=True)))
    merges = session.merges
    merges.others_bytes = 0
    merges.delta(session.spec("ties", lam=0.5, sparsity=0.7))
    merges.delta(session.spec("tsv_m", lam=0.8))  # TIES' states go, and TSV-M prepares
    switched, evicted = len(trims), session.counts["evicted"]
    assert switched >= 1 and evicted > 0
    delta = merges.delta(session.spec("tsv_m", lam=0.6))
    assert session.counts["evicted"] > evicted and len(trims) == switched
    key = next(iter(delta))
    assert key in delta and "not a key" not in delta


def test_the_resident_model_holds_the_image_tower_only(session):
    model = session.evaluator.model
    text = [n for n, p in model.named_parameters() if not n.startswith("visual.") and n != "logit_scale"]
    assert text and all(p.numel() == 0 for n, p in model.named_parameters() if n in text)
    assert all(p.numel() > 0 for n, p in model.named_parameters() if n.startswith("visual."))
    assert all(session.pool.base[n].numel() > 0 for n in text)  # the pool's base keeps them (exports)


def test_a_cpu_forward_goes_in_batches_whose_activations_fit_the_bound(session, monkeypatch):
    from merger._compat import open_clip
    from merger.evaluation import evaluator as evaluator_mod

    large = open_clip().create_model("ViT-L-14", pretrained=None, device="meta")  # shapes only
    per_image = 4 * 257 * 4096  # ViT-L/14: 257 tokens, an MLP of 4096, fp32
    assert evaluator_mod.cpu_batch(large) == evaluator_mod.CPU_BATCH_BYTES // per_image == 63
    ev = session.evaluator
    assert ev.batch_size == 1024  # the small pool's live split goes in one batch
    spec = session.spec("task_arithmetic", lam=0.45)
    whole = session.evaluate_exact(spec)  # the small pool's live split in one batch
    seen = []
    real = evaluator_mod.encode_images.reference
    monkeypatch.setattr(evaluator_mod, "encode_images", lambda m, x, c=None: seen.append(x.shape[0]) or real(m, x))
    monkeypatch.setattr(ev, "batch_size", 40)
    chunked = session.evaluate_exact(spec)
    n = sum(x.shape[0] for x, _ in ev.inputs("live"))
    assert seen == [40] * (n // 40) + ([n % 40] if n % 40 else [])
    assert chunked.accuracy == whole.accuracy
    assert chunked.loss == pytest.approx(whole.loss, rel=1e-5)


def test_a_lambda_move_holds_its_state_once_and_loads_one_value_at_a_time(session, monkeypatch):
    """Δ = λ · a prepared or derived state: the Δ cache holds no tensor of its own (a copy beside the
    state was one more model's worth at a TSV-M move's peak), its values are λ · the state's bit for
    bit, and the CPU load holds at most one of them at a time beside the model."""
    import gc
    import weakref

    import torch

    from merger.evaluation.merges import held_bytes
    from merger.methods._scaled import Scaled

    merges = session.merges
    spec = session.spec("tsv_m", lam=0.7)
    delta = session.delta(spec)
    assert isinstance(delta, Scaled) and spec in merges._deltas
    states = set()
    held_bytes([session.pool.task_vectors.stacked, session.pool.task_vectors.base,
                list(merges._prepared.values()), list(merges._derived.values())], states)
    assert held_bytes(merges._deltas[spec], states) == 0
    for k in delta:
        assert torch.equal(delta[k], delta.state[k] * 0.7), k
    alive, most = set(), [0]
    read = Scaled.__getitem__

    def counted(self, key):
        value = read(self, key)
        alive.add(id(value))
        weakref.finalize(value, alive.discard, id(value))
        most[0] = max(most[0], len(alive))
        return value

    monkeypatch.setattr(Scaled, "__getitem__", counted)
    assert next(iter(delta)) in delta and most[0] == 0  # a key is looked up, not its value computed
    gc.collect()
    session.evaluator.load_delta(delta)
    assert len(delta) > 10 and most[0] == 1
    base = session.pool.task_vectors.base
    for k, target in session.evaluator.model.state_dict().items():
        if k in delta:
            assert torch.equal(target, torch.add(base[k], read(delta, k))), k
