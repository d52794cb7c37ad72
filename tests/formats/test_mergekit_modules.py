"""mergekit ``modules:`` configs (a vision-language model merged module by module) against mergekit 0.1.5's output.

``tests/fixtures/mergekit_modules/`` holds the configs and what mergekit made of each on tiny
Mistral3, T5 and Whisper stand-ins (``tests/tools/make_mergekit_modules_fixtures.py`` builds both):
each module with its own models, slices and parameters, gradients over the module's own layers, a
sliced module's layer count written to its key (``text_config.num_hidden_layers``; T5's encoder:
``num_layers``; Whisper's: ``encoder_layers``), T5's ``shared`` module (embeddings and head). hubsoup must give the same
tensors (names, dtypes, values bit for bit or within 1e-5 relative / 1 ulp) and the same config
layer counts and dtype, and leave nothing behind when a module fails.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import pytest
import torch
import yaml

from paths import TESTS as HERE
sys.path.insert(0, os.path.join(HERE, "tools"))
from make_mergekit_modules_fixtures import FIXTURES, build_models, config_names, layers  # noqa: E402
from tests.formats.test_mergekit_compat import assert_like_mergekit, load_dir  # noqa: E402

from hubsoup.errors import HubsoupError, ParameterError  # noqa: E402
from hubsoup.workflows.rerun import run_config  # noqa: E402

with open(os.path.join(FIXTURES, "manifest.json"), encoding="utf-8") as _f:
    MANIFEST = json.load(_f)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("mk-modules"))
    digests = build_models(folder)
    assert digests == MANIFEST["models"], "rebuilt stand-ins differ from those mergekit read"
    return folder


def _config(name: str) -> str:
    with open(os.path.join(FIXTURES, f"{name}.yml"), encoding="utf-8") as f:
        return f.read()


@pytest.mark.parametrize("name", config_names())
def test_modules_config_gives_mergekits_output(root, name, monkeypatch):
    from safetensors.torch import load_file

    monkeypatch.chdir(root)  # the configs name the stand-ins as folders of the working folder
    out = os.path.join(root, f"out-{name}")
    run_config(_config(name), out, quiet=True, overwrite=True)
    ref = load_file(os.path.join(FIXTURES, f"{name}.safetensors"))
    assert_like_mergekit(load_dir(out), ref)
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    want = MANIFEST["configs"][name]
    assert {k: layers(cfg, k) for k in want["layers"]} == want["layers"]
    assert (cfg.get("dtype") or cfg.get("torch_dtype")) == want["config"]["dtype"]
    assert cfg["architectures"] == want["config"]["architectures"]
    assert [f for f in os.listdir(out) if f.startswith(".")] == [".hubsoup"], "a module's folder was left in the output"
    if len(yaml.safe_load(_config(name))["modules"]) > 1:  # one module: one file, no index
        with open(os.path.join(out, "model.safetensors.index.json"), encoding="utf-8") as f:
            index = json.load(f)["weight_map"]
        assert sorted(index) == sorted(ref) and all(os.path.isfile(os.path.join(out, v)) for v in index.values())
    else:
        assert [f for f in os.listdir(out) if f.startswith("model")] == ["model.safetensors"]
    with open(os.path.join(out, "README.md"), encoding="utf-8") as f:
        card = f.read()
    assert "modules:" in card and "merged module by module" in card  # the card shows the whole config, every module

    with open(os.path.join(out, "hubsoup_recipe.yaml"), encoding="utf-8") as f:
        recipe = yaml.safe_load(f)
    data = yaml.safe_load(_config(name))
    modules = data["modules"]
    assert sorted(recipe["extra"]["options"]["modules"]) == sorted(modules)  # the hash covers every module's merge
    named = {m["model"] for mod in modules.values() for m in mod.get("models") or []} | \
        {s["model"] for mod in modules.values() for sl in mod.get("slices") or [] for s in sl["sources"]}
    assert {os.path.basename(i["path"]) for i in recipe["inputs"]} == named - {data["base_model"]}


def test_a_failing_module_leaves_no_output(root, monkeypatch):
    monkeypatch.chdir(root)
    # the last module fails, once the others are merged
    head, sep, tail = _config("slerp_per_module").partition("  multi_modal_projector:")
    text = head + sep + tail.replace("model: mm-ft-b", "model: mm-ft-z")
    out = os.path.join(root, "out-bad")
    with pytest.raises(HubsoupError, match=r"mm-ft-z"):
        run_config(text, out, quiet=True)
    assert not os.path.exists(out)
    assert not [f for f in os.listdir(root) if f.startswith(".out-bad")], "a temporary folder was left"


def test_a_module_the_architecture_lacks_is_named(root, monkeypatch):
    monkeypatch.chdir(root)
    text = _config("ties_models_per_module").replace("  vision_tower:", "  vision_model:")
    with pytest.raises(ParameterError, match=r"module 'vision_model' is not one of Mistral3ForConditionalGeneration"):
        run_config(text, os.path.join(root, "out-unknown"), quiet=True)


def test_tensors_of_no_module_are_dropped_as_mergekit_does(tmp_path, caplog):
    """A tensor outside every module: mergekit plans the modules' tensors only, so it is not written (a warning says so)."""
    from safetensors.torch import load_file, save_file

    build_models(str(tmp_path))
    for ref in ("mm-base", "mm-ft-a", "mm-ft-b"):
        path = tmp_path / ref / "model.safetensors"
        t = load_file(str(path))
        t["image_newline"] = torch.ones(8, dtype=torch.bfloat16)
        save_file(t, str(path), metadata={"format": "pt"})
    os.chdir(tmp_path)
    try:
        with caplog.at_level(logging.WARNING):
            run_config(_config("ties_models_per_module"), str(tmp_path / "out"), quiet=True)
    finally:
        os.chdir(HERE)
    assert "image_newline" not in load_dir(str(tmp_path / "out"))
    assert "belong to no merged module" in caplog.text and "image_newline" in caplog.text


def test_modules_mergekit_cannot_merge_are_refused_before_anything_is_read(root, monkeypatch):
    """Whisper's decoder (mergekit 0.1.5 asks for 'model.decoderembed_tokens.weight' and stops) and a model
    mergekit does not split: one line each, no output."""
    from safetensors.torch import save_file

    monkeypatch.chdir(root)
    cfg = "merge_method: linear\nbase_model: {m}\nmodules:\n  encoder:\n    models: [{{model: {m}}}]\n" \
          "  decoder:\n    models: [{{model: {m}}}]\nparameters: {{weight: 1.0}}\n"
    with pytest.raises(ParameterError, match=r"module 'decoder' of WhisperForConditionalGeneration: mergekit 0.1.5 "
                                              r"cannot merge it: .*'model.decoder' lacks the dot"):
        run_config(cfg.format(m="wh-base"), os.path.join(root, "out-wh-dec"), quiet=True)
    folder = os.path.join(root, "llama")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, f)
    save_file({"model.embed_tokens.weight": torch.zeros(4, 2)}, os.path.join(folder, "model.safetensors"))
    with pytest.raises(ParameterError, match=r"LlamaForCausalLM, which mergekit does not define by modules"):
        run_config(cfg.format(m="llama"), os.path.join(root, "out-llama"), quiet=True)
    assert not os.path.exists(os.path.join(root, "out-wh-dec")) and not os.path.exists(os.path.join(root, "out-llama"))


def test_t5_modules_split_as_mergekit_defines_them():
    """T5's modules: encoder and decoder blocks by prefix, ``shared`` = the embeddings and the head (mergekit's t5.json)."""
    from hubsoup.formats.mergekit.modules import ARCHITECTURES

    t5 = ARCHITECTURES["T5ForConditionalGeneration"]
    owner = {n: [m for m, mod in t5.items() if mod.holds(n)] for n in
             ("shared.weight", "lm_head.weight", "encoder.block.0.layer.0.SelfAttention.q.weight",
              "encoder.final_layer_norm.weight", "decoder.embed_tokens.weight", "decoder.block.1.layer.2.layer_norm.weight")}
    assert owner == {"shared.weight": ["shared"], "lm_head.weight": ["shared"],
                     "encoder.block.0.layer.0.SelfAttention.q.weight": ["encoder"],
                     "encoder.final_layer_norm.weight": ["encoder"], "decoder.embed_tokens.weight": ["decoder"],
                     "decoder.block.1.layer.2.layer_norm.weight": ["decoder"]}
