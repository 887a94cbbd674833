"""The bad-input catalogue's cases about what merger keeps on disk (devtools/attacks.py lists them):
a cache someone tampered with must give the merge a cache-less run gives and touch nothing outside it;
a history file of another program is refused."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch

from merger.methods.cart import CART
from devtools.testing import write_pool


def other_history(root: Path, pool: Path) -> None:
    import sqlite3

    db = sqlite3.connect(root / "other.sqlite")
    db.execute("CREATE TABLE evaluations (id INTEGER PRIMARY KEY, score REAL)")
    db.commit()
    db.close()


def cached(build_cache: Callable[[Path, Path], None]):
    """A merge (CART, its preparation cached) with the cache under ``root/cache`` as ``build_cache`` left it:
    it must equal the merge with no cache, and leave ``root/models`` as it was."""
    def build(root: Path):
        from merger.io import disk_cache

        path = write_pool(root, n_experts=3, scale=0.1, demo_data=True)
        (root / "models").mkdir()
        (root / "models" / "mine.safetensors").write_bytes(b"the user's file")

        def action():
            import merger
            from merger.evaluation.session import PoolSession

            os.environ["MERGER_CACHE_DIR"], worth = str(root / "cache"), disk_cache.WORTH_ENTRIES
            disk_cache.WORTH_ENTRIES = 0
            try:
                first = PoolSession(merger.open_pool(path))
                honest = first.merges.delta(first.spec(CART.name))
                build_cache(root, path)
                again = PoolSession(merger.open_pool(path))
                delta = again.merges.delta(again.spec(CART.name))
                merger.Evaluator(again.pool)
            finally:
                del os.environ["MERGER_CACHE_DIR"]
                os.environ.pop("MERGER_CACHE_GB", None)
                disk_cache.WORTH_ENTRIES = worth
            if any(not torch.equal(honest[k], delta[k]) for k in honest):
                raise AssertionError("the merge read from the cache differs from the merge")
            if (root / "models" / "mine.safetensors").read_bytes() != b"the user's file":
                raise AssertionError("a file outside the cache was changed or deleted")
        return action
    return build


def forge_entries(root: Path, pool: Path) -> None:
    """Every cached tensor tripled, the file rewritten with its key (as another pool's would be)."""
    from safetensors import safe_open

    from merger.io.checkpoints import save_safetensors

    for path in (root / "cache").rglob("*.safetensors"):
        with safe_open(str(path), framework="pt") as fh:
            meta, tensors = fh.metadata(), {k: fh.get_tensor(k) * 3 for k in fh.keys()}
        save_safetensors(tensors, path, metadata={k: v for k, v in meta.items() if k != "tag"})


def fifos_for_entries(root: Path, pool: Path) -> None:
    for path in (root / "cache").rglob("*"):
        if path.is_file() and path.name != "secret":
            path.unlink()
            os.mkfifo(path)


def cache_linked_to_models(root: Path, pool: Path) -> None:
    import shutil

    shutil.rmtree(root / "cache" / "computed")
    (root / "cache" / "computed").symlink_to(root / "models")
    os.environ["MERGER_CACHE_GB"] = "0"  # the cap's trim runs at every write
