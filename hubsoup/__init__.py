"""hubsoup: model soups from the Hugging Face Hub.

Merge fine-tunes of one base model (Hub repo IDs or local folders) with the methods
of the model-merging literature, streaming tensor by tensor, and get a standard
``save_pretrained`` checkpoint with a model card that says how it was made.

The public face: :func:`merge` and :class:`MergeResult`, :class:`MergeOptions`,
the workflows built on them (:func:`search`, :func:`sweep`, :func:`greedy_soup`,
:func:`uniform_soup`, the :mod:`continual` module, :func:`run_recipe`) and the
errors in :mod:`hubsoup.errors`. The workflows are imported on first use.

Example:
    >>> import hubsoup
    >>> result = hubsoup.merge(["org/ft-a", "org/ft-b"], method="ties",
    ...                        base="org/base", out="./soup")        # doctest: +SKIP
    >>> print(result)                                                 # doctest: +SKIP
"""

# first of all: in the `hubsoup` command, a Ctrl-C or SIGTERM from now on is recorded, never raised (a traceback out of
# an import), until cli.main installs the handlers that unwind through the cleanup (hubsoup.startup, cli.signals)
from hubsoup import startup as _startup  # noqa: I001 - before anything else of the package

_startup.record_signals()

__version__ = "0.3.0"
"""The one place the version is written (``pyproject.toml`` reads it); ``CHANGELOG.md`` dates each one."""
REPOSITORY = "https://github.com/hubsoup/hubsoup"
"""hubsoup's source repository (``pyproject.toml``'s ``Repository`` URL): where cards and Spaces link to."""

import importlib  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

from hubsoup.errors import HubsoupError  # noqa: E402

# name -> (module, attribute or None for the module itself); imported on first access, so that
# `hubsoup --help` and `--version` never import torch (seconds)
_LAZY = {
    "merge": ("hubsoup.api", "merge"),
    "MergeResult": ("hubsoup.api", "MergeResult"),
    "MergeOptions": ("hubsoup.options", "MergeOptions"),
    "PushTarget": ("hubsoup.hub", "PushTarget"),
    "push_figures": ("hubsoup.api", "push_figures"),
    "continual": ("hubsoup.workflows.continual", None),
    "search": ("hubsoup.workflows.search", "search"),
    "sweep": ("hubsoup.workflows.sweep", "sweep"),
    "greedy_soup": ("hubsoup.workflows.soups", "greedy_soup"),
    "uniform_soup": ("hubsoup.workflows.soups", "uniform_soup"),
    "run_recipe": ("hubsoup.workflows.rerun", "run_recipe"),
    "evolve": ("hubsoup.workflows.evolve", "evolve"),
    "list_methods": ("hubsoup.methods", "list_methods"),
    "method": ("hubsoup.methods", "method"),
}


if TYPE_CHECKING:  # what type checkers and IDEs see of the lazy names (``X as X``: re-exported, for mypy --strict)
    from hubsoup.api import MergeResult as MergeResult, merge as merge, push_figures as push_figures
    from hubsoup.hub import PushTarget as PushTarget
    from hubsoup.methods import list_methods as list_methods, method as method
    from hubsoup.options import MergeOptions as MergeOptions
    from hubsoup.workflows import continual as continual
    from hubsoup.workflows.evolve import evolve as evolve
    from hubsoup.workflows.rerun import run_recipe as run_recipe
    from hubsoup.workflows.search import search as search
    from hubsoup.workflows.soups import greedy_soup as greedy_soup, uniform_soup as uniform_soup
    from hubsoup.workflows.sweep import sweep as sweep


def __getattr__(name: str) -> object:
    if name in _LAZY:
        module, attr = _LAZY[name]
        mod = importlib.import_module(module)
        return mod if attr is None else getattr(mod, attr)
    raise AttributeError(f"module 'hubsoup' has no attribute {name!r}")


__all__ = ["HubsoupError", "__version__", "REPOSITORY", *_LAZY]
