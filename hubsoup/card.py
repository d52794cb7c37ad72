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
from hubsoup.methods import describe

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
    """What the card shows of an input or the base: its repo ID and SHA, or a local folder's name and digest.

    Never a local path: the card is published (see :meth:`hubsoup.sources.InputRef.public`).
    """
    from huggingface_hub import constants

    name = ref.public_name
    url = f"{constants.ENDPOINT}/{ref.repo_id}" if ref.repo_id else ""
    return {"name": name, "label": ref.repo_id or name, "url": url, "revision": ref.revision,
            "sha": ref.sha, "kind": ref.kind, "repo_id": ref.repo_id,
            "digest": None if ref.repo_id else ref.digest}


def _public_eval_results(eval_results: Sequence[EvalResult] | None) -> list[EvalResult] | None:
    """Eval results whose dataset is a local file name it by file name and content hash, not by path."""
    if not eval_results:
        return eval_results
    import dataclasses

    from hubsoup.recipe import looks_local, public_file_ref

    out = []
    for r in eval_results:
        if looks_local(getattr(r, "dataset_type", None)):
            r = dataclasses.replace(r, dataset_type=public_file_ref(r.dataset_type))
        out.append(r)
    return out


def _param_rows(method, values: dict[str, Any], prefix: str = "") -> list[dict[str, Any]]:
    """Hyperparameter table rows; a modifier's ``base_params`` become rows ``inner.name`` of the inner method."""
    info = {row["name"]: row for row in describe(method.Params)}
    rows = []
    for k, v in values.items():
        if k == "base_params" and isinstance(v, dict) and "base_method" in values:
            inner = get_method(str(values["base_method"]).split("+")[0].strip())
            rows.extend(_param_rows(inner, v, f"{prefix}{inner.name}."))
            continue
        row = info.get(k, {})
        ours = " [ours: a choice where the paper is silent]" if row.get("source") == "ours" else ""
        help_text = (row.get("help", "") + ours).replace("|", "\\|")  # a bare | would split the table cell
        rows.append({"name": prefix + k, "value": v, "help": help_text})
    return rows


def render(result, *, repo_id: str | None = None, eval_results: Sequence[EvalResult] | None = None,
           template: str | None = None, license: str | None = None, notes: Sequence[str] = ()) -> ModelCard:
    """Render the model card of a merge result.

    Args:
        result: a :class:`hubsoup.MergeResult`.
        repo_id: where the model will live (used in the "how to use" snippet).
        eval_results: ``huggingface_hub.EvalResult`` entries for the ``model-index``.
        template: path of a custom Jinja template (default ``cards/merge.md``).
        license: license id; default: the base card's, unless an input's card names another
            (see :func:`inherited_license`).
        notes: extra markdown paragraphs for the "Merge notes" section, after the method's own
            (``method.card_notes(params, stats, n_inputs)``, e.g. LwPTV's reverted tensors).
    """
    method = get_method(result.method)
    if eval_results is None and getattr(result, "evaluation", None):
        from hubsoup.eval import to_eval_results

        eval_results = to_eval_results(result.evaluation)
    eval_results = _public_eval_results(eval_results)
    base = _ref_view(result.base)
    inputs = [_ref_view(r) for r in result.inputs]
    hub_inputs = [i["repo_id"] for i in inputs if i["repo_id"]]
    model_name = (repo_id or os.path.basename(result.path.rstrip("/"))).split("/")[-1]
    lora = _lora_view(result)
    lic = {"license": license} if license else inherited_license(result)
    if lic.get("note"):
        notes = [*notes, lic["note"]]
    data = ModelCardData(
        # a LoRA output is an adapter *of the base* (the merge's inputs are listed in the card body)
        base_model=([result.base.repo_id] if result.base.repo_id else None) if lora else (hub_inputs or None),
        base_model_relation="adapter" if lora else ("merge" if hub_inputs else None),
        library_name="peft" if lora else "transformers",
        tags=["merge", "hubsoup", result.method, *(["lora", "peft"] if lora else [])],
        license=lic.get("license"),
        license_name=lic.get("license_name"),
        license_link=lic.get("license_link"),
        model_name=model_name if eval_results else None,
        eval_results=list(eval_results) if eval_results else None,
    )
    from hubsoup.recipe import public_value

    params = _param_rows(method, public_value(result.params))  # a parameter naming a local file: its name + hash
    method_notes = method.card_notes(result.params, result.stats, len(result.inputs))
    notes = [*method_notes, *result.notes, *notes]
    if template is not None and not os.path.isfile(template):
        from hubsoup.errors import ParameterError

        raise ParameterError(f"card template '{template}' not found; give the path of a Jinja markdown file")
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
        recipe_yaml=result.recipe.public_yaml(),
        load_id=repo_id or result.path,
        notes=notes,
        search=result.search,
        sections=result.sections,
        lora=lora,
        base_load_id=result.base.repo_id or result.base.public_name,  # a local base: its folder name, not its path
    )
    return card


def _card_meta(ref) -> dict[str, Any] | None:
    """Card metadata of an input or base (its README.md, local or in the Hub cache); None if unknown."""
    from huggingface_hub import metadata_load

    if not (ref.path or ref.spec):  # read back from a published recipe: nothing local to read
        return None
    path = os.path.join(ref.path or ref.spec, "README.md")
    if not os.path.isfile(path):
        return None
    try:
        return metadata_load(path) or {}
    except Exception:  # noqa: BLE001 - a malformed card says nothing
        return {}


def inherited_license(result) -> dict[str, Any]:
    """The license the merge inherits: the base card's, when no input's card names another one.

    Inputs whose card is silent about the license do not block it (fine-tunes often omit
    it). When an input names a different license, no license is set and the returned
    ``note`` (shown under "Merge notes") lists them. ``license: other`` carries its
    ``license_name`` / ``license_link`` along.

    Returns:
        ``{"license": ..., "license_name": ..., "license_link": ..., "note": ...}`` (keys may be absent).
    """
    base_meta = _card_meta(result.base) or {}
    base_lic = base_meta.get("license")
    if isinstance(base_lic, list):
        base_lic = base_lic[0] if len(base_lic) == 1 else None
    if not base_lic:
        return {}
    others = {}
    for ref in result.inputs:
        lic = (_card_meta(ref) or {}).get("license")
        if lic and lic != base_lic and lic != [base_lic]:
            others[ref.public_name] = lic
    if others:
        listed = ", ".join(f"`{k}`: `{v}`" for k, v in others.items())
        return {"note": f"**License:** the base is licensed `{base_lic}` but some inputs name another license "
                        f"({listed}), so this card sets none; check every input's license before using or "
                        "sharing this model."}
    out = {"license": base_lic}
    if base_lic == "other":
        out.update(license_name=base_meta.get("license_name"), license_link=base_meta.get("license_link"))
    return out


def _lora_view(result) -> dict[str, Any] | None:
    """The LoRA output's report, trimmed for the card (the full one is ``hubsoup_lora_report.json``)."""
    report = getattr(result, "lora", None)
    if not report:
        return None
    worst = sorted(report.get("modules", []), key=lambda m: -m["rel_error"])[:10]
    return {**{k: v for k, v in report.items() if k != "modules"}, "worst": worst}


def write_card(result, folder: str, **kwargs: Any) -> str:
    path = os.path.join(folder, "README.md")
    render(result, **kwargs).save(path)
    return path
