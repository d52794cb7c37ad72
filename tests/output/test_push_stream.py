"""A merge streamed to the Hub (issue 45, item 2): each shard uploaded as soon as it is written, deleted, and
everything committed at once; faults, resume, cancel, and the writer's backpressure (against the test Hub's LFS)."""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest

import hubsoup
from hubsoup.cli import main
from hubsoup.errors import DiskFullError, MergeCancelled, PushError
from hubsoup.hub import PushTarget, resume_dir
from hubsoup.output import shards as shards_module
from hubsoup.output.shards import SHARDS_IN_FLIGHT
from hubsoup.testing import make_base, make_finetune

from paths import ROOT
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
    assert {k for k in remote if k != ".gitattributes"} == set(here) - {".hubsoup"}  # the marker is never pushed
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


def test_nothing_is_visible_on_the_repo_before_the_commit(hub, zoo, cwd):
    hub.login("alice")
    seen = []

    def progress(done, stage, message):  # the main thread, between blocks: the uploads run meanwhile
        if hub.exists("alice/soup"):
            seen.append((message, set(hub.files("alice/soup")), hub.lfs_uploaded_objects,
                         len(hub.history("alice/soup"))))

    res = merge(zoo, push="alice/soup", progress=progress)
    before = [s for s in seen if s[0] not in ("committed to alice/soup", "pushed to alice/soup")]
    # by the last block the writer has waited for uploads (at most K + 1 shards held): some are on the Hub ...
    merging = [s for s in before if s[0].startswith("merging")]
    assert merging and merging[-1][2] >= 6 - SHARDS_IN_FLIGHT - 1
    # ... and until the one commit, the repo shows none of them, nor anything else
    assert before and all(files == {".gitattributes"} and commits == 1 for _, files, _, commits in before)
    assert seen[-1][1] > {".gitattributes", "config.json", "README.md"} and seen[-1][3] == 2
    assert res.pushed.oid == hub.head("alice/soup")


def test_the_writer_waits_while_k_shards_are_uploading(hub, zoo, cwd, monkeypatch):
    """Backpressure: with the first upload held, the writer stops at K + 1 shard files on disk until it ends."""
    from hubsoup import hub as hub_module

    hub.login("alice")
    waiting, on_disk = threading.Event(), []
    real_wait, real_upload = shards_module.ShardedWriter._wait_for_room, hub_module.HubPush._upload

    def wait_for_room(self):
        with self._room:
            if self._held >= SHARDS_IN_FLIGHT + 1:
                waiting.set()  # the writer is about to wait: K + 1 shards are held
        real_wait(self)
        on_disk.append(len([f for f in os.listdir(self.folder) if f.endswith(".safetensors")]) + 1)  # + the next

    def upload(self, name, path):
        if name.startswith("model-00001-"):
            assert waiting.wait(60), "the writer never had to wait"
        return real_upload(self, name, path)

    monkeypatch.setattr(shards_module.ShardedWriter, "_wait_for_room", wait_for_room)
    monkeypatch.setattr(hub_module.HubPush, "_upload", upload)
    res = merge(zoo, push="alice/soup")
    assert waiting.is_set() and len(on_disk) == 6
    assert max(on_disk) == SHARDS_IN_FLIGHT + 1  # never more shard files on disk than that
    assert res.pushed.oid == hub.head("alice/soup") and hub.lfs_uploaded_objects == 6


def test_a_rerun_after_an_interruption_resumes(hub, zoo, tmp_path, cwd, monkeypatch):
    """Interrupted after two shards went up: the rerun neither reads, merges nor uploads what the Hub holds."""
    from hubsoup.engine import TensorWork
    from hubsoup.sources.checkpoint import Checkpoint

    hub.login("alice")
    local = hubsoup.merge([zoo["a"], zoo["b"]], method="linear", base=zoo["base"], shard_size=SHARD,
                          out=str(tmp_path / "local"), quiet=True)

    def interrupt(done, stage, message):
        if stage == "merge" and hub.lfs_uploaded_objects >= 2:
            raise KeyboardInterrupt  # as Ctrl-C lands in the main thread

    with pytest.raises(KeyboardInterrupt):
        hubsoup.merge([zoo["a"], zoo["b"]], method="linear", base=zoo["base"], shard_size=SHARD,
                      push="alice/soup", progress=interrupt)
    for t in threading.enumerate():  # an upload in flight ends (its shard is then on the Hub, not recorded)
        if t.name == "hubsoup-upload":
            t.join(60)
    assert leftovers(cwd) == [] and len(hub.history("alice/soup")) == 1  # nothing on disk, nothing committed
    (record,) = os.listdir(resume_dir())
    with open(os.path.join(resume_dir(), record), encoding="utf-8") as f:
        recorded = json.load(f)["shards"]
    assert len(recorded) >= 2
    done = {n for entry in recorded.values() for n in entry["tensors"]}
    held = hub.lfs_held("alice/soup")
    uploaded = hub.lfs_uploaded_objects

    merged, read = [], []
    real_merge, real_tensor = TensorWork.merge, Checkpoint.tensor
    monkeypatch.setattr(TensorWork, "merge", lambda self, **kw: merged.append(self.name) or real_merge(self, **kw))
    monkeypatch.setattr(Checkpoint, "tensor", lambda self, name, *a, **kw: read.append(name) or real_tensor(
        self, name, *a, **kw))
    res = hubsoup.merge([zoo["a"], zoo["b"]], method="linear", base=zoo["base"], shard_size=SHARD,
                        push="alice/soup", quiet=True)
    assert not done & set(merged) and not done & set(read)  # the finished shards' tensors: neither read nor merged
    assert {e.name for _, e in local.plan.entries()} - done <= set(merged)  # every other one was
    # nothing uploaded twice: only the objects the Hub lacked went up
    assert hub.lfs_uploaded_objects - uploaded == 6 - len(held)
    oids = [u["oid"] for u in hub.lfs_uploads if u["repo"] == "alice/soup"]
    assert len(oids) == len(set(oids)) == 6
    assert weight_files(hub.files("alice/soup")) == weight_files(local_files(local.path))
    assert res.pushed.oid == hub.head("alice/soup") and os.listdir(resume_dir()) == []


def test_a_cancel_commits_nothing_and_deletes_the_repo_it_created(hub, zoo, cwd):
    hub.login("alice")
    stop = threading.Event()

    def progress(done, stage, message):
        if hub.lfs_uploaded_objects >= 1:
            stop.set()

    with pytest.raises(MergeCancelled):
        merge(zoo, push="alice/soup", progress=progress, cancel=stop)
    assert not hub.exists("alice/soup") and leftovers(cwd) == []
    assert not os.path.isdir(resume_dir()) or os.listdir(resume_dir()) == []
    # an existing repo keeps its history
    hub.api("alice").create_repo("alice/soup")
    head = hub.head("alice/soup")
    stop.clear()
    with pytest.raises(MergeCancelled):
        merge(zoo, push="alice/soup", progress=progress, cancel=stop)
    assert hub.head("alice/soup") == head and len(hub.history("alice/soup")) == 1 and leftovers(cwd) == []
    assert not hub.calls("POST", r"/api/models/alice/soup/commit/")


# ---- faults ---------------------------------------------------------------------------------------


def test_a_connection_dropped_during_a_shard_upload_is_retried(hub, zoo, tmp_path, cwd):
    hub.login("alice")
    hub.fail_next(1, method="PUT", path=r"^/_test-lfs/upload/", drop=True)
    hub.fail_next(1, 503, method="POST", path=r"\.git/info/lfs/objects/batch$")
    hub.fail_next(1, 500, method="PUT", path=r"^/_test-lfs/upload/")
    res = merge(zoo, push="alice/soup")
    assert hub.pending_failures == 0 and len(hub.calls("PUT", r"^/_test-lfs/upload/")) == 6 + 2
    local = merge(zoo, out=str(tmp_path / "local"))
    assert weight_files(hub.files("alice/soup")) == weight_files(local_files(local.path))
    assert res.pushed.oid == hub.head("alice/soup") and leftovers(cwd) == []


def test_a_5xx_on_the_commit_commits_nothing_and_the_rerun_uploads_nothing_again(hub, zoo, cwd, capsys):
    hub.login("alice")
    args = ["merge", zoo["a"], zoo["b"], "--base", zoo["base"], "--method", "ties", "--shard-size", SHARD,
            "--push", "alice/soup", "-q"]
    hub.fail_commits(1, 500)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: push to alice/soup failed: Hub server error 500")
    assert "Nothing was committed; run the same merge again: it resumes" in err
    assert len(hub.history("alice/soup")) == 1 and leftovers(cwd) == [] and hub.lfs_uploaded_objects == 6
    assert main(args) == 0
    assert hub.lfs_uploaded_objects == 6 and len(hub.history("alice/soup")) == 2
    assert "pushed to alice/soup: " in capsys.readouterr().out


def test_a_slow_server_ends_in_one_line_and_a_slow_upload_is_retried(hub, zoo, cwd, capsys, monkeypatch):
    import time

    monkeypatch.setenv("HUBSOUP_HUB_TIMEOUT", "1")
    hub.login("alice")
    hub.fail_next(1, method="PUT", path=r"^/_test-lfs/upload/", hang=20)  # one upload's answer never comes
    hub.fail_commits(1, hang=20)  # nor the commit's
    t0 = time.monotonic()
    rc = main(["merge", zoo["a"], zoo["b"], "--base", zoo["base"], "--method", "ties", "--shard-size", SHARD,
               "--push", "alice/soup", "-q"])
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert rc == 2 and took < 15, took
    assert len(err.splitlines()) == 1 and "did not answer within 1s (timed out" in err
    assert len(hub.history("alice/soup")) == 1 and leftovers(cwd) == []
    assert hub.lfs_uploaded_objects == 6  # the upload that timed out was sent again


def test_a_shard_that_would_publish_a_local_path_is_refused_before_its_upload(hub, zoo, cwd, monkeypatch):
    from hubsoup.recipe import Recipe

    hub.login("alice")
    real = Recipe.metadata
    monkeypatch.setattr(Recipe, "metadata", lambda self: {**real(self), "source": zoo["a"]})
    with pytest.raises(PushError, match=r"push to alice/soup refused: model-00001-of-00006\.safetensors holds a "
                                        r"local path .* in its metadata"):
        merge(zoo, push="alice/soup")
    assert hub.lfs_uploaded_objects == 0 and len(hub.history("alice/soup")) == 1 and leftovers(cwd) == []


def test_private_inputs_are_checked_before_the_first_upload(hub, zoo, cwd):
    hub.seed("alice/base", zoo["base"])
    hub.seed("alice/a", zoo["a"], private=True)
    hub.seed("alice/b", zoo["b"])
    hub.login("alice")
    uploads = hub.lfs_uploaded_objects
    with pytest.raises(PushError, match=r"push to alice/public refused: alice/public is public and the merge "
                                        r"contains 'alice/a' \(private\)"):
        hubsoup.merge(["alice/a", "alice/b"], method="linear", base="alice/base", push="alice/public",
                      shard_size=SHARD, quiet=True)
    assert not hub.exists("alice/public") and hub.lfs_uploaded_objects == uploads and leftovers(cwd) == []
    res = hubsoup.merge(["alice/a", "alice/b"], method="linear", base="alice/base", shard_size=SHARD, quiet=True,
                        push=PushTarget("alice/public", allow_private_inputs=True))
    card = hub.files("alice/public")["README.md"].decode()
    assert "Private or gated inputs" in card and "alice/a" in card and res.pushed.oid == hub.head("alice/public")




def test_disk_full_while_writing_a_shard(hub, zoo, small_disk, tmp_path, cwd):
    disk = small_disk("40k")  # room for two shards of 20 kB and the small files, not for K + 1 = 3
    hub.login("alice")
    with pytest.raises(DiskFullError, match=r"disk full while writing model-0000\d-of-00006\.safetensors in "
                                            r".*\.hubsoup-push-alice--soup: \d+ bytes needed"):
        merge(zoo, push=PushTarget("alice/soup", work_dir=disk))
    assert os.listdir(disk) == [] and len(hub.history("alice/soup")) == 1
    uploaded = hub.lfs_uploaded_objects
    res = merge(zoo, push=PushTarget("alice/soup", work_dir=str(tmp_path)))  # on a larger disk: it resumes
    assert hub.lfs_uploaded_objects - uploaded == 6 - uploaded
    assert res.pushed.oid == hub.head("alice/soup")


@pytest.mark.parametrize("sig, code, head, moment", [(signal.SIGINT, 130, "interrupted", "upload"),
                                                     (signal.SIGTERM, 143, "terminated (SIGTERM)", "commit")])
def test_a_signal_at_any_moment_commits_nothing_leaves_nothing_and_the_rerun_resumes(hub, zoo, cwd, sig, code, head,
                                                                                     moment):
    import subprocess
    import sys
    import time

    token = hub.login("alice")
    args = [sys.executable, "-m", "hubsoup", "merge", zoo["a"], zoo["b"], "--base", zoo["base"], "--method", "ties",
            "--shard-size", SHARD, "--push", "alice/soup", "-q"]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if moment == "upload":  # the first shard's upload is held: the writer soon waits for it (K + 1 shards held)
        hub.fail_next(1, method="PUT", path=r"^/_test-lfs/upload/", hang=30)
    else:  # every shard is up, the commit is sent and held
        hub.fail_commits(1, hang=30)
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while hub.pending_failures:  # the held request has reached the Hub
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == code and len(lines) == 1 and "Traceback" not in err, err
    if moment == "upload":
        assert lines[0] == (f"{head}; no output was left behind; nothing was committed to alice/soup (run the same "
                            "command again: it resumes)")
    else:
        assert lines[0] == f"{head}; no output was left behind; the one commit to alice/soup was on its way: the repo " \
                           "holds all of it or none"
    assert len(hub.history("alice/soup")) == 1 and leftovers(cwd) == []
    assert hub.lfs_uploaded_objects == (0 if moment == "upload" else 6)
    rerun = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
    assert rerun.returncode == 0, rerun.stderr
    assert hub.lfs_uploaded_objects == 6 and len(hub.history("alice/soup")) == 2 and leftovers(cwd) == []
    assert token not in out + err + rerun.stdout + rerun.stderr


def test_run_pushes_a_recipe_and_the_final_stage_of_a_multi_stage_config(hub, zoo, tmp_path, cwd, capsys):
    hub.login("alice")
    first = hubsoup.merge([zoo["a"], zoo["b"]], method="ties", base=zoo["base"], out=str(tmp_path / "first"),
                          quiet=True)
    assert main(["run", os.path.join(first.path, "hubsoup_recipe.yaml"), "--push", "alice/again", "-q"]) == 0
    assert "pushed to alice/again: " in capsys.readouterr().out and leftovers(cwd) == []
    assert weight_files(hub.files("alice/again")) == weight_files(local_files(first.path))

    config = tmp_path / "stages.yml"
    config.write_text(f"""name: first
merge_method: linear
models:
  - model: {zoo['a']}
    parameters: {{weight: 0.5}}
  - model: {zoo['b']}
    parameters: {{weight: 0.5}}
dtype: float32
---
merge_method: linear
models:
  - model: first
    parameters: {{weight: 0.5}}
  - model: {zoo['base']}
    parameters: {{weight: 0.5}}
dtype: float32
""")
    stages = tmp_path / "stages"
    assert main(["run", str(config), "--push", "alice/staged", "--intermediate-dir", str(stages), "-q"]) == 0
    capsys.readouterr()
    files = hub.files("alice/staged")
    card = files["README.md"].decode()
    assert "Merge stages" in card and "**first**" in card and "**final merge**" in card
    assert str(tmp_path) not in card and "model.safetensors" in files
    assert os.path.isdir(stages / "first") and leftovers(cwd) == []  # the intermediate stage stays local


def test_push_figures_before_a_merge_starts(hub, zoo, tmp_path):
    """push_figures is the merge's own footprint: inputs read in place (fetched, never on disk), the output's K + 1
    largest shards on disk with a push, all of it without; the figures a merge then checks max_disk against."""
    from hubsoup.errors import DiskLimitError

    hub.seed("alice/base", zoo["base"])
    hub.seed("alice/a", zoo["a"])
    pushed = hubsoup.push_figures(["alice/a", zoo["b"]], base="alice/base", shard_size=SHARD, token=False)
    local = hubsoup.push_figures([zoo["a"], zoo["b"]], base=zoo["base"], push=False, shard_size=SHARD,
                                 bandwidth=1e6, token=False)
    out = local_files(merge(zoo, out=str(tmp_path / "o")).path)
    weights = sum(len(v) for k, v in out.items() if k.endswith(".safetensors"))
    blocks = sorted((-(-len(v) // 4096) * 4096 for k, v in out.items() if k.endswith(".safetensors")), reverse=True)
    hub_inputs = sum(len(v) for r in ("alice/base", "alice/a") for k, v in hub.files(r).items()
                     if k.endswith(".safetensors"))
    assert pushed["download"] == hub_inputs and local["download"] == 0  # what a merge fetches: the Hub inputs' tensors
    assert local["upload"] == 0 and weights < pushed["upload"] < weights + 100_000  # the output and its small files
    # without a push: the whole output (in whole blocks) and its small files; with it, K + 1 shards of it, and the
    # Hub inputs' configs in the cache (never their weights)
    assert sum(blocks) < local["disk"] < sum(blocks) + 48 * 1024
    held = sum(blocks[:SHARDS_IN_FLIGHT + 1])
    assert held < pushed["disk"] < held + 80 * 1024 and pushed["disk"] < local["disk"]
    assert local["seconds"] == 0 and pushed["seconds"] is None  # nothing to move: local inputs, no push
    # the merge checks the same figure: a max_disk just under it is refused before anything is read or created
    with pytest.raises(DiskLimitError, match="over --max-disk"):
        hubsoup.merge(["alice/a", zoo["b"]], method="task_arithmetic", base="alice/base", shard_size=SHARD,
                      push="alice/tight", max_disk=pushed["disk"] - 1, token=hub.token("alice"), quiet=True)
    assert not hub.exists("alice/tight")
    res = hubsoup.merge(["alice/a", zoo["b"]], method="task_arithmetic", base="alice/base", shard_size=SHARD,
                        push="alice/fits", max_disk=pushed["disk"], token=hub.token("alice"), quiet=True)
    assert res.network["predicted"]["output_streamed"] and hub.exists("alice/fits")
