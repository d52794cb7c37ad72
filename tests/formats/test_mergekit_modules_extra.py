"""``modules:`` configs against mergekit 0.1.5: a merged vocabulary across modules, tied tensors, unlisted tensors.

``tests/fixtures/mergekit_modules_extra/`` holds the configs and mergekit's outputs on the stand-ins of
``tests/tools/make_mergekit_modules_extra_fixtures.py`` (which builds both):

* ``tokenizer_source: union`` / a ``tokenizer:`` section with several modules: one vocabulary over
  every module's models, each module's embedding and head rows re-mapped to it;
* T5 checkpoints that differ in which tied tensors they store (mergekit writes a tied tensor some
  model stores, reading a model's missing one from its tie source), in a ``modules:`` config and in a
  plain one (which mergekit merges module by module);
* a tensor under a module's prefix that mergekit's list of the module lacks: not written;
* configs mergekit refuses (top-level slices over T5, a plain Whisper config): refused, saying why.

hubsoup must give the same tensors (names, dtypes, values bit for bit or within 1e-5 relative /
1 ulp), the same config values (vocabulary size at the architecture's key, layer counts, dtype) and
the same tokenizer files.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import pytest

from paths import TESTS as HERE
sys.path.insert(0, os.path.join(HERE, "tools"))
from make_mergekit_modules_extra_fixtures import (FIXTURES, build_models, config_names,  # noqa: E402
                                                  tokenizer_files)
from make_mergekit_modules_fixtures import layers  # noqa: E402
from tests.formats.test_mergekit_compat import assert_like_mergekit, load_dir  # noqa: E402

from hubsoup.errors import ParameterError  # noqa: E402
from hubsoup.workflows.rerun import run_config  # noqa: E402

with open(os.path.join(FIXTURES, "manifest.json"), encoding="utf-8") as _f:
    MANIFEST = json.load(_f)

RAN = [n for n in config_names() if not n.startswith("refused_")]
REFUSED = [n for n in config_names() if n.startswith("refused_")]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("mk-modules-extra"))
    assert build_models(folder) == MANIFEST["models"], "rebuilt stand-ins differ from those mergekit read"
    return folder


def _config(name: str) -> str:
    with open(os.path.join(FIXTURES, f"{name}.yml"), encoding="utf-8") as f:
        return f.read()


@pytest.mark.slow
@pytest.mark.parametrize("name", RAN)
def test_gives_mergekits_output(root, name, monkeypatch, caplog):
    from safetensors.torch import load_file

    monkeypatch.chdir(root)
    out = os.path.join(root, f"out-{name}")
    with caplog.at_level(logging.WARNING):
        run_config(_config(name), out, quiet=True, overwrite=True)
    ref = load_file(os.path.join(FIXTURES, f"{name}.safetensors"))
    assert_like_mergekit(load_dir(out), ref)
    want = MANIFEST["configs"][name]
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    assert {k: layers(cfg, k) for k in want["config"]} == want["config"]
    assert (cfg.get("dtype") or cfg.get("torch_dtype")) == want["dtype"]
    if name.startswith("t5_"):  # the T5 stand-ins carry no tokenizer (mergekit then writes transformers' default
        pass  # T5 tokenizer, hubsoup none): their tokenizer files are not compared
    else:
        assert tokenizer_files(out) == want["tokenizer"]
    if name.startswith("t5_"):  # the unlisted tensor is named once, as dropped
        assert "encoder.extra_scale (encoder)" in caplog.text and "not in mergekit 0.1.5's list" in caplog.text


def test_the_vocabulary_spans_every_modules_models():
    """The text decoder merges models without the chat tokens; the vision tower's mm-ft-a brings them: the
    output vocabulary has them (34 tokens), and the decoder's rows of them are zeros (no merged model has them)."""
    from safetensors.torch import load_file

    want = MANIFEST["configs"]["union_across_modules"]
    assert want["config"]["text_config.vocab_size"] == 34
    assert "<|im_start|>" in json.dumps(want["tokenizer"]["tokenizer.json"]["added_tokens"])
    ref = load_file(os.path.join(FIXTURES, "union_across_modules.safetensors"))
    assert ref["language_model.model.embed_tokens.weight"][32:].abs().max() == 0


def test_tied_tensors_are_written_as_mergekit_writes_them():
    """What the fixtures hold: the embeddings one model stores, a head one model lacks, no unlisted tensor."""
    from safetensors.torch import load_file

    for name in ("t5_tied_modules", "t5_tied_plain"):
        keys = set(load_file(os.path.join(FIXTURES, f"{name}.safetensors")))
        assert {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight", "shared.weight"} <= keys
        assert "encoder.extra_scale" not in keys


@pytest.mark.slow
@pytest.mark.parametrize("name", ["della_linear_modules_bf16", "t5_dare_ties_modules_fp16"])
def test_half_precision_modules_are_mergekits_bit_for_bit(root, name, monkeypatch):
    """della_linear and dare_ties over `modules:` in bf16 / fp16 with lambda (a module's own too), rescale and
    normalize (every density 1: nothing dropped at random): computed step for step as mergekit computes them
    in the config's dtype (compute_dtype), every tensor is mergekit's bit for bit."""
    import torch
    from safetensors.torch import load_file

    monkeypatch.chdir(root)
    out = os.path.join(root, f"out-exact-{name}")
    run_config(_config(name), out, quiet=True, overwrite=True)
    got, ref = load_dir(out), load_file(os.path.join(FIXTURES, f"{name}.safetensors"))
    assert sorted(got) == sorted(ref)
    differ = [k for k in ref if not torch.equal(got[k], ref[k])]
    assert not differ, f"{len(differ)} tensors differ from mergekit's, e.g. {differ[0]}"


@pytest.mark.parametrize("name", REFUSED)
def test_refused_where_mergekit_fails(root, name, monkeypatch):
    monkeypatch.chdir(root)
    why = {"refused_t5_slices": r"'slices' over 't5-base', a T5ForConditionalGeneration: .*refuses slices",
           "refused_whisper_plain": r"module 'decoder' of WhisperForConditionalGeneration: mergekit 0.1.5 cannot "
                                    r"merge it"}[name]
    assert MANIFEST["configs"][name]["mergekit_error"].startswith("RuntimeError")
    out = os.path.join(root, f"out-{name}")
    with pytest.raises(ParameterError, match=why):
        run_config(_config(name), out, quiet=True)
    assert not os.path.exists(out)
