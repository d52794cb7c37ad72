"""Merged vocabularies as mergekit 0.1.5 makes them: ``tokenizer_source`` and the ``tokenizer:`` section.

A mergekit config may give its output a vocabulary other than the base's, over inputs whose
vocabularies differ (added tokens, resized or padded embeddings, one token at different ids)::

    tokenizer_source: union            # or: base, or a model reference
    # or, equivalently with more control (``tokenizer: {source: X}`` is ``tokenizer_source: X``):
    tokenizer:
      source: union                    # the default
      tokens:                          # tokens added to the output vocabulary, and where rows come from
        <|im_start|>: {source: org/chat}                      # that model's row of this token
        <|im_end|>:
          source: {kind: model_token, model: org/chat, token: </s>}   # or token_id: 2
          force: true                  # every model takes this row, even those that have the token
        <pad>: {source: {kind: zero}}
      pad_to_multiple_of: 64           # extra rows: each model's mean row

hubsoup reproduces mergekit's ``mergekit/tokenizer/`` exactly (:class:`VocabMerge`, ported from
``build.py`` and ``embed.py``, with the same ``transformers`` calls, so the tokenizer files are the
ones mergekit writes):

* **the output vocabulary**: ``base``: the base's tokenizer, stripped of tokens whose ids are at or
  above its config's ``vocab_size`` (BPE only, as mergekit); ``union``: the base's, then every
  other token of the models, plain tokens first, then added tokens with their settings (the first
  model's when they differ); a model: that model's tokenizer as is. The ``tokens`` of a section are
  then added (plain added tokens) when missing. ``config.json``'s ``vocab_size`` becomes the
  vocabulary's size, rounded up to ``pad_to_multiple_of``.
* **every embedding and output-head row** (the tensors mergekit's architectures index by token:
  :data:`VOCAB_TENSORS`): each model's tensor is re-indexed to the output vocabulary before the
  merge method sees it, so the method merges rows of one token. A model lacking a token (or every
  model, for a ``force``-d one) gets a default row: the row its ``tokens`` entry names; else, for
  a token only one model has, that model's row; a token several models have: the base's row when
  ``base_model`` is one of them and has it, else the mean of theirs; a token no model has: zeros.
  Padding rows are each model's mean row. The merge then runs as usual (so a token every input
  lacks but the base has keeps the base's row under task arithmetic, and so on).

In hubsoup the re-indexing is a view of each checkpoint
(:class:`~hubsoup.sources.remap.RemappedCheckpoint`): the engine streams the re-mapped rows like
any tensor, a model's rows made when the engine reads that tensor, and the default rows, computed
once per tensor, are all that is kept beside them.

Where mergekit is not deterministic hubsoup is, and says so: mergekit orders the models of the
union (and, without ``base_model``, picks the base whose tokenizer starts it) by a Python ``set``
of references, which changes with ``PYTHONHASHSEED``; hubsoup takes ``base_model`` (else the first
model of the config), then the models in the order the config names them; and a model's new tokens
join the union in the order of their ids (mergekit: in the order of the ``tokenizers`` library's
hash map, which also changes from run to run). Where mergekit fails
(a token a model's tokenizer holds beyond its ``vocab_size``, a ``tokens`` entry without a source
where one is needed, a source model that is not merged, a stripped non-BPE tokenizer), hubsoup
refuses before any weight is read, naming the token and the model.

A config is read under limits (SECURITY.md): ``pad_to_multiple_of`` at most
:data:`MAX_PAD_TO_MULTIPLE_OF`, ``tokens`` at most :data:`MAX_SECTION_TOKENS` entries (refused when
the config is read, so a Space's "Valid" refuses them too), and every vocabulary (a model's config's
``vocab_size`` before its tokenizer is read, its tokenizer with its added tokens, the output's) at most
:data:`MAX_VOCAB` tokens. Within them the work is linear in the vocabulary: tokens are added to a
tokenizer in one call per list, the default rows are a few whole-tensor operations per model, and what
mergekit logs per token (tokens beyond a model's ``vocab_size``, tokens in no model, rows a model lacks)
is one line each that counts them.

Example:
    >>> spec = parse_vocab({"tokenizer": {"source": "base", "pad_to_multiple_of": 8}})
    >>> spec.source, spec.pad_to_multiple_of, spec.tokens
    ('base', 8, {})
    >>> parse_vocab({"tokenizer": {"tokens": {"<x>": {"source": {"kind": "zero"}, "force": True}}}}).tokens
    {'<x>': TokenSetting(source=TokenSource(kind='zero', model=None, token=None, token_id=None), force=True)}
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from hubsoup.errors import ParameterError
from hubsoup.output.checkpoint import BASE_FILES
from hubsoup.sources.adapted import open_adapted
from hubsoup.sources.checkpoint import TensorInfo
from hubsoup.sources.compat import is_local
from hubsoup.sources.remap import RemappedCheckpoint
from hubsoup.sources.resolve import open_input
from hubsoup.untrusted import short

if TYPE_CHECKING:
    from hubsoup.formats.mergekit.read import MergekitMerge
    from hubsoup.options import MergeOptions
    from hubsoup.progress import Monitor

log = logging.getLogger(__name__)

VOCAB_TENSORS = frozenset({
    "model.embed_tokens.weight", "lm_head.weight", "lm_head.bias", "transformer.wte.weight",
    "model.language_model.embed_tokens.weight", "model.tok_embeddings.weight", "output.weight",
    "gpt_neox.embed_in.weight", "embed_out.weight", "transformer.word_embeddings.weight",
    "transformer.output_layer.weight", "transformer.embedding.word_embeddings.weight",
    "transformer.embd.wte.weight", "lm_head.linear.weight", "lm_head.linear.bias", "lm_head.decoder.weight",
    "backbone.embeddings.weight", "embeddings.word_embeddings.weight", "bert.embeddings.word_embeddings.weight",
    "roberta.embeddings.word_embeddings.weight", "distilbert.embeddings.word_embeddings.weight",
    "vocab_projector.weight", "vocab_projector.bias", "cls.predictions.bias", "shared.weight",
    "encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "embed_tokens.weight",
})
"""The tensors mergekit 0.1.5's architecture definitions index by token (``vocabulary_axis: 0``)."""

_SECTION_KEYS = {"source", "tokens", "pad_to_multiple_of"}

# The limits of a merged vocabulary (SECURITY.md, "Untrusted text"): generous for real models, refused at once
# above. Every step costs time linear in the vocabulary (one call of the tokenizers library per list of tokens,
# whole-tensor row operations); these bound the memory: the tokenizers library keeps ~2-3 kB per token, every
# vocabulary tensor of every model is re-indexed to the output's rows.
MAX_PAD_TO_MULTIPLE_OF = 1024
"""The largest ``tokenizer.pad_to_multiple_of`` (configs use 8 to 128 for the hardware; padding adds fewer rows)."""
MAX_SECTION_TOKENS = 65_536
"""The most entries of ``tokenizer.tokens`` (a config names a few chat or reserved tokens; Llama 3 reserves 256)."""
MAX_VOCAB = 1 << 20
"""The most tokens of a tokenizer, added tokens included (an input's, its config's ``vocab_size``, the output's
before padding): 1,048,576; real vocabularies go to 262,144 (Gemma), 901,629 (XLM-V)."""
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


# --- the config ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TokenSource:
    """Where a ``tokens`` entry's row comes from (mergekit's ``ModelTokenEmbedding`` / ``ZeroEmbedding`` / model)."""

    kind: str
    """``model`` (this token's row in ``model``), ``model_token`` (``token``/``token_id``'s row in ``model``), ``zero``."""
    model: str | None = None
    token: str | None = None
    token_id: int | None = None


@dataclass(frozen=True)
class TokenSetting:
    """One ``tokens`` entry (mergekit's ``TokenEmbeddingConfig``)."""

    source: TokenSource | None = None
    force: bool = False


@dataclass
class VocabSpec:
    """A config's ``tokenizer_source`` or ``tokenizer`` section (see :func:`parse_vocab`)."""

    source: str
    """``union``, ``base`` or a model reference."""
    tokens: dict[str, TokenSetting] = field(default_factory=dict)
    pad_to_multiple_of: int | None = None
    compute_dtype: str | None = None
    """The config's ``dtype``: mergekit casts every input to it before re-indexing rows."""
    base_model: str | None = None
    """The config's ``base_model``: its tokenizer starts the vocabulary, its row wins for a shared token."""
    referenced: list[str] | None = None
    """One module's merge of a ``modules:`` config: every model the whole config names (the vocabulary is
    theirs, built once over all modules; None: the models this merge names)."""

    def hashed(self) -> dict[str, Any]:
        """What the recipe hash covers."""
        out: dict[str, Any] = {"source": self.source}
        if self.tokens:
            out["tokens"] = {k: {"source": None if v.source is None else
                                 {a: b for a, b in vars(v.source).items() if b is not None},
                                 "force": v.force} for k, v in self.tokens.items()}
        if self.pad_to_multiple_of:
            out["pad_to_multiple_of"] = self.pad_to_multiple_of
        return out

    def models(self) -> list[str]:
        """Every model reference it names (the source and the ``tokens`` entries' models)."""
        out = [] if self.source in ("union", "base") else [self.source]
        out += [s.source.model for s in self.tokens.values() if s.source is not None and s.source.model]
        return out


LEGACY_MODEL_PREFIX = "model:"
"""Older mergekit configs name a tokenizer's model ``model:org/name``; mergekit 0.1.5 reads a plain model
reference there and takes ``model:org/name`` for a model of that name (which it then fails to find)."""


def _ref(value: object, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ParameterError(f"mergekit config: '{where}' must be a model reference (org/name[@revision] or a "
                             f"folder), got {short(value)}")
    value = value.strip()
    if value.startswith(LEGACY_MODEL_PREFIX) and not os.path.isdir(value):  # a folder so named is a local model
        model = value[len(LEGACY_MODEL_PREFIX):].strip()
        key = where.split(".")[0]
        fix = (f"'tokenizer_source: {model}' (or 'tokenizer: {{source: {model}}}')" if key == "tokenizer_source"
               else f"'{where.rsplit('.', 1)[-1]}: {model}'")
        raise ParameterError(f"mergekit config: '{where}' = '{value}' is the legacy 'model:' spelling, which "
                             f"mergekit 0.1.5 no longer reads (it looks for a model named '{value}'); write {fix}")
    return value


def _bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "on", "off", "1", "0"):
        return value.lower() in ("true", "yes", "on", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ParameterError(f"mergekit config: '{where}' must be true or false, got {short(value)}")


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise ParameterError(f"mergekit config: '{where}' must be an integer, got {short(value)}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str) and len(value) <= 32 and value.strip().lstrip("-").isdigit():
        value = int(value)
    if not isinstance(value, int):
        raise ParameterError(f"mergekit config: '{where}' must be an integer, got {short(value)}")
    return value


def _token_source(value: Any, where: str) -> TokenSource | None:
    if value is None:
        return None
    if isinstance(value, str):
        return TokenSource("model", _ref(value, where))
    if isinstance(value, dict) and value.get("kind") == "zero":
        return TokenSource("zero")
    if isinstance(value, dict) and value.get("kind") == "model_token":
        model = _ref(value.get("model"), f"{where}.model")
        token, token_id = value.get("token"), value.get("token_id")
        if (token is None) == (token_id is None):
            raise ParameterError(f"mergekit config: '{where}': give exactly one of 'token' and 'token_id'")
        if token is not None and not isinstance(token, str):
            raise ParameterError(f"mergekit config: '{where}.token' must be a string, got {short(token)}")
        return TokenSource("model_token", model, token, None if token_id is None else _int(token_id, f"{where}.token_id"))
    raise ParameterError(f"mergekit config: '{where}' must be a model reference, {{kind: model_token, model: M, "
                         f"token: T | token_id: N}} or {{kind: zero}}, got {short(value)}")


def parse_vocab(data: dict[str, Any]) -> VocabSpec | None:
    """The merged vocabulary a parsed mergekit config asks for (None: the base's tokenizer files, copied).

    ``tokenizer_source: X`` and ``tokenizer: {source: X}`` are the same; a section without
    ``source`` means ``union`` (mergekit's default). Both at once are refused, as mergekit does.

    Raises:
        hubsoup.errors.ParameterError: naming the key at fault.
    """
    src, section = data.get("tokenizer_source"), data.get("tokenizer")
    if src is not None and section is not None:
        raise ParameterError("mergekit config: give 'tokenizer_source' or a 'tokenizer' section, not both "
                             "(mergekit refuses both too)")
    dtype = data.get("dtype") if isinstance(data.get("dtype"), str) and data.get("dtype") in _DTYPES else None
    base = b.strip() if isinstance(b := data.get("base_model"), str) else None
    if src is not None:
        return VocabSpec(src if src in ("union", "base") else _ref(src, "tokenizer_source"), compute_dtype=dtype,
                         base_model=base)
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ParameterError(f"mergekit config: 'tokenizer' must be a mapping (source, tokens, pad_to_multiple_of), "
                             f"got {short(section)}")
    for k in section:
        if k not in _SECTION_KEYS:  # mergekit's TokenizerConfig drops unknown keys
            log.warning("mergekit config: key 'tokenizer.%s' is ignored (mergekit ignores it too; the keys of "
                        "'tokenizer' are %s)", k, ", ".join(sorted(_SECTION_KEYS)))
    source = section.get("source", "union")
    source = source if source in ("union", "base") else _ref(source, "tokenizer.source")
    tokens: dict[str, TokenSetting] = {}
    raw = section.get("tokens")
    if raw is not None:
        if not isinstance(raw, dict):
            raise ParameterError(f"mergekit config: 'tokenizer.tokens' must map tokens to settings, got {short(raw)}")
        if len(raw) > MAX_SECTION_TOKENS:
            raise ParameterError(f"mergekit config: 'tokenizer.tokens' has {len(raw)} entries; hubsoup reads at most "
                                 f"{MAX_SECTION_TOKENS:,} (a vocabulary that large belongs in a tokenizer)")
        for tok, setting in raw.items():
            where = f"tokenizer.tokens.{short(tok)}" if not isinstance(tok, str) or len(tok) > 64 else \
                f"tokenizer.tokens.{tok}"
            if not isinstance(tok, str):
                raise ParameterError(f"mergekit config: '{where}': a token must be a string (quote it), got {short(tok)}")
            setting = {} if setting is None else setting
            if not isinstance(setting, dict):
                raise ParameterError(f"mergekit config: '{where}' must be a mapping (source, force), got "
                                     f"{short(setting)}")
            tokens[tok] = TokenSetting(_token_source(setting.get("source"), f"{where}.source"),
                                       _bool(setting.get("force", False), f"{where}.force"))
    pad = section.get("pad_to_multiple_of")
    if pad is not None:
        pad = _int(pad, "tokenizer.pad_to_multiple_of")
        if pad < 0:
            raise ParameterError(f"mergekit config: 'tokenizer.pad_to_multiple_of' must be positive, got {pad}")
        if pad > MAX_PAD_TO_MULTIPLE_OF:
            raise ParameterError(f"mergekit config: 'tokenizer.pad_to_multiple_of' is {short(pad)}; hubsoup pads to "
                                 f"multiples of at most {MAX_PAD_TO_MULTIPLE_OF}")
    return VocabSpec(source, tokens, pad or None, dtype, base)


# --- the output vocabulary (mergekit's tokenizer/build.py) -----------------------------------------

def config_vocab_size(config: dict[str, Any]) -> int | None:
    """A model's ``vocab_size`` from its config (a multimodal model's text config), if it says."""
    for cfg in (config, tc if isinstance(tc := config.get("text_config"), dict) else {}):
        v = cfg.get("vocab_size")
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _load_tokenizer(folder: str, label: str, **kw: Any) -> Any:  # a transformers tokenizer
    # lazy: transformers costs ~4 s to import here (torch ~6 s); only a config's tokenizer source needs it
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=False, **kw)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; the message says which model
        raise ParameterError(f"mergekit config: cannot load the tokenizer of '{label}' for the merged "
                             f"vocabulary: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def check_vocab_size(count: int, what: str) -> None:
    """Refuse a vocabulary over :data:`MAX_VOCAB` tokens (``what`` names it: a model's tokenizer, the output)."""
    if count > MAX_VOCAB:
        raise ParameterError(f"mergekit config: {what} has {count:,} tokens; hubsoup merges vocabularies of at most "
                             f"{MAX_VOCAB:,} tokens")


def _sized(tok: Any, label: str) -> Any:
    check_vocab_size(len(tok), f"the tokenizer of '{label}'")
    return tok


def stripped_tokenizer(folder: str, label: str, vocab_size: int | None) -> Any:
    """The tokenizer without the tokens at ids ``>= vocab_size`` (mergekit's ``get_stripped_tokenizer``)."""
    import tokenizers  # lazy: tokenizers comes with transformers (~4 s here); only a tokenizer source needs it

    tok = _sized(_load_tokenizer(folder, label, use_fast=True), label)
    vocab = tok.get_vocab()
    size = vocab_size or len(vocab)
    unused = [t for t, i in vocab.items() if i >= size]
    if not unused:
        return tok
    if not tok.is_fast:
        raise ParameterError(f"mergekit config: '{label}' has tokens beyond its vocab_size ({size}) and no fast "
                             "tokenizer; mergekit cannot strip them either")
    d = json.loads(tok._tokenizer.to_str())
    if d["model"]["type"] != "BPE":
        raise ParameterError(f"mergekit config: '{label}' has tokens beyond its vocab_size ({size}, e.g. "
                             f"{short(unused[0])}) in a {d['model']['type']} tokenizer; mergekit strips them only from "
                             "BPE tokenizers and fails here")
    d["added_tokens"] = [e for e in d["added_tokens"] if e["id"] < size]
    gone = set(unused)
    for t in unused:
        d["model"]["vocab"].pop(t, None)

    def keep(m: Any) -> bool:
        if isinstance(m, str) and m.count(" ") == 1:
            toks = m.split(" ")
        elif isinstance(m, list):
            toks = m
        else:
            raise ParameterError(f"mergekit config: '{label}': unexpected BPE merge {short(m)}")
        return not any(t in gone for t in toks)

    d["model"]["merges"] = [m for m in d["model"]["merges"] if keep(m)]
    tok._tokenizer = tokenizers.Tokenizer.from_str(json.dumps(d))
    return tok


def union_tokenizer(base_tok: Any, toks: dict[str, Any], sizes: dict[str, int | None]) -> Any:
    """The union of the tokenizers (mergekit's ``build_union_tokenizer``), starting from the base's."""
    # lazy: transformers costs ~4 s to import here (torch ~6 s); only a config's tokenizer source needs it
    from transformers import AutoTokenizer

    out_added: dict[str, Any] = {}
    out_vocab: dict[str, int] = {}
    differ: dict[str, None] = {}
    for ref, tok in toks.items():
        size = sizes.get(ref) or tok.vocab_size
        added = tok.added_tokens_decoder
        added_names = {info.content for info in added.values()}
        beyond: list[str] = []
        # in id order: mergekit takes the order of the tokenizers library's hash map, which changes from
        # run to run, so a model's new tokens would take their output ids in a random order
        for t, i in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
            if i >= size:
                beyond.append(t)
                continue
            if t in added_names:
                continue
            out_vocab.setdefault(t, len(out_vocab))
        if beyond:  # one line for any number of them (mergekit: one per token)
            log.warning("%d token(s) of '%s' are at ids >= its vocab_size %d (e.g. %s): left out of the union",
                        len(beyond), ref, size, _examples(beyond))
        for i, info in added.items():
            if i >= size:
                continue
            if info.content in out_added:
                if out_added[info.content] != info:
                    differ[info.content] = None
                continue
            out_added[info.content] = info
    if differ:
        log.warning("%d token(s) are added with different settings by several models (e.g. %s): the first "
                    "model's settings are kept", len(differ), _examples(differ))
    with tempfile.TemporaryDirectory() as p:  # a copy: the base's tokenizer stays as it is
        base_tok.save_pretrained(p, legacy_format=False, safe_serialization=True)
        res = AutoTokenizer.from_pretrained(p, use_fast=True, trust_remote_code=False)
    base_vocab = base_tok.get_vocab()
    # one call each, not one per token (as mergekit): the ``tokenizers`` library rebuilds its matcher of added
    # tokens on every call, so a call per token costs time quadratic in their number; in one call they take
    # the same ids, in the same order
    plain = [t for t in out_vocab if t not in out_added and t not in base_vocab]
    check_vocab_size(len(res) + len(plain) + sum(t not in base_vocab for t in out_added), "the union vocabulary")
    res.add_tokens(plain)
    res.add_tokens(list(out_added.values()))
    return res


class VocabMerge:
    """The output vocabulary, and for each model the row of each output token (mergekit's ``BuildTokenizer``).

    ``models``: every model the config names (references as written), in hubsoup's order (the
    base's first); ``folders``/``configs``: each one's folder (tokenizer files) and config;
    ``source_folder``: the ``tokenizer_source`` model's folder when the source is a model.
    """

    def __init__(self, spec: VocabSpec, base: str, models: Sequence[str], folders: dict[str, str],
                 configs: dict[str, dict[str, Any]], source_folder: str | None = None, prefer: str | None = None):
        self.spec = spec
        self.prefer = prefer
        """The config's ``base_model`` (None if it names none): its row wins for a token several models have."""
        sizes = {m: config_vocab_size(configs[m]) for m in models}
        for m, v in sizes.items():  # before any tokenizer is read
            check_vocab_size(v or 0, f"'{m}' (its config's vocab_size)")
        toks = {base: stripped_tokenizer(folders[base], base, sizes[base])}
        for m in models:
            if m != base:
                try:
                    tok = _load_tokenizer(folders[m], m)
                except ParameterError as e:  # mergekit logs it and takes the base's vocabulary for that model
                    log.warning("%s; taking it to have the same vocabulary as '%s' (as mergekit does)", e, base)
                else:
                    toks[m] = _sized(tok, m)
        if spec.source == "base":
            out = toks[base]  # the very object: tokens added below are the base's too (as in mergekit)
        elif spec.source == "union":
            out = union_tokenizer(toks[base], toks, sizes)
        else:
            assert source_folder is not None  # a model source: its folder (VocabLayout.open)
            out = _sized(_load_tokenizer(source_folder, spec.source), spec.source)
        have = out.get_vocab()
        new = [t for t in spec.tokens if t not in have]
        check_vocab_size(len(have) + len(new), "the output vocabulary")
        out.add_tokens(new)  # one call: see union_tokenizer
        self.tokenizer = out
        self.vocab: dict[str, int] = out.get_vocab()
        n = len(self.vocab)
        pad = spec.pad_to_multiple_of
        self.size = (n // pad + 1) * pad if pad and n % pad else n
        """Rows of every vocabulary tensor of the output (``config.json``'s ``vocab_size``)."""
        top = max(self.vocab.values(), default=-1)
        if top >= self.size:
            bad = next(t for t, i in self.vocab.items() if i == top)
            raise ParameterError(f"mergekit config: the output vocabulary has {n} tokens but token {short(bad)} has id "
                                 f"{top} (the ids have gaps); mergekit fails on it (index out of range)")
        self.original_vocabs = {m: t.get_vocab() for m, t in toks.items()}
        self.perms: dict[str, torch.Tensor] = {}
        """Per model, per output id: the model's row of that token, -1 where it lacks it."""
        self.holes: dict[str, str] = {}
        """Per model whose permutation has a hole (mergekit fails with KeyError on a tensor it is merged into): why."""
        for m in models:
            mv = self.original_vocabs.get(m, self.original_vocabs[base])
            size = sizes[m] or len(mv)
            p = [-1] * self.size
            for t, i in self.vocab.items():
                j = mv.get(t)
                if j is None:
                    continue
                if j >= size:  # mergekit leaves a hole in its permutation here, and fails on it (KeyError)
                    self.holes.setdefault(m, f"token {short(t)} of the output vocabulary is at id {j} in '{m}', beyond "
                                             f"its vocab_size {size} (a padding token?)")
                    continue
                p[i] = j
            self.perms[m] = torch.tensor(p, dtype=torch.long)
        self.sizes = sizes
        self._rows: dict[tuple[str, tuple[str, ...]], _Defaults] = {}
        self._lock = threading.Lock()
        self._tokens: dict[int, str] | None = None

    def defaults(self, name: str, group: Sequence[str], load: Callable[[str], torch.Tensor],
                 stored: Callable[[str], torch.dtype], *, quiet: bool = False) -> "_Defaults":
        """The default rows of tensor ``name`` merged from ``group`` (see :meth:`remap`); with ``load``
        giving meta tensors, it checks every default can be made, reading no weight."""
        dtype = _DTYPES.get(self.spec.compute_dtype or "")
        common = dtype
        if common is None:
            common = stored(group[0])
            for m in group[1:]:
                common = torch.promote_types(common, stored(m))
        return _Defaults(self, name, list(group), load, dtype, common, quiet)

    def remap(self, name: str, model: str, group: Sequence[str], load: Callable[[str], torch.Tensor],
              stored: Callable[[str], torch.dtype]) -> torch.Tensor:
        """Model ``model``'s tensor ``name`` re-indexed to the output vocabulary (mergekit's ``PermutedVocabulary``).

        ``group``: the models merged into this tensor, in the config's order (mergekit's: its
        default rows depend on them); ``load(m)``: model ``m``'s stored tensor ``name``;
        ``stored(m)``: its stored dtype. Rows are computed in the config's ``dtype`` (mergekit casts
        every input to it), else in the inputs' dtypes promoted.
        """
        dtype = _DTYPES.get(self.spec.compute_dtype or "")
        key = (name, tuple(group))
        with self._lock:
            rows = self._rows.get(key)
            if rows is None:
                rows = self._rows[key] = self.defaults(name, group, load, stored)
        own = load(model)
        own = own.to(dtype) if dtype is not None else own
        if own.dim() < 1:
            raise ParameterError(f"mergekit config: tensor '{name}' of '{model}' has no vocabulary axis")
        p = self.perms[model]
        n = len(self.vocab)
        out = torch.zeros((self.size, *own.shape[1:]), dtype=rows.dtype)
        take = p >= 0
        take[n:] = False
        take[rows.forced] = False
        if bool((p[take] >= own.shape[0]).any()):
            raise ParameterError(f"mergekit config: tensor '{name}' of '{model}' has {own.shape[0]} rows, fewer "
                                 "than its tokenizer's ids need")
        ids = take.nonzero().squeeze(1)
        out[ids] = own[p[ids]].to(rows.dtype)
        fill = ~take[rows.ids]  # the default rows of the tokens this model lacks (or every model, forced)
        out[rows.ids[fill]] = rows.rows[fill]
        lacking = (~take[:n] & ~rows.has_default[:n]).nonzero().squeeze(1).tolist()
        if lacking:  # mergekit logs a line per token; one line says the same of any number
            log.error("no embedding in model %s for %d token(s) (e.g. %s): their rows are zeros, as in mergekit",
                      model, len(lacking), _examples(self.token_of(i) for i in lacking))
        if self.size > n:  # padding rows: the model's mean row (https://nlp.stanford.edu/~johnhew/vocab-expansion.html)
            out[n:] = torch.mean(out[:n], dim=0)
        return out

    def token_of(self, tid: int) -> str | None:
        """The output token at id ``tid`` (for messages)."""
        if self._tokens is None:
            self._tokens = {i: t for t, i in self.vocab.items()}
        return self._tokens.get(tid)


def _examples(tokens: Any, k: int = 3) -> str:
    """A few tokens of a long list, quoted, for a one-line summary."""
    out: list[str] = []
    for t in tokens:
        if len(out) == k:
            out.append("...")
            break
        out.append(short(t))
    return ", ".join(out)


class _Defaults:
    """The rows of one vocabulary tensor that models lacking a token take (mergekit's ``default_embeds``).

    ``ids``: the output ids that have a default row, ascending; ``rows``: those rows, one per id; computed
    with a few whole-tensor operations per model (a Python loop runs only over the section's ``tokens``), so
    a vocabulary of any size costs time linear in it."""

    def __init__(self, vm: VocabMerge, name: str, group: list[str], load: Callable[[str], torch.Tensor],
                 dtype: torch.dtype | None, common: torch.dtype, quiet: bool = False):
        spec, vocab, perms, size = vm.spec, vm.vocab, vm.perms, vm.size
        cache: dict[str, torch.Tensor] = {}

        def tensor(m: str) -> torch.Tensor:
            if m not in cache:
                t = load(m)
                cache[m] = t.to(dtype) if dtype is not None else t
            return cache[m]

        configured = {vocab[t]: (t, c) for t, c in spec.tokens.items() if t in vocab}  # id -> the section's entry
        in_vocab = torch.zeros(size, dtype=torch.bool)
        in_vocab[torch.tensor(list(vocab.values()), dtype=torch.long)] = True
        conf = torch.zeros(size, dtype=torch.bool)
        forced = torch.zeros(size, dtype=torch.bool)
        if configured:
            conf[torch.tensor(list(configured), dtype=torch.long)] = True
            forced[torch.tensor([i for i, (_, c) in configured.items() if c.force], dtype=torch.long)] = True
        rows_of = torch.stack([perms[m] for m in group])  # (models, ids): each model's row of each id, -1: none
        has = rows_of >= 0
        count = has.sum(0)
        auto = in_vocab & ~conf  # assign_embedding_sources: a token the section does not name
        need = in_vocab & (~has.all(0) | forced)
        zero = auto & (count == 0)
        if bool(zero.any()) and not quiet:
            zids = zero.nonzero().squeeze(1).tolist()
            log.warning("%d token(s) are in no model (e.g. %s): their rows of %s are zeros", len(zids),
                        _examples(vm.token_of(i) for i in zids), name)
        base = vm.prefer
        from_base = auto & need & (count >= 2)
        if base in group:
            from_base &= has[group.index(base)]
        else:
            from_base[:] = False
        average = auto & need & (count >= 2) & ~from_base
        one = auto & need & (count == 1)
        source = has.to(torch.int8).argmax(0)  # the one model that has the token (for `one`)
        first = tensor(group[0])
        self.dtype = common
        self.ids = need.nonzero().squeeze(1)
        pos = torch.full((size,), -1, dtype=torch.long)
        pos[self.ids] = torch.arange(len(self.ids))
        self.rows = torch.zeros((len(self.ids), *first.shape[1:]), dtype=common, device=first.device)
        for k, m in enumerate(group):  # a model's own row: the one model that has the token, or the base's
            take = (one & (source == k)) | (from_base if m == base else torch.zeros_like(one))
            self._gather(vm, name, m, tensor(m), rows_of[k], take, pos)
        if bool(average.any()):  # the mean of the rows of the models that have it, summed in the config's order
            acc = self.rows.new_zeros((int(average.sum()), *first.shape[1:]))
            at = average.nonzero().squeeze(1)
            for k, m in enumerate(group):
                sel = has[k][at]
                self._check(vm, name, m, tensor(m), rows_of[k][at][sel])
                acc[sel] = acc[sel] + tensor(m)[rows_of[k][at][sel]]
            acc /= count[at].to(common).view(-1, *([1] * (acc.dim() - 1)))
            self.rows[pos[at]] = acc
        for i, (t, cfg) in configured.items():  # the section's tokens: at most MAX_SECTION_TOKENS
            if bool(need[i]):
                self.rows[pos[i]] = self._default(vm, name, group, tensor, t, i, cfg)
        self.forced = forced.nonzero().squeeze(1)
        self.has_default = need

    def _gather(self, vm: VocabMerge, name: str, model: str, t: torch.Tensor, rows_of: torch.Tensor,
                take: torch.Tensor, pos: torch.Tensor) -> None:
        at = take.nonzero().squeeze(1)
        if len(at):
            self._check(vm, name, model, t, rows_of[at])
            self.rows[pos[at]] = t[rows_of[at]].to(self.dtype)

    @staticmethod
    def _check(vm: VocabMerge, name: str, model: str, t: torch.Tensor, rows: torch.Tensor) -> None:
        if len(rows) and int(rows.max()) >= t.shape[0]:  # checked here: a meta tensor's indexing checks nothing
            raise ParameterError(f"mergekit config: tensor '{name}' of '{model}' has {t.shape[0]} rows, fewer "
                                 "than its tokenizer's ids need")

    @staticmethod
    def _default(vm: VocabMerge, name: str, group: list[str], tensor: Callable[[str], torch.Tensor], token: str,
                 tid: int, cfg: TokenSetting) -> torch.Tensor:
        src = cfg.source
        if src is not None and src.kind == "zero":
            first = tensor(group[0])
            return first.new_zeros(first.shape[1:])
        where = f"mergekit config: token {short(token)} (tokenizer.tokens)"
        if src is None:
            raise ParameterError(f"{where} has no 'source' and needs one here (a model lacks it, or force is set); "
                                 "mergekit 0.1.5 fails on it (NotImplementedError)")
        if src.model not in group:
            raise ParameterError(f"{where}: its source '{src.model}' is not one of the models merged into "
                                 f"'{name}' ({', '.join(group)}); mergekit fails on it")
        t = tensor(src.model)
        if src.kind == "model_token":
            sid = src.token_id
            if sid is None:
                vocab = vm.original_vocabs.get(src.model, {})
                if src.token not in vocab:
                    raise ParameterError(f"{where}: token {short(src.token)} is not in '{src.model}'s vocabulary")
                sid = vocab[src.token]
            if not 0 <= sid < t.shape[0]:
                raise ParameterError(f"{where}: token id {sid} is out of range for '{src.model}' ({t.shape[0]} rows)")
            return t[sid]
        j = int(vm.perms[src.model][tid])
        if j < 0:
            raise ParameterError(f"{where}: '{src.model}' does not have this token (use kind: model_token to take "
                                 "another token's row)")
        return t[j]


# --- the layout's part: open the models re-mapped, write the tokenizer ----------------------------

class VocabLayout:
    """A mergekit config's merged vocabulary in a hubsoup merge: the re-mapped checkpoints and the output files.

    ``merge``: the :class:`~hubsoup.formats.mergekit.MergekitMerge`; ``groups(name)``: the models
    merged into vocabulary tensor ``name``, in the config's order.
    """

    def __init__(self, merge: MergekitMerge, spec: VocabSpec, order: list[str], groups: Callable[[str], list[str]],
                 names: Callable[[str], bool] | None = None, vocab_key: str | None = None):
        self.merge, self.spec, self.order, self.groups = merge, spec, order, groups
        self.is_vocab = names or VOCAB_TENSORS.__contains__
        """Which tensors are indexed by token (one module's: those its mergekit definition says)."""
        self.vocab_key = vocab_key
        """``config.json``'s dotted key of the vocabulary size (None: ``vocab_size``, else ``text_config``'s)."""
        self.base_ref = spec.base_model
        self.views: dict[str, Any] = {}
        self.vm: VocabMerge | None = None
        self.source_ckpt: Any = None

    def open(self, opts: MergeOptions, monitor: Monitor | None = None,
             wrap: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> dict[str, Any]:
        """Every model of the config opened (headers only) and wrapped as re-mapped; returns ref → checkpoint.

        ``wrap``: applied to the opened models (ref → checkpoint) before they are re-mapped (a module's
        tied tensors, aliased where a model does not store them)."""
        physical = list(dict.fromkeys(self.order))  # a model+adapter reference: the model, adapter applied on read
        extra = [] if self.spec.source in ("union", "base") else [self.spec.source.split("+")[0]]
        if monitor is not None:
            monitor.expect("download", 2 * sum(not is_local(r.split("+")[0]) for r in physical + extra))
        raw = {r: open_adapted(r, open_input, allow_pickle=opts.allow_pickle, token=opts.token, with_tokenizer=True,
                               monitor=monitor, headers_only=True, role="base" if r == self.merge.base else "input")
               for r in physical}
        if wrap is not None:
            raw = wrap(raw)
        folders = {r: raw[r].folder for r in self.order}
        configs = {r: raw[r].config for r in self.order}
        if extra:
            self.source_ckpt = raw.get(extra[0]) or open_input(extra[0], allow_pickle=opts.allow_pickle,
                                                               token=opts.token, with_tokenizer=True,
                                                               monitor=monitor, headers_only=True)
        for m in self.spec.models():
            if m != self.spec.source and m not in self.order:
                raise ParameterError(f"mergekit config: 'tokenizer.tokens' takes a row from '{m}', which is not one "
                                     f"of the models merged ({', '.join(self.order)})")
        base = self.base_ref or self.order[0]
        if self.base_ref is None and len(self.order) > 1:
            log.warning("mergekit config: no base_model: the merged vocabulary starts from the first model's "
                        "tokenizer, '%s' (mergekit takes the first of a set, which changes from run to run)", base)
        self.vm = VocabMerge(self.spec, base, self.order, folders, configs,
                             self.source_ckpt.folder if self.source_ckpt is not None else None, prefer=self.base_ref)
        for name in sorted({k for ck in raw.values() for k in ck.keys() if self.is_vocab(k)}):
            group = self.groups(name)
            for m in group:
                if m in self.vm.holes:
                    raise ParameterError(f"mergekit config: {self.vm.holes[m]}; mergekit 0.1.5 fails on it "
                                         f"(KeyError, merging '{name}')")
            if all(raw[m].has(name) for m in group):  # every default row can be made: checked on
                info: Callable[[str], TensorInfo] = lambda m: raw[m].info(name)  # noqa: E731 - meta tensors, no weight read
                self.vm.defaults(name, group, lambda m: torch.empty(info(m).shape, dtype=info(m).dtype, device="meta"),
                                 lambda m: info(m).dtype, quiet=True)
        for r in physical:
            ck = raw[r]
            names = [k for k in ck.keys() if self.is_vocab(k)]
            infos = {k: TensorInfo((self.vm.size, *ck.info(k).shape[1:]), ck.info(k).dtype) for k in names}
            self.views[r] = RemappedCheckpoint(ck, infos, self._maker(r, raw))
        return self.views

    def _maker(self, ref: str, raw: dict[str, Any]) -> Callable[[str], torch.Tensor]:
        def make(name: str) -> torch.Tensor:
            assert self.vm is not None  # made by open, before any tensor is read
            group = self.groups(name)
            # a model outside this tensor's group (nothing reads it there): as if merged alone
            members = [ref] if ref in group else []  # a model+adapter reference: the model with it applied
            return self.vm.remap(name, members[0] if members else ref, group if members else [ref],
                                 lambda m: raw[m].tensor(name), lambda m: raw[m].info(name).dtype)
        return make

    def hashed(self) -> dict[str, Any]:
        """What the recipe hash covers: the spec, and a tokenizer source model that is not merged, pinned."""
        out = self.spec.hashed()
        if self.source_ckpt is not None and self.spec.source not in self.order:
            out["source_ref"] = {k: v for k, v in self.source_ckpt.ref.to_dict().items()
                                 if k in ("repo_id", "sha", "path") and v}
        return out

    def check_sources(self, sources: Sequence[Any]) -> None:
        """Refuse a LoRA input that changes a vocabulary tensor (its rows would be in its own vocabulary)."""
        for s in sources:
            if getattr(s, "kind", "full") == "lora":
                for name in VOCAB_TENSORS:
                    if s.touches(name):
                        raise ParameterError(f"mergekit config: LoRA input '{s.label}' changes '{name}', which the "
                                             "merged vocabulary re-indexes; merge the adapter into its model first")

    def finish(self, folder: str) -> None:
        """The output's tokenizer (saved as mergekit saves it) and ``config.json``'s ``vocab_size``."""
        for fname in (*BASE_FILES, "tokenizer.model", "added_tokens.json", "vocab.json", "merges.txt",
                      "vocab.txt", "chat_template.jinja", "chat_template.json"):
            if fname not in ("config.json", "generation_config.json", "preprocessor_config.json"):
                p = os.path.join(folder, fname)
                if os.path.isfile(p):
                    os.remove(p)
        assert self.vm is not None  # made by open, before the output is written
        self.vm.tokenizer.save_pretrained(folder, safe_serialization=True)
        path = os.path.join(folder, "config.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                cfg = json.load(f)
            if self.vocab_key is not None:  # a modular architecture's key (mergekit's vocab_size_config_key)
                *parents, last = self.vocab_key.split(".")
                target = cfg
                for part in parents:
                    target = target.setdefault(part, {}) if isinstance(target, dict) else target
            else:
                target = cfg.get("text_config") if "vocab_size" not in cfg and isinstance(cfg.get("text_config"), dict) else cfg
                last = "vocab_size"
            if isinstance(target, dict):
                target[last] = self.vm.size
            else:
                log.warning("mergekit config: cannot set '%s' = %d in the output's config.json", self.vocab_key, self.vm.size)
            with open(path, "w", encoding="utf-8") as f:
                json.dump(cfg, f, indent=2)
