"""Block groups of the image tower: what a per-block weight b_g multiplies.

The groups follow the tower's depth: ``embeddings`` (patch embedding, class and positional
embeddings, the pre-norm), ``block0`` … ``block{L-1}`` (each transformer block), and
``projection`` (the post-norm and the projection to the embedding space).
"""
from __future__ import annotations

import re
from typing import Iterable

_BLOCK = re.compile(r"(?:resblocks|layers|blocks)\.(\d+)\.")
_AFTER = ("ln_post", "post_layernorm", "proj")  # past the last block


def block_of(key: str) -> str:
    """The block group a merged tensor belongs to."""
    found = _BLOCK.search(key)
    if found:
        return f"block{int(found.group(1))}"
    last = key.split(".")[-2] if key.count(".") >= 1 else key
    name = key.rsplit(".", 1)[-1]
    if last in _AFTER or name in _AFTER:
        return "projection"
    return "embeddings"


def block_groups(keys: Iterable[str]) -> list[str]:
    """The block groups of these keys, shallow to deep."""
    present = {block_of(k) for k in keys}
    blocks = sorted((g for g in present if g.startswith("block")), key=lambda g: int(g[5:]))
    return [g for g in ("embeddings",) if g in present] + blocks + [g for g in ("projection",) if g in present]
