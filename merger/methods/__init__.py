"""Merge methods. Importing this package registers every method: each module of this package
registers its own, so a new method is one new file here."""
import importlib
import pkgutil

# Display order: these first, then any other module of the package by name.
_FIRST = ("basic", "ties", "cart", "tsv_m", "iso", "adaptive")
_modules = [m.name for m in pkgutil.iter_modules(__path__) if m.name != "registry" and not m.name.startswith("_")]
for _name in [*_FIRST, *sorted(set(_modules) - set(_FIRST))]:
    importlib.import_module(f"{__name__}.{_name}")

from merger.methods.registry import Method, Paper, Param, all_methods, get, names, param_names  # noqa: E402

PARAM_NAMES = param_names()  # the shared parameter vocabulary, in order of first use

__all__ = ["Method", "Param", "PARAM_NAMES", "Paper", "all_methods", "get", "names", "param_names"]
