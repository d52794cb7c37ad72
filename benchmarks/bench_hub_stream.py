#!/usr/bin/env python3
"""Hub to Hub at any size (issue 45): a merge whose disk is a few shards and whose time is the download's.

Against the project's own test Hub server (``tests/hub_server.py``, in a process of its own) with its bandwidth
limited (``--bandwidth``, default 30 MB/s: downloads share it, all connections together, and LFS uploads get as
much on the link's other direction), on a Llama-shaped bfloat16 model of ≥ 20 shards, base + 3 fine-tunes on the
Hub, task arithmetic:

1. **download only**: ``huggingface_hub.snapshot_download`` of the four repos (what a merge needed before);
2. **merge only**: ``hubsoup.merge`` of the downloaded folders (local files);
3. **upload only**: ``HfApi.upload_folder`` of that output to a new repo (LFS uploads, throttled as downloads);
4. **sequential** (the old way): 1 + 2 + 3, one after another; and **mergekit's way**: 1, then ``mergekit``
   0.1.5's merge of the downloaded folders (its own venv: ``--mergekit-python``; ``dtype: float32``,
   ``out_dtype: bfloat16``, as hubsoup computes and writes), then ``upload_folder`` of its output: their sum;
5. **streamed, local output**: ``hubsoup.merge`` of the Hub IDs, inputs read in place (``sources/remote.py``), the
   output written to a folder;
6. **partial**: a mergekit ``slices:`` config over half the layers of one fine-tune: fetched vs needed;
7. **streamed + push** (the run the targets are about): ``hubsoup.merge(..., push=REPO)`` without ``out``: inputs
   read in place, each output shard uploaded as soon as it is written and deleted, one commit at the end, under
   ``max_disk`` (input bytes ≥ 10 × it): wall time, peak local disk (its working folder, ``TMPDIR`` and
   ``HF_HOME``: Hub cache and push records; allocated blocks sampled every 50 ms), bytes fetched vs needed.

Targets (issue 45): peak disk ≤ 4 output shards + the read-ahead window (the read-ahead is held in memory, so the
disk is held to 4 output shards alone); wall ≤ 1.2 × the largest of 1, 2, 3; bytes fetched ≤ 1.05 × needed.
Every measured step runs in a fresh process, its imports done before its clock starts; with ``--repeat N`` the
steps run interleaved N times and the fastest of each is kept (the machine's load moves the same for all).

Writes ``benchmarks/results/hub_stream.{md,json}``.

Usage (one command; what the results file was made with)::

    python benchmarks/bench_hub_stream.py --repeat 3   # ~7 min on 2 cores (+1 min to build the models once)
    python benchmarks/bench_hub_stream.py --quick      # a small model: a smoke test of the script (~1 min)

mergekit runs from ``benchmarks/.work/mergekit-venv`` (created if missing with ``pip install -c constraints.txt
torch==2.13.0 mergekit==0.1.5``), or the interpreter ``--mergekit-python`` names; ``--no-mergekit`` leaves it out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WORK = os.path.join(HERE, ".work", "hubstream")
MB = 10**6

# ~69M parameters, 138 MB in bfloat16; 6 MB shards: 26 per model. Largest tensor: embed_tokens, 4096 x 768.
FULL = dict(vocab_size=4096, hidden_size=768, intermediate_size=2048, num_hidden_layers=10, num_attention_heads=12,
            num_key_value_heads=12)
QUICK = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4)
SHARD = {"full": "6MB", "quick": "300KB"}


def child_env(**extra: str) -> dict:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.path.join(REPO, "tests"), "HF_HUB_DISABLE_XET": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_OFFLINE": "0",
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("HF_TOKEN", None)
    env.update(extra)
    return env


# --------------------------------------------------------------------------------------------
# the models and the server
# --------------------------------------------------------------------------------------------
def build_models(kind: str, log) -> dict[str, str]:
    root = os.path.join(WORK, kind)
    names = ["base", "ft1", "ft2", "ft3"]
    if all(os.path.isfile(os.path.join(root, n, "config.json")) for n in names):
        return {n: os.path.join(root, n) for n in names}
    log(f"building the {kind} models in {os.path.relpath(root, REPO)} (once)")
    code = f"""
import os, sys, torch, transformers
from hubsoup.testing import make_finetune, write_card_metadata
root = {root!r}
cfg = transformers.LlamaConfig(**{(FULL if kind == "full" else QUICK)!r}, tie_word_embeddings=False)
torch.manual_seed(0)
m = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
base = os.path.join(root, "base")
m.save_pretrained(base, max_shard_size={SHARD[kind]!r})
for i in (1, 2, 3):
    make_finetune(base, os.path.join(root, f"ft{{i}}"), seed=i, scale=0.01, base_model="bench/base")
"""
    subprocess.run([sys.executable, "-c", code], check=True, env=child_env())
    return {n: os.path.join(root, n) for n in names}


SERVER = """
import json, os, signal, sys, threading
from hub_server import HubServer
port, rate, models, stats = int(sys.argv[1]), float(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
hub = HubServer(port=port, content_shas=True).start()
for name, folder in models.items():
    hub.seed(f"bench/{name}", folder)  # safetensors files as LFS objects, their sha256 known (as the Hub's)
hub.limit_bandwidth(rate or None)

def dump(*_):
    with hub._served_cond:
        rows = list(hub.served)
    tmp = stats + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rows, f)
    os.replace(tmp, stats)

def clear(*_):
    with hub._served_cond:
        hub.served.clear()

signal.signal(signal.SIGUSR1, dump)
signal.signal(signal.SIGUSR2, clear)
print("ready", flush=True)
threading.Event().wait()
"""


class Server:
    """The test Hub in a process of its own (the merge must not share a GIL with it), seeded with the models."""

    def __init__(self, models: dict[str, str], rate: float, work: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.stats = os.path.join(work, "served.json")
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, str(self.port), str(rate), json.dumps(models),
                                      self.stats], env=child_env(), stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def served(self) -> list[tuple[str, int, int]]:
        """``(path, first byte, bytes)`` of every file body sent since the last :meth:`clear`."""
        before = os.path.getmtime(self.stats) if os.path.exists(self.stats) else 0
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if os.path.exists(self.stats) and os.path.getmtime(self.stats) != before:
                with open(self.stats) as f:
                    return [tuple(r) for r in json.load(f)]
            time.sleep(0.02)
        raise RuntimeError("the server did not report what it served")

    def clear(self) -> None:
        self.proc.send_signal(signal.SIGUSR2)
        time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


# --------------------------------------------------------------------------------------------
# measured steps, each in a fresh process
# --------------------------------------------------------------------------------------------
def run_child(code: str, env: dict, sample: list[str] | None = None, cwd: str | None = None,
              python: str | None = None) -> dict:
    """Run ``code`` with ``python`` (default: this one; it prints one JSON line last); with ``sample``, the folders'
    allocated bytes are summed every 50 ms while it runs and the peak is added as ``peak_disk``."""
    peak = [0]
    stop = threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            total = 0
            for folder in sample or ():
                for d, _, files in os.walk(folder):
                    for f in files:
                        try:
                            total += os.lstat(os.path.join(d, f)).st_blocks * 512
                        except OSError:
                            pass
            peak[0] = max(peak[0], total)
            stop.wait(0.05)

    t = threading.Thread(target=sampler, daemon=True)
    if sample:
        t.start()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([python or sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=cwd)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    stop.set()
    if sample:
        t.join()
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["cpu_seconds_process"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if sample:
        out["peak_disk"] = peak[0]
    return out


DOWNLOAD = """
import json, time
from huggingface_hub import snapshot_download
t0 = time.perf_counter()
folders = {n: snapshot_download(f"bench/{n}") for n in ("base", "ft1", "ft2", "ft3")}
print(json.dumps({"seconds": time.perf_counter() - t0, "folders": folders}))
"""

MERGE_LOCAL = """
import json, time, hubsoup
merge = hubsoup.merge  # imports the API (torch, transformers) before the clock starts
f = json.loads({folders!r})
t0 = time.perf_counter()
r = merge([f["ft1"], f["ft2"], f["ft3"]], "task_arithmetic", base=f["base"], out={out!r}, shard_size={shard!r},
          quiet=True)
print(json.dumps({{"seconds": time.perf_counter() - t0}}))
"""

MERGEKIT_LOCAL = """
import json, time
from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge
from mergekit.options import MergeOptions
f = json.loads({folders!r})
cfg = MergeConfiguration.model_validate({{
    "merge_method": "task_arithmetic", "base_model": f["base"], "dtype": "float32", "out_dtype": "bfloat16",
    "models": [{{"model": f[k], "parameters": {{"weight": 1 / 3}}}} for k in ("ft1", "ft2", "ft3")]}})
t0 = time.perf_counter()
run_merge(cfg, {out!r}, options=MergeOptions(lazy_unpickle=True, copy_tokenizer=False, quiet=True,
                                             out_shard_size={shard_bytes}))
print(json.dumps({{"seconds": time.perf_counter() - t0}}))
"""

UPLOAD = """
import json, time
from huggingface_hub import HfApi
api = HfApi(token="hf_write_alice")
api.create_repo({repo!r})  # a new repo: the Hub holds none of its objects yet
t0 = time.perf_counter()
api.upload_folder(repo_id={repo!r}, folder_path={out!r})
print(json.dumps({{"seconds": time.perf_counter() - t0}}))
"""

MERGE_STREAM = """
import dataclasses, json, time, hubsoup
merge = hubsoup.merge  # imports the API (torch, transformers) before the clock starts
import hubsoup.api, hubsoup.hub  # noqa: F401 - the push's modules too
t0 = time.perf_counter()
r = merge(["bench/ft1", "bench/ft2", "bench/ft3"], "task_arithmetic", base="bench/base",
          quiet=True, max_disk={max_disk!r}, read_ahead={read_ahead!r}{extra})
print(json.dumps({{"seconds": time.perf_counter() - t0, "network": r.network,
                  "pushed": getattr(r.pushed, "oid", None)}}))
"""

SLICES = """
import json, time
from hubsoup.workflows.rerun import run_config
text = "merge_method: passthrough\\nslices:\\n  - sources:\\n      - model: bench/ft1\\n        layer_range: [0, {half}]\\n"
t0 = time.perf_counter()
r = run_config(text, out={out!r}, quiet=True)
print(json.dumps({{"seconds": time.perf_counter() - t0, "network": r.network}}))
"""


def folder_bytes(folder: str, suffix: str = ".safetensors") -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs if f.endswith(suffix))


def tensor_bytes(folder: str, only: str | None = None) -> int:
    """Bytes of the tensors in ``folder``'s safetensors files (those whose name matches ``only``)."""
    import re

    total = 0
    for f in os.listdir(folder):
        if f.endswith(".safetensors"):
            with open(os.path.join(folder, f), "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                for k, v in json.loads(fh.read(n)).items():
                    if k != "__metadata__" and (only is None or re.search(only, k)):
                        total += v["data_offsets"][1] - v["data_offsets"][0]
    return total


def ensure_mergekit(python: str | None, log) -> str:
    """The interpreter of a venv with mergekit 0.1.5 (created under benchmarks/.work if missing)."""
    if python:
        return python
    venv = os.path.join(HERE, ".work", "mergekit-venv")
    py = os.path.join(venv, "bin", "python")
    if not os.path.isfile(py):
        log(f"creating {os.path.relpath(venv, REPO)} (mergekit==0.1.5, torch pinned by constraints.txt)")
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run([py, "-m", "pip", "install", "-q", "-c", os.path.join(REPO, "constraints.txt"),
                        "torch==2.13.0", "mergekit==0.1.5"], check=True)
    return py


def mergekit_version(py: str) -> str:
    r = subprocess.run([py, "-c", "import importlib.metadata as m; print(m.version('mergekit'))"],
                       capture_output=True, text=True)
    return r.stdout.strip() or f"unknown ({r.stderr.strip()[-200:]})"


def shard_sizes(folder: str) -> list[int]:
    return sorted((os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
                   if f.endswith(".safetensors")), reverse=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small model: a smoke test of the script")
    ap.add_argument("--bandwidth", type=float, default=30.0,
                    help="the server's link, MB/s each way (default 30)")
    ap.add_argument("--read-ahead", default="64MB", help="the streamed merges' read-ahead window (default 64MB)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="interleaved runs of every timed step; the fastest of each is kept (default 1)")
    ap.add_argument("--mergekit-python", help="python of a venv with mergekit 0.1.5 (default: "
                                              "benchmarks/.work/mergekit-venv, created if missing)")
    ap.add_argument("--no-mergekit", action="store_true", help="leave mergekit's way out")
    args = ap.parse_args()
    kind = "quick" if args.quick else "full"
    log = lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)  # noqa: E731
    models = build_models(kind, log)
    mk_py = None if args.no_mergekit else ensure_mergekit(args.mergekit_python, log)
    in_shards = shard_sizes(models["base"])
    n_shards = len(in_shards)
    inputs = sum(folder_bytes(models[n]) for n in models)
    output = folder_bytes(models["base"])  # task arithmetic in the inputs' dtype: the base's size
    shard_size = SHARD[kind]
    shard_bytes = int(float(shard_size[:-2]) * (MB if shard_size.endswith("MB") else 1000))
    rate = args.bandwidth * MB
    # the push run's disk limit: 4 output shards (the most it may hold: K + 1 = 3 shards in flight) and room for the
    # Hub cache's configs; the inputs are ≥ 10 × it
    max_disk_push = 4 * in_shards[0] + MB
    work = tempfile.mkdtemp(prefix="hubsoup-bench-stream-", dir=os.path.join(HERE, ".work"))
    result: dict = {"model": {"kind": kind, "config": FULL if kind == "full" else QUICK, "dtype": "bfloat16",
                              "shards_per_model": n_shards, "largest_shard": in_shards[0], "input_bytes": inputs,
                              "output_bytes": output, "output_shard_size": shard_size},
                    "bandwidth": rate, "read_ahead": args.read_ahead, "machine": machine(),
                    "started": time.strftime("%Y-%m-%d %H:%M:%S"), "load_before": os.getloadavg(),
                    "uptime_before": uptime(), "mergekit": mergekit_version(mk_py) if mk_py else None}
    server = Server(models, rate, work)
    log(f"server on {server.endpoint}, {args.bandwidth:g} MB/s each way; inputs {inputs / MB:.0f} MB in 4 × "
        f"{n_shards} shards; {uptime()}")
    steps = ["download", "merge", "upload", "streamed", "push"] + (["mergekit", "mergekit_upload"] if mk_py else [])
    runs: dict[str, list] = {k: [] for k in steps}
    try:
        def env(home: str) -> dict:
            return child_env(HF_ENDPOINT=server.endpoint, HF_HOME=home)

        max_disk_local = output + 10 * MB  # the output stays local here: all of it counts (no push)
        for rep in range(args.repeat):  # interleaved: the machine's load moves the same for every step
            # 1. download only
            home1 = os.path.join(work, f"home-download-{rep}")
            down = run_child(DOWNLOAD, env(home1))
            runs["download"].append(down["seconds"])
            folders = json.dumps(down["folders"])
            # 2. merge only, local files
            out2 = os.path.join(work, f"merged-local-{rep}")
            merge = run_child(MERGE_LOCAL.format(folders=folders, out=out2, shard=shard_size), env(home1))
            runs["merge"].append(merge["seconds"])
            # 3. upload only, to a new repo
            up = run_child(UPLOAD.format(out=out2, repo=f"soup-org/upload-only-{rep}"), env(home1))
            runs["upload"].append(up["seconds"])
            out_shards = shard_sizes(out2)
            shutil.rmtree(out2, ignore_errors=True)
            # 4. mergekit's way: its merge of the downloaded files, then the upload of its output
            if mk_py:
                out4 = os.path.join(work, f"merged-mergekit-{rep}")
                mk = run_child(MERGEKIT_LOCAL.format(folders=folders, out=out4, shard_bytes=shard_bytes),
                               child_env(HF_HUB_OFFLINE="1", HF_HOME=home1), python=mk_py)
                runs["mergekit"].append(mk["seconds"])
                mku = run_child(UPLOAD.format(out=out4, repo=f"soup-org/mergekit-{rep}"), env(home1))
                runs["mergekit_upload"].append(mku["seconds"])
                shutil.rmtree(out4, ignore_errors=True)
            shutil.rmtree(home1, ignore_errors=True)
            # 5. streamed in, local output
            home5 = os.path.join(work, f"home-stream-{rep}")
            parent5 = os.path.join(work, f"stream-out-{rep}")
            os.makedirs(parent5)
            os.makedirs(home5)
            server.clear()
            st = run_child(MERGE_STREAM.format(max_disk=max_disk_local, read_ahead=args.read_ahead,
                                               extra=f", out={os.path.join(parent5, 'soup')!r}, "
                                                     f"shard_size={shard_size!r}"),
                           env(home5), sample=[home5, parent5])
            st["served"] = server.served()
            runs["streamed"].append(st)
            shutil.rmtree(parent5, ignore_errors=True)
            shutil.rmtree(home5, ignore_errors=True)
            # 7. streamed in, streamed out: no local copy, under max_disk
            home7 = os.path.join(work, f"home-push-{rep}")
            parent7 = os.path.join(work, f"push-cwd-{rep}")
            os.makedirs(parent7)
            os.makedirs(home7)
            server.clear()
            extra = (f", push='soup-org/streamed-{rep}', shard_size={shard_size!r}, token='hf_write_alice'")
            # its working folder (where a push without --out works), TMPDIR and HF_HOME: every disk it may use
            p7 = run_child(MERGE_STREAM.format(max_disk=max_disk_push, read_ahead=args.read_ahead, extra=extra),
                           {**env(home7), "TMPDIR": parent7}, sample=[home7, parent7], cwd=parent7)
            p7["served"] = server.served()
            p7["left_on_disk"] = sum(len(fs) for _, _, fs in os.walk(parent7))
            runs["push"].append(p7)
            shutil.rmtree(parent7, ignore_errors=True)
            shutil.rmtree(home7, ignore_errors=True)
            log(f"run {rep + 1}: download {down['seconds']:.1f} s, merge {merge['seconds']:.1f} s, upload "
                f"{up['seconds']:.1f} s" + (f", mergekit {mk['seconds']:.1f} s + upload {mku['seconds']:.1f} s"
                                            if mk_py else "")
                + f"; streamed (local output) {st['seconds']:.1f} s; streamed + push {p7['seconds']:.1f} s, peak "
                f"disk {p7['peak_disk'] / MB:.1f} MB; {uptime()}")
        result["runs"] = {k: [r if isinstance(r, float) else r["seconds"] for r in v] for k, v in runs.items()}
        best = {k: min(v) for k, v in result["runs"].items()}
        result["download_only"], result["merge_only"], result["upload_only"] = (
            best["download"], best["merge"], best["upload"])
        result["sequential"] = best["download"] + best["merge"] + best["upload"]
        if mk_py:
            result["mergekit_only"], result["mergekit_upload"] = best["mergekit"], best["mergekit_upload"]
            result["mergekit_sequential"] = best["download"] + best["mergekit"] + best["mergekit_upload"]
        largest = max(result["download_only"], result["merge_only"], result["upload_only"])
        result["largest_of_three"] = largest
        result["model"]["output_largest_shard"] = out_shards[0]
        result["model"]["output_shards"] = len(out_shards)
        needed = sum(tensor_bytes(models[n]) for n in models)
        for key, name in (("streamed", "streamed"), ("push", "streamed_push")):
            r = min(runs[key], key=lambda x: x["seconds"])  # the fastest, as for the other steps
            served = r.pop("served")
            for x in runs[key]:
                x.pop("served", None)
            r["fetched_server"] = sum(n for p, _, n in served if p.endswith(".safetensors"))
            r["needed_tensors"] = needed
            r["wall_vs_largest"] = r["seconds"] / largest
            r["wall_vs_sequential"] = r["seconds"] / result["sequential"]
            r["fetched_vs_needed"] = r["network"]["fetched"] / r["network"]["needed"]
            r["server_fetched_vs_tensors"] = r["fetched_server"] / needed
            result[name] = r
        st, p7 = result["streamed"], result["streamed_push"]
        st["max_disk"] = max_disk_local
        st["peak_disk_without_output"] = st["peak_disk"] - output  # the Hub cache and temporary files
        p7["max_disk"] = max_disk_push
        p7["peak_disk_in_output_shards"] = p7["peak_disk"] / out_shards[0]
        log(f"streamed + push: {p7['seconds']:.1f} s ({p7['wall_vs_largest']:.2f}× the largest of the three, "
            f"{p7['wall_vs_sequential']:.2f}× the sequential way), peak disk {p7['peak_disk'] / MB:.1f} MB "
            f"({p7['peak_disk_in_output_shards']:.2f} output shards), fetched/needed {p7['fetched_vs_needed']:.4f}")

        # 6. partial: slices over half the layers of ft1
        home6 = os.path.join(work, "home-slices")
        half = (FULL if kind == "full" else QUICK)["num_hidden_layers"] // 2
        server.clear()
        sl = run_child(SLICES.format(half=half, out=os.path.join(work, "slices")), env(home6))
        served = server.served()
        layers = "|".join(str(i) for i in range(half))
        want = tensor_bytes(models["ft1"], rf"^(?!model\.layers\.)|^model\.layers\.({layers})\.")
        data = sum(n for p, first, n in served if p.endswith(".safetensors") and first > 0)
        heads = sum(n for p, first, n in served if p.endswith(".safetensors") and first == 0)
        sl.update(needed_tensors=want, fetched_data=data, fetched_headers=heads,
                  fetched_vs_needed=sl["network"]["fetched"] / sl["network"]["needed"],
                  server_data_vs_tensors=(data + heads) / want, file_bytes=folder_bytes(models["ft1"]))
        result["partial"] = sl
        log(f"partial (layers 0-{half - 1} of {2 * half}): fetched {(data + heads) / MB:.1f} MB of "
            f"{sl['file_bytes'] / MB:.1f} MB, {sl['server_data_vs_tensors']:.3f}× the tensors it needs")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    result["load_after"] = os.getloadavg()
    result["uptime_after"] = uptime()
    result["targets"] = targets(result)
    write(result)


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def targets(r: dict) -> list[dict]:
    largest = r["largest_of_three"]
    st, pt, p7, m = r["streamed"], r["partial"], r["streamed_push"], r["model"]
    shard = m["output_largest_shard"]
    return [
        {"target": "wall ≤ 1.2 × max(download, merge, upload) (streamed in and out)",
         "value": round(p7["wall_vs_largest"], 3), "met": p7["wall_vs_largest"] <= 1.2},
        {"target": "peak disk ≤ 4 output shards + the read-ahead window (streamed in and out; the window is in "
                   "memory: held to 4 shards)",
         "value": f"{p7['peak_disk'] / MB:.1f} MB = {p7['peak_disk_in_output_shards']:.2f} shards",
         "met": p7["peak_disk"] <= 4 * shard},
        {"target": "bytes fetched ≤ 1.05 × needed (streamed in and out)", "value": round(p7["fetched_vs_needed"], 4),
         "met": p7["fetched_vs_needed"] <= 1.05},
        {"target": "bytes fetched ≤ 1.05 × needed (slices over half the layers)",
         "value": round(pt["fetched_vs_needed"], 4), "met": pt["fetched_vs_needed"] <= 1.05},
        {"target": "input bytes ≥ 10 × the --max-disk it runs under", "value": round(m["input_bytes"] / p7["max_disk"], 1),
         "met": m["input_bytes"] >= 10 * p7["max_disk"]},
        {"target": "≥ 20 shards per model, base + 3 inputs", "value": m["shards_per_model"],
         "met": m["shards_per_model"] >= 20},
        {"target": "(inputs only, local output) wall ≤ 1.2 × max(download, merge)",
         "value": round(st["seconds"] / max(r["download_only"], r["merge_only"]), 3),
         "met": st["seconds"] <= 1.2 * max(r["download_only"], r["merge_only"])},
    ]


def machine() -> dict:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def write(r: dict) -> None:
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    name = "hub_stream" + ("_quick" if r["model"]["kind"] == "quick" else "")
    with open(os.path.join(HERE, "results", f"{name}.json"), "w") as f:
        json.dump(r, f, indent=2, default=str)
    st, pt, p7, m = r["streamed"], r["partial"], r["streamed_push"], r["model"]
    mb = lambda n: f"{n / MB:.1f} MB"  # noqa: E731
    runs = {k: [round(x, 1) for x in v] for k, v in r["runs"].items()}
    seq_disk = m["input_bytes"] + m["output_bytes"]
    lines = [
        "# Hub to Hub: inputs read in place, output pushed as written (`benchmarks/bench_hub_stream.py`)", "",
        f"Run {r['started']}, {m['kind']} model: bfloat16 Llama, {m['shards_per_model']} shards per model (largest "
        f"{mb(m['largest_shard'])}), base + 3 fine-tunes = {mb(m['input_bytes'])} on the test Hub server (its own "
        f"process), its link limited to {r['bandwidth'] / MB:g} MB/s each way (downloads together; LFS uploads on "
        f"the other direction); task arithmetic; output {mb(m['output_bytes'])} in {m['output_shards']} shards of "
        f"{m['output_shard_size']}; read-ahead {r['read_ahead']} (memory). Machine: {r['machine']['cpus']} CPUs, "
        f"shared: `{r['uptime_before']}` before, `{r['uptime_after']}` after; ratios within the run are what count. "
        f"The fastest of {len(r['runs']['push'])} interleaved runs of each step (seconds): {runs}.", "",
        "| step | wall (s) | / largest of 1-3 | peak local disk |", "|---|---:|---:|---:|",
        f"| 1. download only (`snapshot_download` of the 4 repos) | {r['download_only']:.1f} | "
        f"{r['download_only'] / r['largest_of_three']:.2f} | {mb(m['input_bytes'])} (the inputs) |",
        f"| 2. merge only (hubsoup, local files) | {r['merge_only']:.1f} | {r['merge_only'] / r['largest_of_three']:.2f}"
        f" | {mb(m['output_bytes'])} (the output) |",
        f"| 3. upload only (`upload_folder`, LFS) | {r['upload_only']:.1f} | "
        f"{r['upload_only'] / r['largest_of_three']:.2f} | - |",
        f"| 4. sequential: 1 + 2 + 3 | {r['sequential']:.1f} | {r['sequential'] / r['largest_of_three']:.2f} | "
        f"{mb(seq_disk)} (inputs and output) |",
    ]
    if r.get("mergekit_sequential") is not None:
        lines += [f"| 4m. mergekit {r['mergekit']}'s way: 1 + its merge ({r['mergekit_only']:.1f} s) + upload "
                  f"({r['mergekit_upload']:.1f} s) | {r['mergekit_sequential']:.1f} | "
                  f"{r['mergekit_sequential'] / r['largest_of_three']:.2f} | {mb(seq_disk)} (inputs and output) |"]
    lines += [
        f"| 5. hubsoup, inputs read in place, output to a folder | {st['seconds']:.1f} | {st['wall_vs_largest']:.2f} | "
        f"{mb(st['peak_disk'])} (the output, and {mb(st['peak_disk_without_output'])} besides) |",
        f"| **7. hubsoup, inputs read in place, output pushed as written** (`merge(..., push=...)`, no local copy) | "
        f"**{p7['seconds']:.1f}** | **{p7['wall_vs_largest']:.2f}** | **{mb(p7['peak_disk'])}** "
        f"({p7['peak_disk_in_output_shards']:.2f} output shards) |",
        "", "| the run with push (7) | value |", "|---|---:|",
        f"| --max-disk it ran under | {mb(p7['max_disk'])} (the inputs are {m['input_bytes'] / p7['max_disk']:.1f}×) |",
        f"| peak local disk (working folder, TMPDIR, HF_HOME; sampled every 50 ms) | {mb(p7['peak_disk'])} |",
        f"| predicted peak (the footprint max_disk is checked against) | "
        f"{mb(_predicted_peak(p7['network']['predicted']))} |",
        f"| files left in its working folder | {p7['left_on_disk']} |",
        f"| bytes fetched / needed (hubsoup's count) | {p7['network']['fetched']:,} / {p7['network']['needed']:,}"
        f" = {p7['fetched_vs_needed']:.4f} |",
        f"| bytes served by the server / the inputs' tensor bytes | {p7['fetched_server']:,} / "
        f"{p7['needed_tensors']:,} = {p7['server_fetched_vs_tensors']:.4f} |",
        f"| files verified against their sha256 (read whole) | {len(p7['network']['verified'])} |",
        f"| wall / the largest of download, merge, upload | {p7['wall_vs_largest']:.2f} |",
        f"| wall / the sequential way | {p7['wall_vs_sequential']:.2f} |",
        "", f"Partial read (`slices:` over layers 0-{m['config']['num_hidden_layers'] // 2 - 1} of one "
        f"fine-tune): fetched {mb(pt['fetched_data'] + pt['fetched_headers'])} of its {mb(pt['file_bytes'])} "
        f"(headers {mb(pt['fetched_headers'])}); the tensors it needs: {mb(pt['needed_tensors'])}; hubsoup's "
        f"count fetched / needed = {pt['fetched_vs_needed']:.4f}.", "",
        "| target (issue 45) | value | met |", "|---|---:|---|"]
    for t in r["targets"]:
        met = "yes" if t["met"] else "**no**"
        lines.append(f"| {t['target']} | {t['value']} | {met} |")
    with open(os.path.join(HERE, "results", f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def _predicted_peak(f: dict) -> int:
    """:attr:`hubsoup.footprint.Footprint.peak_disk` of a footprint as ``dataclasses.asdict`` gives it."""
    sys.path.insert(0, REPO)
    from hubsoup.footprint import Footprint

    return Footprint(**{k: tuple(v) if k == "held_shards" else v for k, v in f.items()}).peak_disk


if __name__ == "__main__":
    main()
