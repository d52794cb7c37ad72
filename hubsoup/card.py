"""Model cards rendered from the Jinja templates in ``cards/``.

Example:
    >>> from hubsoup.card import render
    >>> card = render(result)             # doctest: +SKIP
    >>> card.data.base_model_relation     # doctest: +SKIP
    'merge'
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from hubsoup.methods import get_method
from hubsoup.params import describe

_HERE = os.path.dirname(os.path.abspath(__file__))
# installed wheels carry the templates inside the package; a source checkout has them at the top
TEMPLATE_DIRS = [os.path.join(_HERE, "cards"), os.path.join(os.path.dirname(_HERE), "cards")]


def template_path(name: str = "merge.md") -> str:
    for d in TEMPLATE_DIRS:
        path = os.path.join(d, name)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"card template {name} not found in {TEMPLATE_DIRS}")


def _ref_view(ref) -> dict[str, Any]:
    from huggingface_hub import constants

    name = ref.repo_id or os.path.basename(os.path.abspath(ref.path or ref.spec))
    url = f"{constants.ENDPOINT}/{ref.repo_id}" if ref.repo_id else ""
    return {"name": name, "label": ref.repo_id or name, "url": url, "revision": ref.revision,
            "sha": ref.sha, "kind": ref.kind, "repo_id": ref.repo_id}


def render(result, *, repo_id: str | None = None, eval_results: Sequence[EvalResult] | None = None,
           template: str | None = None, license: str | None = None) -> ModelCard:
    """Render the model card of a merge result.

    Args:
        result: a :class:`hubsoup.MergeResult`.
        repo_id: where the model will live (used in the "how to use" snippet).
        eval_results: ``huggingface_hub.EvalResult`` entries for the ``model-index``.
        template: path of a custom Jinja template (default ``cards/merge.md``).
        license: license id; default: the base's, when every input agrees with it.
    """
    method = get_method(result.method)
    base = _ref_view(result.base)
    inputs = [_ref_view(r) for r in result.inputs]
    hub_inputs = [i["repo_id"] for i in inputs if i["repo_id"]]
    model_name = (repo_id or os.path.basename(result.path.rstrip("/"))).split("/")[-1]
    data = ModelCardData(
        base_model=hub_inputs or None,
        base_model_relation="merge" if hub_inputs else None,
        library_name="transformers",
        tags=["merge", "hubsoup", result.method],
        license=license,
        model_name=model_name if eval_results else None,
        eval_results=list(eval_results) if eval_results else None,
    )
    help_of = {row["name"]: row.get("help", "") for row in describe(method.Params)}
    params = [{"name": k, "value": v, "help": help_of.get(k, "")} for k, v in result.params.items()]
    card = ModelCard.from_template(
        data,
        template_path=template or template_path(),
        model_name=model_name,
        method={"name": method.name, "summary": method.summary, "paper": method.paper,
                "paper_url": method.paper_url, "params": params},
        base=base,
        inputs=inputs,
        eval_results=list(eval_results or []),
        hubsoup_version=result.recipe.hubsoup_version,
        recipe_hash=result.recipe.hash,
        recipe_yaml=result.recipe.to_yaml(),
        load_id=repo_id or result.path,
    )
    return card


def write_card(result, folder: str, **kwargs: Any) -> str:
    path = os.path.join(folder, "README.md")
    render(result, **kwargs).save(path)
    return path
