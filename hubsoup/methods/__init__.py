"""Merge methods, one module each, registered by name.

Every module in this package is imported on first use, and each registers its
methods with :func:`register`; adding a method is adding a module. The engine finds
a method here by name and knows nothing else about it.
"""

import importlib
import pkgutil

from hubsoup.methods.base import Method, StatsPass, TensorContext, available, get_method, register

for _mod in pkgutil.iter_modules(__path__):
    if _mod.name not in ("base", "select") and not _mod.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_mod.name}")

__all__ = ["Method", "StatsPass", "TensorContext", "available", "get_method", "register"]
