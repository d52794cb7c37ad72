"""Model cards rendered from the Jinja templates in ``cards/``.

Example:
    >>> from hubsoup.card import render
    >>> card = render(result)             # doctest: +SKIP
    >>> card.data.base_model_relation     # doctest: +SKIP
    'merge'
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import TYPE_CHECKING, Any, Protocol, Sequence, cast

from huggingface_hub import EvalResult, ModelCard, ModelCardData, constants, metadata_load

from hubsoup import REPOSITORY
from hubsoup.arch import auto_class
from hubsoup.errors import ParameterError
from hubsoup.eval import to_eval_results
from hubsoup.eval.run import local_dataset_type
from hubsoup.methods import get_method
from hubsoup.methods import describe, measured_harms
from hubsoup.public import looks_local, public_value
from hubsoup.recipe import RECIPE_FILE, Recipe
from hubsoup.untrusted import read_json

if TYPE_CHECKING:
    from hubsoup.methods import Method
    from hubsoup.sources.checkpoint import InputRef

_HERE = os.path.dirname(os.path.abspath(__file__))
# installed wheels carry the templates inside the package; a source checkout has them at the top
TEMPLATE_DIRS = [os.path.join(_HERE, "cards"), os.path.join(os.path.dirname(_HERE), "cards")]


def template_path(name: str = "merge.md") -> str:
    for d in TEMPLATE_DIRS:
        path = os.path.join(d, name)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"card template {name} not found in {TEMPLATE_DIRS}")


class CardResult(Protocol):
    """What the card reads of a merge result (:class:`hubsoup.MergeResult`), and :func:`write_card` sets."""

    card_text: str | None

    @property
    def path(self) -> str: ...

    @property
    def recipe(self) -> Recipe: ...

    @property
    def method(self) -> str: ...

    @property
    def params(self) -> dict[str, Any]: ...

    @property
    def base(self) -> InputRef: ...

    @property
    def inputs(self) -> list[InputRef]: ...

    @property
    def stats(self) -> dict[str, Any]: ...

    @property
    def notes(self) -> list[str]: ...

    @property
    def sections(self) -> list[dict[str, str]]: ...

    @property
    def search(self) -> dict[str, Any] | None: ...

    @property
    def evaluation(self) -> list[Any]: ...


def _ref_view(ref: InputRef) -> dict[str, Any]:
    """What the card shows of an input or the base: its repo ID and SHA, or a local folder's name and digest.

    Never a local path: the card is published (see :meth:`hubsoup.sources.InputRef.public`).
    """
    name = ref.public_name
    url = f"{constants.ENDPOINT}/{ref.repo_id}" if ref.repo_id else ""
    return {"name": name, "label": ref.repo_id or name, "url": url, "revision": ref.revision,
            "sha": ref.sha, "kind": ref.kind, "repo_id": ref.repo_id,
            "digest": None if ref.repo_id else ref.digest}


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def upstream_model(ref: InputRef) -> str | None:
    """The Hub model a base stands for: its repo ID, or, for a local folder, the one Hub ID its own card
    names as ``base_model`` (a local copy of a Hub model, e.g. the demo's all-MiniLM-L6-v2); else None."""

    if ref.repo_id:
        return ref.repo_id
    named = (_card_meta(ref) or {}).get("base_model")
    if isinstance(named, list):
        named = named[0] if len(named) == 1 else None
    if isinstance(named, str) and _HUB_ID.match(named) and not looks_local(named):
        return named
    return None


def _public_eval_results(eval_results: Sequence[EvalResult] | None) -> Sequence[EvalResult] | None:
    """Eval results as published: a ``dataset.type`` that is a local file (a caller's own ``EvalResult``) is the
    result's dataset name, as :func:`hubsoup.eval.run.dataset_type` makes it; the file is never named there."""
    if not eval_results:
        return eval_results

    out = []
    for r in eval_results:
        kind = getattr(r, "dataset_type", None)
        if isinstance(kind, str) and (looks_local(kind) or "@sha256:" in kind or kind.endswith("@local")):
            r = dataclasses.replace(r, dataset_type=local_dataset_type(r.dataset_name))
        out.append(r)
    return out


# peft's task types (adapter_config.json) -> the Auto class of the model they adapt: only used when the
# base's config.json is not at hand (a card rendered again from a published recipe)
_PEFT_TASK_AUTO = {"CAUSAL_LM": ("AutoModelForCausalLM", "text-generation"),
                   "SEQ_CLS": ("AutoModelForSequenceClassification", "text-classification"),
                   "SEQ_2_SEQ_LM": ("AutoModelForSeq2SeqLM", "text2text-generation"),
                   "TOKEN_CLS": ("AutoModelForTokenClassification", "token-classification"),
                   "QUESTION_ANS": ("AutoModelForQuestionAnswering", "question-answering"),
                   "FEATURE_EXTRACTION": ("AutoModel", "feature-extraction")}
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "vocab.txt", "tokenizer.model")


def _load_view(result: CardResult, folder: str | None, lora: bool) -> dict[str, Any]:
    """How the "how to use" snippet loads the output: the Auto class of the architecture its
    ``config.json`` names (the base's, for a LoRA adapter), the card's ``pipeline_tag``, and
    whether there is a tokenizer to load."""

    here = [d for d in (folder, result.path) if d]
    base_dir = result.base.path if result.base.path and os.path.isdir(result.base.path) else None
    where = ([base_dir] if lora else [*here, base_dir])
    # an unreadable config says nothing about the class
    config = next((c for c in (read_json(os.path.join(d, "config.json"), lenient=True) for d in where if d)
                   if isinstance(c, dict) and c), None)
    auto = auto_class(config)
    cls, tag = auto.name, auto.pipeline_tag
    if config is None and lora:
        task = next((c.get("task_type") for c in (read_json(os.path.join(d, "adapter_config.json"), lenient=True)
                                                  for d in here) if isinstance(c, dict) and c), None)
        cls, tag = _PEFT_TASK_AUTO.get(str(task), (cls, tag))
    seen = [d for d in [*here, base_dir] if d and os.path.isdir(d)]
    tokenizer = not seen or any(os.path.isfile(os.path.join(d, f)) for d in seen for f in _TOKENIZER_FILES)
    # an adapter folder holds the base's tokenizer: loaded from it, the snippet needs the base for the weights only
    tokenizer_here = any(os.path.isfile(os.path.join(d, f)) for d in here if os.path.isdir(d) for f in _TOKENIZER_FILES)
    return {"auto_class": cls, "pipeline_tag": tag, "architecture": auto.architecture, "tokenizer": tokenizer,
            "tokenizer_here": tokenizer_here}


def _heads_view(evaluation: Sequence[Any]) -> list[dict[str, Any]]:
    """The frozen heads behind the scores (from :class:`hubsoup.eval.TaskResult`), one row per task.

    A head's free-form ``source`` metadata is shown only when it names no local file.
    """

    rows = []
    for r in evaluation or []:
        head = getattr(r, "head", None)
        if not head:
            continue
        source = head.get("source") or ""
        if any(looks_local(w.strip("()[],;:'\"`")) for w in str(source).split()):
            source = ""
        rows.append({"task": r.task.name, "file": head.get("file"), "pooling": head.get("pooling", "mean"),
                     "source": source})
    return rows


# where a default comes from (a parameter's ``source``): said of the default, never of the value given
_ORIGINS = {"paper": "default: the paper's", "ours": "default: ours (the paper is silent)",
            "mergekit": "default (a parameter from mergekit)"}


def _origin(row: dict[str, Any], value: Any) -> str:
    """Where a hyperparameter's value comes from: given (and what the default would have been), or the default
    and its provenance.

    Example:
        >>> row = {"default": "paper", "source": "mergekit"}
        >>> _origin(row, "paper"), _origin(row, "mergekit")
        ('default (a parameter from mergekit)', 'given (default: `paper`)')
    """
    if not row:
        return ""
    if value != row.get("default"):
        default = row.get("default")
        shown = ", ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"given (default: `{shown}`)".replace("|", "\\|")
    if row.get("source") == "measured":
        return "default: " + str(row.get("evidence") or "measured").replace("|", "\\|")
    return _ORIGINS.get(row.get("source", "paper"), "default")


def _param_rows(method: Method[Any], values: dict[str, Any], prefix: str = "") -> list[dict[str, Any]]:
    """Hyperparameter table rows; a modifier's ``base_params`` become rows ``inner.name`` of the inner method."""
    info = {row["name"]: row for row in describe(method.Params)}
    rows = []
    for k, v in values.items():
        if k == "base_params" and isinstance(v, dict) and "base_method" in values:
            inner = get_method(str(values["base_method"]).split("+")[0].strip())
            rows.extend(_param_rows(inner, v, f"{prefix}{inner.name}."))
            continue
        row = info.get(k, {})
        help_text = row.get("help", "").replace("|", "\\|")  # a bare | would split the table cell
        rows.append({"name": prefix + k, "value": v, "help": help_text, "origin": _origin(row, v)})
    return rows


def render(result: CardResult, *, repo_id: str | None = None, eval_results: Sequence[EvalResult] | None = None,
           template: str | None = None, license: str | None = None, notes: Sequence[str] = (),
           folder: str | None = None) -> ModelCard:
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
        folder: where the output's files are now (default ``result.path``; a merge renders its card in
            the temporary folder before the rename): its ``config.json`` picks the snippet's Auto class.

    The "how to use" snippet loads the output with the Auto class of its architecture
    (``LlamaForCausalLM`` → ``AutoModelForCausalLM``, see :func:`hubsoup.arch.auto_class`), or a
    LoRA output as a ``PeftModel`` over that class; ``pipeline_tag`` matches it. Scores computed
    with a frozen head from outside the model are marked as such, with the head's file named.
    """
    method = get_method(result.method)
    if eval_results is None and getattr(result, "evaluation", None):
        eval_results = to_eval_results(result.evaluation)
    eval_results = _public_eval_results(eval_results)
    base = _ref_view(result.base)
    upstream = upstream_model(result.base)
    if upstream and not result.base.repo_id:  # a local base derived from (or copied from) a Hub model
        base.update(upstream=upstream, upstream_url=f"{constants.ENDPOINT}/{upstream}")
    inputs = [_ref_view(r) for r in result.inputs]
    hub_inputs = [i["repo_id"] for i in inputs if i["repo_id"]]
    model_name = card_title(repo_id or result.path)
    lora = _lora_view(result)
    load = _load_view(result, folder, bool(lora))
    heads = [h for h in _heads_view(getattr(result, "evaluation", None) or [])  # only heads the table names
             if any(h["file"] and h["file"] in (r.metric_name or "") for r in eval_results or [])]
    lic = {"license": license} if license else inherited_license(result)
    if lic.get("note"):
        notes = [*notes, lic["note"]]
    base_model = ([upstream] if upstream else None) if lora else (hub_inputs or ([upstream] if upstream else None))
    data = ModelCardData(
        # a LoRA output is an adapter *of the base* (the merge's inputs are listed in the card body)
        # inputs on the Hub: a merge of them; else, a base that is (a copy of) a Hub model: derived from it
        base_model=base_model,
        # a relation only with the models it relates to (the Hub reads it against base_model)
        base_model_relation=("adapter" if lora else "merge") if base_model else None,
        library_name="peft" if lora else "transformers",
        pipeline_tag=load["pipeline_tag"],
        tags=["merge", "hubsoup", result.method, *(["lora", "peft"] if lora else [])],
        license=lic.get("license"),
        license_name=lic.get("license_name"),
        license_link=lic.get("license_link"),
        model_name=model_name if eval_results else None,
        eval_results=list(eval_results) if eval_results else None,
    )

    params = _param_rows(method, public_value(result.params))  # a parameter naming a local file: its name + hash
    method_notes = method.card_notes(result.params, result.stats, len(result.inputs))
    notes = [*method_notes, *result.notes, *notes]
    if template is not None and not os.path.isfile(template):
        raise ParameterError(f"card template '{template}' not found; give the path of a Jinja markdown file")
    card: ModelCard = ModelCard.from_template(
        data,
        template_path=template or template_path(),
        model_name=model_name,
        method={"name": method.name, "summary": method.summary, "paper": method.paper,
                "paper_url": method.paper_url, "params": params},
        base=base,
        inputs=inputs,
        eval_results=list(eval_results or []),
        hubsoup_version=result.recipe.hubsoup_version,
        repository=REPOSITORY,
        recipe_hash=result.recipe.hash,
        recipe_yaml=result.recipe.public_yaml(),
        load_id=repo_id or os.path.abspath(result.path),  # a local card loads from anywhere
        notes=notes,
        search=result.search,
        sections=result.sections,
        restricted=getattr(result, "restricted", None) or [],
        lora=lora,
        # a card to push names the base as published (never a path); a local card, where the base is
        base_load_id=(base_load_id(result.base) if result.base.repo_id or repo_id or not result.base.path
                      else os.path.abspath(result.base.path)),
        base_on_hub=bool(upstream),
        load=load,
        heads=heads,
        # what the quality benchmarks saw this method at its defaults do to single tasks with inputs of this kind
        # and number (issue 46: every harm is disclosed)
        measured_harms=measured_harms(result.method, result.params, [r.kind for r in result.inputs]),
    )
    return card


def card_title(where: str) -> str:
    """The card's title (and ``model-index`` name): the name of the repo it is pushed to, or of the folder.

    Example:
        >>> card_title("alice/soup"), card_title("/tmp/work/merge/")
        ('soup', 'merge')
    """
    return os.path.basename(os.path.normpath(where.rstrip("/\\"))) or where


def base_load_id(ref: InputRef) -> str:
    """How a published card (and adapter) names the base to load: its repo ID, the Hub model a local copy
    stands for (:func:`upstream_model`), or a local folder's name (its path is never published)."""
    return upstream_model(ref) or ref.public_name


def _recipe_base(folder: str) -> InputRef | None:
    """The base :class:`~hubsoup.sources.InputRef` of the hubsoup recipe in ``folder`` (None: no readable recipe)."""

    try:
        with open(os.path.join(folder, RECIPE_FILE), encoding="utf-8") as f:
            return Recipe.from_yaml(f.read(), verify=False).base
    except Exception:  # noqa: BLE001 - any folder may be pushed: no recipe, no base to rename
        return None


def _local_forms(path: str) -> set[str]:
    return {p for p in (path, os.path.abspath(path), os.path.realpath(path)) if p not in ("", ".", "/")}


def retarget_text(text: str, folder: str, repo_id: str) -> str:
    """A hubsoup card of ``folder`` as it is pushed to ``repo_id``: titled by the repo, its snippet loading the
    repo, and a local base named as :func:`base_load_id` names it (the card never publishes a path).

    Example:
        >>> text = '---\\nlicense: mit\\n---\\n\\n# merge\\n\\nmodel = M.from_pretrained("/tmp/merge")\\n'
        >>> print(retarget_text(text, "/tmp/merge", "alice/soup").split("---")[-1].strip())
        # soup
        <BLANKLINE>
        model = M.from_pretrained("alice/soup")
    """
    new = text
    for local in _local_forms(folder):
        new = new.replace(f'from_pretrained("{local}")', f'from_pretrained("{repo_id}")')
        new = new.replace(f'from_pretrained(base, "{local}")', f'from_pretrained(base, "{repo_id}")')
    base = _recipe_base(folder)
    if base is not None and not base.repo_id and base.path:
        for local in _local_forms(base.path):
            new = new.replace(f'from_pretrained("{local}")', f'from_pretrained("{base_load_id(base)}")')
            new = new.replace(f'base_path = "{local}"', f'base_path = "{base_load_id(base)}"')  # a local-only base
    old_title, title = card_title(os.path.abspath(folder)), card_title(repo_id)
    if old_title != title:
        head, sep, body = new.partition("\n---\n") if new.startswith("---\n") else ("", "", new)
        body = re.sub(rf"^# {re.escape(old_title)}$", lambda m: f"# {title}", body, count=1, flags=re.M)
        new = head + sep + body
        if sep and "model-index" in head:
            card = ModelCard(new)
            data = cast(ModelCardData, card.data)  # a ModelCard's data: ModelCardData (typed as its base class)
            if data.model_name == old_title:
                data.model_name = title
                new = str(card)
    return new


def public_adapter_config(text: str, folder: str) -> str:
    """``adapter_config.json`` as published: a local base path becomes :func:`base_load_id` (what peft then loads)."""
    base = _recipe_base(folder)
    try:
        config = json.loads(text)
    except ValueError:
        return text
    where = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    if base is None or base.repo_id or not base.path or not isinstance(where, str):
        return text
    if where in _local_forms(base.path):
        config["base_model_name_or_path"] = base_load_id(base)
        return json.dumps(config, indent=2)
    return text


def _card_meta(ref: InputRef) -> dict[str, Any] | None:
    """Card metadata of an input or base (its README.md, local or in the Hub cache); None if unknown."""
    if not (ref.path or ref.spec):  # read back from a published recipe: nothing local to read
        return None
    path = os.path.join(ref.path or ref.spec, "README.md")
    if not os.path.isfile(path):
        return None
    try:
        return metadata_load(path) or {}
    except Exception:  # noqa: BLE001 - a malformed card says nothing
        return {}


def inherited_license(result: CardResult) -> dict[str, Any]:
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


def _lora_view(result: CardResult) -> dict[str, Any] | None:
    """The LoRA output's report, trimmed for the card (the full one is ``hubsoup_lora_report.json``)."""
    report = getattr(result, "lora", None)
    if not report:
        return None
    worst = sorted(report.get("modules", []), key=lambda m: -m["rel_error"])[:10]
    return {**{k: v for k, v in report.items() if k != "modules"}, "worst": worst}


def write_card(result: CardResult, folder: str, **kwargs: Any) -> str:
    path = os.path.join(folder, "README.md")
    kwargs.setdefault("folder", folder)
    card = render(result, **kwargs)
    card.save(path)
    result.card_text = str(card)  # MergeResult.card: the text just written
    return path
