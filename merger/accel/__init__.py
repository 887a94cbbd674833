"""Faster routes to reference functions: each a drop-in for one function marked ``@accelerable`` where
it is defined (a method's plain-torch definition), tested equal to it under the precision contract
(tests/test_accel.py) and kept only where a bench shows it at least 1.5× faster on what a person waits
for (docs/accel.md). ``registry``: how a drop-in is registered and routed; ``reference_only()`` turns
them all off."""
from merger.accel import cart_ranks, compiled, gram, histogram, iso_cts, tower  # noqa: F401  (each registers its drop-ins)
from merger.accel.registry import DropIn, accelerable, drop_ins, reference_only, references_asked

__all__ = ["DropIn", "accelerable", "drop_ins", "reference_only", "references_asked"]
