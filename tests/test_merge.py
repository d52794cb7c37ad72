"""End-to-end merges of tiny models: exact properties, loading, determinism, layout."""

import json
import os

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

import hubsoup
from hubsoup.testing import make_base, make_finetune

ARCH_LOADERS = {
    "llama": "AutoModelForCausalLM",
    "gpt2": "AutoModelForCausalLM",
    "bert": "AutoModel",
    "t5": "AutoModelForSeq2SeqLM",
    "clip_vision": "CLIPVisionModel",
}


from method_helpers import state  # noqa: E402  (tests/ is on sys.path)


def finite_forward(arch, folder):
    import transformers

    model = getattr(transformers, ARCH_LOADERS[arch]).from_pretrained(folder).eval()
    with torch.no_grad():
        if arch == "clip_vision":
            out = model(pixel_values=torch.randn(1, 3, 16, 16)).last_hidden_state
        elif arch == "t5":
            ids = torch.tensor([[1, 2, 3, 4]])
            out = model(input_ids=ids, decoder_input_ids=ids).logits
        else:
            out = model(input_ids=torch.tensor([[1, 2, 3, 4]]))[0]
    assert torch.isfinite(out).all()
    return model


@pytest.mark.parametrize("arch", list(ARCH_LOADERS))
def test_every_arch_merges_and_loads(arch, model_dir, tmp_path):
    base = model_dir(arch)
    fts = [model_dir(arch, f"ft{i}") for i in (1, 2)]
    res = hubsoup.merge(fts, method="ties", base=base, out=str(tmp_path / "out"), quiet=True, density=0.5)
    assert res.path == str(tmp_path / "out")
    finite_forward(arch, res.path)
    merged, b = state(res.path), state(base)
    assert set(merged) == set(b)
    changed = [k for k in b if b[k].dtype.is_floating_point and not torch.equal(merged[k], b[k])]
    assert changed, "the merge changed nothing"


@pytest.mark.parametrize("arch", ["llama", "t5", "clip_vision"])
def test_linear_of_one_model_returns_it(arch, model_dir, tmp_path):
    base, ft = model_dir(arch), model_dir(arch, "ft1")
    res = hubsoup.merge([ft], method="linear", base=base, out=str(tmp_path / "o"), quiet=True)
    got, want = state(res.path), state(ft)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6)


def test_task_arithmetic_scale_zero_is_base_bit_exact(llama, tmp_path):
    base, fts = llama
    res = hubsoup.merge(fts, method="task_arithmetic", base=base, out=str(tmp_path / "o"), quiet=True, scale=0.0)
    got, want = state(res.path), state(base)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_consensus_k0_equals_task_arithmetic_and_dare_p0_too(llama, tmp_path):
    base, fts = llama
    ta = state(hubsoup.merge(fts, method="task_arithmetic", base=base, out=str(tmp_path / "ta"), quiet=True, scale=0.5).path)
    cons = state(hubsoup.merge(fts, method="consensus", base=base, out=str(tmp_path / "c"), quiet=True, k=0, scale=0.5).path)
    dare = state(hubsoup.merge(fts, method="dare", base=base, out=str(tmp_path / "d"), quiet=True, p=0.0, scale=0.5).path)
    for k in ta:
        assert torch.equal(ta[k], cons[k])
        assert torch.equal(ta[k], dare[k])


def test_ties_model_scope_full_density_agreeing_signs_is_mean(model_dir, tmp_path):
    base = model_dir("llama")
    b = state(base)
    # fine-tunes whose task vectors share signs everywhere: base + c * |noise|
    fts = []
    for i, c in enumerate((0.01, 0.03)):
        folder = make_finetune(base, str(tmp_path / f"pos{i}"), seed=7)
        sd = {k: (v + c) if v.dtype.is_floating_point else v for k, v in b.items()}
        from safetensors.torch import save_file
        save_file(sd, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        fts.append(folder)
    res = hubsoup.merge(fts, method="ties", base=base, out=str(tmp_path / "o"), quiet=True, density=1.0, scale=1.0)
    got = state(res.path)
    for k, v in b.items():
        if v.dtype.is_floating_point:
            torch.testing.assert_close(got[k], v + 0.02, rtol=1e-5, atol=1e-6)


def test_dare_runs_repeat_bit_exactly_and_depend_on_recipe(llama, tmp_path):
    base, fts = llama
    a = hubsoup.merge(fts, method="dare", base=base, out=str(tmp_path / "a"), quiet=True, p=0.5)
    b = hubsoup.merge(fts, method="dare", base=base, out=str(tmp_path / "b"), quiet=True, p=0.5)
    c = hubsoup.merge(fts, method="dare", base=base, out=str(tmp_path / "c"), quiet=True, p=0.5, seed=3)
    with open(os.path.join(a.path, "model.safetensors"), "rb") as fa, open(os.path.join(b.path, "model.safetensors"), "rb") as fb:
        assert fa.read() == fb.read()
    sa, sc = state(a.path), state(c.path)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].dtype.is_floating_point)


def test_recipe_metadata_card_and_files(llama, tmp_path):
    base, fts = llama
    res = hubsoup.merge(fts, method="ties", base=base, out=str(tmp_path / "o"), quiet=True, density=0.3)
    files = set(os.listdir(res.path))
    assert {"config.json", "model.safetensors", "hubsoup_recipe.yaml", "README.md", "generation_config.json"} <= files
    recipe = yaml.safe_load(open(os.path.join(res.path, "hubsoup_recipe.yaml")))
    assert recipe["method"] == "ties" and recipe["params"]["density"] == 0.3
    assert [i["path"] for i in recipe["inputs"]] == [os.path.abspath(f) for f in fts]
    assert recipe["hubsoup_version"] == hubsoup.__version__
    with safe_open(os.path.join(res.path, "model.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt"
    assert json.loads(meta["hubsoup_recipe"])["hash"] == res.recipe.hash
    card = open(os.path.join(res.path, "README.md")).read()
    assert "ties" in card and "density" in card and "0.3" in card


def test_sharded_output_and_dtype(model_dir, tmp_path):
    base = make_base("llama", str(tmp_path / "bf16base"), dtype=torch.bfloat16)
    ft = make_finetune(base, str(tmp_path / "bf16ft"), seed=1)
    res = hubsoup.merge([ft], method="linear", base=base, out=str(tmp_path / "o"), quiet=True, shard_size="20KB")
    shards = sorted(f for f in os.listdir(res.path) if f.endswith(".safetensors"))
    assert len(shards) > 1 and shards[0].startswith("model-00001-of-")
    index = json.load(open(os.path.join(res.path, "model.safetensors.index.json")))
    assert set(index["weight_map"].values()) == set(shards)
    got, want = state(res.path), state(ft)
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k]) for k in want)  # bf16 round-trips exactly
    finite_forward("llama", res.path)
    res32 = hubsoup.merge([ft], method="linear", base=base, out=str(tmp_path / "o32"), quiet=True, dtype="float32")
    assert all(v.dtype == torch.float32 for v in state(res32.path).values())
    assert json.load(open(os.path.join(res32.path, "config.json")))["dtype"] == "float32"


def test_every_tensor_is_handed_to_the_disk_as_it_is_written(tmp_path, monkeypatch):
    """The writer starts each tensor's writeback at once (Linux sync_file_range), so the final
    fsync does not wait for a whole shard; the bytes are the same."""
    import sys

    from safetensors.torch import load_file

    from hubsoup.output import shards

    if sys.platform.startswith("linux"):
        assert shards._writeback_starter() is not None
    started = []
    real = shards._START_WRITEBACK
    monkeypatch.setattr(shards, "_START_WRITEBACK",
                        lambda fd, off, n: (started.append((os.fstat(fd).st_ino, off, n)), real and real(fd, off, n)))
    tensors = {f"t{i}": torch.randn(64 + i, 3) for i in range(4)}
    w = shards.ShardedWriter(str(tmp_path), [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()], 2000)
    for k, v in tensors.items():
        w.write(k, v)
    w.close()
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    assert len(files) > 1
    got = {}
    for f in files:
        got.update(load_file(str(tmp_path / f)))
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    # one start per tensor, each over exactly that tensor's bytes in its shard
    slots = {(os.stat(tmp_path / w.files[s.shard]).st_ino, s.start, s.nbytes) for s in w.slots.values()}
    assert sorted(started) == sorted(slots) and len(started) == len(tensors)


def test_tied_weights_merged_once_and_kept_tied(model_dir, tmp_path):
    """A GPT-2 checkpoint that stores both wte and lm_head (older saves do): DARE must give both the same mask."""
    from safetensors.torch import save_file

    base = model_dir("gpt2")
    sd = state(base)
    assert "lm_head.weight" not in sd  # transformers saves the tie once
    folders = []
    for name, src in (("base", base), ("ft1", model_dir("gpt2", "ft1")), ("ft2", model_dir("gpt2", "ft2"))):
        folder = tmp_path / name
        folder.mkdir()
        s = state(src)
        s["lm_head.weight"] = s["transformer.wte.weight"].clone()
        save_file(s, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(open(os.path.join(src, "config.json")).read())
        folders.append(str(folder))
    res = hubsoup.merge(folders[1:], method="dare", base=folders[0], out=str(tmp_path / "o"), quiet=True, p=0.5)
    got = state(res.path)
    assert torch.equal(got["lm_head.weight"], got["transformer.wte.weight"])
    assert not torch.equal(got["transformer.wte.weight"], sd["transformer.wte.weight"])


def test_non_float_tensors_copied_from_base(model_dir, tmp_path):
    from safetensors.torch import save_file

    base = model_dir("bert")
    sd = state(base)
    sd["embeddings.position_ids"] = torch.arange(64).unsqueeze(0)
    b2 = tmp_path / "b"
    b2.mkdir()
    save_file(sd, str(b2 / "model.safetensors"), metadata={"format": "pt"})
    (b2 / "config.json").write_text(open(os.path.join(base, "config.json")).read())
    ft = make_finetune(str(b2), str(tmp_path / "ft"), seed=2)
    ftsd = load_file(os.path.join(ft, "model.safetensors"))
    ftsd["embeddings.position_ids"] = torch.arange(64).flip(0).unsqueeze(0)
    save_file(ftsd, os.path.join(ft, "model.safetensors"), metadata={"format": "pt"})
    res = hubsoup.merge([ft], method="task_arithmetic", base=str(b2), out=str(tmp_path / "o"), quiet=True, scale=1.0)
    assert torch.equal(state(res.path)["embeddings.position_ids"], sd["embeddings.position_ids"])


def test_prefixed_finetune_matches_bare_base(model_dir, tmp_path):
    """A BertForSequenceClassification save has 'bert.' keys and a classifier the base lacks."""
    from safetensors.torch import save_file

    base = model_dir("bert")
    ft = state(model_dir("bert", "ft1"))
    sd = {f"bert.{k}": v for k, v in ft.items()}
    sd["classifier.weight"] = torch.zeros(2, 32)
    folder = tmp_path / "cls"
    folder.mkdir()
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(open(os.path.join(base, "config.json")).read())
    with pytest.raises(hubsoup.HubsoupError, match="classifier.weight.*--ignore-extra"):
        hubsoup.merge([str(folder)], method="linear", base=base, out=str(tmp_path / "o"), quiet=True)
    res = hubsoup.merge([str(folder)], method="linear", base=base, out=str(tmp_path / "o"), quiet=True, ignore_extra=True)
    got = state(res.path)
    for k, v in ft.items():
        torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-6)


def test_base_resolved_from_input_cards(model_dir, tmp_path):
    base = model_dir("llama")
    fts = [make_finetune(base, str(tmp_path / f"ft{i}"), seed=i, base_model=base) for i in (1, 2)]
    res = hubsoup.merge(fts, method="linear", out=str(tmp_path / "o"), quiet=True)
    assert res.base.path == os.path.abspath(base)


def test_plan_cli(model_dir, capsys):
    from hubsoup.cli import main

    assert main(["plan", model_dir("t5")]) == 0
    out = capsys.readouterr().out
    assert "decoder.block.1" in out and "block 1/2 of decoder.block" in out
    assert out.index("encoder.block.0") < out.index("decoder.block.0")
