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
import sys

import pytest
import torch
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
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
    from hubsoup.formats.mergekit_vocab import TokenSetting, TokenSource

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
