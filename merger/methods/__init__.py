"""Merge methods. Importing this package registers every method."""
from . import basic, ties, lowrank, adaptive  # noqa: F401,I001  (registration order = display order)
from .registry import Method, Param, Paper, all_methods, get, names

__all__ = ["Method", "Param", "Paper", "all_methods", "get", "names"]
