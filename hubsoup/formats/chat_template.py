"""A mergekit config's ``chat_template``: a template's text, one of mergekit's names, or ``auto``.

mergekit 0.1.5 reads the value this way (``mergekit/merge.py``), and so does hubsoup:

* ``auto``: the template most of the config's models carry (each model's own tokenizer
  template, stripped; a dict of templates counts by its ``default``); none carries one → the
  tokenizer is left as it is. mergekit breaks a tie by the order of a Python ``set`` of the
  models, which changes from run to run; hubsoup takes the first in the config's order
  (base_model, then the models or slices as written) and logs which it chose.
* a short name with no ``{`` and no line break that names a shipped template (``alpaca``,
  ``chatml``, ``exaone``, ``llama3``, ``mistral``): that file, as mergekit ships it
  (``hubsoup/formats/chat_templates/``, copied from mergekit 0.1.5);
* otherwise the text itself, which must contain ``{`` or be at least 20 characters long.

Example:
    >>> from hubsoup.formats.chat_template import resolve, NAMES
    >>> NAMES
    ('alpaca', 'chatml', 'exaone', 'llama3', 'mistral')
    >>> resolve("chatml").startswith("{% for message in messages %}")
    True
    >>> resolve("auto") is None                        # decided from the models (see plurality)
    True
"""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Iterable

from hubsoup.errors import ParameterError

_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_templates")
NAMES = tuple(sorted(f[: -len(".jinja")] for f in os.listdir(_DIR) if f.endswith(".jinja")))
"""mergekit's named chat templates."""


def resolve(value: str) -> str | None:
    """The template a config's ``chat_template`` value means; None for ``auto`` (decided from the models)."""
    if not isinstance(value, str):
        raise ParameterError(f"mergekit config: 'chat_template' must be text, got a {type(value).__name__}")
    if value == "auto":
        return None
    if len(value) < 256 and "\n" not in value and "{" not in value and value in NAMES:
        with open(os.path.join(_DIR, value + ".jinja"), encoding="utf-8") as f:
            return f.read()
    if len(value) < 20 or "{" not in value:
        raise ParameterError(f"mergekit config: 'chat_template: {value[:40]!r}' is neither a template (Jinja text) "
                             f"nor one of mergekit's named templates ({', '.join(NAMES)}) nor 'auto'")
    return value


def template_of(folder: str) -> str | None:
    """A model folder's own chat template (stripped), as transformers loads it; None if it has none."""
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    template = None
    for name, key in (("chat_template.json", "chat_template"), ("tokenizer_config.json", "chat_template")):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    template = json.load(f).get(key)
            except (OSError, ValueError, AttributeError):
                template = None
            if template:
                break
    if isinstance(template, list):  # [{name, template}, ...], as transformers saves several
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if isinstance(template, dict):
        template = template.get("default")
    return template.strip() if isinstance(template, str) and template.strip() else None


def plurality(templates: Iterable[tuple[str, str | None]]) -> tuple[str, str] | None:
    """``(label, template)``: the template most models carry, the first in order among equals; None if none has one."""
    seen = [(label, t) for label, t in templates if t]
    if not seen:
        return None
    counts = Counter(t for _, t in seen)
    best = max(counts.values())
    return next((label, t) for label, t in seen if counts[t] == best)
