"""A merge streamed to the Hub (issue 45, item 2): each shard uploaded as soon as it is written, deleted, and
everything committed at once; faults, resume, cancel, and the writer's backpressure (against the test Hub's LFS)."""

from __future__ import annotations

import json
import os
import threading

import pytest

import hubsoup
from hubsoup.cli import main
from hubsoup.errors import DiskFullError, MergeCancelled, PushError
from hubsoup.hub import PushTarget, resume_dir
from hubsoup.output import shards as shards_module
from hubsoup.output.shards import SHARDS_IN_FLIGHT
from hubsoup.testing import make_base, make_finetune

SHARD = "20kB"  # the tiny Llama (107 kB of float32, 21 tensors of at most 16 kB) in 6 shards


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream-zoo")
    base = make_base("llama", str(root / "base"))
    return {"base": base, "a": make_finetune(base, str(root / "a"), seed=1),
            "b": make_finetune(base, str(root / "b"), seed=2)}


def merge(zoo, **kw):
    kw.setdefault("quiet", True)
    return hubsoup.merge([zoo["a"], zoo["b"]], method="ties", base=zoo["base"], shard_size=SHARD, **kw)


def local_files(folder) -> dict[str, bytes]:
    out = {}
    for dirpath, _, names in os.walk(folder):
        for n in names:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, folder).replace(os.sep, "/")] = open(p, "rb").read()
    return out


def weight_files(files: dict[str, bytes]) -> dict[str, bytes]:
    return {k: v for k, v in files.items() if k.endswith(".safetensors") or k.endswith(".index.json")}


def leftovers(folder) -> list[str]:
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    """The working directory, where a push without a local copy works (and must leave nothing)."""
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


# ---- what goes up ---------------------------------------------------------------------------------


def test_streamed_shards_are_byte_identical_to_a_local_merge(hub, zoo, tmp_path, cwd):
    local = merge(zoo, out=str(tmp_path / "local"))
    hub.login("alice")
    res = merge(zoo, push="alice/soup")
    assert res.path == "" and res.repo_id == "alice/soup" and res.pushed.oid == hub.head("alice/soup")
    assert leftovers(cwd) == []  # no local copy, no temporary folder, no lock
    remote, here = hub.files("alice/soup"), local_files(local.path)
    shard_names = [k for k in here if k.endswith(".safetensors")]
    assert len(shard_names) == 6
    # every shard, header and metadata included, and the index: byte for byte what a local merge writes
    assert weight_files(remote) == weight_files(here)
    assert {k for k in remote if k != ".gitattributes"} == set(here)
    assert [c.title for c in hub.history("alice/soup")] == ["Upload ties merge made with hubsoup", "initial commit"]
    # the shards went up as LFS objects, each once
    assert hub.lfs_uploaded_objects == 6 and sorted(u["size"] for u in hub.lfs_uploads) == sorted(
        len(here[k]) for k in shard_names)
    card = remote["README.md"].decode()
    assert 'from_pretrained("alice/soup")' in card and str(tmp_path) not in card
    assert res.card == card and str(res).endswith("-> pushed to alice/soup")
    assert os.listdir(resume_dir()) == [] if os.path.isdir(resume_dir()) else True  # the record went with the commit


def test_a_local_copy_only_with_out_and_then_the_same_files(hub, zoo, tmp_path, cwd):
    hub.login("alice")
    res = merge(zoo, out=str(tmp_path / "kept"), push=PushTarget("alice/kept", private=True,
                                                                   commit_message="kept soup"))
    assert res.path == str(tmp_path / "kept") and hub.head("alice/kept") == res.pushed.oid
    remote = hub.files("alice/kept")
    here = local_files(res.path)
    assert weight_files(remote) == weight_files(here)
    assert remote["README.md"] == here["README.md"]  # the local card loads the repo too
    assert hub.history("alice/kept")[0].title == "kept soup" and hub.api("alice").model_info("alice/kept").private
    # pushing the kept folder again: nothing new is uploaded (the Hub holds every object), no new commit
    n = hub.lfs_uploaded_objects
    assert main(["push", res.path, "alice/kept"]) == 0
    assert hub.lfs_uploaded_objects == n and len(hub.history("alice/kept")) == 2
