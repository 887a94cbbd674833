"""What merger keeps between runs cannot be turned against its user: nothing is read, loaded or
executed from a folder someone else can write; the cache deletes only its own files and follows no
link; an entry it did not write is refused and rebuilt; a FIFO hangs nothing; a file rewritten in
place with its old mtime is hashed again."""
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import merger
from merger.cli import main as cli
from merger.evaluation.session import PoolSession
from merger.io import disk_cache
from merger.io.checkpoints import load_state_dict, save_safetensors
from merger.io.private import why_not_private
from merger.pool.pool import open_pool
from devtools.testing import write_pool

POSIX_ROOT = hasattr(os, "getuid") and os.getuid() == 0  # chown to another user needs root
NOBODY = 65534


@pytest.fixture
def cached_pool(tmp_path, monkeypatch):
    monkeypatch.setenv("MERGER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(disk_cache, "WORTH_ENTRIES", 0)
    return write_pool(tmp_path / "pool", n_experts=3, demo_data=True)


def prepared(path, method="cart"):
    session = PoolSession(open_pool(path))
    spec = session.spec(method)
    session.merges.prepared_for(spec)
    return session, spec


def test_no_module_loads_a_library_or_compiled_code_of_its_own():
    package = Path(merger.__file__).parent
    for path in package.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        for word in ("cpp_extension", "importlib.machinery", "spec_from_file_location", "find_library",
                     "LoadLibrary", "cdll", "windll", "PyDLL"):
            assert word not in text, f"{path}: {word}"
        # ctypes only over the running process's own symbols (glibc's malloc_trim for the memory
        # budget): CDLL(None) maps no file
        assert text.count("ctypes.CDLL(") == text.count("ctypes.CDLL(None)"), path
        assert "ctypes" not in text or path.name == "memory.py", path
    assert not [p for p in package.rglob("*") if p.suffix in (".c", ".so", ".dll", ".dylib")]


@pytest.mark.skipif(not POSIX_ROOT, reason="needs root to hand a folder to another user")
def test_torch_compile_is_not_used_where_its_cache_folder_is_someone_elses(tmp_path, monkeypatch):
    from merger.accel import compiled, reference_only
    from merger.methods import entries, ties

    planted = tmp_path / "inductor"
    planted.mkdir()
    os.chown(planted, NOBODY, NOBODY)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(planted))
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("compiled from a folder another user owns"))
    stack = torch.randn(8, 600_000)
    args = (torch.full((8,), 0.5), torch.ones(8))
    with pytest.warns(RuntimeWarning, match=f"{planted} belongs to another user.*merging eagerly"):
        out = entries.entrywise(ties.ties_entries, stack, args=args)
    with reference_only():
        assert torch.equal(out, entries.entrywise(ties.ties_entries, stack, args=args))


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX permissions")
def test_a_cache_folder_others_can_write_is_not_used(cached_pool, tmp_path, capsys):
    cache = tmp_path / "cache" / "computed"
    cache.mkdir(parents=True)
    cache.chmod(0o777)
    session, spec = prepared(cached_pool)
    assert session.counts["prepares"] == 1 and not any(cache.iterdir())  # merged, nothing read or written
    assert "the disk cache is off" in capsys.readouterr().err
    assert why_not_private(cache).startswith("others can write to it")


def test_clear_and_the_cap_never_follow_a_link_or_delete_what_they_did_not_write(cached_pool, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    expert = models / ("e" * 64 + ".safetensors")  # named as an entry would be
    save_safetensors({"w": torch.ones(256)}, expert)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "computed").symlink_to(models)  # the whole folder a link
    prepared(cached_pool)
    assert cli(["cache", "clear"]) == 0
    os.environ["MERGER_CACHE_GB"] = "0"
    try:
        prepared(cached_pool)
    finally:
        del os.environ["MERGER_CACHE_GB"]
    assert expert.exists() and sorted(p.name for p in models.iterdir()) == [expert.name]
    # a real folder, with a link named as an entry and a checkpoint of the user's in it
    (tmp_path / "cache" / "computed").unlink()
    prepared(cached_pool)
    computed = tmp_path / "cache" / "computed"
    (computed / ("d" * 64 + ".safetensors")).symlink_to(expert)
    mine = computed / "my-model.safetensors"
    save_safetensors({"w": torch.ones(4)}, mine)
    assert cli(["cache", "clear"]) == 0
    assert expert.exists() and mine.exists()
    assert not [p for p in computed.iterdir() if disk_cache.ENTRY_NAME.fullmatch(p.name) and p.is_file()
                and not p.is_symlink()]


def test_an_entry_this_cache_did_not_sign_is_refused_and_rebuilt(cached_pool, tmp_path, caplog):
    session, spec = prepared(cached_pool)
    reference = session.merges.delta(spec)
    cache = disk_cache.DiskCache()
    (entry,) = [e for e in cache.entries() if "cart over" in cache.describe(e["path"])]
    # another pool's tensors written under this entry's key, with its key and version in the metadata
    from safetensors import safe_open

    with safe_open(str(entry["path"]), framework="pt") as fh:
        meta = fh.metadata()
        forged = {k: fh.get_tensor(k) * 3 for k in fh.keys()}
    meta.pop("tag")
    save_safetensors(forged, entry["path"], metadata=meta)
    with caplog.at_level(logging.WARNING, logger=disk_cache.__name__):
        second, spec2 = prepared(cached_pool)
    assert second.counts["disk hits"] == 0 and second.counts["prepares"] == 1
    assert any("not signed by this cache's secret" in m for m in caplog.messages)
    again = second.merges.delta(spec2)
    assert all(torch.equal(reference[k], again[k]) for k in reference)


def test_a_signed_entry_of_an_unknown_structure_is_dropped_and_rebuilt(tmp_path, caplog):
    cache = disk_cache.DiskCache(tmp_path / "c")
    cache.put("a" * 64, "odd", {"t0": torch.ones(2)}, {"q": [1]})
    with caplog.at_level(logging.WARNING, logger=disk_cache.__name__):
        assert cache.get("a" * 64) is None
    assert "unknown node 'q'" in caplog.text and not (tmp_path / "c" / ("a" * 64 + ".safetensors")).exists()


@pytest.mark.parametrize("damage", ["nan", "permuted", "wider"])
def test_a_planted_zero_shot_head_is_computed_again(tmp_path, monkeypatch, damage):
    from merger.data.heads import heads_cache_dir

    monkeypatch.setenv("MERGER_CACHE_DIR", str(tmp_path / "cache"))
    pool = open_pool(write_pool(tmp_path / "pool", n_experts=2, demo_data=True))
    honest = merger.Evaluator(pool).heads
    for path in heads_cache_dir().glob("*.safetensors"):
        head = load_state_dict(path)["head"]
        head = {"nan": torch.full_like(head, float("nan")), "permuted": head.flip(0),
                "wider": torch.zeros(head.shape[0], head.shape[1] + 1)}[damage]
        save_safetensors({"head": head}, path)  # unsigned, as anyone's would be
    again = merger.Evaluator(pool).heads
    assert all(torch.equal(honest[t], again[t]) for t in honest)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs")
def test_fifos_in_the_cache_hang_nothing(cached_pool, tmp_path):
    prepared(cached_pool)  # the entries and the hash memo exist
    merger.Evaluator(open_pool(cached_pool))  # and the heads
    for folder in ("computed", "heads"):
        for path in list((tmp_path / "cache" / folder).iterdir()):
            if path.name != "secret":
                path.unlink()
                os.mkfifo(path)
    env = {**os.environ, "MERGER_CACHE_DIR": str(tmp_path / "cache"), "MERGER_CACHE_GB": "0.000001"}
    code = ("import merger; from merger.io import disk_cache; disk_cache.WORTH_ENTRIES = 0\n"
            "from merger.evaluation.session import PoolSession\n"
            f"s = PoolSession(merger.open_pool({str(cached_pool)!r})); s.merges.prepared_for(s.spec('cart'))\n"
            "merger.Evaluator(s.pool); print('merged', s.counts['prepares'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "merged 1" in out.stdout, out.stderr[-2000:]
    for args in (["cache", "info"], ["cache", "clear"]):
        out = subprocess.run([sys.executable, "-m", "merger", *args], env=env, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]


def test_a_file_rewritten_in_place_with_its_old_mtime_is_hashed_again(cached_pool):
    base = cached_pool.parent / "base.safetensors"
    first = disk_cache.file_hash(base)
    st = base.stat()
    data = bytearray(base.read_bytes())
    data[-1] ^= 0xFF
    time.sleep(0.01)
    with open(base, "r+b") as fh:  # same inode, same size
        fh.write(bytes(data))
    os.utime(base, ns=(st.st_atime_ns, st.st_mtime_ns))  # the old mtime put back
    assert base.stat().st_mtime_ns == st.st_mtime_ns and base.stat().st_ino == st.st_ino
    assert disk_cache.file_hash(base) != first
