"""Merging again from what a merge left: a hubsoup recipe, a mergekit config, or mergekit-multi's stages.

A workflow above :func:`hubsoup.merge` (``hubsoup run`` and :func:`hubsoup.run_recipe`): the recipe
(:mod:`hubsoup.recipe`) and the mergekit reader (:mod:`hubsoup.formats.mergekit`) are data and parsing only,
so neither imports the merge it describes.

Example:
    >>> from hubsoup.workflows.rerun import run_recipe
    >>> again = run_recipe("./soup", "./soup-again")     # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any

from hubsoup.api import merge, scoped
from hubsoup.errors import HubsoupError, OutputExistsError, ParameterError
from hubsoup.formats import mergekit, stages
from hubsoup.formats.mergekit import check_hub_only, load_text, read_config
from hubsoup.formats.mergekit.modules import plain_as_modules, run_modules, several_modules
from hubsoup.formats.stages import Stage, read_stages
from hubsoup.methods import check_plugins, get_method
from hubsoup.options import DTYPES
from hubsoup.output.folder import check_output, replace_problem, write_marker
from hubsoup.public import dump_config, map_models, public_config_text
from hubsoup.recipe import RECIPE_FILE, Recipe
from hubsoup.sources.access import check_specs, hub_only
from hubsoup.sources.resolve import open_input
from hubsoup.untrusted import MAX_YAML_BYTES, load_yaml, owned_path, short

if TYPE_CHECKING:
    from hubsoup.api import MergeResult


def recipe_merge_args(recipe: Recipe) -> tuple[list[str], dict[str, Any]]:
    """The ``hubsoup.merge`` arguments that repeat ``recipe`` exactly (Hub inputs pinned to their SHAs)."""
    kwargs: dict[str, Any] = {"method": recipe.method, "base": recipe.base.pinned_spec,
                              "params": dict(recipe.params), "dtype": recipe.dtype}
    for k, v in recipe.options.items():  # only the options that change the result are in a recipe
        if k not in ("shape_mismatch", "ignore_extra"):
            raise ParameterError(f"recipe: option '{k}' cannot come from a recipe")
        if k == "ignore_extra" and not isinstance(v, bool):
            raise ParameterError(f"recipe: option 'ignore_extra' must be true or false, got {short(v)}")
        kwargs[k] = v
    if recipe.output.get("format") not in (None, "full", "lora"):
        raise ParameterError(f"recipe: output format must be full or lora, got {short(recipe.output['format'])}")
    if recipe.output.get("format") == "lora":
        kwargs.update(output_format="lora", rank=recipe.output.get("rank"), energy=recipe.output.get("energy"))
    return [i.pinned_spec for i in recipe.inputs], kwargs


@scoped
def run_recipe(path: str, out: str | None, **overrides: Any) -> MergeResult:
    """Merge again from a recipe file (or an output folder holding one); returns the MergeResult.

    ``push=ORG/NAME`` (or a :class:`hubsoup.hub.PushTarget`) streams the output to the Hub as
    :func:`hubsoup.merge` does (``out`` then optional: a local copy); a multi-stage config's intermediate stages
    stay local, only the final one is pushed.

    ``path`` may also be a mergekit YAML config (a file with ``merge_method``, or a folder holding
    ``mergekit_config.yml``): it is merged with mergekit's semantics
    (:func:`run_config`; model folders relative to the working folder), or a
    stream of them (mergekit-multi's stages, :func:`run_stages`).
    With ``hub_only=True``, ``path`` is the recipe's (or config's) YAML *text*, never a path, and every
    model it names must be a Hub repo ID. mergekit-yaml's options (``copy_tokenizer``, ``random_seed``,
    ``out_shard_params``, ``intermediate_dir``) apply to mergekit configs only.
    """
    mk: dict[str, Any] = {k: overrides.pop(k) for k in ("copy_tokenizer", "random_seed", "out_shard_params",
                                                        "intermediate_dir") if k in overrides}
    mk = {k: v for k, v in mk.items() if v is not None and not (k == "copy_tokenizer" and v is True)}
    if hub_only():  # a server's run: the text itself; nothing on the disk is read or probed
        if not isinstance(path, str):
            raise ParameterError("recipe: with hub_only, give the recipe's YAML text")
        text, where = path, "recipe"
    else:
        if os.path.isdir(path):
            if not os.path.isfile(os.path.join(path, RECIPE_FILE)) and os.path.isfile(os.path.join(path, mergekit.CONFIG_FILE)):
                path = os.path.join(path, mergekit.CONFIG_FILE)
            else:
                path = os.path.join(path, RECIPE_FILE)
        if not os.path.isfile(path):
            raise ParameterError(f"recipe '{path}' not found")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read(MAX_YAML_BYTES + 1)
        except OSError as e:
            raise ParameterError(f"recipe '{path}' cannot be read: {type(e).__name__}") from e
        where = f"recipe '{path}'"
    if stages.is_multi_stage(text):  # mergekit-multi's stream of configs
        return run_stages(text, out, **mk, **overrides)
    mk.pop("intermediate_dir", None)
    data = load_yaml(text, where)
    if mergekit.is_mergekit_config(data):
        return run_config(text, out, **mk, **overrides)
    try:
        recipe = Recipe.from_yaml(text)
    except ParameterError:
        raise
    except Exception as e:  # noqa: BLE001 - a malformed file gets one clear line
        raise ParameterError(f"{where} cannot be read: {short(str(e))}") from e
    if hub_only():
        check_specs(inputs=[r.pinned_spec for r in recipe.inputs], base=recipe.base.pinned_spec)
    check_plugins(recipe.plugins)  # a method from a package not installed here: which one to install
    if mk and not recipe.mergekit.get("config"):
        raise ParameterError(f"{', '.join(sorted(mk))}: mergekit-yaml's options apply to mergekit configs; "
                             f"{where} is a hubsoup recipe")
    return _rerun(recipe, out, overrides, mk)


def check_digests(recipe: "Recipe", *, allow_pickle: bool = False) -> None:
    """Before a rerun: every local input (and base, and adapter) the recipe names by path is still the folder it
    recorded: its content digest now (:meth:`hubsoup.sources.Checkpoint.content_digest`, headers and samples of
    the weights) is the recorded one, else one line naming the input. The recipe's hash is not changed by this
    (it seeds random choices, and outputs repeat byte for byte): the digest is checked on its own."""
    for i, ref in enumerate([recipe.base, *recipe.inputs]):
        what = "base" if i == 0 else f"inputs[{i - 1}]"
        for where, r in ((what, ref), (f"{what}.adapter", ref.adapter)):
            if r is None or r.repo_id or not r.path or not r.digest:
                continue
            try:
                ckpt = open_input(r.path, allow_pickle=allow_pickle, role=where)
                ckpt.keys()  # opens the weights: the digest is computed as it was at the merge
                now = ckpt.ref.digest
                ckpt.release()
            except HubsoupError as e:
                raise ParameterError(f"recipe: '{where}' {short(r.spec or r.path)} cannot be opened to check its "
                                     f"digest: {e}") from e
            if now != r.digest:
                raise ParameterError(f"recipe: '{where}' {short(r.spec or r.path)} is not the folder the recipe "
                                     f"recorded: its digest is {now}, the recipe's '{where}.digest' is "
                                     f"{short(r.digest)}; merge again instead of rerunning it")


def _rerun(recipe: "Recipe", out: str | None, overrides: dict[str, Any], mk: dict[str, Any] | None = None
           ) -> MergeResult:
    check_digests(recipe, allow_pickle=bool(overrides.get("allow_pickle")))
    if recipe.mergekit.get("config"):  # repeat the mergekit config, its Hub models pinned to the recorded SHAs
        refs = [*(recipe.base, *recipe.inputs), *(r.adapter for r in (recipe.base, *recipe.inputs) if r.adapter)]
        pins = {r.spec: dataclasses.replace(r, adapter=None).pinned_spec for r in refs if r.spec and r.repo_id}
        result = run_config(recipe.mergekit["config"], out, pins=pins, **(mk or {}), **overrides)
    else:
        inputs, kwargs = recipe_merge_args(recipe)
        result = merge(inputs, out=out, **{**kwargs, **overrides})
    if result.recipe.hash != recipe.hash:
        logging.getLogger(__name__).warning("recipe hash changed (%s -> %s): an input or parameter differs",
                                            recipe.hash[:12], result.recipe.hash[:12])
    return result


@scoped
def run_config(source: str, out: str | None, *, pins: dict[str, str] | None = None, copy_tokenizer: bool = True,
               random_seed: int | None = None, out_shard_params: int | None = None, **options: Any) -> MergeResult:
    """Run a mergekit config with hubsoup; returns the :class:`hubsoup.MergeResult`.

    ``source``: the YAML text or a file (with ``hub_only``: always the text, never a path);
    ``pins``: model reference → pinned spec (``org/name@sha``),
    used when repeating a merge from its recipe; ``options``: :class:`hubsoup.MergeOptions` fields
    (``overwrite``, ``device``, ``quiet``, ...; ``dtype`` overrides the config's).
    mergekit-yaml's options: ``copy_tokenizer`` (False: the output holds no tokenizer files),
    ``random_seed`` (the ``seed`` of a random method: DARE, DELLA), ``out_shard_params`` (parameters
    per output shard, as ``--out-shard-size``; in bytes of the config's dtype, float16's when it names none).

    Example:
        >>> res = run_config("mk.yml", "./merged", overwrite=True)     # doctest: +SKIP
    """
    if hub_only():  # a server's run: the config is text; nothing is read from (or probed on) the disk
        if not isinstance(source, str):
            raise ParameterError("mergekit config: with hub_only, give the config's YAML text")
        text = source if "\n" in source else source + "\n"
        check_hub_only(load_yaml(text, "mergekit config"))
    else:
        text = source if "\n" in source else load_text(source)
    if pins:
        data = load_yaml(text, "mergekit config")
        # each part of a model+adapter reference pinned on its own
        text = dump_config(map_models(data, lambda r: "+".join(pins.get(x, x) for x in r.split("+"))))
    token, allow_pickle = options.get("token"), bool(options.get("allow_pickle"))
    shard_size, dtype = options.get("shard_size"), options.pop("dtype", None)

    def one(config: str, target: str | None, module: Any = None, referenced: Any = None, **opts: Any) -> MergeResult:
        m = read_config(config, token=token, allow_pickle=allow_pickle, module=module)
        m.text = text  # the card and recipe carry the whole config (a module's merge included)
        if referenced is not None and m.vocab is not None:  # a module's merge: the vocabulary of every module's models
            m.vocab.referenced = list(referenced)
        kwargs = m.merge_kwargs()
        kwargs["layout"].copy_tokenizer = copy_tokenizer
        if random_seed is not None:
            if "seed" in {f.name for f in dataclasses.fields(get_method(m.method).Params)}:
                kwargs["params"]["seed"] = int(random_seed)
        if out_shard_params is not None and shard_size is None:
            opts["shard_size"] = int(out_shard_params) * DTYPES[dtype or m.dtype or "float16"].itemsize
        if dtype is not None:
            kwargs.pop("dtype")
            opts["dtype"] = dtype
        return merge(m.inputs, out=target, **kwargs, **opts)

    data = load_yaml(text, "mergekit config")
    data = plain_as_modules(data, token=token, allow_pickle=allow_pickle) or data  # T5, Whisper, ...: by modules
    if several_modules(data):  # a multimodal model, module by module: one merge each, assembled into one output
        if options.get("push") is not None or out is None:
            raise ParameterError("a modules: config is assembled from one merge per module: give an output folder "
                                 "(--out), then push it with `hubsoup push OUT ORG/NAME`")
        assembled: MergeResult = run_modules(text, data, out, lambda config, module, target, referenced: one(
            config, target, module, referenced, **{**options, "overwrite": False}),
            overwrite=bool(options.get("overwrite")), token=token, allow_pickle=allow_pickle)
        return assembled
    return one(text, out, **options)


def _check_stage_targets(stages: list[Stage], paths: dict[str, str], out: str, inter: str, overwrite: bool,
                         local_out: bool = True) -> None:
    """Before any stage is merged: every folder the stages will replace may be replaced (one line otherwise).

    A stage's folder is replaced when an earlier run made it (its marker says ``stage``), or, with
    ``overwrite``, when hubsoup made it at all (:func:`hubsoup.output.folder.replace_problem`); never another
    folder, the working folder, an input or the base, or a folder that holds one. In a ``hub_only`` run a stage
    cannot read another's output (a local folder): such a stream is refused here, before anything is written.
    ``local_out`` False: the final stage is only pushed (``out`` names where its stages' folder goes, nothing more).
    """
    if hub_only():
        for st in stages:
            if st.needs:
                raise ParameterError(f"mergekit config: stage {short(st.name or 'final')} merges the output of stage "
                                     f"{short(st.needs[0])}, a local folder, which a hub_only run does not read; run "
                                     "each stage on its own, pushing it to the Hub, and name it by its repo ID")
        if local_out:
            check_output(out, overwrite)
        return  # a hub_only run's folders: below its own output's, and its models are Hub repos
    if local_out:
        check_output(out, overwrite)
    if inter == out or inter.startswith(out.rstrip(os.sep) + os.sep):
        raise ParameterError(f"the intermediate folder '{inter}' is inside the output '{out}', which the final stage "
                             "replaces: choose another --intermediate-dir")
    names = {s.name for s in stages if s.name is not None}
    local: list[str] = []

    def note(ref: str) -> str:
        local.extend(p for p in str(ref).split("+")
                     if p.split("@")[0] not in names and os.path.isdir(os.path.expanduser(p)))
        return ref

    for st in stages:  # the models the stages read that are folders here (never a stage's own output)
        map_models(st.data, note)
    for name, target in paths.items():
        if target != out:
            why = replace_problem(target, True, kind="stage", legacy=False)  # an earlier run's stage: replaced
            if why is not None and overwrite:  # --overwrite: any folder hubsoup made
                why = replace_problem(target, True)
            if why is not None:
                raise OutputExistsError(f"stage {short(name)}: {why}")
        real = os.path.realpath(target)
        for ref in local:
            got = os.path.realpath(os.path.expanduser(ref))
            if got == real or got.startswith(real.rstrip(os.sep) + os.sep):
                raise ParameterError(f"stage {short(name)}'s folder '{target}' {'is' if got == real else 'holds'} the "
                                     f"model '{ref}', which a stage reads; choose another --intermediate-dir or --out")


def run_stages(text: str, out: str | None, *, intermediate_dir: str | None = None, **options: Any) -> MergeResult:
    """Merge every stage of a multi-stage config; returns the final stage's :class:`hubsoup.MergeResult`.

    ``intermediate_dir``: where named stages are written (default: ``.NAME.stages`` beside ``out``);
    ``options``: as for :func:`run_config` (each stage is run with them,
    an intermediate stage always replacing an earlier run's). ``push``: the final stage is streamed to the Hub
    (its card with every stage's config); the intermediate stages stay local.
    """
    stages = read_stages(text)  # every name a label, refused here: nothing is written before
    push, before_push = options.pop("push", None), options.pop("before_push", None)
    if out is None and push is None:
        raise ParameterError("give the output folder, or a Hub repo to push the final stage to")
    repo = getattr(push, "repo_id", push)
    out_abs = os.path.abspath(out if out is not None else str(repo).split("/")[-1])
    inter = os.path.abspath(intermediate_dir or os.path.join(os.path.dirname(out_abs),
                                                             f".{os.path.basename(out_abs)}.stages"))
    # a stage's name is a label (checked by read_stages): its folder is derived inside the intermediate folder
    paths = {s.name: owned_path(inter, s.name, what="stage name") for s in stages if s.name is not None}
    final = stages[-1]
    if final.name is not None:
        paths[final.name] = out_abs
    _check_stage_targets(stages, paths, out_abs, inter, bool(options.get("overwrite")), local_out=out is not None)

    def patch(ref: str) -> str:
        head, sep, lora = ref.partition("+")
        name, at, rev = head.partition("@")
        return paths[name] + sep + lora if name in paths else ref

    done: list[tuple[Stage, Any, str]] = []

    def stages_section(final_result: Any, final_config: str) -> dict[str, str]:
        body = ["This model was merged in stages from one multi-stage mergekit config (mergekit-multi), each stage "
                "by hubsoup with mergekit's semantics:\n"]
        for st, res, config in [*done, (final, final_result, final_config)]:
            body.append(f"**{st.name or 'final merge'}** (recipe `{res.recipe.hash[:12]}`):\n\n```yaml\n"
                        + public_config_text(config).rstrip() + "\n```\n")
        return {"title": "Merge stages", "body": "\n".join(body)}

    result = None
    for st in stages:
        config = dump_config(map_models(st.data, patch))
        if st is not final:  # checked above: a stage's folder; a later run replaces it without --overwrite (only it)
            assert st.name is not None  # only the final stage may be unnamed (read_stages)
            result = run_config(config, paths[st.name], **{**options, "overwrite": True})
            write_marker(paths[st.name], "stage", stage=st.name)
            done.append((st, result, config))
            continue
        if push is None:
            result = run_config(config, out_abs, **options)
            result.sections.append(stages_section(result, config))
            result.write_card(result.path)
        else:  # the card with every stage goes up in the push's one commit

            def card(res: Any, folder: str, config: str = config) -> None:
                res.sections.append(stages_section(res, config))
                res.write_card(folder, repo_id=repo)
                if before_push is not None:
                    before_push(res, folder)

            result = run_config(config, out, push=push, before_push=card, **options)
    assert result is not None
    return result
