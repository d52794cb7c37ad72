"""``hubsoup.merge``: the Python API that the CLI calls."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from hubsoup import __version__
from hubsoup.engine import Job, run
from hubsoup.errors import BaseModelError, HubsoupError, IncompatibleInputError, ParameterError
from hubsoup.methods import get_method
from hubsoup.plan import Plan, build_plan, tied_groups
from hubsoup.recipe import RECIPE_FILE, Recipe
from hubsoup.sources import Checkpoint, InputRef, open_input
from hubsoup.sources.deltas import SHAPE_POLICIES, FullDelta, shape_message
from hubsoup.writer import OutputFolder, ShardedWriter, check_output, parse_size

log = logging.getLogger(__name__)

# Config fields that must agree between the base and every input (first one present counts).
_ARCH_FIELDS = {
    "hidden size": ("hidden_size", "n_embd", "d_model", "dim"),
    "number of layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "number of decoder layers": ("num_decoder_layers", "decoder_layers"),
    "attention heads": ("num_attention_heads", "n_head", "num_heads"),
    "intermediate size": ("intermediate_size", "n_inner", "d_ff", "ffn_dim"),
}
_COPY_FROM_BASE = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json", "vocab.txt", "vocab.json", "merges.txt",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "chat_template.jinja",
                   "chat_template.json", "preprocessor_config.json")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass
class MergeResult:
    """What a merge produced. ``path`` is a standard ``save_pretrained`` folder."""

    path: str
    recipe: Recipe
    method: str
    params: dict[str, Any]
    base: InputRef
    inputs: list[InputRef]
    plan: Plan = field(repr=False)
    stats: dict[str, Any] = field(default_factory=dict, repr=False)
    seconds: float = 0.0
    output_format: str = "full"
    """``full`` (a checkpoint) or ``lora`` (a PEFT adapter of the base)."""
    lora: dict[str, Any] | None = field(default=None, repr=False)
    """LoRA output only: ranks and truncation errors (``hubsoup_lora_report.json``)."""
    evaluation: list = field(default_factory=list, repr=False)
    """:class:`hubsoup.eval.TaskResult` of each ``evaluate`` task (also in ``eval_results.json``)."""

    def push_to_hub(self, repo_id: str, *, private: bool | None = None, create_pr: bool = False,
                    commit_message: str | None = None, token: str | bool | None = None,
                    eval_results: Sequence[Any] | None = None, card_template: str | None = None,
                    license: str | None = None):
        """Upload the output folder to the Hub in one commit (the repo is created if needed).

        The folder's model card is updated first, in place, so that the folder stays identical
        to what is on the Hub and ``hubsoup push FOLDER REPO`` retries a failed push: its "how to
        use" snippet loads ``repo_id``. Given ``eval_results`` (``huggingface_hub.EvalResult``
        entries: the card's ``model-index`` and results table), ``card_template`` or ``license``,
        the card is rendered again from this result (sections appended to it after the merge
        are then lost).

        Returns:
            ``huggingface_hub.CommitInfo`` (``commit_url``, ``oid``, ``pr_url``).

        Raises:
            hubsoup.errors.PushError: what failed and how to retry; the local folder is intact.

        Example:
            >>> info = result.push_to_hub("my-org/soup", private=True)   # doctest: +SKIP
            >>> print(info.commit_url)                                     # doctest: +SKIP
        """
        from hubsoup.card import write_card
        from hubsoup.hub import check_repo_id, push_folder, retarget_card

        check_repo_id(repo_id)
        if eval_results or card_template or license:
            write_card(self, self.path, repo_id=repo_id, eval_results=eval_results, template=card_template,
                       license=license)
        else:
            retarget_card(self.path, repo_id)
        return push_folder(self.path, repo_id, private=private, create_pr=create_pr,
                           commit_message=commit_message, token=token)

    def __str__(self) -> str:
        what = ""
        if self.lora is not None:
            what = f" as a LoRA adapter (relative truncation error {self.lora['aggregate_rel_error']:.2e})"
        return (f"merged {len(self.inputs)} model(s) with {self.method} onto {self.base.label}{what} "
                f"in {self.seconds:.2f}s -> {self.path}")


def _pick(cfg: dict, keys: Sequence[str]) -> Any:
    for k in keys:
        if k in cfg:
            return cfg[k]
    return None


def check_config(base: Checkpoint, ckpt: Checkpoint) -> None:
    """Refuse an input whose architecture differs from the base's, before any weight is read."""
    b, c = base.config, ckpt.config
    if b.get("model_type") and c.get("model_type") and b["model_type"] != c["model_type"]:
        raise IncompatibleInputError(
            f"input '{ckpt.label}' is a {c['model_type']} model but the base '{base.label}' is {b['model_type']}; "
            "all inputs must be fine-tunes of the same base")
    for what, keys in _ARCH_FIELDS.items():
        bv, cv = _pick(b, keys), _pick(c, keys)
        if bv is not None and cv is not None and bv != cv:
            raise IncompatibleInputError(
                f"input '{ckpt.label}' has {what} {cv} but the base '{base.label}' has {bv}; "
                "it is not a fine-tune of this base")


def base_model_claims(ckpt: Checkpoint) -> list[str]:
    """Base models an input names for itself (card ``base_model``, adapter config)."""
    claims = []
    bm = ckpt.card_metadata().get("base_model")
    if isinstance(bm, str) and bm.strip():  # peft writes `base_model: ''` when it did not know
        claims.append(bm)
    elif isinstance(bm, list) and len(bm) == 1 and bm[0]:
        claims.append(bm[0])
    adapter = ckpt.read_json("adapter_config.json") or {}
    if adapter.get("base_model_name_or_path"):
        claims.append(adapter["base_model_name_or_path"])
    return claims


def resolve_base(inputs: list[Checkpoint]) -> str:
    named = {}
    for ckpt in inputs:
        claims = base_model_claims(ckpt)
        if not claims:
            raise BaseModelError(
                f"input '{ckpt.label}' does not say which base model it was fine-tuned from "
                "(no base_model in its model card, no base_model_name_or_path in an adapter_config.json); "
                "pass --base ORG/NAME or a folder")
        named[ckpt.label] = claims[0]
    if len(set(named.values())) > 1:
        detail = ", ".join(f"{k} -> {v}" for k, v in named.items())
        raise BaseModelError(f"inputs disagree on their base model ({detail}); pass --base to choose one")
    return next(iter(named.values()))


def _align_names(base_keys: list[str], ckpt: Checkpoint, ignore_extra: bool) -> dict[str, str]:
    """Map base tensor names to the input's, allowing one leading prefix (``bert.``) either way."""
    keys = ckpt.keys()
    have = set(keys)
    name_map = {k: k for k in base_keys}
    if not set(base_keys) <= have:
        prefixes = {k.split(".", 1)[0] + "." for k in keys if "." in k} | {k.split(".", 1)[0] + "." for k in base_keys if "." in k}
        for p in sorted(prefixes):
            if all((p + k) in have for k in base_keys):
                name_map = {k: p + k for k in base_keys}
                break
            if all(k.startswith(p) and k[len(p):] in have for k in base_keys):
                name_map = {k: k[len(p):] for k in base_keys}
                break
    missing = [k for k, v in name_map.items() if v not in have]
    if missing:
        raise IncompatibleInputError(
            f"input '{ckpt.label}' lacks {len(missing)} tensor(s) the base has, e.g. '{missing[0]}'; "
            "is it a fine-tune of this base, and is its checkpoint complete?")
    extra = sorted(have - set(name_map.values()))
    if extra and not ignore_extra:
        raise IncompatibleInputError(
            f"input '{ckpt.label}' has {len(extra)} tensor(s) the base lacks, e.g. '{extra[0]}' (a task head?); "
            "pass --ignore-extra (ignore_extra=True) to leave them out of the merge")
    if extra:
        log.warning("input %s: ignoring %d tensor(s) the base lacks (e.g. %s)", ckpt.label, len(extra), extra[0])
    return name_map


def delta_source(ckpt: Checkpoint, base: Checkpoint, base_keys: list[str], infos: dict, *,
                 ignore_extra: bool = False, shape_mismatch: str = "error"):
    """The task-vector source for one input, after checking its tensors against the base.

    A full checkpoint gives a :class:`FullDelta`; a PEFT LoRA adapter (``adapter_config.json``)
    a :class:`~hubsoup.sources.lora.LoraDelta`, which materialises each adapted tensor's ΔW
    on demand from the adapter's factors (see ``hubsoup/sources/lora.py`` for the checks).
    """
    if ckpt.ref.kind == "lora":
        from hubsoup.sources.lora import lora_source

        return lora_source(ckpt, base, base_keys, infos, ignore_extra=ignore_extra)
    if ckpt.ref.kind != "full":
        raise IncompatibleInputError(f"input '{ckpt.label}' is a {ckpt.ref.kind} adapter; such inputs are not supported")
    name_map = _align_names(base_keys, ckpt, ignore_extra)
    for k in base_keys:
        shape = tuple(ckpt.info(name_map[k]).shape)
        want = tuple(infos[k].shape)
        if shape != want and (shape_mismatch == "error" or len(shape) != len(want)):
            raise IncompatibleInputError(shape_message(ckpt.label, name_map[k], shape, want))
    return FullDelta(ckpt, name_map, shape_mismatch)


def _copy_base_files(base: Checkpoint, dest: str, tokenizer_only: bool = False) -> list[str]:
    copied = []
    for fname in _COPY_FROM_BASE:
        if tokenizer_only and fname in ("config.json", "generation_config.json"):
            continue  # an adapter folder with a config.json would look like a full model
        src = os.path.join(base.folder, fname)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(dest, fname))
            copied.append(fname)
    return copied


def merge(inputs: Sequence[str], method: str, *, base: str | None = None, out: str,
          params: dict[str, Any] | None = None, device: str = "cpu", dtype: str | None = None,
          shard_size: str | int = "5GB", overwrite: bool = False, allow_pickle: bool = False,
          ignore_extra: bool = False, shape_mismatch: str = "error", token: str | bool | None = None,
          output_format: str = "full", rank: int | None = None, energy: float | None = None,
          exemplars: dict[str, str] | Sequence[str] | None = None,
          evaluate: Sequence[Any] | None = None, eval_limit: int | None = None,
          quiet: bool = False, **kwargs: Any) -> MergeResult:
    """Merge fine-tunes of one base model and write a standard checkpoint folder.

    Args:
        inputs: local folders or Hub repo IDs (``org/name[@revision]``).
        method: a registered method name (``hubsoup methods`` lists them).
        base: the pre-trained model; when omitted, taken from the inputs' model cards.
        out: output folder (written atomically; must not exist unless ``overwrite``).
        params: method parameters; keyword arguments not listed here are added to them.
        device: where tensors are merged (``cpu``, ``cuda:0``, ...).
        dtype: output dtype (default: the base's).
        shard_size: maximum shard size (``"5GB"``, ``"500MB"`` or bytes).
        allow_pickle: accept ``pytorch_model.bin`` inputs (pickle can execute code).
        ignore_extra: leave out input tensors the base lacks (e.g. task heads).
        shape_mismatch: ``error`` or ``base-slice`` (merge the rows the base has).
        token: Hub token (default: the usual huggingface_hub sources).
        output_format: ``full`` (a checkpoint) or ``lora`` (a PEFT adapter of the base holding
            the merged task vector, per-module truncated SVD; see ``hubsoup/lora_out.py``).
        rank: LoRA output: the rank of every module (the cap when ``energy`` is given).
        energy: LoRA output: per module, the smallest rank keeping this fraction of ‖τ‖²_F.
        exemplars: for data-aware methods (``lot``): ``{task: path_or_dataset}`` or
            ``["task=path_or_dataset", ...]``, one per input; passed as the ``exemplars``
            method parameter (so they are in the recipe and its hash).
        evaluate: tasks (:class:`hubsoup.eval.TaskSpec` or spec strings such as
            ``"classification:val.csv,text=sentence"``) to evaluate the output on before it is
            committed; results go to ``eval_results.json`` and the card's model-index.
        eval_limit: evaluate on at most this many examples per task.

    Inputs may be PEFT LoRA adapters (folders or repos with ``adapter_config.json``),
    mixed freely with full fine-tunes of the same base.

    Returns:
        :class:`MergeResult` describing the output.

    Example:
        >>> import hubsoup
        >>> res = hubsoup.merge(["org/ft-a", "org/ft-b"], method="ties", base="org/base",
        ...                     out="./soup", density=0.2)          # doctest: +SKIP
        >>> res.path                                                # doctest: +SKIP
        '/abs/path/soup'
    """
    t0 = time.perf_counter()
    params = {**(params or {}), **kwargs}
    if exemplars:
        from hubsoup.features import parse_exemplar_specs

        given = params.get("exemplars") or []
        given = [given] if isinstance(given, str) else list(given)
        params["exemplars"] = given + [f"{k}={v}" for k, v in parse_exemplar_specs(exemplars).items()]
    m = get_method(method)
    p = m.parse(params)
    tasks = _tasks(evaluate)
    if shape_mismatch not in SHAPE_POLICIES:
        raise ParameterError(f"shape_mismatch must be one of {', '.join(SHAPE_POLICIES)}, got {shape_mismatch!r}")
    if dtype is not None and dtype not in _DTYPES:
        raise ParameterError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    if not inputs:
        raise ParameterError("no input models given")
    lora_opts = None
    if output_format == "lora":
        from hubsoup.lora_out import LoraOptions

        lora_opts = LoraOptions(rank, energy, _DTYPES[dtype] if dtype else None)
        lora_opts.validate()
    elif output_format != "full":
        raise ParameterError(f"output_format must be 'full' or 'lora', got {output_format!r}")
    elif rank is not None or energy is not None:
        raise ParameterError("rank/energy apply to the LoRA output only (--output-format lora)")
    m.check_inputs(p, len(inputs))
    check_output(out, overwrite)

    ckpts = [open_input(s, allow_pickle=allow_pickle, token=token) for s in inputs]
    base_spec = base or resolve_base(ckpts)
    base_ckpt = open_input(base_spec, allow_pickle=allow_pickle, token=token, with_tokenizer=True)
    if base_ckpt.ref.kind != "full":
        raise BaseModelError(f"base '{base_ckpt.label}' is an adapter, not a full model")
    for c in ckpts:
        if c.ref.kind == "full":
            check_config(base_ckpt, c)

    base_keys = base_ckpt.keys()
    infos = {k: base_ckpt.info(k) for k in base_keys}
    sources = [delta_source(c, base_ckpt, base_keys, infos, ignore_extra=ignore_extra, shape_mismatch=shape_mismatch)
               for c in ckpts]

    plan = build_plan(base_keys, infos, base_ckpt.config, ties=tied_groups(base_ckpt.folder, base_keys), device=device)
    out_dtype = _DTYPES[dtype] if dtype else None
    recipe = Recipe(method=method, params=m.describe_params(p), base=base_ckpt.ref.to_dict(),
                    inputs=[c.ref.to_dict() for c in ckpts], dtype=dtype, hubsoup_version=__version__)
    if shape_mismatch != "error" or ignore_extra:  # they change what is merged: inside the hash
        recipe.extra["options"] = {"shape_mismatch": shape_mismatch, "ignore_extra": ignore_extra}
    if lora_opts is not None:  # how τ is stored, not what it is: outside the hash
        recipe.extra["output"] = {"format": "lora", "rank": rank, "energy": energy}

    folder = OutputFolder(out, overwrite=overwrite)
    writer = None
    lora_report = None
    try:
        job = Job(plan, base_ckpt, sources, m, p, recipe.hash)
        if lora_opts is not None:
            from hubsoup.lora_out import write_adapter

            stats, lora_report = write_adapter(job, base_keys, sources, lora_opts, folder.path, quiet=quiet,
                                               metadata={"hubsoup_recipe": json.dumps(recipe.to_dict(), default=str)})
            _copy_base_files(base_ckpt, folder.path, tokenizer_only=True)
        else:
            entries = [(name, e.shape, out_dtype if (out_dtype and e.mergeable) else e.dtype)
                       for name, e in plan.output_entries()]
            writer = ShardedWriter(folder.path, entries, parse_size(shard_size),
                                   metadata={"hubsoup_recipe": json.dumps(recipe.to_dict(), default=str)})
            copied = _copy_base_files(base_ckpt, folder.path)
            if out_dtype is not None and "config.json" in copied:
                _set_config_dtype(os.path.join(folder.path, "config.json"), dtype)
            stats = run(job, writer, out_dtype, quiet=quiet)
            writer.close()
        with open(os.path.join(folder.path, RECIPE_FILE), "w", encoding="utf-8") as f:
            f.write(recipe.to_yaml())
        result = MergeResult(folder.target, recipe, method, m.describe_params(p), base_ckpt.ref, [c.ref for c in ckpts],
                             plan, _jsonable(stats), time.perf_counter() - t0, output_format, lora_report)
        if tasks:
            from hubsoup.eval import evaluate_model
            from hubsoup.eval.run import EVAL_FILE, write_results

            result.evaluation = evaluate_model(folder.path, tasks, limit=eval_limit, device=device, quiet=quiet)
            write_results(result.evaluation, os.path.join(folder.path, EVAL_FILE))
        from hubsoup.card import write_card

        write_card(result, folder.path)
        folder.commit()
    except BaseException:
        if writer is not None:
            writer.abort()
        folder.abort()
        raise
    result.seconds = time.perf_counter() - t0
    return result


def _tasks(evaluate: Sequence[Any] | None) -> list:
    if not evaluate:
        return []
    from hubsoup.eval import TaskSpec

    return [TaskSpec.parse(t) if isinstance(t, str) else t for t in evaluate]


def _set_config_dtype(path: str, dtype: str) -> None:
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    name = str(_DTYPES[dtype]).replace("torch.", "")
    cfg["dtype"] = name
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = name
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)


def _jsonable(stats: dict) -> dict:
    out = {}
    for k, v in stats.items():
        try:
            json.dumps(v)
            out[k] = v
        except TypeError:
            out[k] = repr(v)
    return out


__all__ = ["merge", "MergeResult", "HubsoupError"]
