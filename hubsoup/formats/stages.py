"""Multi-stage mergekit configs (``mergekit-multi``): a YAML stream of configs, later stages merging earlier ones.

Each document is a mergekit config; a document's ``name`` names its stage, and a model
reference equal to a stage's name (``model: stage-1``, also as ``stage-1@rev`` or
``stage-1+lora``) means that stage's output. As ``mergekit-multi`` does, hubsoup merges every
stage in dependency order, a named stage into ``INTERMEDIATE/NAME`` (kept after the run), and
refuses duplicate names, a second unnamed document and circular references. A stage's name is a label
(:func:`hubsoup.untrusted.label`: letters, digits, ``_``, ``-``, ``.``; never ``..``, a separator or an
absolute path), refused when the stream is read, before anything is written. The output is the
unnamed document's; where every document is named (mergekit-multi then needs no output
folder), it is the last document's. The output's card lists every stage with its config and
recipe hash.

Example:
    >>> from hubsoup.formats.stages import read_stages
    >>> stages = read_stages('''
    ... name: first
    ... merge_method: linear
    ... models: [{model: org/a, parameters: {weight: 1}}, {model: org/b, parameters: {weight: 1}}]
    ... ---
    ... merge_method: slerp
    ... base_model: org/a
    ... models: [{model: first}]
    ... parameters: {t: 0.5}
    ... ''')
    >>> [(s.name, s.needs) for s in stages]
    [('first', []), (None, ['first'])]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hubsoup.errors import ParameterError
from hubsoup.formats.mergekit import is_mergekit_config
from hubsoup.public import map_models
from hubsoup.untrusted import label, load_yaml_all


@dataclass
class Stage:
    """One document of a multi-stage config."""

    name: str | None
    """None for the unnamed (final) document."""
    data: dict[str, Any]
    needs: list[str] = field(default_factory=list)
    """The stages whose outputs it merges, in the order it names them."""


def is_multi_stage(text: str) -> bool:
    """Whether ``text`` is a stream of several mergekit configs."""
    if "\n---" not in text and not text.startswith("---"):
        return False  # one document (the common case): not parsed twice
    try:
        docs = [d for d in load_yaml_all(text, "mergekit config") if d is not None]
    except ParameterError:
        return False  # read again, and refused with the reason, by the single-document reader
    return len(docs) > 1 and all(is_mergekit_config(d) for d in docs)


def _model_name(ref: str) -> str:
    return ref.split("+", 1)[0].split("@", 1)[0]


def read_stages(text: str) -> list[Stage]:
    """The stages of a multi-stage config, in an order where each comes after the stages it merges."""
    docs = [d for d in load_yaml_all(text, "mergekit config") if d is not None]
    stages: dict[str | None, Stage] = {}
    for i, d in enumerate(docs):
        if not is_mergekit_config(d):
            raise ParameterError(f"mergekit config: document {i + 1} of the stream has no 'merge_method'")
        d = dict(d)
        name = d.pop("name", None)
        if name is not None:  # a label: hubsoup makes INTERMEDIATE/NAME of it, never a path the config chose
            label(name, f"mergekit config: document {i + 1}: stage 'name'")
        if name in stages:
            raise ParameterError("mergekit config: more than one unnamed document in the stream" if name is None
                                 else f"mergekit config: two stages are named '{name}'")
        stages[name] = Stage(name, d)
    names = {n for n in stages if n is not None}
    for st in stages.values():
        seen: list[str] = []

        def note(ref: str) -> str:  # every model reference, unchanged
            seen.append(_model_name(ref))
            return ref

        map_models(st.data, note)
        st.needs = list(dict.fromkeys(n for n in seen if n in names))

    order: list[Stage] = []
    state: dict[str | None, str] = {}

    def visit(name: str | None, path: list[str | None]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            raise ParameterError("mergekit config: stages refer to each other in a circle: "
                                 + " -> ".join(str(n) for n in [*path, name]))
        state[name] = "visiting"
        for dep in stages[name].needs:
            visit(dep, [*path, name])
        state[name] = "done"
        order.append(stages[name])

    final = None if None in stages else list(stages)[-1]
    for name in stages:  # every stage runs, as with mergekit-multi; the output's stage last
        if name != final:
            visit(name, [])
    visit(final, [])
    return order


