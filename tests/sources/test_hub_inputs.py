"""Hub inputs: pinned to a commit SHA, metadata first, only the weight files needed."""

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import hubsoup
from hubsoup import errors
from hubsoup.sources import open_input
from hubsoup.testing import make_finetune, tiny_model


def weights_fetched(hub, repo):
    return sorted({c["path"].rsplit("/", 1)[-1] for c in hub.calls("GET", rf"/{repo}/resolve/")
                   if c["path"].endswith((".safetensors", ".bin"))})


def test_hub_inputs_pinned_and_only_needed_files(hub, model_dir, tmp_path):
    base = model_dir("llama")
    hub.seed("alice/base", base)
    # a sharded fine-tune whose repo also carries files a merge must not download
    ft = tmp_path / "ft"
    tiny_model("llama", seed=0).save_pretrained(ft, max_shard_size="20KB")
    for f in os.listdir(ft):
        if f.endswith(".safetensors"):
            sd = load_file(ft / f)
            save_file({k: v + 0.01 for k, v in sd.items()}, ft / f, metadata={"format": "pt"})
    (ft / "consolidated.safetensors").write_bytes(b"not needed")
    (ft / "pytorch_model.bin").write_bytes(b"not needed either")
    sha = hub.seed("alice/ft-sharded", str(ft))
    shards = sorted(f for f in os.listdir(ft) if f.startswith("model-"))

    res = hubsoup.merge(["alice/ft-sharded@main"], method="linear", base="alice/base",
                        out=str(tmp_path / "out"), quiet=True)
    assert res.inputs[0].sha == sha and res.inputs[0].revision == "main"
    assert res.base.sha == hub.head("alice/base")
    assert weights_fetched(hub, "alice/ft-sharded") == shards
    # every download was by commit SHA, never by the moving branch name
    gets = hub.calls("GET", r"/alice/ft-sharded/resolve/")
    assert gets and all(f"/resolve/{sha}/" in c["path"] for c in gets)
    got = load_file(os.path.join(res.path, "model.safetensors"))
    want = {}
    for f in shards:
        want.update(load_file(ft / f))
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-6)


def test_incompatible_hub_input_fails_before_downloading_weights(hub, model_dir, tmp_path):
    hub.seed("alice/base", model_dir("llama"))
    hub.seed("alice/gpt", model_dir("gpt2", "ft1"))
    with pytest.raises(errors.IncompatibleInputError, match="gpt2 model"):
        hubsoup.merge(["alice/gpt"], method="linear", base="alice/base", out=str(tmp_path / "o"), quiet=True)
    assert weights_fetched(hub, "alice/gpt") == []
    assert not (tmp_path / "o").exists()


def test_revision_by_sha_and_tag(hub, model_dir, tmp_path):
    base = model_dir("llama")
    old_sha = hub.seed("alice/ft", make_finetune(base, str(tmp_path / "v1"), seed=1))
    hub.seed("alice/ft", make_finetune(base, str(tmp_path / "v2"), seed=2))
    ck = open_input(f"alice/ft@{old_sha}")
    assert ck.ref.sha == old_sha
    old = load_file(str(tmp_path / "v1" / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(ck.tensor(name), old[name])
    assert open_input("alice/ft").ref.sha == hub.head("alice/ft") != old_sha


def test_hub_errors(hub, model_dir, tmp_path):
    hub.seed("alice/base", model_dir("llama"))
    with pytest.raises(errors.InputError, match="repo alice/nope not found"):
        open_input("alice/nope")
    with pytest.raises(errors.InputError, match="revision 'v9' not found in alice/base"):
        open_input("alice/base@v9")
    with pytest.raises(errors.InputError, match="not a valid Hub repo ID"):
        open_input("a/b/c/d")
