"""Untrusted input (issue 12): what a Hub repo, a card or a server may not make hubsoup do.

Each case runs the command line in-process (``hubsoup.cli.main``) against the test Hub where the
case is remote, and checks the exit code, the one-line message (no traceback), that nothing was
read or pushed that should not be, and that no partial output, lock or temporary folder is left.
"""

from __future__ import annotations

import builtins
import getpass
import json
import logging
import os
import shutil
import time

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import hubsoup
from hubsoup.cli import main
from hubsoup.testing import make_finetune, save_tiny_tokenizer, tiny_model, write_card_metadata

SECRET = "root:x:0:0:a line of a file of this machine that must never be read or pushed\n"


# ---- helpers ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zoo(model_dir, tmp_path_factory):
    """A tiny base and two fine-tunes whose cards name it as ``alice/base``."""
    root = tmp_path_factory.mktemp("sec-zoo")
    base = str(root / "base")
    shutil.copytree(model_dir("llama"), base)
    write_card_metadata(base, license="apache-2.0")
    fa = make_finetune(base, str(root / "ft-a"), seed=1, base_model="alice/base")
    fb = make_finetune(base, str(root / "ft-b"), seed=2, base_model="alice/base")
    return {"root": str(root), "base": base, "ft-a": fa, "ft-b": fb}


@pytest.fixture
def opened(monkeypatch):
    """The real path of every file opened from now on (Python's ``open`` and safetensors' ``safe_open``)."""
    import hubsoup.sources.checkpoint as checkpoint

    seen: list[str] = []
    real_open, real_safe_open = builtins.open, checkpoint.safe_open

    def rec_open(file, *a, **k):
        if isinstance(file, (str, bytes, os.PathLike)):
            seen.append(os.path.realpath(os.fsdecode(file)))
        return real_open(file, *a, **k)

    def rec_safe_open(path, *a, **k):
        seen.append(os.path.realpath(os.fsdecode(path)))
        return real_safe_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", rec_open)
    monkeypatch.setattr(checkpoint, "safe_open", rec_safe_open)
    return seen


def cli(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def one_line_error(err: str) -> str:
    """The CLI's error: exactly one line, ``error: ...``, and no traceback."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def assert_no_leftovers(parent, name):
    """No output ``name`` and no ``.name.partial-*`` / ``.name.lock`` / ``.name.old-*`` beside it."""
    left = [p for p in os.listdir(parent) if p == name or p.startswith(f".{name}.")]
    assert left == [], left


def snapshot(folder) -> dict[str, bytes]:
    out = {}
    for dirpath, _, names in os.walk(folder):
        for n in names:
            p = os.path.join(dirpath, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, folder)] = f.read()
    return out


def weights_fetched(hub, repo):
    return sorted({c["path"].rsplit("/", 1)[-1] for c in hub.calls("GET", rf"/{repo}/resolve/")
                   if c["path"].endswith((".safetensors", ".bin"))})


def tensor_names(folder) -> list[str]:
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        return list(f.keys())


def secret_weights(zoo, folder) -> str:
    """A valid fine-tune's weights outside every checkpoint: what the old code merged in and pushed."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "model.safetensors")
    shutil.copyfile(os.path.join(zoo["ft-b"], "model.safetensors"), path)
    return path


# ---- 1. every file a checkpoint names lies inside it --------------------------------------------


@pytest.mark.parametrize("how", ["absolute", "dotdot", "not-a-string"])
def test_hub_index_naming_a_file_outside_the_repo_is_refused(hub, zoo, tmp_path, capsys, opened, how):
    from huggingface_hub import constants

    secret = secret_weights(zoo, str(tmp_path / "private"))
    # where the snapshot will be (any commit: same depth), to climb out of it with ../
    snapshot_dir = os.path.join(constants.HF_HUB_CACHE, "models--alice--evil", "snapshots", "0" * 40)
    entry = {"absolute": secret, "dotdot": os.path.relpath(secret, snapshot_dir), "not-a-string": 7}[how]
    index = {"metadata": {}, "weight_map": {n: entry for n in tensor_names(zoo["ft-a"])}}
    with open(os.path.join(zoo["base"], "config.json"), encoding="utf-8") as f:
        config = f.read()
    hub.seed("alice/base", zoo["base"])
    hub.seed("alice/evil", {"config.json": config, "model.safetensors.index.json": json.dumps(index),
                            "README.md": "---\nbase_model: alice/base\n---\n"})
    hub.login("alice")
    opened.clear()
    rc, _, err = cli(capsys, "merge", "alice/evil", "--base", "alice/base", "--method", "linear",
                     "--out", tmp_path / "soup", "--push", "alice/soup")
    line = one_line_error(err)
    assert rc == 2
    assert "input 'alice/evil@" in line and "model.safetensors.index.json" in line and repr(entry) in line
    assert "refused" in line
    assert os.path.realpath(secret) not in opened  # never opened, let alone merged
    assert not hub.exists("alice/soup")  # nothing pushed
    assert_no_leftovers(tmp_path, "soup")


@pytest.mark.parametrize("how", ["linked-weights", "index-dotdot", "index-absolute", "linked-folder"])
def test_local_folder_naming_a_file_outside_is_refused(zoo, tmp_path, capsys, opened, how):
    secret = secret_weights(zoo, str(tmp_path / "private"))
    ft = tmp_path / "ft"
    shutil.copytree(zoo["ft-a"], ft)
    os.remove(ft / "model.safetensors")
    names = tensor_names(zoo["ft-a"])
    if how == "linked-weights":  # e.g. a git clone whose weights are a symlink to a file of this machine
        os.symlink(secret, ft / "model.safetensors")
        entry = "model.safetensors"
    elif how == "linked-folder":
        os.symlink(os.path.dirname(secret), ft / "weights")
        entry = "weights/model.safetensors"
        (ft / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: entry for n in names}}))
    else:
        entry = "../private/model.safetensors" if how == "index-dotdot" else secret
        (ft / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: entry for n in names}}))

    opened.clear()
    rc, _, err = cli(capsys, "merge", ft, "--base", zoo["base"], "--method", "linear", "--out", tmp_path / "soup")
    line = one_line_error(err)
    assert rc == 2 and f"input '{ft}'" in line and repr(entry) in line and "refused" in line
    assert os.path.realpath(secret) not in opened
    assert_no_leftovers(tmp_path, "soup")


def test_hub_cache_links_are_inside_but_not_into_another_repo(hub, zoo, tmp_path, capsys):
    hub.seed("alice/ft-a", zoo["ft-a"])
    hub.seed("alice/ft-b", zoo["ft-b"])
    from hubsoup.sources.access import scope

    with scope(cache_inputs=True):  # downloaded (not read in place): the snapshot's files are links into ../../blobs
        a, b = hubsoup.sources.open_input("alice/ft-a"), hubsoup.sources.open_input("alice/ft-b")
        a.keys(), b.keys()
    assert os.path.islink(os.path.join(a.folder, "model.safetensors"))
    # the snapshot folder given as a local folder is fine: its links stay in models--alice--ft-a
    local = hubsoup.sources.open_input(a.folder)
    assert local.keys() == a.keys() and local.ref.digest

    # a snapshot whose link was pointed into another repo's blobs is not (this commit's snapshot is ours alone)
    link = os.path.join(a.folder, "model.safetensors")
    target = os.path.realpath(os.path.join(b.folder, "model.safetensors"))
    os.remove(link)
    os.symlink(target, link)
    rc, _, err = cli(capsys, "merge", a.folder, "--base", zoo["base"], "--method", "linear",
                     "--out", tmp_path / "soup")
    line = one_line_error(err)
    assert rc == 2 and "'model.safetensors'" in line and "outside the checkpoint's folder" in line
    assert_no_leftovers(tmp_path, "soup")


def test_base_tokenizer_linking_out_is_neither_copied_nor_pushed(hub, zoo, tmp_path, capsys, opened):
    secret = tmp_path / "passwd"
    secret.write_text(SECRET)
    base = tmp_path / "base"
    shutil.copytree(zoo["base"], base)
    os.symlink(secret, base / "tokenizer.json")
    hub.login("alice")
    opened.clear()
    rc, _, err = cli(capsys, "merge", zoo["ft-a"], "--base", base, "--method", "linear",
                     "--out", tmp_path / "soup", "--push", "alice/soup")
    line = one_line_error(err)
    assert rc == 2 and f"base '{base}'" in line and "'tokenizer.json'" in line and "outside" in line
    assert str(secret) not in opened and os.path.realpath(secret) not in opened
    assert not hub.exists("alice/soup")
    assert_no_leftovers(tmp_path, "soup")


# ---- 2. a remote card names a Hub repo as the base, never a local folder ------------------------


@pytest.mark.parametrize("how", ["absolute", "relative", "home"])
def test_hub_card_cannot_choose_a_local_base(hub, zoo, tmp_path, capsys, opened, monkeypatch, how):
    monkeypatch.chdir(zoo["root"])  # where ./base is a folder
    claim = {"absolute": zoo["base"], "relative": "./base", "home": "~/base"}[how]
    ft = make_finetune(zoo["base"], str(tmp_path / "ft"), seed=3, base_model=claim)
    hub.seed("alice/ft", ft)
    hub.login("alice")
    opened.clear()
    rc, _, err = cli(capsys, "merge", "alice/ft", "--method", "linear", "--out", tmp_path / "soup",
                     "--push", "alice/soup")
    line = one_line_error(err)
    assert rc == 2 and "input 'alice/ft@" in line and repr(claim) in line and "not a Hub repo ID" in line
    assert not [p for p in opened if p.startswith(os.path.realpath(zoo["base"]) + os.sep)]
    assert not hub.exists("alice/soup")
    assert_no_leftovers(tmp_path, "soup")


def test_hub_card_naming_a_bare_id_looks_only_on_the_hub(hub, zoo, tmp_path, capsys, opened, monkeypatch):
    monkeypatch.chdir(zoo["root"])  # a folder ./base exists here, but the card means the Hub repo `base`
    ft = make_finetune(zoo["base"], str(tmp_path / "ft"), seed=3, base_model="base")
    hub.seed("alice/ft", ft)
    opened.clear()
    rc, _, err = cli(capsys, "merge", "alice/ft", "--method", "linear", "--out", tmp_path / "soup")
    line = one_line_error(err)
    assert rc == 2 and "base 'base'" in line and "not found" in line
    assert not [p for p in opened if p.startswith(os.path.realpath(zoo["base"]) + os.sep)]
    assert_no_leftovers(tmp_path, "soup")


def test_hub_adapter_cannot_choose_a_local_base(hub, zoo, tmp_path, capsys, opened):
    peft = pytest.importorskip("peft")
    model = tiny_model("llama")
    pm = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=2, target_modules=["q_proj"]))
    adapter = tmp_path / "adapter"
    pm.save_pretrained(str(adapter))
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = zoo["base"]
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    (adapter / "README.md").unlink(missing_ok=True)
    hub.seed("alice/lora", str(adapter))
    opened.clear()
    rc, _, err = cli(capsys, "merge", "alice/lora", "--method", "linear", "--out", tmp_path / "soup")
    line = one_line_error(err)
    assert rc == 2 and "input 'alice/lora@" in line and repr(zoo["base"]) in line and "not a Hub repo ID" in line
    assert not [p for p in opened if p.startswith(os.path.realpath(zoo["base"]) + os.sep)]
    assert_no_leftovers(tmp_path, "soup")
    # the user's own --base, and a local input's card, may still name a local folder
    ft = make_finetune(zoo["base"], str(tmp_path / "ft"), seed=4, base_model=zoo["base"])
    assert cli(capsys, "merge", ft, "--method", "linear", "--out", tmp_path / "local", "-q")[0] == 0
    assert cli(capsys, "merge", "alice/lora", "--base", zoo["base"], "--method", "linear",
               "--out", tmp_path / "given", "-q")[0] == 0


# ---- 5. nothing local goes to the Hub -----------------------------------------------------------


@pytest.mark.parametrize("fmt", ["full", "lora"])
def test_nothing_local_is_pushed(hub, model_dir, tmp_path, capsys, monkeypatch, fmt):
    work = tmp_path / "work"
    base = str(work / "base")
    shutil.copytree(model_dir("llama"), base)
    save_tiny_tokenizer(base)
    fa = make_finetune(base, str(work / "ft-a"), seed=1)
    fb = make_finetune(base, str(work / "ft-b"), seed=2)
    data = work / "wiki.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(f"w{(i * 7 + j) % 100}" for j in range(12))}) + "\n"
                            for i in range(6)))
    out = work / "soup"
    hub.login("alice")
    args = ["merge", fa, fb, "--base", base, "--method", "dare", "-p", "p=0.5", "--out", out,
            "--push", "alice/soup", "-q"]
    args += (["--eval", f"perplexity:{data},text=text,max_length=16", "--eval-limit", "4"] if fmt == "full"
             else ["--output-format", "lora", "--rank", "4"])
    rc, _, err = cli(capsys, *args)
    assert rc == 0, err

    pushed = hub.files("alice/soup")
    needles = {str(tmp_path), os.path.realpath(tmp_path), getpass.getuser()}
    home = os.path.expanduser("~")
    if len(home) > 1:
        needles.add(home + "/")
    for name, content in pushed.items():
        blobs = [content]
        if name.endswith(".safetensors"):  # the header (and its __metadata__): the tensor bytes cannot hold text
            n = int.from_bytes(content[:8], "little")
            blobs = [content[8:8 + n]]
        for needle in needles:
            assert all(needle.encode() not in b for b in blobs), (name, needle)

    # the local recipe keeps the paths (hubsoup run); what was pushed names the folders; same hash
    local = yaml.safe_load((out / "hubsoup_recipe.yaml").read_text())
    remote = yaml.safe_load(pushed["hubsoup_recipe.yaml"])
    assert [i["path"] for i in local["inputs"]] == [fa, fb] and local["base"]["path"] == base
    assert [i["name"] for i in remote["inputs"]] == ["ft-a", "ft-b"] and remote["base"]["name"] == "base"
    assert all(len(i["digest"]) == 16 for i in remote["inputs"])
    assert remote["inputs"][0]["digest"] != remote["inputs"][1]["digest"]
    assert remote["hash"] == local["hash"]
    weights = "model.safetensors" if fmt == "full" else "adapter_model.safetensors"
    with safe_open(str(out / weights), "pt") as f:
        meta = json.loads(f.metadata()["hubsoup_recipe"])
    assert meta == remote
    card = pushed["README.md"].decode()
    assert "`ft-a` `sha256:" in card
    if fmt == "full":
        assert "wiki.jsonl@sha256:" in pushed["eval_results.json"].decode()  # the data by name and content hash
        meta = yaml.safe_load(card.split("---\n")[1])  # the model-index: a local file is no dataset type
        rows = meta["model-index"][0]["results"]  # the task's name, never the file
        assert [r["dataset"]["type"] for r in rows] == [r["dataset"]["name"] for r in rows]
    else:
        # the folder name peft can load (run beside it), never the path; its digest is in the card (issue 32)
        assert json.loads(pushed["adapter_config.json"])["base_model_name_or_path"] == "base"

    # pushing again is idempotent: the same public bytes, no new commit
    head = hub.head("alice/soup")
    assert cli(capsys, "push", out, "alice/soup")[0] == 0
    assert hub.head("alice/soup") == head
    # and the local recipe still repeats the merge
    if fmt == "full":
        again = hubsoup.run_recipe(str(out), str(work / "again"), quiet=True)
        assert again.recipe.hash == local["hash"]


@pytest.mark.parametrize("how", ["text-file", "safetensors-header", "link-out"])
def test_push_refuses_what_would_still_publish_a_local_path(hub, zoo, tmp_path, capsys, monkeypatch, how):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    res = hubsoup.merge([zoo["ft-a"]], method="linear", base=zoo["base"], out=str(tmp_path / "soup"), quiet=True)
    if how == "text-file":  # something hubsoup does not know about, holding a path of this user
        (tmp_path / "soup" / "notes.txt").write_text(f"trained from {tmp_path / 'home'}/runs/7\n")
        culprit = "notes.txt holds a local path"
    elif how == "safetensors-header":  # an output of an older hubsoup: its metadata recipe has the paths
        path = os.path.join(res.path, "model.safetensors")
        save_file(load_file(path), path, metadata={"format": "pt", "hubsoup_recipe": json.dumps(res.recipe.to_dict())})
        culprit = "model.safetensors holds a local path"
    else:
        secret = tmp_path / "passwd"
        secret.write_text(SECRET)
        os.symlink(secret, tmp_path / "soup" / "vocab.txt")
        culprit = "vocab.txt is a link to a file outside the folder"
    hub.login("alice")
    rc, _, err = cli(capsys, "push", res.path, "alice/soup")
    line = one_line_error(err)
    assert rc == 2 and f"push of '{res.path}' to alice/soup refused: {culprit}" in line
    assert not hub.exists("alice/soup")  # nothing was sent, not even the repo creation


def test_a_published_recipe_does_not_pretend_to_know_local_inputs(zoo, tmp_path, capsys):
    res = hubsoup.merge([zoo["ft-a"]], method="linear", base=zoo["base"], out=str(tmp_path / "soup"), quiet=True)
    public = tmp_path / "public.yaml"
    public.write_text(res.recipe.public_yaml())
    rc, _, err = cli(capsys, "run", public, "--out", tmp_path / "again")
    line = one_line_error(err)
    assert rc == 2 and "was a local folder" in line and str(zoo["root"]) not in line
    assert_no_leftovers(tmp_path, "again")


# ---- 6. a server that stops answering -----------------------------------------------------------


@pytest.fixture
def soup(zoo, tmp_path):
    return hubsoup.merge([zoo["ft-a"], zoo["ft-b"]], method="linear", base=zoo["base"],
                         out=str(tmp_path / "soup"), quiet=True)


def test_push_to_a_server_that_stops_answering_ends(hub, soup, capsys, monkeypatch):
    monkeypatch.setenv("HUBSOUP_HUB_TIMEOUT", "1")
    hub.login("alice")
    before = snapshot(soup.path)
    hub.fail_commits(1, hang=25)
    t0 = time.monotonic()
    rc, _, err = cli(capsys, "push", soup.path, "alice/soup")
    took = time.monotonic() - t0
    line = one_line_error(err)
    assert rc == 2 and took < 15, took
    assert "did not answer within 1s (timed out" in line
    assert line.endswith(f"retry with: hubsoup push {soup.path} alice/soup")
    assert len(hub.history("alice/soup")) == 1  # created; nothing committed
    after = snapshot(soup.path)
    assert after.pop("README.md") != before.pop("README.md")  # only its "how to use" now names the repo
    assert after == before
    assert cli(capsys, "push", soup.path, "alice/soup")[0] == 0  # the retry goes through
    assert len(hub.history("alice/soup")) == 2


def test_input_from_a_server_that_stops_answering_ends(hub, zoo, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HUBSOUP_HUB_TIMEOUT", "1")
    hub.seed("alice/base", zoo["base"])
    hub.seed("alice/ft-a", zoo["ft-a"])
    hub.fail_next(1, method="GET", path=r"^/api/models/alice/ft-a", hang=25)
    t0 = time.monotonic()
    rc, _, err = cli(capsys, "merge", "alice/ft-a", "--base", "alice/base", "--method", "linear",
                     "--out", tmp_path / "soup")
    took = time.monotonic() - t0
    line = one_line_error(err)
    assert rc == 2 and took < 15, took
    assert "input 'alice/ft-a'" in line and "did not answer within 1s (timed out" in line
    assert_no_leftovers(tmp_path, "soup")


# ---- 7. overwrite, quantized, duplicates, pickle-only, server errors ----------------------------


def test_overwrite_never_deletes_an_input_or_the_base(zoo, tmp_path, capsys):
    work = tmp_path / "work"
    for name in ("base", "ft-a", "ft-b"):
        shutil.copytree(zoo[name], work / name)
    before = snapshot(work)
    for out in (work / "ft-a", work / "base", work):  # model folders: hubsoup did not make them (issue 44)
        rc, _, err = cli(capsys, "merge", work / "ft-a", work / "ft-b", "--base", work / "base",
                         "--method", "linear", "--out", out, "--overwrite")
        line = one_line_error(err)
        assert rc == 2 and "hubsoup did not make it" in line, line
        assert snapshot(work) == before
    from hubsoup.output.folder import write_marker

    for name in ("ft-a", "base", ""):  # even folders hubsoup made (an earlier merge as an input)
        write_marker(str(work / name), "merge")
    before = snapshot(work)
    for out, what in ((work / "ft-a", "is input"), (work / "base", "is the base"), (work, "contains")):
        rc, _, err = cli(capsys, "merge", work / "ft-a", work / "ft-b", "--base", work / "base",
                         "--method", "linear", "--out", out, "--overwrite")
        line = one_line_error(err)
        assert rc == 2 and what in line and "would delete it" in line, line
        assert snapshot(work) == before
        assert not [p for p in os.listdir(out.parent) if p.startswith(f".{out.name}.")]


def test_quantized_input_is_refused(zoo, tmp_path, capsys):
    ft = tmp_path / "ft"
    shutil.copytree(zoo["ft-a"], ft)
    sd = load_file(ft / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    sd[name] = (sd[name] * 100).round().clamp(-127, 127).to(torch.int8)
    save_file(sd, ft / "model.safetensors", metadata={"format": "pt"})
    rc, _, err = cli(capsys, "merge", ft, "--base", zoo["base"], "--method", "linear", "--out", tmp_path / "soup")
    line = one_line_error(err)
    assert rc == 2 and f"tensor '{name}' is int8" in line and "quantized checkpoint?" in line
    assert_no_leftovers(tmp_path, "soup")

    cfg = json.loads((ft / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    (ft / "config.json").write_text(json.dumps(cfg))
    rc, _, err = cli(capsys, "merge", ft, "--base", zoo["base"], "--method", "linear", "--out", tmp_path / "soup")
    line = one_line_error(err)
    assert rc == 2 and "quantized (bitsandbytes" in line and "quantized checkpoint?" in line
    assert_no_leftovers(tmp_path, "soup")


def test_the_same_input_twice_warns(zoo, tmp_path, capsys, caplog):
    caplog.set_level(logging.WARNING)
    rc, _, err = cli(capsys, "merge", zoo["ft-a"], zoo["ft-a"] + "/", zoo["ft-b"], "--base", zoo["base"],
                     "--method", "linear", "--out", tmp_path / "soup", "-q")
    assert rc == 0, err
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("given twice" in m and "ft-a" in m for m in warned), warned


def test_pickle_only_hub_repo_gets_the_pickle_message(hub, zoo, tmp_path, capsys):
    ft = tmp_path / "ft"
    shutil.copytree(zoo["ft-a"], ft)
    torch.save(load_file(ft / "model.safetensors"), ft / "pytorch_model.bin")
    os.remove(ft / "model.safetensors")
    hub.seed("alice/base", zoo["base"])
    hub.seed("alice/pickled", str(ft))
    rc, _, err = cli(capsys, "merge", "alice/pickled", "--method", "linear", "--out", tmp_path / "soup")
    line = one_line_error(err)
    assert rc == 2 and "only pickle weights" in line and "--allow-pickle" in line and "no weights found" not in line
    assert weights_fetched(hub, "alice/pickled") == []  # nothing of it was downloaded
    assert_no_leftovers(tmp_path, "soup")
    assert cli(capsys, "merge", "alice/pickled", "--method", "linear", "--out", tmp_path / "soup",
               "--allow-pickle", "-q")[0] == 0


def test_persistent_server_error_on_download_is_a_server_error(hub, zoo, tmp_path, capsys, monkeypatch):
    import types

    import huggingface_hub.utils._http as http

    # huggingface_hub retries a 5xx 5 times, 23 s of backoff in all: the test skips the waiting only
    monkeypatch.setattr(http, "time", types.SimpleNamespace(sleep=lambda s: None))
    hub.seed("alice/base", zoo["base"])
    hub.seed("alice/ft-a", zoo["ft-a"])
    hub.fail_next(1000, status=503, path=r"/alice/ft-a/resolve/")
    rc, _, err = cli(capsys, "merge", "alice/ft-a", "--base", "alice/base", "--method", "linear",
                     "--out", tmp_path / "soup")
    line = one_line_error(err)
    assert rc == 2 and "Hub server error 503" in line and "offline" not in line and "alice/ft-a" in line
    hub.clear_failures()
    assert_no_leftovers(tmp_path, "soup")


# ---- 8. the token is never printed --------------------------------------------------------------


def test_token_is_never_printed_even_when_echoed(hub, zoo, soup, tmp_path, capsys, caplog):
    token = hub.login("alice")
    shaped = "hf_" + "Q" * 34  # a token-shaped string that is not the one in use
    caplog.set_level(logging.DEBUG)
    hub.fail_commits(1, status=500, message=f"cannot commit for {token} ({shaped})")
    rc, out, err = cli(capsys, "-v", "push", soup.path, "alice/soup")
    assert rc == 2 and "Hub server error 500" in err and "***" in err
    hub.seed("alice/ft-a", zoo["ft-a"])
    hub.fail_next(1, status=400, method="GET", path=r"^/api/models/alice/ft-a", message=f"bad token {token}")
    rc2, out2, err2 = cli(capsys, "-v", "merge", "alice/ft-a", "--base", zoo["base"], "--method", "linear",
                          "--out", tmp_path / "x")
    assert rc2 == 2 and "HTTP 400 (bad token ***)" in err2
    # -v installed the filter on the log handlers: an Authorization header never reaches them either
    logging.getLogger("httpx2").debug("request headers: {'authorization': 'Bearer %s'}", token)
    logging.getLogger("huggingface_hub").warning("echo: %s", shaped)
    for text in (out, err, out2, err2, caplog.text):
        assert token not in text and shaped not in text
    assert_no_leftovers(tmp_path, "x")
