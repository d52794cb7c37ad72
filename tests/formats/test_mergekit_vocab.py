"""Merged vocabularies: mergekit configs with ``tokenizer_source`` / ``tokenizer:`` give mergekit's model (issue 29).

Every config under ``tests/fixtures/mergekit_vocab/`` (union with linear, ties and a
passthrough frankenmerge; a model of another vocabulary as the source; ``tokenizer:`` sections
with ``tokens`` (per-token ``source``, ``force``), ``pad_to_multiple_of`` and ``source: base``; a
base with a padded embedding truncated to its tokenizer) is run by ``hubsoup run`` on tiny Llamas
whose tokenizers differ (added tokens, a resized and a padded embedding, one token at different
ids, a token only one model has, a BPE tokenizer longer than its embedding, which mergekit strips),
rebuilt from seeds, and compared with what mergekit 0.1.5 wrote
from the same models (``tests/tools/make_mergekit_vocab_fixtures.py``): the same tensors (float32,
within 1e-5 relative), the same ``vocab_size`` in ``config.json``, the same vocabulary
(token → id), added tokens and tokenizer files.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
import yaml

from paths import TESTS as HERE
sys.path.insert(0, os.path.join(HERE, "tools"))
from make_mergekit_vocab_fixtures import CONFIGS, build_models  # noqa: E402

FIX = os.path.join(HERE, "fixtures", "mergekit_vocab")
with open(os.path.join(FIX, "manifest.json"), encoding="utf-8") as _f:
    MANIFEST = json.load(_f)
NAMES = sorted(MANIFEST["configs"])
RTOL = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny input models under a fresh folder, bit-identical to those mergekit read."""
    root = str(tmp_path_factory.mktemp("mk-vocab-models"))
    digests = build_models(root)
    if digests != MANIFEST["models"]:
        bad = [k for k in digests if digests[k] != MANIFEST["models"].get(k)]
        pytest.fail(f"rebuilt input models differ from those of the fixtures ({', '.join(bad)}): regenerate with "
                    "tests/tools/make_mergekit_vocab_fixtures.py")
    return root


def load_dir(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for fn in sorted(os.listdir(folder)):
        if fn.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, fn)))
    return out


def run_cli(text: str, models: str, out: str, monkeypatch) -> None:
    from hubsoup.cli import main

    monkeypatch.chdir(models)  # mergekit resolves `tiny-vocab/base` against the working folder; so does hubsoup
    cfg = os.path.join(os.path.dirname(out), os.path.basename(out) + ".yml")
    with open(cfg, "w", encoding="utf-8") as f:
        f.write(text)
    assert main(["run", cfg, "--out", out, "--quiet"]) == 0


def run_api(text: str, models: str, out: str, monkeypatch):
    import hubsoup

    monkeypatch.chdir(models)
    cfg = out + ".yml"
    with open(cfg, "w", encoding="utf-8") as f:
        f.write(text)
    return hubsoup.run_recipe(cfg, out, quiet=True)


def assert_like_mergekit(name: str, out: str) -> None:
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    ref = load_file(os.path.join(FIX, f"{name}.safetensors"))
    with open(os.path.join(FIX, f"{name}.json"), encoding="utf-8") as f:
        info = json.load(f)
    got = load_dir(out)
    assert sorted(got) == sorted(ref), "the output's tensor names differ from mergekit's"
    for k in ref:
        assert got[k].shape == ref[k].shape, f"{k}: {tuple(got[k].shape)} vs mergekit's {tuple(ref[k].shape)}"
        assert got[k].dtype == ref[k].dtype, k
        scale = max(float(ref[k].abs().max()), 1e-12)
        diff = float((got[k].double() - ref[k].double()).abs().max())
        assert diff <= RTOL * scale, f"{k}: max |diff| {diff:.3g} > {RTOL} × {scale:.3g}"
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
        assert json.load(f)["vocab_size"] == info["vocab_size"]
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.get_vocab() == info["vocab"]
    files, want = {}, json.loads(json.dumps(info["files"]))
    for fn in info["files"]:
        with open(os.path.join(out, fn), encoding="utf-8") as f:
            files[fn] = json.load(f)
    for d in (files, want):  # transformers records whether the tokenizer was loaded offline (the fixtures' run was)
        d["tokenizer_config.json"].pop("local_files_only", None)
    assert files["tokenizer.json"]["added_tokens"] == info["added_tokens"]
    assert files == want, "the tokenizer files differ from mergekit's"
    present = sorted(fn for fn in os.listdir(out) if fn.startswith(("tokenizer", "special_tokens")))
    assert present == info["tokenizer_files"]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_config_matches_mergekit(name, models, tmp_path, monkeypatch):
    out = str(tmp_path / name)
    run_cli(CONFIGS[name], models, out, monkeypatch)
    assert_like_mergekit(name, out)


@pytest.mark.slow
def test_tokenizer_section_with_a_source_is_tokenizer_source(models, tmp_path, monkeypatch):
    """``tokenizer: {source: X}`` is ``tokenizer_source: X`` (mergekit's planner reads one as the other)."""
    text = CONFIGS["source_model"].replace("tokenizer_source: tiny-vocab/shuffled",
                                           "tokenizer:\n  source: tiny-vocab/shuffled")
    assert "tokenizer_source" not in text
    out = str(tmp_path / "section")
    run_cli(text, models, out, monkeypatch)
    assert_like_mergekit("source_model", out)
    text = CONFIGS["section_base_slerp"].replace("tokenizer:\n  source: base", "tokenizer_source: base")
    out = str(tmp_path / "plain")
    run_cli(text, models, out, monkeypatch)
    assert_like_mergekit("section_base_slerp", out)


# --- the rows, by hand: what mergekit's defaults mean on the tiny models -----------------------------

@pytest.mark.slow
def test_rows_follow_mergekit_defaults(models, tmp_path, monkeypatch):
    """The union's rows, from the models themselves: a token one model has takes its row in every model."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    out = str(tmp_path / "u")
    run_cli(CONFIGS["union_ties"], models, out, monkeypatch)
    emb = load_dir(out)["model.embed_tokens.weight"]
    vocab = AutoTokenizer.from_pretrained(out).get_vocab()

    def row(model: str, token: str) -> torch.Tensor:
        t = load_file(os.path.join(models, model, "model.safetensors"))["model.embed_tokens.weight"]
        return t[AutoTokenizer.from_pretrained(os.path.join(models, model)).get_vocab()[token]]

    # `zeta`: only in `shuffled`; every model (the base too) takes its row: τ = 0 for all, so the output is it
    assert torch.allclose(emb[vocab["zeta"]], row("tiny-vocab/shuffled", "zeta"), atol=1e-6)
    # `<tool>`: only in `padded`, added after the base's 32 tokens
    assert vocab["<tool>"] >= 32
    assert torch.allclose(emb[vocab["<tool>"]], row("tiny-vocab/padded", "<tool>"), atol=1e-6)
    # `w3` is at id 10 in `shuffled` and 8 elsewhere: the output has it at the base's id 8
    assert vocab["w3"] == 8


def test_bad_sections_name_the_key():
    from hubsoup.errors import ParameterError
    from hubsoup.formats.mergekit import read_config

    head = "merge_method: linear\nmodels:\n  - model: c/d\n    parameters: {weight: 1}\n"
    cases = [
        ("tokenizer_source: union\ntokenizer: {source: base}\n", "not both"),
        ("tokenizer: [union]\n", "'tokenizer' must be a mapping"),
        ("tokenizer:\n  tokens:\n    <x>: {source: {kind: model_token, model: c/d}}\n", "exactly one of 'token'"),
        ("tokenizer:\n  tokens:\n    <x>: {source: {kind: nope}}\n", "tokenizer.tokens.<x>.source"),
        ("tokenizer:\n  tokens:\n    <x>: {force: maybe}\n", "tokenizer.tokens.<x>.force"),
        ("tokenizer:\n  pad_to_multiple_of: -8\n", "pad_to_multiple_of"),
        ("tokenizer_source: 3\n", "tokenizer_source"),
    ]
    for extra, match in cases:
        with pytest.raises(ParameterError, match=match.replace("[", r"\[")):
            read_config(head + extra, resolve=False)


def test_the_legacy_model_spelling_is_refused_naming_it_and_its_replacement(tmp_path, monkeypatch):
    """``tokenizer_source: model:org/name`` (older mergekit's spelling): mergekit 0.1.5 takes ``model:org/name`` for
    a model's name and fails to load it ("Repo id must use alphanumeric chars"); hubsoup refuses it before any work,
    in one line naming the spelling and what mergekit 0.1.5 reads instead. A local folder of that name is a model."""
    from hubsoup.errors import ParameterError
    from hubsoup.formats.mergekit import read_config

    head = "merge_method: linear\nmodels:\n  - model: c/d\n    parameters: {weight: 1}\n"
    cases = [("tokenizer_source: model:org/chat\n", "'tokenizer_source' = 'model:org/chat' is the legacy 'model:' "
                                                      "spelling", "write 'tokenizer_source: org/chat' (or 'tokenizer: "
                                                                  "{source: org/chat}')"),
             ("tokenizer:\n  source: model:org/chat\n", "'tokenizer.source' = 'model:org/chat'", "write 'source: "
                                                                                                 "org/chat'"),
             ("tokenizer:\n  tokens:\n    <x>: {source: {kind: model_token, model: 'model:c/d', token: a}}\n",
              "'tokenizer.tokens.<x>.source.model' = 'model:c/d'", "write 'model: c/d'")]
    for extra, spelling, fix in cases:
        with pytest.raises(ParameterError) as e:
            read_config(head + extra, resolve=False)
        msg = str(e.value)
        assert spelling in msg and fix in msg and "mergekit 0.1.5" in msg and "\n" not in msg, msg
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model:org" / "chat").mkdir(parents=True)  # an existing folder: a local model, as mergekit reads it
    assert read_config(head + "tokenizer_source: model:org/chat\n", resolve=False).vocab.source == "model:org/chat"


def test_sections_parse_as_mergekit_reads_them():
    from hubsoup.formats.mergekit import read_config
    from hubsoup.formats.mergekit.vocab import TokenSetting, TokenSource

    head = "merge_method: ties\nbase_model: a/b\nmodels:\n  - model: c/d\n    parameters: {weight: 1}\n"
    m = read_config(head + "tokenizer: {}\n", resolve=False)
    assert m.vocab.source == "union" and m.vocab.base_model == "a/b"  # mergekit's default source
    m = read_config(head + "tokenizer:\n  source: c/d\n  pad_to_multiple_of: '32'\n  tokens:\n"
                    "    <a>:\n    <b>: {source: {kind: model_token, model: a/b, token_id: 3}, force: true}\n"
                    "dtype: bfloat16\n", resolve=False)
    assert m.vocab.source == "c/d" and m.vocab.pad_to_multiple_of == 32 and m.vocab.compute_dtype == "bfloat16"
    assert m.vocab.tokens == {"<a>": TokenSetting(), "<b>": TokenSetting(TokenSource("model_token", "a/b", None, 3),
                                                                         True)}
    assert read_config(head, resolve=False).vocab is None
    assert read_config(head + "tokenizer_source: base\n", resolve=False).vocab.source == "base"


@pytest.mark.slow
def test_where_mergekit_fails_hubsoup_refuses(models, tmp_path, monkeypatch):
    """A ``tokens`` row from a model that is not merged, or a source-less entry a model needs: one clear line."""
    from hubsoup.errors import ParameterError

    text = CONFIGS["section_tokens"].replace("      source: tiny-vocab/chat\n", "      source: tiny-vocab/other\n")
    with pytest.raises(ParameterError, match="tiny-vocab/other"):
        run_api(text, models, str(tmp_path / "a"), monkeypatch)
    assert not os.path.exists(tmp_path / "a")
    text = CONFIGS["section_tokens"].replace("    <think>:\n      source:\n        kind: zero\n", "    <think>: {}\n")
    with pytest.raises(ParameterError, match="'<think>'.*no 'source'"):
        run_api(text, models, str(tmp_path / "b"), monkeypatch)
    assert not os.path.exists(tmp_path / "b")
    # source: base + a new token: mergekit adds it to the base's own tokenizer, so the base "has" it at an id
    # beyond its vocab_size and its permutation has a hole there (KeyError in mergekit 0.1.5)
    text = CONFIGS["section_base_slerp"].replace("  source: base\n", "  source: base\n  tokens:\n    <new>:\n"
                                                 "      source: {kind: zero}\n")
    assert "<new>" in text
    with pytest.raises(ParameterError, match="'<new>'.*beyond its vocab_size 34.*KeyError"):
        run_api(text, models, str(tmp_path / "c"), monkeypatch)
    assert not os.path.exists(tmp_path / "c")


def test_configs_are_the_fixtures():
    for name in NAMES:
        with open(os.path.join(FIX, f"{name}.yml"), encoding="utf-8") as f:
            assert yaml.safe_load(f.read()) == yaml.safe_load(CONFIGS[name]), name


@pytest.mark.slow
def test_hub_models_merge_their_vocabularies(models, hub, tmp_path, monkeypatch):
    """The same union from Hub repos (tokenizer files fetched with the configs, weights after the fit check)."""
    for ref in ("tiny-vocab/base", "tiny-vocab/chat", "tiny-vocab/padded", "tiny-vocab/shuffled"):
        hub.seed(ref, os.path.join(models, ref))
    elsewhere = tmp_path / "cwd"  # no folder named tiny-vocab/... here: the references are Hub repos
    elsewhere.mkdir()
    out = str(tmp_path / "out")
    run_cli(CONFIGS["union_ties"], str(elsewhere), out, monkeypatch)
    assert_like_mergekit("union_ties", out)


def test_the_recipe_hash_covers_the_vocabulary():
    """Two configs differing only in their tokenizer section are different merges (and recipes)."""
    from hubsoup.formats.mergekit import MergekitLayout, read_config

    head = "merge_method: ties\nbase_model: a/b\nmodels:\n  - model: c/d\n    parameters: {weight: 1}\n"
    variants = ["", "tokenizer_source: union\n", "tokenizer_source: base\n", "tokenizer: {pad_to_multiple_of: 64}\n",
                "tokenizer:\n  tokens:\n    <x>: {source: c/d}\n",
                "tokenizer:\n  tokens:\n    <x>: {source: c/d, force: true}\n"]
    hashed = [MergekitLayout(read_config(head + v, resolve=False)).hashed for v in variants]
    assert all(hashed[i] != hashed[j] for i in range(len(hashed)) for j in range(i))
    # the section's source and the plain key are one merge
    same = [MergekitLayout(read_config(head + v, resolve=False)).hashed
            for v in ("tokenizer_source: union\n", "tokenizer: {source: union}\n", "tokenizer: {}\n")]
    assert same[0] == same[1] == same[2]


# --- bounded work: limits read with the config, union vocabularies of any size in linear time (issue 44) -----

def test_tokenizer_bombs_are_refused_at_once_with_one_line(tmp_path, capsys):
    """``pad_to_multiple_of: 1e12`` (a MemoryError before), a ``tokens`` section over the limit, a number of
    5,000 digits: refused when the config is read, naming the key, before any model is opened."""
    import time

    from hubsoup.cli import main
    from hubsoup.errors import ParameterError
    from hubsoup.formats.mergekit import read_config
    from hubsoup.formats.mergekit.vocab import MAX_PAD_TO_MULTIPLE_OF, MAX_SECTION_TOKENS, parse_vocab

    head = "merge_method: linear\nmodels:\n  - model: c/d\n    parameters: {weight: 1}\n"
    for extra, match in [("tokenizer: {pad_to_multiple_of: 1.0e+12}\n", "at most 1024"),
                         (f"tokenizer: {{pad_to_multiple_of: {MAX_PAD_TO_MULTIPLE_OF * 2}}}\n", "at most 1024"),
                         ("tokenizer: {pad_to_multiple_of: '" + "9" * 5000 + "'}\n", "must be an integer"),
                         ("tokenizer: {pad_to_multiple_of: .nan}\n", "must be an integer")]:
        with pytest.raises(ParameterError, match=match):
            read_config(head + extra, resolve=False)
    assert read_config(head + f"tokenizer: {{pad_to_multiple_of: {MAX_PAD_TO_MULTIPLE_OF}}}\n",
                       resolve=False).vocab.pad_to_multiple_of == 1024
    many = {f"t{i}": None for i in range(MAX_SECTION_TOKENS + 1)}
    with pytest.raises(ParameterError, match="65537 entries.*at most 65,536"):
        parse_vocab({"tokenizer": {"tokens": many}})
    many.popitem()
    assert len(parse_vocab({"tokenizer": {"tokens": many}}).tokens) == MAX_SECTION_TOKENS
    # the command line: one line, exit 2, nothing written, at once (no model named exists)
    cfg = tmp_path / "bomb.yml"
    cfg.write_text(head.replace("c/d", str(tmp_path / "nowhere")) + "tokenizer: {pad_to_multiple_of: 1.0e+12}\n")
    start = time.monotonic()
    assert main(["run", str(cfg), "--out", str(tmp_path / "out")]) == 2
    assert time.monotonic() - start < 60  # generous: the point is "not a MemoryError after minutes"
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "pad_to_multiple_of" in err[0], err
    assert not os.path.exists(tmp_path / "out")


def _big_vocab_models(root: str, n: int, rows: int | None = None) -> str:
    """tiny-vocab/base and ``big``: the base's 32 tokens then ``n`` more (t0 .. t{n-1}), ``rows`` embedding rows
    (default: one per token). Returns the config merging them with a union vocabulary."""
    from safetensors.torch import load_file, save_file

    from make_mergekit_vocab_fixtures import BASE_WORDS, model_config, save_tokenizer

    if not os.path.isdir(os.path.join(root, "tiny-vocab", "base")):
        build_models(root)
    folder = os.path.join(root, f"big{n}-{rows}")
    os.makedirs(folder, exist_ok=True)
    made = os.path.join(root, f"big{n}-None")
    if rows is not None and os.path.isdir(made):  # the same tokenizer over fewer rows: its files, copied
        for fn in os.listdir(made):
            if fn.startswith(("tokenizer", "special_tokens")):
                shutil.copy(os.path.join(made, fn), folder)
    else:
        save_tokenizer(folder, BASE_WORDS + [f"t{i}" for i in range(n)], [])
    rows = rows or 32 + n
    g = torch.Generator().manual_seed(n)
    tensors = {}
    for k, t in load_file(os.path.join(root, "tiny-vocab", "base", "model.safetensors")).items():
        if k in ("model.embed_tokens.weight", "lm_head.weight"):
            new = torch.randn((rows, t.shape[1]), generator=g) * 0.2
            new[:32] = t[: min(32, rows)]
            tensors[k] = new
        else:
            tensors[k] = t + 0.01
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(model_config(rows), f)
    return (f"models:\n  - model: tiny-vocab/base\n    parameters: {{weight: 0.5}}\n  - model: {os.path.basename(folder)}\n"
            "    parameters: {weight: 0.5}\nmerge_method: linear\nbase_model: tiny-vocab/base\n"
            "tokenizer_source: union\ndtype: float32\n")


class _Counted:
    """Calls of the tokenizers' ``add_tokens`` and of tensor indexing while a merged vocabulary is built."""

    def __init__(self, monkeypatch):
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase

        self.add_tokens = self.index = 0
        real_add, real_get, real_set = PreTrainedTokenizerBase.add_tokens, torch.Tensor.__getitem__, torch.Tensor.__setitem__

        def add(tok, *a, **k):
            self.add_tokens += 1
            return real_add(tok, *a, **k)

        def get(t, i):
            self.index += 1
            return real_get(t, i)

        def put(t, i, v):
            self.index += 1
            return real_set(t, i, v)

        monkeypatch.setattr(PreTrainedTokenizerBase, "add_tokens", add)
        monkeypatch.setattr(torch.Tensor, "__getitem__", get)
        monkeypatch.setattr(torch.Tensor, "__setitem__", put)


def _build(text: str, root: str, monkeypatch, counted: bool = False) -> tuple[object, torch.Tensor, "_Counted | None"]:
    """The config's merged vocabulary (opened as a merge opens it) and the big model's re-mapped embedding."""
    from hubsoup.formats.mergekit import MergekitLayout, read_config
    from hubsoup.options import MergeOptions

    monkeypatch.chdir(root)
    layout = MergekitLayout(read_config(text, resolve=False))
    with monkeypatch.context() as mp:
        c = _Counted(mp) if counted else None
        views = layout._vocab.open(MergeOptions(quiet=True))
        emb = views[layout.merge.inputs[-1]].tensor("model.embed_tokens.weight")
    return layout._vocab.vm, emb, c


@pytest.mark.slow
def test_a_300k_token_union_is_one_warning_and_linear_work(tmp_path, monkeypatch, caplog):
    """A union with a model of 300,000 more tokens (a 300k-token vocabulary, as real ones go to 262k): every row
    where mergekit puts it, one call of the tokenizers library per list of tokens (a call per token rebuilds its
    matcher each time: quadratic), a number of tensor operations that does not grow with the vocabulary, and
    at most one warning line (mergekit, and hubsoup before, logged a line per token)."""
    import logging

    root = str(tmp_path)
    small = _big_vocab_models(root, 2000)
    larger = _big_vocab_models(root, 8000)
    _, _, c_small = _build(small, root, monkeypatch, counted=True)
    _, _, c_larger = _build(larger, root, monkeypatch, counted=True)
    assert c_small.add_tokens == c_larger.add_tokens < 10  # transformers adds its special tokens too: a few calls
    assert c_larger.index <= c_small.index + 20, (c_small.index, c_larger.index)

    n = 300_000
    big = _big_vocab_models(root, n)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        vm, emb, _ = _build(big, root, monkeypatch)
    assert vm.size == 32 + n and emb.shape == (32 + n, 8)
    from safetensors.torch import load_file

    own = load_file(os.path.join(root, f"big{n}-None", "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(emb, own)  # every token at its own id: the base's 32, then t0 .. t299999
    base_row = vm.remap("model.embed_tokens.weight", "tiny-vocab/base", ["tiny-vocab/base", f"big{n}-None"],
                        lambda m: load_file(os.path.join(root, m, "model.safetensors"))["model.embed_tokens.weight"],
                        lambda m: torch.float32)
    assert torch.equal(base_row[32:], own[32:])  # a token only `big` has: its row, in the base too
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(noisy) <= 1, [r.getMessage()[:100] for r in noisy[:5]]

    # the probe's 300,001 stderr lines: the same tokenizer over a 32-row embedding (vocab_size 32); its 300,000
    # tokens beyond are left out of the union as mergekit leaves them, said in one line that counts them
    text = _big_vocab_models(root, n, rows=32)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        vm, emb, _ = _build(text, root, monkeypatch)
    assert vm.size == 32 and emb.shape == (32, 8)
    noisy = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(noisy) == 1 and "300000 token(s)" in noisy[0] and "left out of the union" in noisy[0], noisy[:3]


def test_vocabularies_over_the_limit_are_refused_before_any_tokenizer_is_read(tmp_path, monkeypatch):
    from hubsoup.errors import ParameterError
    from hubsoup.formats.mergekit import vocab as mergekit_vocab

    root = str(tmp_path)
    text = _big_vocab_models(root, 100)
    monkeypatch.setattr(mergekit_vocab, "MAX_VOCAB", 120)  # the base: 32 tokens; big: 132 (its config: 132 rows)
    read: list[str] = []
    real = mergekit_vocab._load_tokenizer
    monkeypatch.setattr(mergekit_vocab, "_load_tokenizer", lambda f, label, **k: read.append(label) or real(f, label, **k))
    with pytest.raises(ParameterError, match=r"'big100-None' \(its config's vocab_size\) has 132 tokens; .*at most 120"):
        _build(text, root, monkeypatch)
    assert read == []
    monkeypatch.setattr(mergekit_vocab, "config_vocab_size", lambda cfg: None)  # a config that does not say
    with pytest.raises(ParameterError, match="the tokenizer of 'big100-None' has 132 tokens"):
        _build(text, root, monkeypatch)
    monkeypatch.setattr(mergekit_vocab, "MAX_VOCAB", 132)  # each fits; the union with a section's token does not
    with pytest.raises(ParameterError, match="the output vocabulary has 133 tokens"):
        _build(text.replace("tokenizer_source: union\n", "tokenizer:\n  tokens:\n    <new>: {source: {kind: zero}}\n"),
               root, monkeypatch)
