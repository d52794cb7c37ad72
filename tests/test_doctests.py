"""Every ``Example:`` in hubsoup's docstrings runs and prints what it says (huggingface_hub's style:
docstrings with examples; an example that no longer runs misleads)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import hubsoup

# ``__main__`` modules run the CLI when imported
MODULES = sorted(m.name for m in pkgutil.walk_packages(hubsoup.__path__, "hubsoup.") if not m.name.endswith("__main__"))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False,
                             report=True)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (output above)"


def test_the_examples_are_found():
    """The walk reaches the modules with examples (a broken walk would pass every case above vacuously)."""
    attempted = sum(doctest.testmod(importlib.import_module(n), verbose=False, report=False).attempted
                    for n in ("hubsoup.linalg", "hubsoup.methods._sparsify", "hubsoup.options"))
    assert attempted >= 8
