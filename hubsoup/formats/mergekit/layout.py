"""How a mergekit config lays out the output (:class:`MergekitLayout`): its plan (slices renumber layers), the
checkpoints it copies from, the output's config (layer count, dtype), tokenizer (a merged vocabulary:
:mod:`~hubsoup.formats.mergekit.vocab`) and chat template; passed to :func:`hubsoup.merge` as ``layout``."""

from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING, Any, Sequence, cast

from hubsoup.arch import before_blocks, tied_groups
from hubsoup.errors import ParameterError
from hubsoup.formats import chat_template
from hubsoup.formats.mergekit.config import Slice, Source
from hubsoup.formats.mergekit.vocab import VocabLayout
from hubsoup.hubclient import Token
from hubsoup.output.checkpoint import BASE_FILES
from hubsoup.plan import Plan, TensorSource, block_of, build_plan, layout_plan
from hubsoup.public import public_config_text
from hubsoup.sources.adapted import open_adapted
from hubsoup.sources.compat import open_models
from hubsoup.sources.remap import AliasedCheckpoint
from hubsoup.sources.resolve import open_input
from hubsoup.untrusted import load_yaml, short

if TYPE_CHECKING:
    from hubsoup.formats.mergekit.modules import Module
    from hubsoup.formats.mergekit.read import MergekitMerge
    from hubsoup.options import MergeOptions
    from hubsoup.progress import Monitor
    from hubsoup.sources.checkpoint import Checkpoint

log = logging.getLogger(__name__)


class MergekitLayout:
    """How a mergekit config lays out the output: its plan (slices renumber layers), output config, tokenizer.

    Passed to :func:`hubsoup.merge` as ``layout``: ``plan()`` gives the plan the one engine streams
    (for ``models`` configs, the base's own plan), ``donors`` the other checkpoints it reads
    from, ``finish()`` fixes the output folder (layer count, tokenizer, chat template).
    """

    def __init__(self, merge: MergekitMerge) -> None:
        self.merge = merge
        self.donors: list[Any] = []
        self.copy_tokenizer = True
        """False (``--no-copy-tokenizer``): the output holds no tokenizer files, as with mergekit-yaml."""
        self._num_layers: int | None = None
        self._vocab = self._vocab_layout() if merge.vocab is not None else None
        self._views: dict[str, Any] = {}
        self._base_config: dict[str, Any] | None = None
        """The models as :meth:`open_inputs` opened them (re-mapped, tied tensors aliased), by reference."""

    # --- the merged vocabulary (tokenizer_source / tokenizer): hubsoup.formats.mergekit.vocab ---------

    def _vocab_layout(self) -> VocabLayout:
        merge = self.merge
        spec = merge.vocab
        assert spec is not None  # only made for a config with a merged vocabulary (__init__)
        if merge.slices is None:  # mergekit: the models, then base_model when it is not one of them
            sources = [s.model for s in merge.models_mode_sources]
            first = last = sources + ([spec.base_model] if spec.base_model and spec.base_model not in sources else [])
        else:
            first = [s.model for s in merge.slices[0].sources]
            last = [s.model for s in merge.slices[-1].sources]
        first, last = list(dict.fromkeys(first)), list(dict.fromkeys(last))  # a model named twice counts once
        order = list(dict.fromkeys(([spec.base_model] if spec.base_model else []) + first
                                   + [s.model for sl in merge.slices or [] for s in sl.sources] + last))
        module = merge.module
        if spec.referenced:  # one module of several: the vocabulary of every module's models
            order = list(dict.fromkeys(spec.referenced + order))

        def group(name: str) -> list[str]:  # the embeddings: the first slice's models; the head: the last's
            if module is not None:  # a module's: its pre_weights the first slice's, the others the last's
                return first if any(w.name == name and w.part == "pre" for w in module.weights) else last
            return first if _before(name) else last

        if module is not None:
            return VocabLayout(merge, spec, order, group, module.vocab.__contains__, module.vocab_key)
        return VocabLayout(merge, spec, order, group)

    @property
    def reads(self) -> list[Any]:
        """Every checkpoint the output is made from beyond the inputs and the base: the models slices copy
        from and a tokenizer source (never to be overwritten by the output, pinned like the inputs)."""
        tok = self._vocab.source_ckpt if self._vocab is not None else None
        return [*self.donors, *([tok] if tok is not None else [])]

    @property
    def opens_inputs(self) -> bool:
        """Whether :func:`hubsoup.merge` must open the inputs through :meth:`open_inputs` (a merged vocabulary,
        or a module whose tied tensors a model may not store)."""
        return self._vocab is not None or self.merge.module is not None

    def _ties(self, raw: dict[str, Any]) -> dict[str, Any]:
        """The models of a module's merge, each seen as that module's tensors only (mergekit reads no other),
        with the module's tied tensors it does not store read from their tie source (mergekit's
        ``tied_names``: T5's ``encoder.embed_tokens.weight`` from ``shared.weight``); an optional one only
        when some model of the merge stores it, as mergekit plans it."""
        module = self.merge.module
        if module is None:
            return raw
        merge = self.merge
        mine = [r for r in dict.fromkeys([*([merge.base] if merge.base else []),
                                          *(s.model for s in merge.models_mode_sources),
                                          *(s.model for sl in merge.slices or [] for s in sl.sources)]) if r in raw]
        aliases: dict[str, dict[str, str]] = {r: {} for r in raw}
        for w in module.tied:
            if w.optional and not any(raw[r].has(n) for r in mine for n in (w.name, *w.stored_as)):
                continue
            for r, c in raw.items():
                if not c.has(w.name):
                    src = next((n for n in w.sources if c.has(n)), None)
                    if src is not None:
                        aliases[r][w.name] = src
        for r, a in aliases.items():
            if a:
                log.info("mergekit config: '%s' does not store %s: read from %s, as mergekit reads tied tensors",
                         r, ", ".join(a), ", ".join(dict.fromkeys(a.values())))
        return {r: AliasedCheckpoint(c, aliases[r], module.holds) for r, c in raw.items()}

    def _open_tied(self, opts: MergeOptions, monitor: Monitor | None = None) -> dict[str, Any]:
        """Every model of a module's merge opened (headers only), seen as the module (:meth:`_ties`)."""
        merge = self.merge
        refs = [merge.base] if merge.base else []
        refs += [s.model for s in merge.models_mode_sources] + [s.model for sl in merge.slices or [] for s in sl.sources]
        raw = {r: open_adapted(r, open_input, allow_pickle=opts.allow_pickle, token=opts.token, monitor=monitor,
                               headers_only=True, role="base" if r == merge.base else "input")
               for r in dict.fromkeys(refs)}
        return self._ties(raw)

    def open_inputs(self, inputs: Sequence[str], base: str | None, opts: MergeOptions,
                    monitor: Monitor | None = None) -> tuple[Checkpoint, list[Any]]:
        """The base and the inputs' task vectors, every model seen through the merged vocabulary (re-mapped
        rows) and with a module's tied tensors it does not store (:meth:`_ties`)."""

        views = self._vocab.open(opts, monitor, wrap=self._ties) if self._vocab is not None \
            else self._open_tied(opts, monitor)
        self._views = views
        specs = [views.get(i, i) for i in inputs]  # a LoRA (base+adapter) input: the adapter, as is
        if self._vocab is not None:  # ... unless it changes the embeddings: then the base with the adapter
            specs = [self._adapted_view(i, views) or s for i, s in zip(inputs, specs)]  # applied, re-mapped
        assert base is not None  # a mergekit method's merge always has one (base_model, else its first model)
        base_ckpt, sources = open_models(specs, base=views[base], allow_pickle=opts.allow_pickle,
                                         ignore_extra=opts.ignore_extra, shape_mismatch=opts.shape_mismatch,
                                         token=opts.token, headers_only=True,
                                         monitor=monitor if any(isinstance(s, str) for s in specs) else None)
        if self._vocab is not None:
            self._vocab.check_sources(sources)
        return base_ckpt, sources

    def _adapted_view(self, spec: str, views: dict[str, Any]) -> Any:
        """A ``base+adapter`` input (else merged as the adapter alone): the base with the adapter applied,
        re-mapped as a model of its own (mergekit merges the adapter into the base first and reads that model's
        rows by the base's tokenizer: its embeddings if the adapter saves them, ``modules_to_save`` or trainable
        tokens, and the default rows of the tokens the base lacks); None for any other input."""
        base = self.merge.base
        for ref, view in views.items():
            model, sep, adapter = ref.partition("+")
            if sep and model == base and adapter == spec:
                return view
        return None

    @property
    def hashed(self) -> dict[str, Any]:
        """What the recipe hash must cover beyond method, parameters and inputs."""
        out: dict[str, Any] = {}
        if self.merge.slices is not None and not self._trivial_slices():
            out["layout"] = [[[s.model, *cast("tuple[int, int]", s.layer_range)] for s in sl.sources]  # a slice's: set
                             for sl in self.merge.slices]
            # the models a slice copies from without merging: pinned (Hub SHA, or folder) like the inputs
            out["donors"] = [{k: v for k, v in c.ref.to_dict().items() if k in ("repo_id", "sha", "path") and v}
                             for c in self.donors]
        if self._vocab is not None:
            out["tokenizer"] = self._vocab.hashed()
        if self.merge.chat_template:
            out["chat_template"] = self.merge.chat_template
        return out

    def recipe_extra(self) -> dict[str, Any]:
        return {"config": self.merge.text}

    def _trivial_slices(self, num_layers: int | None = None) -> bool:
        """One slice taking every layer of every model: the same as ``models`` (no renumbering)."""
        sl = self.merge.slices
        if sl is None:
            return True
        n = num_layers if num_layers is not None else self._num_layers
        return (len(sl) == 1 and len(sl[0].sources) > 1 and n is not None
                and all(s.layer_range == (0, n) for s in sl[0].sources))

    def check_sources(self, token: Token = None,
                      allow_pickle: bool = False) -> tuple[str, list[str], list[str], list[str]] | None:
        """Read the sliced models' configs (layer ranges within each model's depth); returns their naming.

        The naming: ``(stack, layer suffixes, names before the layers, names after)`` of the
        first sliced model, from its safetensors headers (no weight is read).
        """
        if self.merge.slices is None:
            return None

        naming = None
        for i, sl in enumerate(self.merge.slices):
            for j, s in enumerate(sl.sources):
                ckpt = open_input(s.model.split("+")[0], allow_pickle=allow_pickle, token=token)
                n = _depth(ckpt, self.merge.module)
                assert s.layer_range is not None  # a slice's sources have their layer ranges (read._read_slices)
                if n is not None and s.layer_range[1] > n:
                    raise ParameterError(f"mergekit config: 'slices[{i}].sources[{j}].layer_range' = "
                                         f"{list(s.layer_range)} but '{s.model}' has {n} layers")
                if naming is None:
                    naming = _naming(ckpt, self.merge.module)
        return naming

    def plan(self, base: Any, sources: Sequence[Any], opts: MergeOptions) -> Plan:
        """The plan of the output (the base's own for ``models``), with every donor checkpoint opened."""

        if self.merge.chat_template == "auto":
            self.merge.chat_template_text = self._auto_chat_template(base, opts)
        module = self.merge.module
        self._base_config = base.config
        self._num_layers = _layers(base.config) if module is None else _depth(base, module)
        if self._trivial_slices():
            if module is None:
                return Plan.of(base, opts.device)
            return _module_plan(base, module, opts.device)
        return self._slice_plan(base, sources, opts)

    def _slice_plan(self, base: Any, sources: Sequence[Any], opts: MergeOptions) -> Plan:
        merge = self.merge
        assert merge.slices is not None  # planned by slices only where there are (plan)
        ref_model = merge.inputs[0] if merge.merge_method == "passthrough" else (merge.base or merge.inputs[0])
        keys = [k for k in base.keys() if merge.module is None or merge.module.holds(k)]
        stack, suffixes, pre, post = _naming(base, merge.module)

        origin = self._open_donors(ref_model, opts)
        n_in = len(merge.inputs)

        def ckpt_of(model: str) -> Any:
            return base if origin[model] < 0 else self.donors[origin[model]]

        out: dict[str, TensorSource] = {}
        infos: dict[str, Any] = {}
        have = {id(c): set(c.keys()) for c in (base, *self.donors)}

        def checked(s: Source, tensor: str, name: str) -> Any:
            """The tensor a slice takes from ``s.model``: it exists, and has the shape of the output's (the
            base's) tensor in its place — models of another size cannot be stacked, whatever their configs say."""
            ckpt = ckpt_of(s.model)
            if tensor not in have[id(ckpt)]:
                assert s.layer_range is not None  # a slice's sources have their layer ranges
                raise ParameterError(f"mergekit config: a slice takes {short(tensor)} from {short(s.model)}, which "
                                     f"has no such tensor (layer_range {list(s.layer_range)} beyond its layers?)")
            info = ckpt.info(tensor)
            ref = name if offset_free(name) else f"{stack}.0.{name}"
            if ref in have[id(base)] and tuple(base.info(ref).shape) != tuple(info.shape):
                raise ParameterError(f"mergekit config: a slice takes {short(tensor)} of shape {list(info.shape)} "
                                     f"from {short(s.model)}, but the output is laid out as '{base.label}', whose "
                                     f"'{ref}' is {list(base.info(ref).shape)}: models of different sizes (hidden "
                                     "size, heads, ...) cannot be stacked")
            return info

        def offset_free(name: str) -> bool:
            return name in pre or name in post

        def add(name: str, sl: Slice, offset: int | None, position: float | None) -> None:
            def src_name(s: Source) -> str:
                lr = cast("tuple[int, int]", s.layer_range)  # a slice's sources have their layer ranges
                return name if offset is None else f"{stack}.{lr[0] + offset}.{name}"

            out_name = name if offset is None else f"{stack}.{k_out}.{name}"
            if len(sl.sources) == 1 or merge.merge_method == "passthrough":
                s = sl.sources[0]
                ts = TensorSource(src_name(s), (None,) * n_in, position, origin[s.model])
                infos[out_name] = checked(s, src_name(s), name)
            else:
                by_model = {s.model: s for s in sl.sources}
                for s in sl.sources:
                    checked(s, src_name(s), name)
                r = by_model[ref_model]
                names = tuple(src_name(by_model[m]) if m in by_model else None for m in merge.inputs)
                ts = TensorSource(src_name(r), names, position, -1)
                infos[out_name] = base.info(src_name(r))
            out[out_name] = ts

        # a layer tensor some of the base's own layers lack (T5's relative_attention_bias, layer 0's only) is
        # written only where some model of the slice holds it
        depth = {bl[1] for k in keys if (bl := block_of(k)) and bl[0] == stack}
        optional = {suf for suf in suffixes if any(f"{stack}.{i}.{suf}" not in have[id(base)] for i in depth)}
        k_out = 0
        for k in pre:
            add(k, merge.slices[0], None, None)
        for sl in merge.slices:
            a, b = cast("tuple[int, int]", sl.sources[0].layer_range)  # a slice's sources have their layer ranges
            n = b - a
            for j in range(n):
                t = j / (n - 1) if n > 1 else 1.0
                for suf in suffixes:
                    if suf in optional and not any(
                            f"{stack}.{cast('tuple[int, int]', s.layer_range)[0] + j}.{suf}" in have[id(ckpt_of(s.model))]
                            for s in sl.sources):
                        continue
                    add(suf, sl, j, t)
                k_out += 1
        for k in post:
            add(k, merge.slices[-1], None, None)
        self._num_layers = k_out
        return _renumbered_plan(base, keys, out, infos, k_out, opts.device)

    def _open_donors(self, ref_model: str, opts: MergeOptions) -> dict[str, int]:
        """The checkpoints θ₀ may come from, by model: the base (-1) or a donor (every other model named by a
        slice, opened now and kept in :attr:`donors`)."""
        origin: dict[str, int] = {ref_model: -1}
        for sl in self.merge.slices or []:  # called with slices only (_slice_plan)
            for s in sl.sources:
                if s.model not in origin:
                    ckpt = self._views.get(s.model) or \
                        open_adapted(s.model, open_input, allow_pickle=opts.allow_pickle, token=opts.token)
                    origin[s.model] = len(self.donors)
                    self.donors.append(ckpt)
        return origin

    def _auto_chat_template(self, base: Any, opts: MergeOptions) -> str | None:
        """``chat_template: auto``: the template most of the config's models carry (config order breaks ties)."""

        refs = [r.split("+")[0] for r in _referenced(self.merge)]
        folders = []
        for ref in refs:
            if ref == self.merge.base:
                folders.append((ref, base.folder))
            else:
                ckpt = open_input(ref, allow_pickle=opts.allow_pickle, token=opts.token, with_tokenizer=True,
                                  headers_only=True)
                folders.append((ref, ckpt.folder))
        found = chat_template.plurality((ref, chat_template.template_of(f)) for ref, f in folders)
        if found is None:
            log.warning("mergekit config: chat_template: auto, but none of the models has a chat template: "
                        "the tokenizer keeps its own")
            return None
        log.warning("mergekit config: chat_template: auto chose the template of '%s' (%d of %d models carry it)",
                    found[0], sum(chat_template.template_of(f) == found[1] for _, f in folders), len(folders))
        return found[1]

    def finish(self, folder: str) -> None:
        """The output's config (layer count, vocabulary size), tokenizer (``tokenizer_source``) and chat template."""
        cfg_path = os.path.join(folder, "config.json")
        if self._num_layers is not None and self.merge.slices is not None and self.merge.module is None \
                and os.path.isfile(cfg_path):  # a module's layer count: set when the modules are assembled
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
            _set_layers(cfg, self._num_layers)
            with open(cfg_path, "w", encoding="utf-8") as f:
                json.dump(cfg, f, indent=2)
        if self.merge.config_dtype is not None and os.path.isfile(cfg_path):
            self._name_config_dtype(cfg_path)
        if self._vocab is not None:  # the merged vocabulary's tokenizer and config.json's vocab_size: written
            self._vocab.finish(folder)  # with --no-copy-tokenizer too, as mergekit writes a merged tokenizer
        elif not self.copy_tokenizer:
            _remove_tokenizer_files(folder)
            return
        if self.merge.chat_template:  # mergekit then saves the tokenizer again (not a file copy), template or not
            # lazy: transformers costs ~4 s to import here (torch ~6 s); only a config's tokenizer source needs it
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(folder)
            if self.merge.chat_template_text:
                tok.chat_template = self.merge.chat_template_text
            tok.save_pretrained(folder)

    def _name_config_dtype(self, cfg_path: str) -> None:
        """config.json's dtype as mergekit writes it beside a float32 result: the config's ``dtype``, else the
        base's own (mergekit sets it only from ``out_dtype`` or ``dtype``)."""
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
        want = self.merge.config_dtype
        if want == "base":
            base = getattr(self, "_base_config", None) or {}
            for key in ("dtype", "torch_dtype"):
                if key in base:
                    cfg[key] = base[key]
                else:
                    cfg.pop(key, None)
        else:
            cfg["dtype"] = want
            if "torch_dtype" in cfg:
                cfg["torch_dtype"] = want
        with open(cfg_path, "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2)

    def card_section(self) -> dict[str, str]:
        """The card's section showing the config as YAML (what community cards carry)."""
        return {"title": "mergekit configuration",
                "body": "This model was merged by hubsoup from the following mergekit configuration, with "
                        "mergekit's semantics:\n\n```yaml\n" + public_config_text(self.merge.text).rstrip()
                        + "\n```" + ("\n\nIgnored, as mergekit ignores them: "
                                     + ", ".join(f"`{k}`" for k in self.merge.ignored) + "."
                                     if self.merge.ignored else "")}


def _renumbered_plan(base: Any, keys: list[str], out: dict[str, TensorSource], infos: dict[str, Any], layers: int,
                     device: str) -> Plan:
    """The plan of a sliced output: its tensors (``out``), its config with ``layers`` layers, the base's tied groups
    that it holds whole."""
    config = dict(base.config)
    _set_layers(config, layers)
    stored = [k for k in keys if k in set(_stored_keys(base))]
    ties = [g for g in tied_groups(base.folder, stored, {k: base.info(k) for k in stored}, base.config)
            if all(n in out for n in g)]
    return layout_plan(out, infos, config, ties=ties, device=device)


def _remove_tokenizer_files(folder: str) -> None:
    """Remove the tokenizer files copied from the base into an output folder (its config stays)."""

    for fname in BASE_FILES:
        if fname not in ("config.json", "generation_config.json", "preprocessor_config.json"):
            p = os.path.join(folder, fname)
            if os.path.isfile(p):
                os.remove(p)


def _referenced(merge: MergekitMerge) -> list[str]:
    """Every model the config names, once each, in the config's order (base_model first)."""
    data = load_yaml(merge.text, "mergekit config")
    refs = [data.get("base_model")] if isinstance(data, dict) and data.get("base_model") else []
    refs += [s.model for s in merge.models_mode_sources]
    refs += [s.model for sl in merge.slices or [] for s in sl.sources]
    return list(dict.fromkeys(r for r in refs if isinstance(r, str)))


def _naming(ckpt: Any, module: Module | None = None) -> tuple[str, list[str], list[str], list[str]]:
    """``(stack, layer suffixes, names before the layers, names after)`` of a checkpoint (or of one of its
    modules) with one stack of layers."""

    keys = [k for k in ckpt.keys() if module is None or module.holds(k)]
    stacks = {b[0] for k in keys if (b := block_of(k))}
    if len(stacks) != 1:
        raise ParameterError(f"mergekit config: slices need a model with one stack of layers; "
                             f"'{ckpt.label}' has {len(stacks)} ({', '.join(sorted(stacks))})")
    stack = stacks.pop()
    suffixes = [k[len(f"{stack}.0."):] for k in keys if block_of(k) == (stack, 0)]
    others = [k for k in keys if not block_of(k)]
    before = module.before if module is not None else ()
    pre = [k for k in others if _before(k) or k.startswith(before)]
    return stack, suffixes, pre, [k for k in others if k not in pre]


def _before(name: str) -> bool:
    return before_blocks(name)


def _layers(config: dict[str, Any]) -> int | None:
    for k in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(n := config.get(k), int):
            return n
    return None


def _depth(ckpt: Any, module: Module | None = None) -> int | None:
    """The model's (or module's) layer count: its config's, or (a config without one) counted from its tensors' names."""
    n = _layers(ckpt.config) if module is None else _config_value(ckpt.config, module.layers_key)
    if isinstance(n, int) and not isinstance(n, bool):
        return n

    indices = [b[1] for k in ckpt.keys() if (module is None or module.holds(k)) and (b := block_of(k))]
    return max(indices) + 1 if indices else None


def _config_value(config: dict[str, Any], key: str | None) -> Any:
    """A dotted key's value in a config (``text_config.num_hidden_layers``), or None."""
    node: Any = config
    for part in (key or "").split(".") if key else []:
        node = node.get(part) if isinstance(node, dict) else None
    return node if key else None


def _module_plan(base: Any, module: Module, device: str) -> Plan:
    """The plan of one module of ``base``: its tensors, laid out as in the base."""
    keys = [k for k in base.keys() if module.holds(k)]
    infos = {k: base.info(k) for k in keys}
    stored = _stored_keys(base)  # a tied name read from its tie source is merged on its own, as in mergekit
    ties = [g for g in tied_groups(base.folder, stored, {k: base.info(k) for k in stored}, base.config)
            if all(module.holds(n) for n in g)]
    return build_plan(keys, infos, base.config, ties=ties, device=device)


def _stored_keys(ckpt: Any) -> list[str]:
    """The tensors a checkpoint stores (not those a view reads from a tie source: :class:`AliasedCheckpoint`)."""
    aliased = getattr(ckpt, "tie_aliases", None) or {}
    return [k for k in ckpt.keys() if k not in aliased]


def _set_layers(config: dict[str, Any], n: int) -> None:
    for k in ("num_hidden_layers", "n_layer", "num_layers"):
        if k in config:
            config[k] = n
            return
    config["num_hidden_layers"] = n
