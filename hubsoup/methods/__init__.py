"""Merge methods, one module each, registered by name — and the kit to write one.

Every public module of this package (a name without a leading underscore) is a
method module, imported on first use; each registers its methods with
:func:`register`, so adding a method is adding a module. The private modules are
the kit: the :class:`Method` contract (``_base``), typed parameters (``_params``),
shared tensor primitives (``_kernels``), exact selection (``_select``), the LiNeS
depth schedule (``_depth``) and modifiers (``_compose``). The engine finds a method
here by name and knows nothing else about it.

Example:
    >>> from hubsoup.methods import get_method
    >>> get_method("ties").name
    'ties'
"""

import importlib
import pkgutil

from hubsoup.methods._base import (
    InputInfo,
    Method,
    PrepareContext,
    StatsPass,
    TensorContext,
    available,
    get_method,
    register,
)
from hubsoup.methods._params import describe, param, parse_params, to_dict

for _mod in pkgutil.iter_modules(__path__):
    if not _mod.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_mod.name}")

__all__ = ["InputInfo", "Method", "PrepareContext", "StatsPass", "TensorContext", "available", "get_method", "register",
           "param", "parse_params", "to_dict", "describe"]
