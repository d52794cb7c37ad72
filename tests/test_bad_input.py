"""Bad input: a clear error naming what is wrong, and never a partial output."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import hubsoup
from hubsoup import errors
from hubsoup.testing import make_base, make_finetune


def assert_no_output(tmp_path, name="out"):
    leftovers = [p for p in os.listdir(tmp_path) if p == name or p.startswith(f".{name}.partial")]
    assert leftovers == [], leftovers


def merge(inputs, tmp_path, **kw):
    kw.setdefault("method", "task_arithmetic")
    return hubsoup.merge(inputs, out=str(tmp_path / "out"), quiet=True, **kw)


def rewrite(folder, fn):
    path = os.path.join(folder, "model.safetensors")
    sd = load_file(path)
    fn(sd)
    save_file(sd, path, metadata={"format": "pt"})


def copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_different_architecture(model_dir, tmp_path):
    with pytest.raises(errors.IncompatibleInputError, match="gpt2 model but the base .* is llama"):
        merge([model_dir("gpt2", "ft1")], tmp_path, base=model_dir("llama"))
    assert_no_output(tmp_path)


def test_different_hidden_size(model_dir, tmp_path):
    other = make_base("llama", str(tmp_path / "wide"), hidden=48)
    with pytest.raises(errors.IncompatibleInputError, match="hidden size 48 but the base .* has 32"):
        merge([other], tmp_path, base=model_dir("llama"))
    assert_no_output(tmp_path)


def test_missing_tensor(model_dir, tmp_path):
    ft = copy(model_dir("llama", "ft1"), tmp_path / "ft")
    rewrite(ft, lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(errors.IncompatibleInputError, match="lacks 1 tensor.*model.layers.1.mlp.up_proj.weight"):
        merge([ft], tmp_path, base=model_dir("llama"))
    assert_no_output(tmp_path)


def test_extra_tensor(model_dir, tmp_path):
    ft = copy(model_dir("llama", "ft1"), tmp_path / "ft")
    rewrite(ft, lambda sd: sd.__setitem__("score.weight", torch.zeros(3, 32)))
    with pytest.raises(errors.IncompatibleInputError, match="1 tensor.* the base lacks, e.g. 'score.weight'"):
        merge([ft], tmp_path, base=model_dir("llama"))
    assert_no_output(tmp_path)


def test_vocab_extended_embedding(model_dir, tmp_path):
    base = model_dir("llama")
    ft = copy(model_dir("llama", "ft1"), tmp_path / "ft")

    def grow(sd):
        for k in ("model.embed_tokens.weight", "lm_head.weight"):
            sd[k] = torch.cat([sd[k], torch.ones(4, sd[k].shape[1])])
    rewrite(ft, grow)
    with pytest.raises(errors.IncompatibleInputError, match=r"shape \[132, 32\] but the base has \[128, 32\].*base-slice"):
        merge([ft], tmp_path, base=base)
    assert_no_output(tmp_path)
    res = merge([ft], tmp_path, base=base, method="linear", shape_mismatch="base-slice")
    got = load_file(os.path.join(res.path, "model.safetensors"))
    want = load_file(os.path.join(ft, "model.safetensors"))
    assert got["model.embed_tokens.weight"].shape == (128, 32)
    torch.testing.assert_close(got["model.embed_tokens.weight"], want["model.embed_tokens.weight"][:128])


def test_nan_in_input(model_dir, tmp_path):
    ft = copy(model_dir("llama", "ft1"), tmp_path / "ft")

    def poison(sd):
        sd["model.layers.1.self_attn.k_proj.weight"][0, 0] = float("nan")
    rewrite(ft, poison)
    with pytest.raises(errors.NonFiniteTensorError, match="'model.layers.1.self_attn.k_proj.weight' has 1 NaN/inf"):
        merge([ft, model_dir("llama", "ft2")], tmp_path, base=model_dir("llama"))
    assert_no_output(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(model_dir, tmp_path, damage):
    ft = copy(model_dir("llama", "ft1"), tmp_path / "ft")
    path = os.path.join(ft, "model.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2] if damage == "truncate" else b"\x00garbage" * 100)
    with pytest.raises(errors.CorruptCheckpointError, match="model.safetensors is not a valid safetensors file"):
        merge([ft], tmp_path, base=model_dir("llama"))
    assert_no_output(tmp_path)


def test_missing_shard_listed_in_index(model_dir, tmp_path):
    from hubsoup.testing import tiny_model

    folder = tmp_path / "sharded"
    tiny_model("llama").save_pretrained(folder, max_shard_size="20KB")
    shards = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    os.remove(folder / shards[-1])
    with pytest.raises(errors.CorruptCheckpointError, match=f"{shards[-1]} is missing"):
        merge([str(folder)], tmp_path, base=model_dir("llama"))


def test_nonexistent_local_path(model_dir, tmp_path):
    with pytest.raises(errors.InputError, match="'./nope/here': no such local folder"):
        merge(["./nope/here"], tmp_path, base=model_dir("llama"))
    assert_no_output(tmp_path)


def test_nonexistent_repo_offline(model_dir, tmp_path):
    with pytest.raises(errors.InputError, match="org/never-existed.* not in the local Hub cache while offline"):
        merge(["org/never-existed@v2"], tmp_path, base=model_dir("llama"))
    assert_no_output(tmp_path)


def test_unknown_method_and_parameters(llama, tmp_path):
    base, fts = llama
    with pytest.raises(errors.MethodError, match="unknown method 'tie'.*did you mean 'ties'"):
        merge(fts, tmp_path, base=base, method="tie")
    with pytest.raises(errors.ParameterError, match="method 'ties' has no parameter 'denisty'"):
        merge(fts, tmp_path, base=base, method="ties", denisty=0.1)
    with pytest.raises(errors.ParameterError, match=r"'density' = 1.5 is out of range \[0.0, 1.0\]"):
        merge(fts, tmp_path, base=base, method="ties", density=1.5)
    with pytest.raises(errors.ParameterError, match="'density': expected float, got 'lots'"):
        merge(fts, tmp_path, base=base, method="ties", density="lots")
    with pytest.raises(errors.ParameterError, match="'scope': 'global' is not one of model, tensor"):
        merge(fts, tmp_path, base=base, method="ties", scope="global")
    with pytest.raises(errors.MethodError, match="2 weights given for 3 inputs"):
        merge(fts, tmp_path, base=base, method="linear", weights="1,2")
    with pytest.raises(errors.MethodError, match="'slerp' takes 1 to 2 input"):  # base → input, or input → input
        merge(fts, tmp_path, base=base, method="slerp")
    assert_no_output(tmp_path)


def test_output_exists(llama, tmp_path):
    base, fts = llama
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    for overwrite in (False, True):  # a folder hubsoup did not make: never replaced (issue 44)
        with pytest.raises(errors.OutputExistsError, match="hubsoup did not make it"):
            merge(fts, tmp_path, base=base, overwrite=overwrite)
        assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    shutil.rmtree(tmp_path / "out")
    merge(fts, tmp_path, base=base)
    (tmp_path / "out" / "keep.txt").write_text("mine")  # put into a hubsoup output: replaced with it
    with pytest.raises(errors.OutputExistsError, match="already exists; pass --overwrite"):
        merge(fts, tmp_path, base=base)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    merge(fts, tmp_path, base=base, overwrite=True)
    assert not (tmp_path / "out" / "keep.txt").exists()


def test_pickle_refused_unless_allowed(model_dir, tmp_path):
    ft = copy(model_dir("llama", "ft1"), tmp_path / "ft")
    sd = load_file(os.path.join(ft, "model.safetensors"))
    os.remove(os.path.join(ft, "model.safetensors"))
    torch.save(sd, os.path.join(ft, "pytorch_model.bin"))
    with pytest.raises(errors.PickleRefusedError, match="only pickle weights.*--allow-pickle"):
        merge([ft], tmp_path, base=model_dir("llama"))
    assert_no_output(tmp_path)
    res = merge([ft], tmp_path, base=model_dir("llama"), method="linear", allow_pickle=True)
    got = load_file(os.path.join(res.path, "model.safetensors"))
    torch.testing.assert_close(got["lm_head.weight"], sd["lm_head.weight"])


def test_base_cannot_be_resolved(model_dir, tmp_path):
    base = model_dir("llama")
    a = make_finetune(base, str(tmp_path / "a"), seed=1, base_model="org/base-a")
    b = make_finetune(base, str(tmp_path / "b"), seed=2, base_model="org/base-b")
    c = make_finetune(base, str(tmp_path / "c"), seed=3)
    with pytest.raises(errors.BaseModelError, match="disagree.*pass --base"):
        merge([a, b], tmp_path)
    with pytest.raises(errors.BaseModelError, match="does not say which base.*pass --base"):
        merge([a, c], tmp_path)


def test_interrupted_merge_leaves_nothing(llama, tmp_path, monkeypatch):
    from hubsoup.output.checkpoint import CheckpointSink

    base, fts = llama
    calls = {"n": 0}
    real = CheckpointSink.put  # every tensor's way out, whichever path merged it

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 10:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(CheckpointSink, "put", flaky)
    with pytest.raises(KeyboardInterrupt):
        merge(fts, tmp_path, base=base)
    assert_no_output(tmp_path)
    assert json.dumps(os.listdir(tmp_path)) == "[]"


def test_remote_code_is_never_enabled(tmp_path, monkeypatch):
    """A config that asks for custom code (auto_map) is built, if at all, with trust_remote_code=False."""
    import transformers

    from hubsoup.arch import model_layout

    seen = []
    real = transformers.AutoConfig.from_pretrained

    def spy(*a, **k):
        seen.append(k.get("trust_remote_code"))
        return real(*a, **k)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", spy)
    base = make_base("llama", str(tmp_path / "base"))
    cfg = json.load(open(os.path.join(base, "config.json")))
    cfg["auto_map"] = {"AutoModel": "evil.EvilModel"}
    json.dump(cfg, open(os.path.join(base, "config.json"), "w"))
    with open(os.path.join(base, "evil.py"), "w") as f:
        f.write("raise SystemExit('remote code ran')\n")
    model_layout(base)  # builds the architecture on the meta device
    assert seen and all(v is False for v in seen)
