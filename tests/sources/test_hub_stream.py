"""Hub inputs read in place (issue 45, the input side): only the bytes a merge needs, by range requests at the
pinned commit, fetched ahead within a bounded window, verified when read whole; the faults of the read side; the
run's disk and network predicted and ``--max-disk`` enforced before any weight moves.

Every test runs against the suite's Hub server (``tests/hub_server.py``), with its bandwidth limit, body faults
and byte counters where a test needs them.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import hubsoup
from hubsoup import errors
from hubsoup.cli import main
from hubsoup.sources import remote
from hubsoup.testing import make_adapter, make_finetune, tiny_model

from paths import ROOT as REPO
MODEL = dict(layers=4, hidden=128, vocab=512)  # ~2.9 MB of float32 in 8 shards of ~400 kB


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """A sharded base and three fine-tunes of it (local folders)."""
    root = tmp_path_factory.mktemp("stream-zoo")
    base = str(root / "base")
    tiny_model("llama", seed=0, **MODEL).save_pretrained(base, max_shard_size="400KB")
    out = {"base": base}
    for i in (1, 2, 3):
        out[f"ft{i}"] = make_finetune(base, str(root / f"ft{i}"), seed=i, base_model="alice/base")
    return out


@pytest.fixture()
def published(hub, zoo):
    """``zoo`` on the test Hub: alice/base, alice/ft1, alice/ft2, alice/ft3."""
    for name, folder in zoo.items():
        hub.seed(f"alice/{name}", folder)
    return zoo


def weight_gets(hub, repo: str | None = None) -> list[dict]:
    rx = rf"^/{re.escape(repo)}/resolve/" if repo else r"/resolve/"
    return [c for c in hub.calls("GET", rx) if c["path"].endswith(".safetensors")]


def range_start(call: dict) -> int:
    m = re.match(r"bytes=(\d+)-", call.get("range") or "")
    return int(m.group(1)) if m else 0


def cached_weights() -> set[str]:
    return {os.path.join(d, f) for d, _, fs in os.walk(os.environ["HF_HOME"]) for f in fs
            if f.endswith(".safetensors") or ".incomplete" in f}


def files_bytes(folder: str) -> dict[str, int]:
    return {f: os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors")}


def tensor_ranges(folder: str) -> dict[str, dict[str, tuple[int, int]]]:
    """``{file: {tensor: (absolute offset, length)}}`` from the local files' headers."""
    out = {}
    for f in files_bytes(folder):
        with open(os.path.join(folder, f), "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            import json

            header = json.loads(fh.read(n))
        out[f] = {k: (8 + n + v["data_offsets"][0], v["data_offsets"][1] - v["data_offsets"][0])
                  for k, v in header.items() if k != "__metadata__"}
    return out


def same_weights(a: str, b: str) -> bool:
    def tensors(folder):
        out = {}
        for f in sorted(os.listdir(folder)):
            if f.endswith(".safetensors"):
                out.update(load_file(os.path.join(folder, f)))
        return out

    x, y = tensors(a), tensors(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def leftovers(folder, name: str) -> list[str]:
    return sorted(p for p in os.listdir(folder) if p.startswith(f".{name}.") or p == name)


# ---- 1. read in place: only what is needed, bit for bit, verified when read whole -------------------------------

def test_hub_inputs_are_read_in_place_bit_for_bit_verified_and_never_stored(hub, published, tmp_path):
    before = cached_weights()
    res = hubsoup.merge(["alice/ft1", "alice/ft2"], "task_arithmetic", base="alice/base", out=str(tmp_path / "hub"),
                        quiet=True)
    want = hubsoup.merge([published["ft1"], published["ft2"]], "task_arithmetic", base=published["base"],
                         out=str(tmp_path / "local"), quiet=True)
    assert same_weights(res.path, want.path)
    assert cached_weights() == before, "a weight file was stored"
    for repo in ("base", "ft1", "ft2"):
        sha = hub.head(f"alice/{repo}")
        gets = weight_gets(hub, f"alice/{repo}")
        assert gets and all(c["range"] and c["status"] == 206 and f"/resolve/{sha}/" in c["path"] for c in gets)
        # every byte of every file once (a tensor that began in a header read's bytes may come twice: ≤ 5 %)
        size = sum(files_bytes(published[repo]).values())
        assert size <= hub.served_bytes(rf"^/alice/{repo}/resolve/") <= 1.05 * size
    net = res.network
    assert net["needed"] <= net["fetched"] <= 1.05 * net["needed"]
    assert len(net["verified"]) == 3 * 8 and net["unverified"] == []  # every shard was read whole: checked
    # neighbouring tensors of a file came in one request (the default window): far fewer requests than tensors
    n_tensors = 3 * sum(len(ts) for ts in tensor_ranges(published["ft1"]).values())
    data_gets = [c for c in weight_gets(hub) if range_start(c) > 0]
    assert len(data_gets) <= n_tensors / 3, (len(data_gets), n_tensors)
    assert net["predicted"]["network_in"] == pytest.approx(net["fetched"], rel=0.05)


def test_a_file_read_whole_that_does_not_match_its_sha256_fails_and_commits_nothing(hub, published, tmp_path):
    # the Hub's sha256 of it says otherwise: the bytes that came are not the file
    hub.misreport_sha256("alice/ft1", "model-00003-of-00008.safetensors")
    with pytest.raises(errors.CorruptCheckpointError, match=r"input 'alice/ft1' \(model-00003-of-00008.safetensors\)"
                                                            r": the bytes read .* do not match the Hub's sha256"):
        hubsoup.merge(["alice/ft1", "alice/ft2"], "task_arithmetic", base="alice/base", out=str(tmp_path / "s"),
                      quiet=True)
    assert leftovers(tmp_path, "s") == []


def test_a_second_merge_reads_what_the_cache_holds(hub, published, tmp_path):
    first = hubsoup.merge(["alice/ft1"], "task_arithmetic", base="alice/base", out=str(tmp_path / "a"),
                          cache_inputs=True, quiet=True)  # downloaded into the Hub cache, as before
    assert any("models--alice--ft1" in p for p in cached_weights())
    hub.requests.clear()
    again = hubsoup.merge(["alice/ft1"], "task_arithmetic", base="alice/base", out=str(tmp_path / "b"), quiet=True)
    assert weight_gets(hub) == [] and again.network["fetched"] == 0  # every weight read from the cache
    assert same_weights(first.path, again.path)


def test_a_slices_config_reads_only_its_layers(hub, published, tmp_path):
    """mergekit ``slices:`` over layers 0-1 of 4: no byte of layers 2-3 is fetched; what is fetched is what the
    output holds (each read once), within 5 %."""
    from hubsoup.workflows.rerun import run_config

    text = ("merge_method: passthrough\ndtype: float32\nslices:\n"
            "  - sources:\n      - model: alice/ft1\n        layer_range: [0, 2]\n")
    res = run_config(text, out=str(tmp_path / "half"), quiet=True)
    ranges = tensor_ranges(published["ft1"])
    skipped = {(f, r) for f, ts in ranges.items() for k, r in ts.items()
               if re.match(r"model\.layers\.[23]\.", k)}
    assert skipped
    served = [(p.rsplit("/", 1)[-1], first, n) for p, first, n in hub.served if p.startswith("/alice/ft1/")]
    for f, first, n in served:
        if first == 0:
            continue  # a header read: the file's first 32 kB, whatever they hold (every shard's names are checked)
        for g, (off, length) in skipped:
            assert f != g or first + n <= off or first >= off + length, f"layer 2-3 bytes of {f} were fetched"
    out_bytes = sum(t.numel() * t.element_size() for f in os.listdir(res.path) if f.endswith(".safetensors")
                    for t in load_file(os.path.join(res.path, f)).values())
    data = sum(n for f, first, n in served if first > 0)  # beyond the header reads
    heads = sum(n for f, first, n in served if first == 0)
    assert data + heads <= 1.05 * out_bytes + heads and data + heads >= 0.5 * out_bytes
    assert all(why.startswith("read in part") for _, why in res.network["unverified"] if "ft1" in _)


def test_lora_adapters_merged_into_a_lora_output_fetch_no_base_weights(hub, tmp_path):
    base = str(tmp_path / "base")
    tiny_model("llama", seed=0, **MODEL).save_pretrained(base, max_shard_size="400KB")
    hub.seed("alice/base", base)
    for i in (1, 2):
        folder = make_adapter(tmp_path / f"lora{i}", "llama", seed=i, model_kw=MODEL, r=4,
                              target_modules=["q_proj", "v_proj"])
        hub.seed(f"alice/lora{i}", folder)
    res = hubsoup.merge(["alice/lora1", "alice/lora2"], "linear", base="alice/base", out=str(tmp_path / "out"),
                        output_format="lora", rank=8, quiet=True)
    assert os.path.isfile(os.path.join(res.path, "adapter_model.safetensors"))
    base_reads = weight_gets(hub, "alice/base")
    assert base_reads and all(range_start(c) == 0 for c in base_reads), "the base's tensors were fetched"
    assert {v for v in res.network["verified"] if "lora" in v} == {
        f"alice/lora{i}@{hub.head(f'alice/lora{i}')[:12]}/adapter_model.safetensors" for i in (1, 2)}


def test_the_read_ahead_holds_at_most_its_budget_and_keeps_the_network_busy(hub, published, tmp_path, monkeypatch):
    windows: list[remote.Window] = []
    real = remote.Window.__init__

    def spy(self, *a, **kw):
        real(self, *a, **kw)
        windows.append(self)

    monkeypatch.setattr(remote.Window, "__init__", spy)
    hub.limit_bandwidth(8_000_000)
    res = hubsoup.merge(["alice/ft1", "alice/ft2"], "task_arithmetic", base="alice/base", out=str(tmp_path / "s"),
                        read_ahead="200kB", quiet=True)
    assert windows and all(w.budget == 200_000 for w in windows)
    largest = 3 * 512 * 128 * 4  # one tensor's bytes, base and two inputs (the embedding): fetched when reached
    assert all(w.peak <= w.budget + largest for w in windows), [w.peak for w in windows]
    assert res.network["fetched"] <= 1.05 * res.network["needed"]


# ---- 2. faults on the read side -------------------------------------------------------------------------------

SHARD = "model-00003-of-00008.safetensors"


def test_a_connection_dropped_mid_tensor_resumes_from_the_byte_it_reached(hub, published, tmp_path):
    hub.fail_body(1, path=rf"^/alice/ft1/resolve/.*{SHARD}$", after=50_000, drop=True)
    res = hubsoup.merge(["alice/ft1", "alice/ft2"], "task_arithmetic", base="alice/base", out=str(tmp_path / "s"),
                        quiet=True)
    want = hubsoup.merge([published["ft1"], published["ft2"]], "task_arithmetic", base=published["base"],
                         out=str(tmp_path / "local"), quiet=True)
    assert same_weights(res.path, want.path)
    starts = [range_start(c) for c in weight_gets(hub, "alice/ft1") if c["path"].endswith(SHARD)]
    cut = next(s for s in starts if s > 0)
    assert cut + 50_000 in starts, starts  # the next request asked from the byte the dropped one reached
    assert res.network["fetched"] <= 1.05 * res.network["needed"]


def test_a_5xx_on_a_tensor_read_is_tried_again_and_a_persistent_one_is_one_line(hub, published, tmp_path,
                                                                                 monkeypatch):
    import hubsoup.sources.resolve as resolve

    waits: list[float] = []
    monkeypatch.setattr(resolve, "_sleep", waits.append)
    hub.fail_ranged(2, 503, path=rf"^/alice/ft1/resolve/.*{SHARD}$")
    res = hubsoup.merge(["alice/ft1"], "task_arithmetic", base="alice/base", out=str(tmp_path / "s"), quiet=True)
    assert waits == [1.0, 2.0] and hub.pending_failures == 0 or not hub._ranged_failures[0].remaining
    assert [c["status"] for c in weight_gets(hub, "alice/ft1") if c["status"] == 503] == [503, 503]
    assert os.path.isdir(res.path)
    hub.fail_ranged(100, 500, path=rf"^/alice/ft2/resolve/.*{SHARD}$")
    with pytest.raises(errors.InputError) as e:
        hubsoup.merge(["alice/ft2"], "task_arithmetic", base="alice/base", out=str(tmp_path / "t"), quiet=True)
    msg = str(e.value)
    assert "\n" not in msg and f"input 'alice/ft2' ({SHARD})" in msg and "Hub server error 500" in msg, msg
    assert len(waits) == 2 + 5 and leftovers(tmp_path, "t") == []


def test_a_server_that_stops_answering_mid_tensor_times_out_naming_the_repo_and_file(hub, published, tmp_path,
                                                                                    monkeypatch):
    monkeypatch.setenv("HUBSOUP_HUB_TIMEOUT", "1")
    hub.fail_body(1, path=rf"^/alice/ft1/resolve/.*{SHARD}$", after=10_000, hang=20)
    t0 = time.monotonic()
    with pytest.raises(errors.InputError) as e:
        hubsoup.merge(["alice/ft1"], "task_arithmetic", base="alice/base", out=str(tmp_path / "s"), quiet=True)
    msg = str(e.value)
    assert msg.startswith(f"input 'alice/ft1' ({SHARD}): the Hub at ") and "did not answer within 1s (timed out)" in msg
    assert time.monotonic() - t0 < 15 and leftovers(tmp_path, "s") == []


def test_the_revision_pinned_at_the_start_is_read_while_the_branch_moves(hub, published, tmp_path):
    old_sha = hub.head("alice/ft1")
    hub.limit_bandwidth(3_000_000)  # ~3 s of reading: the branch moves in the middle
    done: dict = {}

    def run():
        try:
            done["res"] = hubsoup.merge(["alice/ft1"], "task_arithmetic", base="alice/base", out=str(tmp_path / "s"),
                                        quiet=True)
        except BaseException as e:  # noqa: BLE001 - reported below
            done["error"] = e

    t = threading.Thread(target=run)
    t.start()
    assert hub.wait_served(1_500_000, timeout=60)
    moved_at = len(hub.requests)
    new_sha = hub.seed("alice/ft1", make_finetune(published["base"], str(tmp_path / "v2"), seed=9))
    t.join(120)
    assert "error" not in done, done.get("error")
    res = done["res"]
    assert res.inputs[0].sha == old_sha != new_sha
    later = [c for c in hub.requests[moved_at:] if c["path"].startswith("/alice/ft1/resolve/")]
    assert later and all(f"/resolve/{old_sha}/" in c["path"] for c in later)  # read on after the move: the old one
    want = hubsoup.merge([published["ft1"]], "task_arithmetic", base=published["base"], out=str(tmp_path / "want"),
                         quiet=True)
    assert same_weights(res.path, want.path)


def _env() -> dict:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": REPO + (os.pathsep + path if path else "")}


@pytest.mark.parametrize("sig,code,message", [
    (signal.SIGTERM, 143, "terminated (SIGTERM); no output was left behind"),
    (signal.SIGINT, 130, "interrupted; no output was left behind"),
], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_reading_from_the_hub_leaves_nothing_and_a_rerun_merges(hub, published, tmp_path, sig, code,
                                                                              message):
    hub.limit_bandwidth(1_000_000)
    before = cached_weights()
    args = [sys.executable, "-m", "hubsoup", "merge", "alice/ft1", "alice/ft2", "--base", "alice/base", "--method",
            "task_arithmetic", "--out", str(tmp_path / "s"), "-q"]
    proc = subprocess.Popen(args, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert hub.wait_served(600_000, timeout=120), "the run never read from the Hub"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert proc.returncode == code and lines == [message], err
    assert leftovers(tmp_path, "s") == [] and cached_weights() == before
    hub.limit_bandwidth(None)
    again = subprocess.run(args, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, again.stderr
    assert os.path.isfile(tmp_path / "s" / "model.safetensors")




def test_a_merge_larger_than_the_cache_disk_and_a_disk_full_while_staging(hub, published, tmp_path, small_disk):
    """The Hub cache on a 1 MB disk: read in place, a merge of 3 × 2.9 MB of inputs runs (the cache holds their
    metadata only); with --cache-inputs the download fills it: one line, no output, no temporary folder."""
    home = small_disk("1m")
    env = {**_env(), "HF_HOME": home}
    env.pop("HF_HUB_CACHE", None)
    args = [sys.executable, "-m", "hubsoup", "merge", "alice/ft1", "alice/ft2", "--base", "alice/base", "--method",
            "task_arithmetic", "-q"]
    ok = subprocess.run([*args, "--out", str(tmp_path / "a")], cwd=tmp_path, env=env, capture_output=True, text=True,
                        timeout=180)
    assert ok.returncode == 0, ok.stderr
    assert not [f for d, _, fs in os.walk(home) for f in fs if f.endswith(".safetensors")]
    full = subprocess.run([*args, "--out", str(tmp_path / "b"), "--cache-inputs"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    lines = [ln for ln in full.stderr.splitlines() if ln.strip()]
    assert full.returncode == 2 and len(lines) == 1 and "Traceback" not in full.stderr, full.stderr
    assert "disk full while downloading into the Hub cache" in lines[0], lines
    assert leftovers(tmp_path, "b") == []


# ---- 3. bounded disk, stated and enforced ----------------------------------------------------------------------

def test_max_disk_refuses_before_any_weight_is_read_naming_what_it_needs(hub, published, tmp_path, capsys):
    out = tmp_path / "s"
    with pytest.raises(errors.DiskLimitError) as e:
        hubsoup.merge(["alice/ft1", "alice/ft2"], "task_arithmetic", base="alice/base", out=str(out),
                      max_disk="1MB", quiet=True)
    msg = str(e.value)
    assert msg.startswith("this run needs 3.0 MB of local disk at its peak (output 2.9 MB; Hub cache: inputs' "
                          "metadata") and "over --max-disk (max_disk) 1.0 MB" in msg and "nothing was downloaded" in msg
    assert all(range_start(c) == 0 for c in weight_gets(hub)), "a tensor's bytes were fetched before the refusal"
    assert not out.exists() and leftovers(tmp_path, "s") == []
    # read in place, 5 MB is enough; downloading the inputs into the cache (3 × 2.9 MB) is not
    hubsoup.merge(["alice/ft1", "alice/ft2"], "task_arithmetic", base="alice/base", out=str(out), max_disk="5MB",
                  quiet=True)
    with pytest.raises(errors.DiskLimitError, match=r"Hub cache: weights 8\.\d MB \(--cache-inputs"):
        hubsoup.merge(["alice/ft1", "alice/ft2"], "task_arithmetic", base="alice/base", out=str(tmp_path / "t"),
                      max_disk="5MB", cache_inputs=True, quiet=True)
    rc = main(["merge", "alice/ft1", "--base", "alice/base", "--method", "task_arithmetic", "--out",
               str(tmp_path / "u"), "--max-disk", "1MB", "-q"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: this run needs ") and not (tmp_path / "u").exists()


def test_plan_push_prints_disk_network_and_time_from_a_measured_bandwidth(hub, published, capsys):
    hub.limit_bandwidth(2_000_000)
    rc = main(["plan", "alice/ft1", "alice/ft2", "--base", "alice/base", "--method", "task_arithmetic",
               "--push", "alice/soup", "--shard-size", "500kB", "--max-disk", "10MB"])
    out = capsys.readouterr().out
    assert rc == 0, out
    disk = next(ln for ln in out.splitlines() if ln.startswith("disk: peak "))
    assert "(within --max-disk 10.0 MB)" in disk and "3 shards of at most 495.6 kB in flight while they upload" in disk
    assert re.match(r"disk: peak 1\.5 MB .*: output 1\.[45] MB \(3 shards", disk), disk
    net = next(ln for ln in out.splitlines() if ln.startswith("network: in "))
    assert re.match(r"network: in 8\.\d MB, \d\.\d MB read in place, in memory; out 2\.9 MB", net), net
    wall = next(ln for ln in out.splitlines() if ln.startswith("time: about "))
    rate = float(re.search(r"at ([\d.]+) MB/s \(measured\)", wall).group(1))
    assert 1.0 <= rate <= 2.5, wall  # the server's 2 MB/s, measured
    assert "merge " in wall and "(measured on this machine)" in wall and "upload " in wall


# ---- 4. everywhere: continual add, search keeps its inputs in the cache -----------------------------------------

def test_continual_add_from_the_hub_reads_in_place(hub, published, tmp_path):
    from hubsoup import continual

    soup = str(tmp_path / "soup")
    continual.init(["alice/ft1"], base="alice/base", out=soup, quiet=True)
    before = cached_weights()
    hub.requests.clear()
    continual.add(soup, "alice/ft2", quiet=True)
    gets = weight_gets(hub, "alice/ft2")
    assert gets and all(c["status"] == 206 for c in gets) and cached_weights() == before


def test_search_keeps_its_inputs_in_the_cache(hub, published, tmp_path):
    from hubsoup.workflows.search import search

    search(["alice/ft1", "alice/ft2"], "task_arithmetic", base="alice/base", out=str(tmp_path / "best"),
           grid={"scale": [0.5, 1.0]}, score_fn=lambda folder: 0.0, quiet=True)
    from huggingface_hub import try_to_load_from_cache

    sha = hub.head("alice/ft1")
    assert all(isinstance(try_to_load_from_cache("alice/ft1", f, revision=sha), str) for f in files_bytes(published["ft1"]))
    # downloaded once, read by both points (and the best one's merge)
    assert hub.served_bytes(r"^/alice/ft1/resolve/.*\.safetensors$") <= 1.05 * sum(files_bytes(published["ft1"]).values())


# ---- 5. the run's token: only to the Hub -----------------------------------------------------------------------

def test_range_reads_carry_the_runs_token_and_never_to_another_host(hub, zoo, tmp_path):
    """A private repo read in place with alice's token: the Hub gets it with every range read; a redirect to another
    host (a CDN, a Xet bridge: ``localhost`` is another origin than ``127.0.0.1``) is followed without it, as
    huggingface_hub's own downloads do. Two runs with two tokens never share a file read in place."""
    from hub_server import HubServer

    from hubsoup.sources.access import scope
    from hubsoup.sources.resolve import open_input

    hub.seed("alice/base", zoo["base"])
    hub.seed("alice/ft1", zoo["ft1"], private=True)
    with HubServer(port=0) as cdn:
        cdn.seed("alice/ft1", zoo["ft1"])  # the storage behind the redirect: public, as a signed URL is
        sha = hub.head("alice/ft1")
        cdn.repos[("model", "alice/ft1")].commits[sha] = cdn.repos[("model", "alice/ft1")].commits[cdn.head("alice/ft1")]
        hub.redirect_ranged(f"http://localhost:{cdn.port}", path=r"^/alice/ft1/resolve/")
        res = hubsoup.merge(["alice/ft1"], "task_arithmetic", base="alice/base", out=str(tmp_path / "s"),
                            token=hub.token("alice"), quiet=True)
        on_hub = [c for c in weight_gets(hub, "alice/ft1")]
        on_cdn = [c for c in cdn.calls("GET", r"/resolve/") if c["path"].endswith(".safetensors")]
    assert on_hub and all(c["user"] == "alice" for c in on_hub)  # the Hub: the run's token, every request
    assert on_cdn and all(c["user"] is None and c["status"] == 206 for c in on_cdn)  # the other host: no token
    want = hubsoup.merge([zoo["ft1"]], "task_arithmetic", base=zoo["base"], out=str(tmp_path / "w"), quiet=True)
    assert same_weights(res.path, want.path)
    # two runs, two tokens: each opens its own file, with its own token's headers
    hub.redirect_ranged("http://unused", n=0)
    with scope():  # each run its own rules (and files read in place); the token: each call's argument
        a = open_input("alice/base", token=hub.token("alice"))
        a.keys()
    with scope():
        b = open_input("alice/base", token=hub.token("bob"))
        b.keys()
    ra, rb = next(iter(a._remote.values())), next(iter(b._remote.values()))
    assert ra is not rb and ra.key != rb.key
    assert ra.headers["authorization"].endswith(hub.token("alice")) and rb.headers["authorization"].endswith(
        hub.token("bob"))


def test_continual_counts_its_state_against_max_disk(hub, published, tmp_path):
    from hubsoup import continual

    with pytest.raises(errors.DiskLimitError, match=r"output 2\.9 MB; .*state and temporary files 2\.9 MB"):
        continual.init(["alice/ft1"], base="alice/base", out=str(tmp_path / "soup"), max_disk="5MB", quiet=True)
    assert all(range_start(c) == 0 for c in weight_gets(hub)) and leftovers(tmp_path, "soup") == []
    continual.init(["alice/ft1"], base="alice/base", out=str(tmp_path / "soup"), max_disk="7MB", quiet=True)
    # with --cache-inputs the weights would go to the Hub cache: refused before any of them is downloaded
    before = cached_weights()
    with pytest.raises(errors.DiskLimitError, match=r"Hub cache: weights 5\.\d MB \(--cache-inputs"):
        continual.add(str(tmp_path / "soup"), ["alice/ft2"], out=str(tmp_path / "soup2"), max_disk="7MB",
                      cache_inputs=True, quiet=True)
    assert cached_weights() == before and leftovers(tmp_path, "soup2") == []


# ---- 6. Hub to Hub: inputs read in place, the output pushed as it is written -----------------------------------

PUSH_SHARD = "400KB"  # the output (2.9 MB) in 8 shards


def pushed_tensors(hub, repo: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    out: dict[str, torch.Tensor] = {}
    for path, data in hub.files(repo).items():
        if path.endswith(".safetensors"):
            out.update(load(data))
    return out


def same_as_local(hub, repo: str, published, tmp_path, inputs=("ft1", "ft2")) -> bool:
    """The pushed weights equal, tensor for tensor, a merge of the same models from local folders."""
    want = hubsoup.merge([published[i] for i in inputs], "task_arithmetic", base=published["base"],
                         out=str(tmp_path / "local-control"), shard_size=PUSH_SHARD, quiet=True)
    got = pushed_tensors(hub, repo)
    ref = {}
    for f in sorted(os.listdir(want.path)):
        if f.endswith(".safetensors"):
            ref.update(load_file(os.path.join(want.path, f)))
    return got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)


def test_hub_to_hub_sigint_at_a_random_moment_then_a_rerun_resumes(hub, published, tmp_path):
    """Both inputs read in place and the output pushed as written; SIGINT at a random moment of the reading
    (seeded: the seed is in the message): one line, nothing committed, nothing left; the rerun uploads no shard
    twice, reads none of the uploaded shards' inputs again, and the repo's weights are a local merge's."""
    import random

    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    token = hub.login("alice")
    needed = sum(sum(files_bytes(published[r]).values()) for r in ("base", "ft1", "ft2"))
    at = int(needed * rng.uniform(0.1, 0.9))
    hub.limit_bandwidth(2_000_000)  # about 4.5 s of reading: the signal lands in the middle of the run
    args = [sys.executable, "-m", "hubsoup", "merge", "alice/ft1", "alice/ft2", "--base", "alice/base", "--method",
            "task_arithmetic", "--shard-size", PUSH_SHARD, "--push", "alice/soup", "-q"]
    # faulthandler: a crash at exit shows its threads (a daemon thread in torch's C++ code once aborted the exit)
    proc = subprocess.Popen(args, cwd=tmp_path, env={**_env(), "PYTHONFAULTHANDLER": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert hub.wait_served(at, timeout=120), f"the run never read {at} bytes (seed {seed})"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert proc.returncode == 130 and lines == [
        "interrupted; no output was left behind; nothing was committed to alice/soup (run the same command again: "
        "it resumes)"], (seed, err)
    assert len(hub.history("alice/soup")) == 1 and os.listdir(tmp_path) == [], seed  # the empty repo the push made
    first = [u["oid"] for u in hub.lfs_uploads if u["repo"] == "alice/soup"]
    hub.limit_bandwidth(None)
    served = hub.served_bytes(r"/resolve/")
    again = subprocess.run(args, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, (seed, again.stderr)
    uploads = [u["oid"] for u in hub.lfs_uploads if u["repo"] == "alice/soup"]
    assert len(uploads) == len(set(uploads)) == 8, (seed, first, uploads)  # each shard uploaded once, in all
    reread = hub.served_bytes(r"/resolve/") - served
    if first:  # the shards already up: their tensors are not read again
        assert reread < needed, (seed, len(first), reread, needed)
    assert len(hub.history("alice/soup")) == 2 and os.listdir(tmp_path) == []
    assert same_as_local(hub, "alice/soup", published, tmp_path / "control"), seed
    assert token not in out + err + again.stdout + again.stderr


def test_a_5xx_on_a_ranged_read_during_a_streamed_push_commits_nothing(hub, published, tmp_path, monkeypatch):
    """A Hub input's tensor bytes answered 500 for good while shards of the output are already uploaded: one line
    naming the input and its file, no commit, nothing left in the working folder; the rerun resumes."""
    import hubsoup.sources.resolve as resolve
    from hubsoup.hub import PushTarget

    monkeypatch.setattr(resolve, "_sleep", lambda s: None)  # the retries' waits (1, 2, 4, 8, 8 s)
    token = hub.token("alice")
    work = tmp_path / "work"
    work.mkdir()
    # the last input shard: read when the first output shards are written, and uploading
    hub.fail_ranged(1000, 500, path=r"^/alice/ft2/resolve/.*model-00008-of-00008\.safetensors$")
    with pytest.raises(errors.InputError) as e:
        hubsoup.merge(["alice/ft1", "alice/ft2"], "task_arithmetic", base="alice/base", shard_size=PUSH_SHARD,
                      push=PushTarget("alice/soup", work_dir=str(work)), token=token, quiet=True)
    msg = str(e.value)
    assert "\n" not in msg and "input 'alice/ft2' (model-00008-of-00008.safetensors)" in msg, msg
    assert "Hub server error 500" in msg, msg
    assert len(hub.history("alice/soup")) == 1 and os.listdir(work) == []  # nothing committed, nothing left
    assert not any(p.endswith(".safetensors") for p in hub.files("alice/soup"))
    first = [u["oid"] for u in hub.lfs_uploads if u["repo"] == "alice/soup"]
    hub.clear_failures()
    res = hubsoup.merge(["alice/ft1", "alice/ft2"], "task_arithmetic", base="alice/base", shard_size=PUSH_SHARD,
                        push=PushTarget("alice/soup", work_dir=str(work)), token=token, quiet=True)
    uploads = [u["oid"] for u in hub.lfs_uploads if u["repo"] == "alice/soup"]
    assert len(uploads) == len(set(uploads)) == 8 and set(first) <= set(uploads)
    assert res.pushed.oid == hub.head("alice/soup") and os.listdir(work) == []
    assert same_as_local(hub, "alice/soup", published, tmp_path / "control")
