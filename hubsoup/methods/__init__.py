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
from typing import Any, Sequence, cast

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

    ``{method: {benchmark row: [{"setting", "model", "kind", "n_inputs", "defaults", "interval", "tuned",
    "tuned_values", "harms", "guard"}]}}``: per setting (``"encoder full-8"``: 8 full fine-tunes of MiniLM-L6;
    ``"LM lora"``: 4 LoRA fine-tunes of SmolLM2-135M; ``kind`` and ``n_inputs`` say which), the share of the
    fine-tunes' gain recovered at the defaults with its 95 % interval, the share and values tuned on validation,
    every task the defaults made worse than the base model beyond the noise (``harms``: ``task``, ``size``,
    its 95 % ``range``, and ``tuned_too`` when the tuned method did no better there; disclosed whatever the guard
    says) and where the defaults fail hubsoup's guard (``guard``: a harm tuning avoids, or well below the tuned
    share). Written by ``python -m benchmarks.defaults_report``.

    Example:
        >>> from hubsoup.methods import measured
        >>> sorted(measured()["linear"])
        ['uniform soup']
        >>> {"setting", "defaults", "interval"} <= set(measured()["linear"]["uniform soup"][0])
        True
    """
    return cast(dict[str, dict[str, list[dict[str, Any]]]],
                json.loads(json.dumps(_measured_file()["methods"])))  # a copy: callers may change theirs


def measured_harms(method: str, params: dict[str, Any], kinds: Sequence[str]) -> list[dict[str, Any]]:
    """The tasks hubsoup's quality benchmarks saw a merge like this one make worse than the base model at the
    method's defaults (issue 46: every harm is disclosed, in the card of a merge that matches a harmed setting).

    A benchmark row matches when its method is ``method`` and its structural parameters (``base_method`` of a
    modifier such as LiNeS or LwPTV, DARE's ``then``) are the merge's: LiNeS over TIES matches "LiNeS + TIES",
    not "TIES". A setting matches when every input is of its kind (``kinds``: each input's ``"lora"`` or
    ``"full"``; a mix matches none) and their number is exactly its number of inputs (no nearest setting: a
    harm measured at 8 inputs says nothing measured about 6). The values of the other parameters are not
    compared: what was measured is the defaults, and the card says so.

    Returns one entry per matching (row, setting) with harms: ``{"row", "setting", "model", "kind",
    "n_inputs", "harms": [{"task", "size", "range", "tuned_too"}]}``.

    Example:
        >>> from hubsoup.methods import measured_harms
        >>> measured_harms("linear", {"normalize": True}, ["lora"] * 8)  # the uniform soup harmed no task
        []
    """
    kind = kinds[0] if kinds and all(k == kinds[0] for k in kinds) else None
    if kind is None:
        return []
    shipped = _measured_file()
    out = []
    for label, entries in shipped["methods"].get(method, {}).items():
        row = shipped.get("rows", {}).get(label, {})
        if any(str(params.get(k)) != str(v) for k, v in row.get("params", {}).items()):
            continue
        for e in entries:
            if e.get("harms") and e.get("kind") == kind and e.get("n_inputs") == len(kinds):
                out.append({"row": label, **{k: e.get(k) for k in ("setting", "model", "kind", "n_inputs")},
                            "harms": json.loads(json.dumps(e["harms"]))})
    return out


for _mod in pkgutil.iter_modules(__path__):
    if not _mod.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_mod.name}")

__all__ = ["InputInfo", "Method", "method", "PrepareContext", "StatsPass", "TensorContext", "available", "get_method", "register",
           "method_distribution", "plugin_distributions", "check_plugins", "param", "parse_params", "to_dict", "describe",
           "list_methods", "measured",
           "measured_harms"]
