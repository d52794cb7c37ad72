"""LoRA adapters as inputs (peft's exact semantics), mixed merges, LoRA output, bad adapters."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import hubsoup
from hubsoup import errors
from hubsoup.sources.lora import LoraDelta
from hubsoup.testing import make_adapter

peft = pytest.importorskip("peft")
from peft import PeftModel  # noqa: E402

LOADERS = {"llama": "AutoModelForCausalLM", "gpt2": "AutoModelForCausalLM", "bert": "AutoModel"}


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def peft_merged(arch, base, adapter, bare=False):
    """What peft itself gives: PeftModel.from_pretrained(base, adapter).merge_and_unload()."""
    import transformers

    model = (transformers.LlamaModel if bare else getattr(transformers, LOADERS[arch])).from_pretrained(base)
    return PeftModel.from_pretrained(model, adapter).merge_and_unload().state_dict()


from method_helpers import state  # noqa: E402  (tests/ is on sys.path)


def merge(inputs, out, **kw):
    kw.setdefault("method", "linear")
    return hubsoup.merge(inputs, out=str(out), quiet=True, **kw)


def assert_no_output(tmp_path, name="out"):
    leftovers = [p for p in os.listdir(tmp_path) if p == name or p.startswith(f".{name}.partial")]
    assert leftovers == [], leftovers


def densify(arch, base, adapter, folder):
    """The adapter merged by peft and saved as a full fine-tune (the dense equivalent)."""
    import transformers

    model = getattr(transformers, LOADERS[arch]).from_pretrained(base)
    PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(str(folder))
    return str(folder)


# ---------------------------------------------------------------------------------------------
# 1. a single adapter, weight 1 == peft's merge_and_unload, tensor for tensor
# ---------------------------------------------------------------------------------------------
CASES = {
    "llama-plain-embedding-modules_to_save": ("llama", dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "embed_tokens"], modules_to_save=["lm_head"])),
    "llama-rslora-patterns": ("llama", dict(
        r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
        rank_pattern={"o_proj": 2, "layers.1.self_attn.q_proj": 6}, alpha_pattern={"down_proj": 3})),
    "llama-patterns": ("llama", dict(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "up_proj"],
        rank_pattern={"k_proj": 2}, alpha_pattern={"model.layers.0.mlp.up_proj": 5})),
    "llama-dora-embedding": ("llama", dict(
        r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj", "gate_proj", "embed_tokens"])),
    "llama-trainable-tokens": ("llama", dict(
        r=4, lora_alpha=8, target_modules=["q_proj"], trainable_token_indices=[3, 17, 42])),
    "gpt2-fan_in_fan_out": ("gpt2", dict(
        r=4, lora_alpha=8, fan_in_fan_out=True, target_modules=["c_attn", "c_proj", "c_fc", "wte"])),
    "gpt2-dora": ("gpt2", dict(r=4, lora_alpha=8, fan_in_fan_out=True, use_dora=True,
                               target_modules=["c_attn", "c_proj", "wte"])),
    "bert-bias_all-modules_to_save": ("bert", dict(
        r=4, lora_alpha=8, target_modules=["query", "value", "word_embeddings"], modules_to_save=["pooler.dense"],
        bias="all")),
    "bert-lora_bias": ("bert", dict(r=4, lora_alpha=16, target_modules=["query", "key", "dense"], lora_bias=True)),
    "bert-dora-rslora": ("bert", dict(r=4, lora_alpha=8, use_dora=True, use_rslora=True,
                                      target_modules=["query", "value", "intermediate.dense"])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_single_adapter_equals_peft_merge(case, model_dir, tmp_path):
    arch, cfg = CASES[case]
    base = model_dir(arch)
    adapter = make_adapter(tmp_path / "adapter", arch, **cfg)
    res = merge([adapter], tmp_path / "out", base=base)
    assert res.inputs[0].kind == "lora"
    got, want, before = state(res.path), peft_merged(arch, base, adapter), state(base)
    assert set(got) == set(before)
    changed = 0
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], rtol=1e-6, atol=1e-6, msg=lambda m: f"{k}: {m}")
        changed += not torch.equal(v, before[k])
    assert changed >= 3  # the adapter did something, and we reproduced it
    card = open(os.path.join(res.path, "README.md")).read()
    assert "LoRA adapter" in card


def test_adapter_of_bare_model_maps_onto_causal_lm_base(model_dir, tmp_path):
    """Adapter keys without the ``model.`` prefix (trained on LlamaModel) onto a LlamaForCausalLM base."""
    base = model_dir("llama")
    adapter = make_adapter(tmp_path / "adapter", "llama", model_cls="model", r=4, lora_alpha=8,
                           target_modules=["q_proj", "down_proj"])
    res = merge([adapter], tmp_path / "out", base=base)
    got, want = state(res.path), peft_merged("llama", base, adapter, bare=True)
    for k, v in want.items():
        torch.testing.assert_close(got[f"model.{k}"], v, rtol=1e-6, atol=1e-6)
    assert not torch.equal(got["model.layers.1.mlp.down_proj.weight"], state(base)["model.layers.1.mlp.down_proj.weight"])


def test_base_resolved_from_adapter_config(model_dir, tmp_path):
    base = model_dir("llama")
    adapter = make_adapter(tmp_path / "adapter", "llama", r=2, lora_alpha=2, target_modules=["q_proj"])
    cfg_path = os.path.join(adapter, "adapter_config.json")
    cfg = json.load(open(cfg_path))
    cfg["base_model_name_or_path"] = base
    json.dump(cfg, open(cfg_path, "w"))
    res = merge([adapter], tmp_path / "out")
    assert os.path.samefile(res.base.path, base)


# ---------------------------------------------------------------------------------------------
# 2. mixed inputs: a full fine-tune and a LoRA, every method == the same merge of dense equivalents
# ---------------------------------------------------------------------------------------------
METHODS = {
    "linear": {}, "task_arithmetic": {"scale": 0.5}, "ties": {"density": 0.3}, "ties-tensor": {"density": 0.5, "scope": "tensor"},
    "dare": {"p": 0.0}, "consensus": {"k": 1}, "slerp": {"t": 0.3}, "wise_ft": {"gamma": 0.6},
}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("mixed")
    base = model_dir("llama")
    full = model_dir("llama", "ft1")
    adapter = make_adapter(root / "adapter", "llama", seed=3, r=4, lora_alpha=8,
                           target_modules=["q_proj", "v_proj", "up_proj"], use_rslora=True)
    dense = densify("llama", base, adapter, root / "dense")
    return base, full, adapter, dense


@pytest.mark.parametrize("method", list(METHODS))
def test_mixed_full_and_lora_every_method(method, mixed, tmp_path):
    base, full, adapter, dense = mixed
    name = method.split("-")[0]
    params = METHODS[method]
    with_lora, with_dense = ([adapter], [dense]) if name == "wise_ft" else ([full, adapter], [full, dense])
    a = merge(with_lora, tmp_path / "lora", base=base, method=name, **params)
    b = merge(with_dense, tmp_path / "dense", base=base, method=name, **params)
    got, want = state(a.path), state(b.path)
    assert [r.kind for r in a.inputs] == ["lora"] * (name == "wise_ft") or [r.kind for r in a.inputs] == ["full", "lora"]
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=lambda m: f"{method} {k}: {m}")


def test_untouched_tensors_have_zero_task_vector(mixed, tmp_path):
    base, full, adapter, _ = mixed
    res = merge([full, adapter], tmp_path / "out", base=base, method="linear")
    got, b, f = state(res.path), state(base), state(full)
    k = "model.layers.0.self_attn.k_proj.weight"  # not adapted by the LoRA: (τ_full + 0) / 2
    torch.testing.assert_close(got[k], b[k] + (f[k] - b[k]) / 2, rtol=1e-6, atol=1e-6)


def test_linear_methods_on_loras_never_densify_inputs(model_dir, tmp_path, monkeypatch):
    """Low-rank path: task arithmetic of LoRAs works on factors; no input ΔW is materialised."""
    base = model_dir("llama")
    a1 = make_adapter(tmp_path / "a1", "llama", seed=1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    a2 = make_adapter(tmp_path / "a2", "llama", seed=2, r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"])
    dense = [densify("llama", base, a, tmp_path / f"dense{i}") for i, a in enumerate((a1, a2))]
    ref = merge(dense, tmp_path / "ref", base=base, method="task_arithmetic", scale=1.0)  # full inputs: dense path

    def boom(self, *a, **k):
        raise AssertionError("dense task vector materialised")

    monkeypatch.setattr(LoraDelta, "delta_into", boom)
    full = merge([a1, a2], tmp_path / "full", base=base, method="task_arithmetic", scale=1.0)
    lora = merge([a1, a2], tmp_path / "lora", base=base, method="task_arithmetic", scale=1.0,
                 output_format="lora", rank=6)
    assert lora.lora["factor_path_modules"] == lora.lora["lora_modules"] == 6
    got, want = state(full.path), state(ref.path)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# 3. LoRA output
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_loras(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("two")
    base = model_dir("llama")
    a1 = make_adapter(root / "a1", "llama", seed=1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"])
    a2 = make_adapter(root / "a2", "llama", seed=2, r=3, lora_alpha=6, use_rslora=True,
                      target_modules=["q_proj", "k_proj", "down_proj", "o_proj"])
    dense = merge([a1, a2], root / "dense", base=base, method="task_arithmetic", scale=0.7)
    return base, a1, a2, state(dense.path)


def load_lora_output(arch, base, folder):
    return peft_merged(arch, base, folder)


def test_lora_output_rank_sum_reproduces_dense_merge(two_loras, tmp_path):
    base, a1, a2, dense = two_loras
    res = merge([a1, a2], tmp_path / "out", base=base, method="task_arithmetic", scale=0.7,
                output_format="lora", rank=7)
    assert sorted(os.listdir(res.path)) == [".hubsoup", "README.md", "adapter_config.json", "adapter_model.safetensors",
                                           "hubsoup_lora_report.json", "hubsoup_recipe.yaml"]
    got = load_lora_output("llama", base, res.path)
    for k, v in dense.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    assert res.lora["aggregate_rel_error"] < 1e-5
    card = open(os.path.join(res.path, "README.md")).read()
    # a local base that names no Hub model: no base_model, so no relation (issue 32)
    assert "base_model_relation" not in card and "library_name: peft" in card
    assert "Relative Frobenius error" in card
    recipe = open(os.path.join(res.path, "hubsoup_recipe.yaml")).read()
    assert "format: lora" in recipe


def test_lora_output_truncation_error_is_the_optimal_one(two_loras, tmp_path):
    base, a1, a2, dense = two_loras
    res = merge([a1, a2], tmp_path / "out", base=base, method="task_arithmetic", scale=0.7,
                output_format="lora", rank=2)
    got, b = load_lora_output("llama", base, res.path), state(base)
    rows = {m["module"]: m for m in res.lora["modules"]}
    assert len(rows) == 10 and all(m["rank"] == 2 for m in rows.values())  # q, k, v, o, down in 2 layers
    discarded = total = 0.0
    for module, row in rows.items():
        k = f"{module}.weight"
        tau = dense[k].double() - b[k].double()
        s = torch.linalg.svdvals(tau)
        best = float((s[2:] ** 2).sum().sqrt() / tau.norm())  # Eckart-Young: what rank 2 can do at best
        measured = float((got[k].double() - dense[k].double()).norm() / tau.norm())
        assert row["rel_error"] == pytest.approx(best, rel=1e-4, abs=1e-6)
        assert measured == pytest.approx(best, rel=1e-3, abs=1e-5)
        discarded += float((s[2:] ** 2).sum())
        total += float((s ** 2).sum())
    assert res.lora["aggregate_rel_error"] == pytest.approx((discarded / total) ** 0.5, rel=1e-4)
    assert res.lora["aggregate_rel_error"] > 0.05  # rank 2 < 7 really truncates


def test_lora_output_energy_threshold(two_loras, tmp_path):
    base, a1, a2, dense = two_loras
    res = merge([a1, a2], tmp_path / "out", base=base, method="task_arithmetic", scale=0.7,
                output_format="lora", energy=0.9, rank=5)
    ranks = {m["module"]: m["rank"] for m in res.lora["modules"]}
    assert max(ranks.values()) <= 5 and len(set(ranks.values())) > 1
    for m in res.lora["modules"]:
        assert m["rel_error"] <= 0.1 ** 0.5 + 1e-9 or m["rank"] == 5
    cfg = json.load(open(os.path.join(res.path, "adapter_config.json")))
    got, b = load_lora_output("llama", base, res.path), state(base)  # rank_pattern loads in peft
    for m in res.lora["modules"]:
        k = f"{m['module']}.weight"
        tau = dense[k] - b[k]
        assert float((got[k] - dense[k]).norm() / tau.norm()) == pytest.approx(m["rel_error"], rel=1e-3, abs=1e-5)
    assert cfg["r"] == 5 and cfg["rank_pattern"]


def test_lora_output_of_mixed_merge_with_biases_and_norms(model_dir, tmp_path):
    """GPT-2: Conv1D orientation, embedding LoRAs, base_layer biases and modules_to_save for norms."""
    base = model_dir("gpt2")
    full = model_dir("gpt2", "ft1")
    adapter = make_adapter(tmp_path / "adapter", "gpt2", r=4, lora_alpha=8, fan_in_fan_out=True,
                           target_modules=["c_attn", "c_fc"])
    dense = merge([full, adapter], tmp_path / "dense", base=base, method="ties", density=0.5)
    res = merge([full, adapter], tmp_path / "out", base=base, method="ties", density=0.5,
                output_format="lora", rank=128)
    cfg = json.load(open(os.path.join(res.path, "adapter_config.json")))
    assert cfg["fan_in_fan_out"] and cfg["bias"] == "lora_only"
    assert "transformer.ln_f" in cfg["modules_to_save"] and "transformer.wte" in cfg["target_modules"]
    got = load_lora_output("gpt2", base, res.path)
    for k, v in state(dense.path).items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=2e-6, msg=lambda m: f"{k}: {m}")
    assert res.lora["aggregate_rel_error"] < 1e-5


def test_cli_lora_output(model_dir, tmp_path, capsys):
    from hubsoup.cli import main

    base = model_dir("llama")
    adapter = make_adapter(tmp_path / "adapter", "llama", r=2, lora_alpha=4, target_modules=["q_proj"])
    out = tmp_path / "out"
    rc = main(["merge", adapter, "--base", base, "--method", "linear", "--output-format", "lora", "--rank", "2",
               "--out", str(out), "-q"])
    assert rc == 0 and os.path.isfile(out / "adapter_model.safetensors")
    assert "as a LoRA adapter" in capsys.readouterr().out
    assert main(["merge", adapter, "--base", base, "--method", "linear", "--rank", "2", "--out",
                 str(tmp_path / "o2"), "-q"]) == 2
    assert "--output-format lora" in capsys.readouterr().err
    assert main(["merge", adapter, "--base", base, "--method", "linear", "--output-format", "lora",
                 "--out", str(tmp_path / "o3"), "-q"]) == 2


# ---------------------------------------------------------------------------------------------
# 4. bad adapters: a clear error naming the adapter and tensor, and no output
# ---------------------------------------------------------------------------------------------
@pytest.fixture()
def adapter(tmp_path):
    return make_adapter(tmp_path / "adapter", "llama", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def _rewrite(folder, fn, name="adapter_model.safetensors"):
    path = os.path.join(folder, name)
    sd = load_file(path)
    fn(sd)
    save_file(sd, path, metadata={"format": "pt"})


def _set_config(folder, **kv):
    path = os.path.join(folder, "adapter_config.json")
    cfg = json.load(open(path))
    cfg.update(kv)
    json.dump(cfg, open(path, "w"))


def test_adapter_for_a_different_base_shapes(model_dir, tmp_path):
    wide = make_adapter(tmp_path / "wide", "llama", model_kw={"hidden": 48}, r=4, lora_alpha=8,
                        target_modules=["q_proj"])
    with pytest.raises(errors.IncompatibleInputError, match=r"adapter '.*wide'.*q_proj.*\[48, 48\].*\[32, 32\].*different base"):
        merge([wide], tmp_path / "out", base=model_dir("llama"))
    assert_no_output(tmp_path)


def test_adapter_for_a_different_base_by_name(model_dir, tmp_path, adapter):
    cache_base = tmp_path / "hub" / "models--org--tiny-llama" / "snapshots" / "0123abc"
    shutil.copytree(model_dir("llama"), cache_base)
    _set_config(adapter, base_model_name_or_path="other-org/another-model")
    with pytest.raises(errors.BaseModelError, match="trained on 'other-org/another-model' but the merge's base is 'org/tiny-llama'"):
        merge([adapter], tmp_path / "out", base=str(cache_base))
    assert_no_output(tmp_path)
    _set_config(adapter, base_model_name_or_path="org/tiny-llama")  # same ID: fine
    merge([adapter], tmp_path / "out", base=str(cache_base))


def test_adapter_base_name_not_comparable_warns(model_dir, tmp_path, adapter, caplog):
    _set_config(adapter, base_model_name_or_path="some-org/some-model")
    with caplog.at_level("WARNING"):
        merge([adapter], tmp_path / "out", base=model_dir("llama"))
    assert "cannot check" in caplog.text


def test_adapter_target_modules_missing_in_base(model_dir, tmp_path):
    deep = make_adapter(tmp_path / "deep", "llama", model_kw={"layers": 3}, r=4, lora_alpha=8,
                        target_modules=["q_proj"])
    with pytest.raises(errors.IncompatibleInputError, match=r"adapts module 'model.layers.2.self_attn.q_proj'.*does not have"):
        merge([deep], tmp_path / "out", base=model_dir("llama"))
    assert_no_output(tmp_path)


def test_adapter_unknown_module_name(model_dir, tmp_path, adapter):
    def rename(sd):
        for k in [k for k in sd if "layers.1.self_attn.v_proj" in k]:
            sd[k.replace("v_proj", "w_proj")] = sd.pop(k)

    _rewrite(adapter, rename)
    with pytest.raises(errors.IncompatibleInputError, match="model.layers.1.self_attn.w_proj"):
        merge([adapter], tmp_path / "out", base=model_dir("llama"))
    assert_no_output(tmp_path)


def test_adapter_rank_mismatch_between_a_and_b(model_dir, tmp_path, adapter):
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    _rewrite(adapter, lambda sd: sd.__setitem__(key, sd[key][:, :3].contiguous()))
    with pytest.raises(errors.IncompatibleInputError,
                       match=r"module 'model.layers.0.self_attn.q_proj' has lora_A of rank 4 .* lora_B of rank 3"):
        merge([adapter], tmp_path / "out", base=model_dir("llama"))
    assert_no_output(tmp_path)


def test_adapter_rank_disagrees_with_config(model_dir, tmp_path, adapter):
    _set_config(adapter, r=8)
    with pytest.raises(errors.IncompatibleInputError, match="rank 4 but adapter_config.json says r=8"):
        merge([adapter], tmp_path / "out", base=model_dir("llama"))


def test_adapter_missing_weights_file(model_dir, tmp_path, adapter):
    os.remove(os.path.join(adapter, "adapter_model.safetensors"))
    with pytest.raises(errors.InputError, match=r"adapter '.*adapter'.*adapter_model.safetensors is missing"):
        merge([adapter], tmp_path / "out", base=model_dir("llama"))
    assert_no_output(tmp_path)


def test_adapter_missing_half_of_a_pair(model_dir, tmp_path, adapter):
    _rewrite(adapter, lambda sd: sd.pop("base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"))
    with pytest.raises(errors.IncompatibleInputError, match="v_proj' has lora_B but no lora_A"):
        merge([adapter], tmp_path / "out", base=model_dir("llama"))


def test_pickle_adapter_needs_allow_pickle(model_dir, tmp_path, adapter):
    sd = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    os.remove(os.path.join(adapter, "adapter_model.safetensors"))
    torch.save(sd, os.path.join(adapter, "adapter_model.bin"))
    with pytest.raises(errors.PickleRefusedError):
        merge([adapter], tmp_path / "out", base=model_dir("llama"))
    merge([adapter], tmp_path / "out", base=model_dir("llama"), allow_pickle=True)


def test_unsupported_adapter_types(model_dir, tmp_path):
    from peft import IA3Config, PromptTuningConfig

    ia3 = make_adapter(tmp_path / "ia3", "llama", config_cls=IA3Config, target_modules=["q_proj", "down_proj"],
                       feedforward_modules=["down_proj"])
    with pytest.raises(errors.UnsupportedAdapterError, match="IA3 adapter"):
        merge([ia3], tmp_path / "out", base=model_dir("llama"))
    prompt = make_adapter(tmp_path / "prompt", "llama", config_cls=PromptTuningConfig, task_type="CAUSAL_LM",
                          num_virtual_tokens=4)
    with pytest.raises(errors.UnsupportedAdapterError, match="prompt-tuning"):
        merge([prompt], tmp_path / "out", base=model_dir("llama"))
    assert_no_output(tmp_path)


def test_unsupported_lora_options(model_dir, tmp_path, adapter):
    _set_config(adapter, layer_replication=[[0, 2], [1, 2]])
    with pytest.raises(errors.UnsupportedAdapterError, match="layer_replication"):
        merge([adapter], tmp_path / "out", base=model_dir("llama"))
    _set_config(adapter, layer_replication=None, init_lora_weights="pissa")
    with pytest.raises(errors.UnsupportedAdapterError, match="modified base"):
        merge([adapter], tmp_path / "out", base=model_dir("llama"))
    assert_no_output(tmp_path)


def test_lora_on_a_tied_name_updates_the_shared_tensor(model_dir, tmp_path):
    """GPT-2 ties lm_head to wte (only wte is saved): a LoRA on lm_head (a Linear) changes wte, as in peft."""
    base = model_dir("gpt2")
    adapter = make_adapter(tmp_path / "adapter", "gpt2", r=4, lora_alpha=8, target_modules=["lm_head", "c_attn"],
                           fan_in_fan_out=True)
    res = merge([adapter], tmp_path / "out", base=base)
    got, want = state(res.path), peft_merged("gpt2", base, adapter)
    assert "lm_head.weight" not in got
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], rtol=1e-6, atol=1e-6, msg=lambda m: f"{k}: {m}")
    assert not torch.equal(got["transformer.wte.weight"], state(base)["transformer.wte.weight"])


# ---------------------------------------------------------------------------------------------
# 5. adapters on the (test) Hub
# ---------------------------------------------------------------------------------------------
def _fetched(hub, repo):
    return sorted({c["path"].rsplit("/", 1)[-1] for c in hub.calls("GET", rf"/{repo}/resolve/")
                   if c["path"].endswith((".safetensors", ".bin"))})


def test_hub_adapter_base_from_config_and_lora_output_card(hub, model_dir, tmp_path, adapter):
    hub.seed("alice/base", model_dir("llama"))
    _set_config(adapter, base_model_name_or_path="alice/base")
    hub.seed("alice/lora", adapter)
    res = hubsoup.merge(["alice/lora"], method="linear", out=str(tmp_path / "out"), quiet=True,
                        output_format="lora", rank=4)
    assert res.base.repo_id == "alice/base" and res.inputs[0].kind == "lora"
    assert _fetched(hub, "alice/lora") == ["adapter_model.safetensors"]
    card = open(os.path.join(res.path, "README.md")).read()
    assert "base_model:\n- alice/base" in card and "base_model_relation: adapter" in card
    assert json.load(open(os.path.join(res.path, "adapter_config.json")))["base_model_name_or_path"] == "alice/base"


def test_hub_adapter_of_another_base_fails_before_downloading(hub, model_dir, tmp_path, adapter):
    hub.seed("alice/base", model_dir("llama"))
    _set_config(adapter, base_model_name_or_path="bob/other-base")
    hub.seed("alice/lora", adapter)
    with pytest.raises(errors.BaseModelError, match="trained on 'bob/other-base' but the merge's base is 'alice/base'"):
        hubsoup.merge(["alice/lora"], method="linear", base="alice/base", out=str(tmp_path / "out"), quiet=True)
    assert _fetched(hub, "alice/lora") == []
    assert_no_output(tmp_path)
