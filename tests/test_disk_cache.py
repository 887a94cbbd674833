"""The disk cache of prepared methods and task-vector stacks: a hit on reopen, a miss
after any file changes, corrupt entries refused and rebuilt, the size cap, `cache info|clear`."""
import logging
import os
import time

import pytest
import torch

import merger
from merger.cli import main as cli
from merger.evaluation.session import PoolSession
from merger.io import disk_cache
from merger.io.checkpoints import load_state_dict, save_safetensors
from merger.pool.pool import open_pool
from devtools.testing import write_pool


@pytest.fixture
def cached_pool(tmp_path, monkeypatch):
    """A tiny pool on disk whose stacks and slow preparations are worth caching (threshold lowered)."""
    monkeypatch.setenv("MERGER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(disk_cache, "WORTH_ENTRIES", 0)
    return write_pool(tmp_path / "pool", n_experts=3)


def prepare(path, method="cart"):
    pool = open_pool(path)
    session = PoolSession(pool)
    spec = session.spec(method)
    _, state = session.merges.prepared_for(spec)
    return pool, session, spec, state


def entries(kind_word: str) -> list:
    cache = disk_cache.DiskCache()
    return [e for e in cache.entries() if kind_word in cache.describe(e["path"])]


def test_reopen_hits_the_disk_and_merges_identically(cached_pool):
    pool, first, spec, _ = prepare(cached_pool)
    assert first.counts["disk hits"] == 0 and first.counts["prepares"] == 1
    assert len(entries("cart over")) == 1 and len(entries("task vectors")) == 1
    delta = first.merges.delta(spec)
    pool2, second, spec2, _ = prepare(cached_pool)
    assert second.counts["disk hits"] == 1  # read, not recomputed
    again = second.merges.delta(spec2)
    assert all(torch.equal(delta[k], again[k]) for k in delta)
    # the stack itself came from the disk too, equal to the one built from the files
    assert all(torch.equal(pool.task_vectors.stacked[k], pool2.task_vectors.stacked[k]) for k in pool.task_vectors.keys)


def test_a_changed_expert_file_misses_and_merges_the_new_weights(cached_pool):
    _, first, spec, _ = prepare(cached_pool)
    before = first.merges.delta(spec)
    expert = cached_pool.parent / "experts" / "task1.safetensors"
    time.sleep(0.01)  # a new mtime even on coarse clocks
    sd = load_state_dict(expert)
    save_safetensors({k: v * 1.5 if v.is_floating_point() else v for k, v in sd.items()}, expert)
    pool2, second, spec2, _ = prepare(cached_pool)
    assert second.counts["disk hits"] == 0  # its hash changed: nothing computed from the old file is found
    after = second.merges.delta(spec2)
    assert any(not torch.allclose(before[k], after[k]) for k in before)
    files = [load_state_dict(cached_pool.parent / "experts" / f"task{i}.safetensors") for i in range(3)]
    fresh = merger.merge_state_dicts(load_state_dict(cached_pool.parent / "base.safetensors"), files, "cart")
    assert all(torch.allclose(fresh[k], pool2.base[k] + after[k], atol=1e-5) for k in after)  # what the new files give
    assert len(entries("cart over")) == 2


def test_a_touched_file_is_hashed_again(cached_pool):
    base = cached_pool.parent / "base.safetensors"
    first = disk_cache.file_hash(base)
    data = bytearray(base.read_bytes())
    data[-1] ^= 0xFF  # same size, new content
    base.write_bytes(bytes(data))
    os.utime(base, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert disk_cache.file_hash(base) != first


@pytest.mark.parametrize("damage", ["truncate", "garbage", "other key"])
def test_a_corrupt_entry_is_refused_deleted_and_rebuilt(cached_pool, caplog, damage):
    _, first, spec, _ = prepare(cached_pool)
    reference = first.merges.delta(spec)
    (entry,) = entries("cart over")
    path = entry["path"]
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "garbage":
        path.write_bytes(os.urandom(4096))
    else:  # a valid file of another entry under this name
        (stack,) = entries("task vectors")
        path.write_bytes(stack["path"].read_bytes())
    with caplog.at_level(logging.WARNING, logger=disk_cache.__name__):
        _, second, spec2, _ = prepare(cached_pool)
    assert second.counts["disk hits"] == 0 and second.counts["prepares"] == 1
    assert any("cannot be read" in r.getMessage() and path.name in r.getMessage() for r in caplog.records)
    rebuilt = second.merges.delta(spec2)
    assert all(torch.equal(reference[k], rebuilt[k]) for k in reference)
    _, third, _, _ = prepare(cached_pool)  # the rebuilt entry is good again
    assert third.counts["disk hits"] == 1


def test_the_cap_evicts_the_least_recently_used(tmp_path):
    cache = disk_cache.DiskCache(tmp_path, cap=3 * 4096 + 2048)
    for i in range(5):
        cache.put(f"{i}" * 64, f"entry {i}", {"x": torch.zeros(1024)}, None)  # 4 KB each
        time.sleep(0.01)
    names = sorted(e["path"].stem[0] for e in cache.entries())
    assert names == ["2", "3", "4"]
    assert cache.put("f" * 64, "too big", {"x": torch.zeros(10**6)}, None) is None  # larger than the cap: not kept


def test_cache_info_and_clear(cached_pool, capsys):
    from merger.data.heads import heads_cache_dir

    prepare(cached_pool)
    disk_cache.DiskCache(heads_cache_dir()).put("b" * 32, "a head", {"head": torch.zeros(3, 4)}, None)
    assert cli(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert "2 entries" in out and "cart over task0, task1, task2" in out and "task vectors of tiny" in out
    assert "1 zero-shot heads" in out
    assert cli(["cache", "clear"]) == 0
    assert "removed 2 entries" in (out := capsys.readouterr().out) and "removed 1 zero-shot heads" in out
    assert disk_cache.DiskCache().entries() == [] and disk_cache.DiskCache(heads_cache_dir()).entries() == []


def test_small_pools_and_a_switched_off_cache_write_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("MERGER_CACHE_DIR", str(tmp_path / "cache"))
    path = write_pool(tmp_path / "pool", n_experts=3)
    prepare(path)  # below WORTH_ENTRIES: recomputing is cheaper than a file
    assert disk_cache.DiskCache().entries() == []
    monkeypatch.setattr(disk_cache, "WORTH_ENTRIES", 0)
    monkeypatch.setenv("MERGER_DISK_CACHE", "off")
    _, session, _, _ = prepare(path)
    assert session.counts["prepares"] == 1 and not (tmp_path / "cache" / "computed").exists()


def test_a_state_holding_one_tensor_twice_or_views_of_one_buffer_is_cached(tmp_path):
    """safetensors refuses tensors that share memory: a tensor held in two places is written once
    and comes back as one tensor; views of one buffer are written apart (the 8-expert crash)."""
    cache = disk_cache.DiskCache(tmp_path / "c")
    whole = torch.randn(6, 4)
    top, bottom = whole[:3], whole[3:]  # contiguous views of one buffer
    state = {"a": whole, "b": {"again": whole, "top": top, "bottom": bottom}, "n": 3}
    tensors, structure = disk_cache.flatten(state)
    assert len(tensors) == 3
    assert cache.put("a" * 64, "shared", tensors, structure) is not None
    back = disk_cache.unflatten(cache.get("a" * 64)[1], cache.get("a" * 64)[0])
    assert back["a"] is back["b"]["again"] and torch.equal(back["a"], whole)
    assert torch.equal(back["b"]["top"], top) and torch.equal(back["b"]["bottom"], bottom) and back["n"] == 3
