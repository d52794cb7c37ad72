"""The Python API for apps (a Gradio Space): progress, cancellation, the card on the result, the method list,
nothing printed, and two merges in two threads with two tokens (issue 13, item 1)."""

from __future__ import annotations

import json
import os
import shutil
import threading

import pytest
import torch
from safetensors.torch import load_file

import hubsoup
from hubsoup.errors import HubsoupError, MergeCancelled
from hubsoup.testing import make_base, make_finetune, save_tiny_tokenizer

LAYERS = 2  # the tiny Llama's decoder layers


class Recorder:
    """A progress callback that records every call (and can cancel at a chosen point)."""

    def __init__(self, cancel_when=None):
        self.calls: list[tuple[float, str, str]] = []
        self.cancel = threading.Event()
        self.cancel_when = cancel_when

    def __call__(self, done: float, stage: str, message: str) -> None:
        assert isinstance(done, float) and isinstance(stage, str) and isinstance(message, str)
        self.calls.append((done, stage, message))
        if self.cancel_when is not None and self.cancel_when(done, stage, message):
            self.cancel.set()

    @property
    def stages(self) -> list[str]:
        out: list[str] = []
        for _, s, _ in self.calls:
            if s and (not out or out[-1] != s):
                out.append(s)
        return out

    def check_monotone_to_one(self) -> None:
        dones = [d for d, _, _ in self.calls]
        assert dones, "progress was never called"
        assert all(0.0 <= d <= 1.0 for d in dones)
        assert all(a <= b for a, b in zip(dones, dones[1:])), dones
        assert dones[-1] == 1.0
        assert dones[0] < 0.5  # it starts near 0, not at the end


def leftovers(out) -> list[str]:
    """Everything a run on ``out`` may leave beside it: the output, ``.NAME.partial-*`` and ``.NAME.lock``."""
    parent, name = os.path.split(os.path.abspath(out))
    return sorted(e for e in os.listdir(parent) if e == name or e.startswith(f".{name}."))


@pytest.fixture(scope="module")
def zoo(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("app-zoo")
    base = str(root / "base")
    shutil.copytree(model_dir("llama"), base)
    save_tiny_tokenizer(base)  # the output gets it: perplexity evaluation needs one
    return {"base": base, "ft-a": make_finetune(base, str(root / "ft-a"), seed=1, base_model="alice/base"),
            "ft-b": make_finetune(base, str(root / "ft-b"), seed=2, base_model="alice/base")}


def publish(hub, zoo, user="alice", names=("base", "ft-a", "ft-b"), private=False) -> None:
    api = hub.api(user)
    for name in names:
        api.create_repo(f"{user}/{name}", private=private)
        api.upload_folder(repo_id=f"{user}/{name}", folder_path=zoo[name])


def blocks(res) -> int:
    return len(res.plan.blocks)


# ---- progress ---------------------------------------------------------------------------------


def test_progress_local_merge(zoo, tmp_path):
    rec = Recorder()
    out = tmp_path / "soup"
    res = hubsoup.merge([zoo["ft-a"], zoo["ft-b"]], method="ties", base=zoo["base"], out=str(out),
                        scope="model", progress=rec)
    rec.check_monotone_to_one()
    assert rec.stages == ["statistics", "merge"]  # local: no download; TIES' model-wide threshold: a pass
    n = blocks(res)
    assert n >= LAYERS
    # at least once per block, in every pass over the model
    merge_steps = [m for _, s, m in rec.calls if s == "merge" and "block" in m]
    stats_steps = [m for _, s, m in rec.calls if s == "statistics" and "block" in m]
    assert len(merge_steps) >= n and len(stats_steps) >= n
    assert f"block {n}/{n}" in merge_steps[-1]
    assert leftovers(out) == ["soup"]


def test_progress_without_statistics_and_with_eval(zoo, tmp_path):
    data = tmp_path / "val.csv"
    data.write_text("text\n" + "".join(f"w{i} w{i + 1} w{i + 2}\n" for i in range(6)))
    rec = Recorder()
    res = hubsoup.merge([zoo["ft-a"], zoo["ft-b"]], method="task_arithmetic", base=zoo["base"],
                        out=str(tmp_path / "o"), evaluate=[f"perplexity:{data}"], progress=rec)
    rec.check_monotone_to_one()
    assert rec.stages == ["merge", "eval"]
    assert res.evaluation


def test_progress_hub_merge_and_push(hub, zoo, tmp_path):
    publish(hub, zoo)
    rec = Recorder()
    res = hubsoup.merge(["alice/ft-a", "alice/ft-b"], method="linear", base="alice/base", out=str(tmp_path / "o"),
                        progress=rec)
    rec.check_monotone_to_one()
    assert rec.stages == ["download", "merge"]
    downloads = [m for _, s, m in rec.calls if s == "download"]
    assert any("downloaded a file" in m for m in downloads)

    push = Recorder()
    info = res.push_to_hub("alice/soup", token=hub.token("alice"), progress=push)
    push.check_monotone_to_one()
    assert push.stages == ["push"]
    assert info.oid == hub.head("alice/soup")
    uploaded = [m for _, _, m in push.calls if m.startswith("uploaded ")]
    assert len(uploaded) == len([f for f in os.listdir(res.path) if os.path.isfile(os.path.join(res.path, f))
                                 and f != ".hubsoup"])  # hubsoup's marker stays local (issue 44)


# ---- cancellation -------------------------------------------------------------------------------


def test_cancel_during_merge_event(zoo, tmp_path):
    rec = Recorder(cancel_when=lambda d, s, m: s == "merge" and "block 1/" in m)
    out = tmp_path / "soup"
    with pytest.raises(MergeCancelled, match="cancelled"):
        hubsoup.merge([zoo["ft-a"], zoo["ft-b"]], method="linear", base=zoo["base"], out=str(out),
                      progress=rec, cancel=rec.cancel)
    assert leftovers(out) == []  # no output, no temporary folder, no lock file
    assert isinstance(MergeCancelled("x"), HubsoupError)
    # the next run on the same output is not blocked by anything the cancelled one left
    hubsoup.merge([zoo["ft-a"]], method="linear", base=zoo["base"], out=str(out), quiet=True)
    assert leftovers(out) == ["soup"]


def test_cancel_is_checked_per_tensor_callable(zoo, tmp_path):
    """A callable cancel, true after a few checks: the engine checks it before every tensor."""
    checks = []

    def cancel() -> bool:
        checks.append(1)
        return len(checks) > 5

    out = tmp_path / "soup"
    with pytest.raises(MergeCancelled):
        hubsoup.merge([zoo["ft-a"], zoo["ft-b"]], method="linear", base=zoo["base"], out=str(out), cancel=cancel,
                      quiet=True)
    assert len(checks) == 6  # stopped at the first check that said so, mid-block
    assert leftovers(out) == []


def test_cancel_during_statistics_pass(zoo, tmp_path):
    rec = Recorder(cancel_when=lambda d, s, m: s == "statistics" and "block" in m)
    out = tmp_path / "soup"
    with pytest.raises(MergeCancelled):
        hubsoup.merge([zoo["ft-a"], zoo["ft-b"]], method="ties", base=zoo["base"], out=str(out), scope="model",
                      progress=rec, cancel=rec.cancel)
    assert "merge" not in rec.stages  # stopped in the statistics pass
    assert leftovers(out) == []


def test_cancel_during_download(hub, zoo, tmp_path):
    publish(hub, zoo)
    rec = Recorder(cancel_when=lambda d, s, m: s == "download" and m == "downloaded a file")
    out = tmp_path / "soup"
    with pytest.raises(MergeCancelled):
        hubsoup.merge(["alice/ft-a", "alice/ft-b"], method="linear", base="alice/base", out=str(out),
                      progress=rec, cancel=rec.cancel)
    assert rec.stages == ["download"]
    assert leftovers(out) == []
    # stopped between files: ft-b's weights were never asked for
    assert not [c for c in hub.calls("GET", r"/alice/ft-b/resolve/") if c["path"].endswith(".safetensors")]


def test_cancel_during_push_uploads_nothing(hub, zoo, tmp_path):
    res = hubsoup.merge([zoo["ft-a"], zoo["ft-b"]], method="linear", base=zoo["base"], out=str(tmp_path / "o"),
                        quiet=True)
    before = open(os.path.join(res.path, "README.md"), encoding="utf-8").read()
    # at the push's first report: before the repo is created
    rec = Recorder(cancel_when=lambda d, s, m: s == "push")
    with pytest.raises(MergeCancelled):
        res.push_to_hub("alice/soup", token=hub.token("alice"), progress=rec, cancel=rec.cancel)
    assert not hub.exists("alice/soup")
    # after the first file went up, before the commit: no commit, and the repo this push created is gone again
    rec = Recorder(cancel_when=lambda d, s, m: m.startswith("uploaded "))
    with pytest.raises(MergeCancelled):
        res.push_to_hub("alice/soup", token=hub.token("alice"), progress=rec, cancel=rec.cancel)
    assert not hub.exists("alice/soup")
    assert not hub.calls("POST", r"/api/models/alice/soup/commit/")
    # an existing repo keeps its history untouched
    hub.api("alice").create_repo("alice/soup")
    head = hub.head("alice/soup")
    rec = Recorder(cancel_when=lambda d, s, m: m.startswith("uploaded "))
    with pytest.raises(MergeCancelled):
        res.push_to_hub("alice/soup", token=hub.token("alice"), progress=rec, cancel=rec.cancel)
    assert hub.head("alice/soup") == head and len(hub.history("alice/soup")) == 1
    assert os.path.isdir(res.path)  # the local output is intact
    # the card was only pointed at the repo: titled by it (issue 32), its snippet loading it
    assert before.replace("\n# o\n", "\n# soup\n").split("from_pretrained")[0] == open(
        os.path.join(res.path, "README.md"), encoding="utf-8").read().split("from_pretrained")[0]


def test_cancel_set_before_start(zoo, tmp_path):
    ev = threading.Event()
    ev.set()
    with pytest.raises(MergeCancelled):
        hubsoup.merge([zoo["ft-a"]], method="linear", base=zoo["base"], out=str(tmp_path / "o"), cancel=ev)
    assert leftovers(tmp_path / "o") == []


def test_bad_cancel_and_progress_are_refused(zoo, tmp_path):
    with pytest.raises(HubsoupError, match="cancel must be"):
        hubsoup.merge([zoo["ft-a"]], method="linear", base=zoo["base"], out=str(tmp_path / "o"), cancel=True)
    with pytest.raises(HubsoupError, match="progress must be"):
        hubsoup.merge([zoo["ft-a"]], method="linear", base=zoo["base"], out=str(tmp_path / "o"), progress="yes")
    assert leftovers(tmp_path / "o") == []


# ---- continual merging and search ---------------------------------------------------------------


def test_continual_progress_and_cancel(zoo, model_dir, tmp_path):
    soup = tmp_path / "soup"
    rec = Recorder()
    hubsoup.continual.init([zoo["ft-a"]], base=zoo["base"], out=str(soup), progress=rec)
    rec.check_monotone_to_one()
    assert rec.stages == ["merge"]
    state = sorted(os.listdir(soup / "continual_state"))

    rec = Recorder()
    res = hubsoup.continual.add(str(soup), [zoo["ft-b"]], progress=rec)
    rec.check_monotone_to_one()
    assert res.stats["continual.count"] == 2
    assert sum("block" in m for _, _, m in rec.calls) >= 2 * blocks(res)  # both passes, per block

    # a cancelled add leaves the soup as it was (in place: the soup is the output)
    before = {f: open(soup / "continual_state" / f, "rb").read() for f in os.listdir(soup / "continual_state")}
    rec = Recorder(cancel_when=lambda d, s, m: "block 1/" in m)
    with pytest.raises(MergeCancelled):
        hubsoup.continual.add(str(soup), [make_finetune(zoo["base"], str(tmp_path / "ft-c"), seed=3)],
                              progress=rec, cancel=rec.cancel)
    after = {f: open(soup / "continual_state" / f, "rb").read() for f in os.listdir(soup / "continual_state")}
    assert after == before and sorted(after) == state
    assert leftovers(soup) == ["soup"]


def test_search_progress_and_cancel(zoo, tmp_path):
    from hubsoup.workflows.search import search

    rec = Recorder()
    found = search([zoo["ft-a"], zoo["ft-b"]], "task_arithmetic", base=zoo["base"], out=str(tmp_path / "s"),
                   grid={"scale": [0.5, 1.0]}, score_fn=lambda folder: 1.0, progress=rec)
    rec.check_monotone_to_one()
    assert found.best == {"scale": 0.5}
    assert [s for s in rec.stages] == ["merge", "eval", "merge", "eval"]

    rec = Recorder(cancel_when=lambda d, s, m: s == "eval")  # after the first point's merge
    with pytest.raises(MergeCancelled):
        search([zoo["ft-a"], zoo["ft-b"]], "task_arithmetic", base=zoo["base"], out=str(tmp_path / "c"),
               grid={"scale": [0.5, 1.0]}, score_fn=lambda folder: 1.0, progress=rec, cancel=rec.cancel)
    assert leftovers(tmp_path / "c") == []


# ---- nothing printed ----------------------------------------------------------------------------


@pytest.fixture
def bars_on(monkeypatch):
    """huggingface_hub's and tqdm's bars as a user's terminal has them (the suite turns them off)."""
    import sys

    import huggingface_hub.utils  # noqa: F401

    hf_tqdm = sys.modules["huggingface_hub.utils.tqdm"]  # the module (the package exports a class of that name)

    monkeypatch.setattr(hf_tqdm, "HF_HUB_DISABLE_PROGRESS_BARS", None)
    monkeypatch.setattr(hf_tqdm, "progress_bar_states", {})
    monkeypatch.setenv("TQDM_POSITION", "-1")  # bars even when stderr is no terminal (huggingface_hub's rule)
    monkeypatch.setenv("TQDM_MININTERVAL", "0")


def test_progress_prints_nothing(hub, zoo, tmp_path, capfd, bars_on):
    publish(hub, zoo)
    # the control: without progress=, the bars do reach the terminal (so the check below can fail)
    hubsoup.merge(["alice/ft-a", "alice/ft-b"], method="ties", base="alice/base", out=str(tmp_path / "loud"),
                  scope="model")
    # huggingface_hub leaves snapshot_download's byte bars open: they render their last line when collected,
    # which must happen here and not during the quiet merge below
    import gc

    gc.collect()
    loud = capfd.readouterr()
    assert "Fetching" in loud.err and "merging (ties)" in loud.err

    hub.reset()
    publish(hub, zoo)  # new commits: everything is downloaded again
    capfd.readouterr()  # the test's own uploads: LFS files, huggingface_hub shows their bars
    rec = Recorder()
    res = hubsoup.merge(["alice/ft-a", "alice/ft-b"], method="ties", base="alice/base", out=str(tmp_path / "quiet"),
                        scope="model", progress=rec)
    res.push_to_hub("alice/soup", token=hub.token("alice"), progress=rec)
    quiet = capfd.readouterr()
    assert quiet.out == "" and quiet.err == ""
    assert "download" in rec.stages and "push" in rec.stages


# ---- the card, the method list ------------------------------------------------------------------


def test_result_card_is_the_rendered_text(zoo, tmp_path):
    res = hubsoup.merge([zoo["ft-a"], zoo["ft-b"]], method="ties", base=zoo["base"], out=str(tmp_path / "o"),
                        quiet=True)
    assert res.card_text is not None
    with open(os.path.join(res.path, "README.md"), encoding="utf-8") as f:
        assert res.card == f.read()
    assert res.card.startswith("---") and "ties" in res.card
    # from_folder reads it back from disk
    again = hubsoup.MergeResult.from_folder(res.path)
    assert again.card_text is None and again.card == res.card
    # re-rendering updates it (the text on the result, not a stale copy)
    res.notes.append("A note added later.")
    res.write_card()
    assert "A note added later." in res.card
    with open(os.path.join(res.path, "README.md"), encoding="utf-8") as f:
        assert res.card == f.read()


def test_list_methods():
    from hubsoup.methods import available

    methods = hubsoup.list_methods()
    assert json.loads(json.dumps(methods)) == methods  # plain data
    by_name = {m["name"]: m for m in methods}
    assert set(by_name) == set(available())
    for m in methods:
        assert set(m) == {"name", "summary", "paper", "paper_url", "min_inputs", "max_inputs", "params", "measured"}
        assert m["summary"] and isinstance(m["min_inputs"], int)
        for p in m["params"]:
            assert {"name", "type", "default", "range", "choices", "help", "source"} <= set(p)
            assert p["type"] in {"float", "int", "bool", "str", "choice", "floats", "ints", "strs", "json"}
            assert p["source"] in {"paper", "ours", "mergekit", "measured"}  # mergekit: a mergekit-compatible option
            assert (p["evidence"] is not None) == (p["source"] == "measured")  # a measured default names its benchmarks
            if p["type"] == "choice":
                assert isinstance(p["choices"], list) and p["default"] in p["choices"]
            assert p["range"] is None or (isinstance(p["range"], list) and len(p["range"]) == 2)
    ties = {p["name"]: p for p in by_name["ties"]["params"]}
    assert ties["density"]["type"] == "float" and ties["density"]["default"] == 0.2
    assert ties["scope"]["type"] == "choice" and ties["scope"]["choices"] == ["model", "tensor"]
    assert ties["weights"]["type"] == "floats" and ties["weights"]["nullable"] and ties["weights"]["default"] is None
    assert by_name["ties"]["paper_url"].startswith("https://arxiv.org/")
    assert by_name["slerp"]["max_inputs"] is not None
    # what the quality benchmarks measured at the defaults: per benchmark row, per setting; {} when not measured
    soup = by_name["linear"]["measured"]["uniform soup"]
    assert {e["setting"] for e in soup} >= {"encoder full-8", "encoder lora-4"} and all(-1 < e["defaults"] < 1.5 for e in soup)
    assert by_name["slerp"]["measured"] == {}
    cons = {p["name"]: p for p in by_name["consensus"]["params"]}
    assert cons["lambdas"]["type"] == "floats" and cons["lambdas"]["default"] == [0.4]
    assert cons["lambdas"]["source"] == "ours"
    lot = {p["name"]: p for p in by_name["lot"]["params"]}
    assert lot["exemplars"]["type"] == "strs"
    # every default parses back through the method (what a form built from this would send)
    from hubsoup.methods import get_method

    for m in methods:
        get_method(m["name"]).parse({p["name"]: p["default"] for p in m["params"] if p["default"] is not None})


def test_cli_methods_uses_the_same_description(capsys):
    from hubsoup.cli import main

    assert main(["methods", "ties"]) == 0
    out = capsys.readouterr().out
    ties = next(m for m in hubsoup.list_methods() if m["name"] == "ties")
    for p in ties["params"]:
        assert f"--param {p['name']}=" in out and p["help"] in out
    assert "one of model, tensor" in out


# ---- two threads, two tokens --------------------------------------------------------------------


def test_two_threads_two_tokens(hub, zoo, tmp_path):
    """Each token reads only its own private repos; concurrent merges must each use their own."""
    publish(hub, zoo, "alice", private=True)
    publish(hub, zoo, "bob", names=("base", "ft-a", "ft-b"), private=True)
    # bob's fine-tune differs from alice's: the outputs tell which inputs each merge read
    bob_ft = make_finetune(zoo["base"], str(tmp_path / "bob-ft"), seed=7)
    hub.api("bob").upload_folder(repo_id="bob/ft-a", folder_path=bob_ft)
    start = threading.Barrier(2)
    results: dict[str, object] = {}
    seen: dict[str, list] = {"alice": [], "bob": []}

    def run(user: str) -> None:
        try:
            start.wait()
            results[user] = hubsoup.merge(
                [f"{user}/ft-a", f"{user}/ft-b"], method="linear", base=f"{user}/base",
                out=str(tmp_path / f"out-{user}"), token=hub.token(user, write=False),
                progress=lambda d, s, m, u=user: seen[u].append(d))
        except BaseException as e:  # noqa: BLE001 - reported below
            results[user] = e

    threads = [threading.Thread(target=run, args=(u,)) for u in ("alice", "bob")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for user in ("alice", "bob"):
        assert not isinstance(results[user], BaseException), results[user]
        assert results[user].inputs[0].sha == hub.head(f"{user}/ft-a")
        assert seen[user][-1] == 1.0 and seen[user] == sorted(seen[user])
    a = load_file(os.path.join(results["alice"].path, "model.safetensors"))
    b = load_file(os.path.join(results["bob"].path, "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(a[name], b[name])  # each read its own user's fine-tune
    # neither token was put where the other thread (or a later run) would find it
    assert "HF_TOKEN" not in os.environ
    from huggingface_hub import get_token

    assert get_token() is None
    # and one user's token cannot read the other's repos (so the merges above really used their own)
    with pytest.raises(HubsoupError, match="not found"):
        hubsoup.merge(["bob/ft-a"], method="linear", base="bob/base", out=str(tmp_path / "x"),
                      token=hub.token("alice", write=False), quiet=True)


def test_progress_prints_nothing_with_eval(zoo, tmp_path, capfd, bars_on):
    """The eval stage (datasets, transformers) prints nothing either when progress= is given."""
    data = tmp_path / "val.csv"
    data.write_text("text\n" + "".join(f"w{i} w{i + 1} w{i + 2}\n" for i in range(6)))
    rec = Recorder()
    res = hubsoup.merge([zoo["ft-a"], zoo["ft-b"]], method="task_arithmetic", base=zoo["base"],
                        out=str(tmp_path / "o"), evaluate=[f"perplexity:{data}"], progress=rec)
    quiet = capfd.readouterr()
    assert res.evaluation and "eval" in rec.stages
    assert quiet.out == "" and quiet.err == "", quiet



def test_push_progress_counts_bytes(hub, tmp_path):
    """Issue 48, item 8: the push is a planned stage counted in bytes (it stood at 0 until the end, so an app's bar
    sat at the merge's share through the whole push): each file moves the bar by its size."""
    base = make_base("llama", str(tmp_path / "base"), layers=4, hidden=256)
    fts = [make_finetune(base, str(tmp_path / f"ft{i}"), seed=i) for i in (1, 2)]
    res = hubsoup.merge(fts, method="linear", base=base, out=str(tmp_path / "o"), quiet=True)
    sizes = {f: os.path.getsize(os.path.join(res.path, f)) for f in os.listdir(res.path)}
    weights = max(sizes, key=sizes.get)
    assert weights.endswith(".safetensors") and sizes[weights] > 0.9 * sum(sizes.values())
    push = Recorder()
    res.push_to_hub("alice/bytes", token=hub.token("alice"), progress=push)
    push.check_monotone_to_one()
    # each file moves the bar by its share of the bytes, whatever the order the files go up in (a streamed push
    # sends the shards first): the shard most of it, every small file a small part, the commit last
    start, moves, last = {}, {}, 0.0
    for d, _, m in push.calls:
        verb, _, f = m.partition(" ")
        if verb in ("uploading", "uploaded"):
            start.setdefault(f, last)  # the bar before the file's first report
            if verb == "uploaded":
                moves[f] = d - start[f]
        last = d
    assert moves[weights] > 0.9, push.calls
    assert all(0 <= v < 0.1 for f, v in moves.items() if f != weights), push.calls
    assert push.calls[-1][0] == 1.0 and max(d for d, _, m in push.calls if m.startswith("uploaded ")) < 1.0
    assert hub.exists("alice/bytes")


def test_an_upload_reports_and_checks_cancel_as_it_reads_a_file(tmp_path):
    """On a Hub that takes files by LFS or Xet they go up in ``preupload_lfs_files``, which reads the file object in
    chunks (httpx: 64 KiB): :func:`hubsoup.progress.upload_steps` reports each chunk reached and a cancel lands
    between two chunks, not after the file. (The test Hub takes every file inline in the commit.)"""
    from huggingface_hub import CommitOperationAdd

    from hubsoup.progress import Monitor, upload_steps

    data = bytes(range(256)) * 4096  # 1 MiB
    (tmp_path / "w.safetensors").write_bytes(data)
    (tmp_path / "c.json").write_bytes(b"{}")
    ops = [CommitOperationAdd("c.json", open(tmp_path / "c.json", "rb")),
           CommitOperationAdd("w.safetensors", open(tmp_path / "w.safetensors", "rb"))]
    def upload(op):  # what the LFS upload does with the operation's file: as_file(), read in chunks
        with op.as_file() as f:
            while f.read(65536):
                pass

    rec = Recorder()
    mon = Monitor(rec)
    mon.plan({"push": 1})
    mon.stage("push")
    upload_steps(mon, ops, upload)
    during = [d for d, _, m in rec.calls if m == "uploading w.safetensors"]
    assert len(during) == 16 and during == sorted(during), during  # one report per chunk read
    assert abs(during[7] - (2 + 8 * 65536) / (len(data) + 2 + 1)) < 1e-9  # in bytes (2: c.json, +1: the commit)
    # a cancel between two chunks of the file stops the upload there
    ops = [CommitOperationAdd("w.safetensors", open(tmp_path / "w.safetensors", "rb"))]
    rec = Recorder(cancel_when=lambda d, s, m: m == "uploading w.safetensors" and d > 0.25)
    mon = Monitor(rec, rec.cancel)
    mon.plan({"push": 1})
    mon.stage("push")
    with pytest.raises(MergeCancelled, match="during the upload"):
        upload_steps(mon, ops, upload)
    assert not any(m.startswith("uploaded") for _, _, m in rec.calls)
