"""Merge methods, one module each, registered by name — and the kit to write one.

Every public module of this package (a name without a leading underscore) is a
method module, imported on first use; each registers its methods with
:func:`register`, so adding a method is adding a module. The private modules are
the kit: the :class:`Method` contract (``_base``), a method as one decorated function
(:func:`method`, ``_easy``), typed parameters (``_params``),
shared tensor primitives (``_kernels``), exact selection (``_select``), the LiNeS
depth schedule (``_depth``) and modifiers (``_compose``). The engine finds a method
here by name and knows nothing else about it.

Example:
    >>> from hubsoup.methods import get_method
    >>> get_method("ties").name
    'ties'
"""

import functools
import importlib
import importlib.resources
import json
import pkgutil
from typing import Any, cast

from hubsoup.methods._base import (
    InputInfo,
    Method,
    PrepareContext,
    StatsPass,
    TensorContext,
    available,
    check_plugins,
    get_method,
    method_distribution,
    plugin_distributions,
    register,
)
from hubsoup.methods._easy import method
from hubsoup.methods._params import describe, param, parse_params, to_dict



def list_methods() -> list[dict[str, Any]]:
    """Every registered method as plain, JSON-serialisable data (for apps that build their forms from it).

    Each: ``{"name", "summary", "paper", "paper_url", "min_inputs", "max_inputs", "params", "measured"}``;
    ``max_inputs`` is None when unbounded; ``params`` as :func:`describe` (name, type, nullable,
    default, range, choices, help, source); ``measured``: what hubsoup's quality benchmarks measured of the
    method at its defaults (:func:`measured`; ``{}`` for a method not in them). ``hubsoup methods`` prints
    the same list.

    Example:
        >>> import hubsoup, json
        >>> ties = next(m for m in hubsoup.list_methods() if m["name"] == "ties")
        >>> [(p["name"], p["type"], p["default"]) for p in ties["params"]][:2]
        [('density', 'float', 0.2), ('scope', 'choice', 'model')]
        >>> _ = json.dumps(hubsoup.list_methods())
    """
    shipped = measured()
    return [{"name": name, "summary": cls.summary, "paper": cls.paper, "paper_url": cls.paper_url,
             "min_inputs": cls.min_inputs, "max_inputs": cls.max_inputs, "params": describe(cls.Params),
             "measured": shipped.get(name, {})}
            for name, cls in available().items()]


@functools.cache
def _measured_file() -> dict[str, Any]:
    return cast(dict[str, Any], json.loads(importlib.resources.files(__name__).joinpath("measured.json").read_text(encoding="utf-8")))


def measured() -> dict[str, dict[str, list[dict[str, Any]]]]:
    """The quality benchmarks' findings on each method's defaults, shipped with the package.

    ``{method: {benchmark row: [{"setting", "defaults", "interval", "tuned", "tuned_values", "guard"}]}}``: per
    setting (``"encoder full-8"``: 8 full fine-tunes of MiniLM-L6; ``"LM lora"``: 4 LoRA fine-tunes of
    SmolLM2-135M), the share of the fine-tunes' gain recovered at the defaults with its 95 % interval, the
    share and values tuned on validation, and where the defaults fail hubsoup's guard (``guard``: worse than
    the base model on a task, or well below the tuned share). Written by ``python -m benchmarks.defaults_report``.

    Example:
        >>> from hubsoup.methods import measured
        >>> sorted(measured()["linear"])
        ['uniform soup']
        >>> {"setting", "defaults", "interval"} <= set(measured()["linear"]["uniform soup"][0])
        True
    """
    return cast(dict[str, dict[str, list[dict[str, Any]]]],
                json.loads(json.dumps(_measured_file()["methods"])))  # a copy: callers may change theirs


for _mod in pkgutil.iter_modules(__path__):
    if not _mod.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_mod.name}")

__all__ = ["InputInfo", "Method", "method", "PrepareContext", "StatsPass", "TensorContext", "available", "get_method", "register",
           "method_distribution", "plugin_distributions", "check_plugins", "param", "parse_params", "to_dict", "describe",
           "list_methods", "measured"]
