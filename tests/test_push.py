"""The Hub round trip against the local test Hub: inputs from repos, merge, push, load back."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil

import pytest
import torch
import yaml
from huggingface_hub import EvalResult, ModelCard
from safetensors.torch import load_file

import hubsoup
from hubsoup.cli import main
from hubsoup.errors import InputError, PushError
from hubsoup.hub import check_repo_id, push_folder
from hubsoup.recipe import public_recipe_yaml
from hubsoup.testing import make_finetune, write_card_metadata

COMMIT_LINE = re.compile(r"pushed to (\S+): (\S+/commit/([0-9a-f]{40}))")


@pytest.fixture(scope="module")
def zoo(model_dir, tmp_path_factory):
    """A licensed tiny base, two fine-tunes whose cards name it, and a later version of ft-a."""
    root = tmp_path_factory.mktemp("push-zoo")
    base = str(root / "base")
    shutil.copytree(model_dir("llama"), base)
    write_card_metadata(base, license="apache-2.0")
    fa = make_finetune(base, str(root / "ft-a"), seed=1)
    write_card_metadata(fa, base_model="alice/base", license="apache-2.0")
    fb = make_finetune(base, str(root / "ft-b"), seed=2, base_model="alice/base")
    fa2 = make_finetune(base, str(root / "ft-a-v2"), seed=3, base_model="alice/base")
    return {"base": base, "ft-a": fa, "ft-b": fb, "ft-a-v2": fa2}


def publish(hub, zoo, names=("base", "ft-a", "ft-b"), private=False) -> dict[str, str]:
    """Upload the zoo as alice/<name>; returns each repo's commit SHA."""
    api = hub.api("alice")
    shas = {}
    for name in names:
        api.create_repo(f"alice/{name}", private=private)
        shas[name] = api.upload_folder(repo_id=f"alice/{name}", folder_path=zoo[name]).oid
    return shas


def tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    return out


def local_files(folder) -> dict[str, bytes]:
    """What a push uploads of ``folder``: its files but hubsoup's marker (``.hubsoup``, local only: issue 44)."""
    out = {}
    for dirpath, _, names in os.walk(folder):
        for n in names:
            if n == ".hubsoup":
                continue
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, folder)] = open(p, "rb").read()
    return out


def assert_same_as_hub(hub, repo_id, folder):
    remote = hub.files(repo_id)
    remote.pop(".gitattributes", None)
    local = local_files(folder)
    if "hubsoup_recipe.yaml" in local:  # uploaded without local paths; the local one keeps them (issue 12)
        local["hubsoup_recipe.yaml"] = public_recipe_yaml(local["hubsoup_recipe.yaml"].decode()).encode()
    assert remote == local


# ---- the round trip ---------------------------------------------------------------------------


def test_merge_push_round_trip(hub, zoo, tmp_path, monkeypatch, capsys):
    import transformers

    shas = publish(hub, zoo)
    hub.login("alice")
    monkeypatch.chdir(tmp_path)
    rc = main(["merge", "alice/ft-a", "alice/ft-b", "--method", "ties", "--param", "density=0.5",
               "--push", "soup-org/soup", "-q"])
    out = capsys.readouterr().out
    assert rc == 0, out
    # streamed to the Hub: nothing on the local disk (a local copy only with --out)
    assert [p for p in os.listdir(tmp_path) if "soup" in p] == []
    repo, url, sha = COMMIT_LINE.search(out).groups()
    assert repo == "soup-org/soup" and url == f"{hub.endpoint}/soup-org/soup/commit/{sha}"
    assert sha == hub.head("soup-org/soup")
    assert [c.title for c in hub.history("soup-org/soup")] == ["Upload ties merge made with hubsoup",
                                                               "initial commit"]  # one commit
    # the same merge with --out: the same files (the local card loads the repo too)
    local = tmp_path / "soup"
    rc = main(["merge", "alice/ft-a", "alice/ft-b", "--method", "ties", "--param", "density=0.5", "--out", "soup", "-q"])
    assert rc == 0
    capsys.readouterr()
    from hubsoup.hub import retarget_card

    retarget_card(str(local), "soup-org/soup")
    assert_same_as_hub(hub, "soup-org/soup", local)
    assert {"model.safetensors", "config.json", "README.md", "hubsoup_recipe.yaml"} <= set(os.listdir(local))

    # the model loads from the Hub and equals the local output, tensor for tensor
    remote = transformers.AutoModel.from_pretrained("soup-org/soup").state_dict()
    here = transformers.AutoModel.from_pretrained(str(local)).state_dict()
    assert remote.keys() == here.keys()
    assert all(torch.equal(remote[k], here[k]) for k in here)
    merged, base = tensors(local), tensors(zoo["base"])
    assert any(not torch.equal(merged[k], base[k]) for k in base)

    card = ModelCard.load("soup-org/soup")
    d = card.data
    assert d.base_model == ["alice/ft-a", "alice/ft-b"] and d.base_model_relation == "merge"
    assert d.library_name == "transformers" and d.tags == ["merge", "hubsoup", "ties"]
    assert d.license == "apache-2.0"
    assert 'AutoModelForCausalLM.from_pretrained("soup-org/soup")' in card.text and str(local) not in card.text
    assert d.pipeline_tag == "text-generation"
    for name in ("base", "ft-a", "ft-b"):
        assert shas[name] in card.text
    info = hub.api().model_info("soup-org/soup")
    assert info.card_data.base_model == ["alice/ft-a", "alice/ft-b"] and info.library_name == "transformers"

    # the recorded input SHAs are the inputs' actual commits; the base came from their cards
    recipe = yaml.safe_load(hub.files("soup-org/soup")["hubsoup_recipe.yaml"])
    assert [(i["repo_id"], i["sha"]) for i in recipe["inputs"]] == [("alice/ft-a", shas["ft-a"]),
                                                                   ("alice/ft-b", shas["ft-b"])]
    assert (recipe["base"]["repo_id"], recipe["base"]["sha"]) == ("alice/base", shas["base"])
    assert hub.calls("POST", r"^/api/validate-yaml$")[-1]["status"] == 200


def test_pinned_sha_uses_the_old_weights(hub, zoo, tmp_path):
    shas = publish(hub, zoo)
    newer = hub.api("alice").upload_folder(repo_id="alice/ft-a", folder_path=zoo["ft-a-v2"]).oid
    old = shas["ft-a"]
    assert newer != old and hub.head("alice/ft-a") == newer

    pinned = hubsoup.merge([f"alice/ft-a@{old}", "alice/ft-b"], method="ties", out=str(tmp_path / "pinned"),
                           quiet=True)
    latest = hubsoup.merge(["alice/ft-a", "alice/ft-b"], method="ties", out=str(tmp_path / "latest"), quiet=True)
    by_hand = hubsoup.merge([zoo["ft-a"], zoo["ft-b"]], method="ties", base=zoo["base"],
                            out=str(tmp_path / "by-hand"), quiet=True)
    assert (pinned.inputs[0].revision, pinned.inputs[0].sha) == (old, old)
    assert latest.inputs[0].sha == newer and latest.inputs[0].revision is None
    got, want, new = tensors(pinned.path), tensors(by_hand.path), tensors(latest.path)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)  # the old ft-a's weights, exactly
    assert any(not torch.equal(got[k], new[k]) for k in want)


def test_push_to_hub_python_api_with_eval_results(hub, zoo, tmp_path):
    publish(hub, zoo)
    result = hubsoup.merge(["alice/ft-a", "alice/ft-b"], method="linear", out=str(tmp_path / "soup"), quiet=True)
    results = [EvalResult(task_type="text-generation", dataset_type="wikitext", dataset_name="WikiText-2",
                          dataset_split="test", metric_type="perplexity", metric_value=12.5)]
    info = result.push_to_hub("alice/soup", private=True, eval_results=results, token=hub.token("alice"),
                              commit_message="My soup")
    assert info.oid == hub.head("alice/soup") and info.pr_url is None
    assert hub.history("alice/soup")[0].title == "My soup"
    api = hub.api("alice")
    assert api.model_info("alice/soup").private is True
    card = ModelCard.load("alice/soup", token=hub.token("alice"))
    assert card.data.eval_results == results and card.data.model_name == "soup"
    assert "| text-generation | WikiText-2 | test | perplexity | 12.5 |" in card.text
    assert 'from_pretrained("alice/soup")' in card.text
    assert_same_as_hub(hub, "alice/soup", result.path)  # the folder holds the card that was pushed


# ---- inputs that cannot be read -----------------------------------------------------------------


def test_input_repo_not_found(hub, zoo, tmp_path, capsys):
    publish(hub, zoo, names=("base", "ft-b"))
    rc = main(["merge", "alice/ft-nope", "alice/ft-b", "--method", "ties", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "input 'alice/ft-nope': repo alice/ft-nope not found" in err
    assert not (tmp_path / "o").exists()


def test_input_revision_not_found(hub, zoo, tmp_path):
    publish(hub, zoo)
    with pytest.raises(InputError, match=r"revision 'no-such-rev' not found in alice/ft-a"):
        hubsoup.merge(["alice/ft-a@no-such-rev", "alice/ft-b"], method="ties", out=str(tmp_path / "o"))
    with pytest.raises(InputError, match=r"revision '0{40}' not found"):
        hubsoup.merge(["alice/ft-a@" + "0" * 40, "alice/ft-b"], method="ties", out=str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()


def test_private_input_needs_a_token(hub, zoo, tmp_path):
    publish(hub, zoo, names=("base", "ft-b"))
    publish(hub, zoo, names=("ft-a",), private=True)
    with pytest.raises(InputError, match=r"repo alice/ft-a not found .*private.*HF_TOKEN"):
        hubsoup.merge(["alice/ft-a", "alice/ft-b"], method="linear", out=str(tmp_path / "o"))
    with pytest.raises(InputError, match="not found"):  # another user's token does not help
        hubsoup.merge(["alice/ft-a", "alice/ft-b"], method="linear", out=str(tmp_path / "o"),
                      token=hub.token("bob"))
    assert not (tmp_path / "o").exists()
    hub.login("alice", write=False)  # the owner's read token is enough
    res = hubsoup.merge(["alice/ft-a", "alice/ft-b"], method="linear", out=str(tmp_path / "o"), quiet=True)
    assert res.inputs[0].sha == hub.head("alice/ft-a")


# ---- pushes that fail ---------------------------------------------------------------------------


@pytest.fixture
def soup(zoo, tmp_path):
    """A local merge output (local inputs: no Hub needed to make it)."""
    return hubsoup.merge([zoo["ft-a"], zoo["ft-b"]], method="linear", base=zoo["base"],
                         out=str(tmp_path / "soup"), quiet=True)


def test_push_without_a_token(hub, soup):
    before = local_files(soup.path)
    with pytest.raises(PushError) as err:
        soup.push_to_hub("alice/soup")
    msg = str(err.value)
    assert "alice/soup" in msg and "authentication failed" in msg and "\n" not in msg
    assert f"retry with: hubsoup push {soup.path} alice/soup" in msg
    assert not hub.exists("alice/soup")
    after = local_files(soup.path)
    assert after.keys() == before.keys() and after["model.safetensors"] == before["model.safetensors"]
    with pytest.raises(PushError, match="authentication failed"):  # an unknown token
        push_folder(soup.path, "alice/soup", token="hf_not_a_real_token")


def test_push_to_a_repo_you_may_not_write(hub, soup, capsys):
    hub.api("alice").create_repo("alice/soup")
    hub.login("bob")
    rc = main(["push", soup.path, "alice/soup"])
    err = capsys.readouterr().err
    assert rc == 2 and "permission denied: the token may not write to alice/soup" in err
    assert f"hubsoup push {soup.path} alice/soup" in err
    with pytest.raises(PushError, match="permission denied"):  # an organisation bob is not in
        push_folder(soup.path, "soup-org/bobs-soup")
    with pytest.raises(PushError, match="permission denied"):  # alice's read token
        push_folder(soup.path, "alice/soup", token=hub.token("alice", write=False))
    assert len(hub.history("alice/soup")) == 1 and not hub.exists("soup-org/bobs-soup")

    # but bob may propose it as a pull request
    rc = main(["push", soup.path, "alice/soup", "--create-pr", "--commit-message", "Bob's soup"])
    out = capsys.readouterr().out
    assert rc == 0 and f"pull request: {hub.endpoint}/alice/soup/discussions/1" in out
    assert len(hub.history("alice/soup")) == 1  # main untouched
    assert hub.files("alice/soup", "refs/pr/1")["model.safetensors"] == local_files(soup.path)["model.safetensors"]


def test_interrupted_merge_push_then_retry(hub, zoo, tmp_path, monkeypatch, capsys):
    publish(hub, zoo)
    hub.login("alice")
    monkeypatch.chdir(tmp_path)
    args = ["merge", "alice/ft-a", "alice/ft-b", "--method", "ties", "--push", "soup-org/soup", "-q"]
    published = hub.lfs_uploaded_objects  # the inputs' own weights
    hub.fail_commits(1, status=500)
    rc = main(args)
    cap = capsys.readouterr()
    assert rc == 2 and "merged 2 model(s)" not in cap.out
    assert "error: push to soup-org/soup failed: Hub server error 500" in cap.err and len(cap.err.splitlines()) == 1
    assert "Nothing was committed; run the same merge again: it resumes" in cap.err
    assert len(hub.history("soup-org/soup")) == 1  # created, nothing committed
    assert [p for p in os.listdir(tmp_path) if "soup" in p] == []  # nothing left on the disk
    uploaded = hub.lfs_uploaded_objects
    assert uploaded == published + 1  # the weights went up before the commit failed

    assert main(args) == 0  # the same command again: it resumes, uploading nothing twice
    first = COMMIT_LINE.search(capsys.readouterr().out).group(3)
    assert first == hub.head("soup-org/soup") and hub.lfs_uploaded_objects == uploaded
    # the same merge once more: identical content, no new commit, and said so
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "\nnothing changed: soup-org/soup already has this content at " in out
    assert re.search(r"/commit/([0-9a-f]{40})", out).group(1) == first and len(hub.history("soup-org/soup")) == 2

    # with a local copy (--out): it is complete when the commit fails, and `hubsoup push` retries
    hub.fail_commits(1, status=500)
    rc = main([*args[:-3], "--push", "soup-org/kept", "--out", "kept", "-q"])
    cap = capsys.readouterr()
    local = str(tmp_path / "kept")
    assert rc == 2 and "merged 2 model(s)" not in cap.out
    assert "push of" in cap.err and "soup-org/kept failed: Hub server error 500" in cap.err
    assert f"retry with: hubsoup push {local} soup-org/kept" in cap.err
    import transformers

    transformers.AutoModel.from_pretrained(local)  # the local output is complete
    assert main(["push", local, "soup-org/kept"]) == 0
    first = COMMIT_LINE.search(capsys.readouterr().out).group(3)
    assert first == hub.head("soup-org/kept")
    assert_same_as_hub(hub, "soup-org/kept", local)
    # pushing again is a no-op: same commit, no new one, and said so
    assert main(["push", local, "soup-org/kept"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("nothing changed: soup-org/kept already has this content at ")
    assert re.search(r"/commit/([0-9a-f]{40})", out).group(1) == first == hub.head("soup-org/kept")
    assert len(hub.history("soup-org/kept")) == 2
    # re-running the merge into the same --out is refused, pointing at the push instead
    rc = main([*args[:-3], "--push", "soup-org/kept", "--out", "kept"])
    assert rc == 2 and "hubsoup push kept soup-org/kept" in capsys.readouterr().err


def test_network_error_and_lost_answer_then_retry(hub, soup):
    hub.login("alice")
    hub.fail_commits(1, drop=True)
    with pytest.raises(PushError, match=r"alice/soup failed: network error.*retry with: hubsoup push"):
        push_folder(soup.path, "alice/soup")
    assert len(hub.history("alice/soup")) == 1
    # the commit lands but its answer is lost: the retry finds everything there, no new commit
    hub.fail_commits(1, status=502, when="after")
    with pytest.raises(PushError, match="server error 502"):
        push_folder(soup.path, "alice/soup")
    landed = hub.head("alice/soup")
    assert len(hub.history("alice/soup")) == 2
    info = push_folder(soup.path, "alice/soup")
    assert info.oid == landed == hub.head("alice/soup")
    assert_same_as_hub(hub, "alice/soup", soup.path)


def test_bad_targets_are_refused_before_merging(hub, zoo, tmp_path, capsys):
    rc = main(["merge", zoo["ft-a"], zoo["ft-b"], "--base", zoo["base"], "--method", "linear", "--push", "no-namespace"])
    assert rc == 2 and "not a Hub repo ID" in capsys.readouterr().err
    rc = main(["merge", zoo["ft-a"], zoo["ft-b"], "--base", zoo["base"], "--method", "linear"])
    assert rc == 2 and "--out" in capsys.readouterr().err
    rc = main(["merge", zoo["ft-a"], zoo["ft-b"], "--base", zoo["base"], "--method", "linear",
               "--out", str(tmp_path / "x"), "--private"])
    assert rc == 2 and "need --push" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    with pytest.raises(PushError, match="no such folder"):
        push_folder(str(tmp_path / "missing"), "alice/soup")


@pytest.mark.parametrize("target", ["alice/soup\n", "alice/so--up", "alice/soupé", "alice/" + "s" * 97, "alice/soup.git",
                                    "alice/soup-", "alice/so..up", " alice/soup"])
def test_repo_ids_the_hub_refuses_are_refused_before_merging(zoo, tmp_path, monkeypatch, capsys, target):
    """Each of these was accepted, merged, and failed only at the push with "network error" (issue 44): now one
    line before any work, from huggingface_hub's own rule and the Hub's that it does not check."""
    monkeypatch.chdir(tmp_path)
    rc = main(["merge", zoo["ft-a"], zoo["ft-b"], "--base", zoo["base"], "--method", "linear", "--push", target])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and "is not a Hub repo ID" in err[0] and repr(target)[:60] in err[0], err
    assert os.listdir(tmp_path) == []  # nothing merged, no ./NAME folder
    assert check_repo_id("alice/" + "s" * 96) == "alice/" + "s" * 96  # 96 is the Hub's limit, inclusive


# ---- the token stays secret ---------------------------------------------------------------------


def test_token_is_never_printed_logged_or_written(hub, zoo, tmp_path, monkeypatch, capsys, caplog):
    token = hub.login("alice")
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="hubsoup")
    publish(hub, zoo)
    monkeypatch.chdir(tmp_path)
    hub.fail_commits(1, status=401)  # a failure whose message talks about tokens
    assert main(["-v", "merge", "alice/ft-a", "alice/ft-b", "--method", "ties", "--push", "soup-org/soup",
                 "--out", "soup"]) == 2
    assert main(["-v", "push", "soup", "soup-org/soup"]) == 0
    hub.fail_commits(1, status=401)  # streamed, without a local copy, then resumed
    assert main(["-v", "merge", "alice/ft-a", "alice/ft-b", "--method", "linear", "--push", "soup-org/other"]) == 2
    assert main(["-v", "merge", "alice/ft-a", "alice/ft-b", "--method", "linear", "--push", "soup-org/other"]) == 0
    from hubsoup.hub import resume_dir

    for dirpath, _, names in os.walk(os.path.dirname(resume_dir())):  # the resume records hold no token
        for n in names:
            assert token.encode() not in open(os.path.join(dirpath, n), "rb").read(), n
    cap = capsys.readouterr()
    assert "authentication failed" in cap.err
    for name, content in local_files(tmp_path / "soup").items():
        assert token.encode() not in content, name
    for repo in ("soup-org/soup", "soup-org/other"):
        for name, content in hub.files(repo).items():
            assert token.encode() not in content, name
    assert token not in cap.out and token not in cap.err
    assert token not in caplog.text
    assert "hubsoup_recipe.yaml" in os.listdir(tmp_path / "soup") and "README.md" in os.listdir(tmp_path / "soup")


def test_push_while_offline_says_so(soup):
    # no ``hub`` fixture: the suite's HF_HUB_OFFLINE=1 is on
    with pytest.raises(PushError, match=r"alice/soup failed: offline mode is on \(HF_HUB_OFFLINE=1\)"):
        push_folder(soup.path, "alice/soup")


def test_every_file_of_the_commit_is_scrubbed_for_local_paths(hub, zoo, tmp_path):
    """Issue 48, item 2: whatever wrote it, a file that still holds an absolute path of this machine or the home
    folder stops the push before anything is sent (JSON values, YAML, text, safetensors metadata); a URL's path,
    a system path (``/usr/bin/time``) and a tokenizer's vocabulary (JSON keys) are no local paths."""
    from safetensors.torch import save_file

    res = hubsoup.merge([zoo["ft-a"], zoo["ft-b"]], method="linear", base=zoo["base"], out=str(tmp_path / "o"),
                        quiet=True)
    here = str(tmp_path / "somewhere" / "data.jsonl")
    home = os.path.join(os.path.expanduser("~"), "x")
    plants = {"notes.txt": f"evaluated on {here}\n".encode(),
              "results/extra.json": json.dumps({"cfg": {"data_files": {"validation": here}}}).encode(),
              "task.yaml": f"task: t\ndataset_kwargs:\n  data_files: {here}\n".encode(),
              "home.md": f"made in {home}\n".encode()}
    tensor_meta = {"source": f"trained from {here}"}
    innocent = {"fine.md": b"see https://huggingface.co/org/x/blob/main/a.md and /usr/bin/time, (/api/models/x)\n",
                "vocab/tokenizer.json": json.dumps({"model": {"vocab": {"/tmp/x": 0, "w": 1}}}).encode()}
    for name, data in innocent.items():
        os.makedirs(os.path.dirname(os.path.join(res.path, name)), exist_ok=True)
        open(os.path.join(res.path, name), "wb").write(data)
    for name, data in [*plants.items(), ("extra.safetensors", None)]:
        path = os.path.join(res.path, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if data is None:
            save_file({"x": torch.zeros(1)}, path, metadata=tensor_meta)
        else:
            open(path, "wb").write(data)
        with pytest.raises(PushError, match=f"{re.escape(name)} holds a local path"):
            push_folder(res.path, "alice/scrubbed", token=hub.token("alice"))
        assert not hub.exists("alice/scrubbed")  # refused before anything was sent
        os.remove(path)
    push_folder(res.path, "alice/scrubbed", token=hub.token("alice"))  # the innocent files go up
    assert set(innocent) <= set(hub.files("alice/scrubbed"))


def test_pushing_the_same_content_again_says_nothing_changed(hub, soup, capsys, caplog):
    """Issue 48, item 6: huggingface_hub skips a commit of identical content with a WARNING and returns the old
    commit; the command line said "pushed to ... <the old commit>". Now: "nothing changed", and the WARNING (third-
    party noise) only when debugging."""
    import logging

    hub.login("alice")
    assert main(["push", soup.path, "alice/again"]) == 0
    assert "pushed to alice/again" in capsys.readouterr().out
    head = hub.head("alice/again")
    caplog.clear()
    assert main(["push", soup.path, "alice/again"]) == 0
    out = capsys.readouterr().out
    assert f"nothing changed: alice/again already has this content at {head[:12]}" in out and "pushed to" not in out
    assert hub.head("alice/again") == head
    assert not [r for r in caplog.records if "No files have been modified" in r.getMessage()]
    caplog.set_level(logging.DEBUG)  # -v: third-party messages shown
    assert main(["push", soup.path, "alice/again"]) == 0
    assert [r for r in caplog.records if "No files have been modified" in r.getMessage()]
    assert "nothing changed" in capsys.readouterr().out
