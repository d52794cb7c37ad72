#!/usr/bin/env python3
"""Hub to Hub at any size (issue 45): a merge whose disk is a few shards and whose time is the download's.

Against the project's own test Hub server (``tests/hub_server.py``, in a process of its own) with its bandwidth
limited (``--bandwidth``, default 30 MB/s for all connections together: a link), on a Llama-shaped bfloat16 model
of ≥ 20 shards, base + 3 fine-tunes on the Hub:

1. **download only**: ``huggingface_hub.snapshot_download`` of the four repos (what a merge needed before);
2. **merge only**: ``hubsoup.merge`` of the downloaded folders (local files), task arithmetic;
3. **upload only**: ``HfApi.upload_folder`` of that output to the server;
4. **sequential** (the old way, mergekit's way): 1 + 2 + 3, one after another (their sum, measured back to back);
5. **streamed**: ``hubsoup.merge`` of the Hub IDs, inputs read in place (``sources/remote.py``), under
   ``--max-disk``: wall time, peak local disk (the Hub cache, the output's folder and its temporary folders,
   allocated blocks sampled every 50 ms), bytes fetched (hubsoup's count and the server's) vs the bytes the merge
   needs;
6. **partial**: a mergekit ``slices:`` config over half the layers of one fine-tune: fetched vs needed;
7. **streamed + push**: the same merge with ``push_to_hub`` (each output shard uploaded as it is written, none
   kept): the run the targets are about. It needs the output side of issue 45 (``hubsoup.merge(...,
   push_to_hub=...)``); without it, it is recorded as pending.

Targets (issue 45): peak disk ≤ 4 output shards + the read-ahead window (7: the read-ahead is held in memory, so
the disk target is the output's shards alone); wall ≤ 1.2 × the largest of 1, 2, 3; bytes fetched ≤ 1.05 × needed.
Every measured step runs in a fresh process (timings exclude the interpreter's start and imports).

Writes ``benchmarks/results/hub_stream.{md,json}``.

Usage::

    python benchmarks/bench_hub_stream.py            # ~3 min on 2 idle cores (+1 min to build the models once)
    python benchmarks/bench_hub_stream.py --repeat 3 # the fastest of 3 interleaved runs of each step (~6 min)
    python benchmarks/bench_hub_stream.py --quick    # a small model: a smoke test of the script (~1 min)
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
    hub.seed(f"bench/{name}", folder)
    for path, data in hub.files(f"bench/{name}").items():  # the Hub keeps its files' sha256: computed now, once
        hub._lfs_fields(path, hub.repos[("model", f"bench/{name}")].commits[hub.head(f"bench/{name}")].tree[path])
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
def run_child(code: str, env: dict, sample: list[str] | None = None, cwd: str | None = None) -> dict:
    """Run ``code`` (it prints one JSON line last); with ``sample``, the folders' allocated bytes are summed every
    50 ms while it runs and the peak is added as ``peak_disk``."""
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
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=cwd)
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
r = merge([f["ft1"], f["ft2"], f["ft3"]], "task_arithmetic", base=f["base"], out={out!r}, quiet=True)
print(json.dumps({{"seconds": time.perf_counter() - t0}}))
"""

UPLOAD = """
import json, time
from huggingface_hub import HfApi
api = HfApi(token="hf_write_alice")
api.create_repo("soup-org/upload-only", exist_ok=True)
t0 = time.perf_counter()
api.upload_folder(repo_id="soup-org/upload-only", folder_path={out!r})
print(json.dumps({{"seconds": time.perf_counter() - t0}}))
"""

MERGE_STREAM = """
import dataclasses, json, time, hubsoup
merge = hubsoup.merge  # imports the API (torch, transformers) before the clock starts
t0 = time.perf_counter()
r = merge(["bench/ft1", "bench/ft2", "bench/ft3"], "task_arithmetic", base="bench/base", out={out!r},
                  quiet=True, max_disk={max_disk!r}, read_ahead={read_ahead!r}{extra})
print(json.dumps({{"seconds": time.perf_counter() - t0, "network": r.network}}))
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small model: a smoke test of the script")
    ap.add_argument("--bandwidth", type=float, default=30.0, help="the server's link, MB/s (default 30)")
    ap.add_argument("--read-ahead", default="64MB", help="the streamed merge's read-ahead window (default 64MB)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="interleaved runs of steps 1-3 and 5; the fastest of each is kept (default 1)")
    args = ap.parse_args()
    kind = "quick" if args.quick else "full"
    log = lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)  # noqa: E731
    models = build_models(kind, log)
    shard = max(os.path.getsize(os.path.join(models["base"], f)) for f in os.listdir(models["base"])
                if f.endswith(".safetensors"))
    n_shards = len([f for f in os.listdir(models["base"]) if f.endswith(".safetensors")])
    inputs = sum(folder_bytes(models[n]) for n in models)
    output = folder_bytes(models["base"])  # task arithmetic in the inputs' dtype: the base's size
    rate = args.bandwidth * MB
    work = tempfile.mkdtemp(prefix="hubsoup-bench-stream-", dir=os.path.join(HERE, ".work"))
    result: dict = {"model": {"kind": kind, "config": FULL if kind == "full" else QUICK, "dtype": "bfloat16",
                              "shards_per_model": n_shards, "largest_shard": shard, "input_bytes": inputs,
                              "output_bytes": output},
                    "bandwidth": rate, "read_ahead": args.read_ahead, "machine": machine(),
                    "started": time.strftime("%Y-%m-%d %H:%M:%S"), "load_before": os.getloadavg()}
    server = Server(models, rate, work)
    log(f"server on {server.endpoint}, {args.bandwidth:g} MB/s; inputs {inputs / MB:.0f} MB in 4 × {n_shards} shards")
    try:
        def env(home: str) -> dict:
            return child_env(HF_ENDPOINT=server.endpoint, HF_HOME=home)

        runs: dict[str, list] = {"download": [], "merge": [], "upload": [], "streamed": []}
        max_disk = output + 10 * MB  # the output stays local here: all of it counts (no push)
        for rep in range(args.repeat):  # interleaved: the machine's load moves the same for every step
            # 1. download only
            home1 = os.path.join(work, f"home-download-{rep}")
            down = run_child(DOWNLOAD, env(home1))
            runs["download"].append(down["seconds"])
            # 2. merge only, local files
            out2 = os.path.join(work, f"merged-local-{rep}")
            merge = run_child(MERGE_LOCAL.format(folders=json.dumps(down["folders"]), out=out2), env(home1))
            runs["merge"].append(merge["seconds"])
            # 3. upload only
            up = run_child(UPLOAD.format(out=out2), env(home1))
            runs["upload"].append(up["seconds"])
            shutil.rmtree(home1, ignore_errors=True)
            shutil.rmtree(out2, ignore_errors=True)
            # 5. streamed, local output
            home5 = os.path.join(work, f"home-stream-{rep}")
            parent5 = os.path.join(work, f"stream-out-{rep}")
            os.makedirs(parent5)
            os.makedirs(home5)
            server.clear()
            st = run_child(MERGE_STREAM.format(out=os.path.join(parent5, "soup"), max_disk=max_disk,
                                               read_ahead=args.read_ahead, extra=""), env(home5),
                           sample=[home5, parent5])
            st["served"] = server.served()
            runs["streamed"].append(st)
            shutil.rmtree(parent5, ignore_errors=True)
            log(f"run {rep + 1}: download only {down['seconds']:.1f} s, merge only {merge['seconds']:.1f} s, upload "
                f"only {up['seconds']:.1f} s (the test server takes uploads unthrottled), streamed {st['seconds']:.1f} s")
        result["runs"] = {k: [r if isinstance(r, float) else r["seconds"] for r in v] for k, v in runs.items()}
        result["download_only"], result["merge_only"], result["upload_only"] = (
            min(runs["download"]), min(runs["merge"]), min(runs["upload"]))
        result["sequential"] = result["download_only"] + result["merge_only"] + result["upload_only"]
        largest = max(result["download_only"], result["merge_only"], result["upload_only"])
        st = min(runs["streamed"], key=lambda r: r["seconds"])  # the fastest, as for the other steps
        served = st.pop("served")
        for r in runs["streamed"]:
            r.pop("served", None)
        fetched_server = sum(n for p, _, n in served if p.endswith(".safetensors"))
        needed = sum(tensor_bytes(models[n]) for n in models)
        st["fetched_server"] = fetched_server
        st["needed_tensors"] = needed
        st["max_disk"] = max_disk
        st["wall_vs_largest"] = st["seconds"] / largest
        st["fetched_vs_needed"] = st["network"]["fetched"] / st["network"]["needed"]
        st["server_fetched_vs_tensors"] = fetched_server / needed
        # the disk that is not the output: cache and temporary files
        st["peak_disk_without_output"] = st["peak_disk"] - output
        result["streamed"] = st
        log(f"streamed: {st['seconds']:.1f} s ({st['wall_vs_largest']:.2f}× the largest of the three), peak disk "
            f"{st['peak_disk'] / MB:.1f} MB (output {output / MB:.1f} MB), fetched/needed "
            f"{st['fetched_vs_needed']:.4f}")

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

        # 7. streamed + push: needs the output side (push_to_hub on merge)
        import inspect

        sys.path.insert(0, REPO)
        import hubsoup

        if "push_to_hub" in inspect.signature(hubsoup.merge).parameters:
            from hubsoup.footprint import OUTPUT_SHARDS_IN_FLIGHT

            home7 = os.path.join(work, "home-push")
            parent7 = os.path.join(work, "push-out")
            os.makedirs(parent7)
            os.makedirs(home7)
            shard_size = SHARD[kind]
            max_disk7 = int(4 * shard * 1.05) + 2 * MB
            server.clear()
            extra = f", push_to_hub='soup-org/streamed', shard_size={shard_size!r}, token='hf_write_alice'"
            code = MERGE_STREAM.format(out=os.path.join(parent7, "soup"), max_disk=max_disk7,
                                       read_ahead=args.read_ahead, extra=extra)
            if inspect.signature(hubsoup.merge).parameters["out"].default is not inspect.Parameter.empty:
                code = code.replace(f"out={os.path.join(parent7, 'soup')!r},", "")  # no local copy asked
            # the temporary folders of a merge without --out: the working folder's and the system's
            p7 = run_child(code, {**env(home7), "TMPDIR": parent7}, sample=[home7, parent7], cwd=parent7)
            p7.update(max_disk=max_disk7, wall_vs_largest=p7["seconds"] / largest,
                      fetched_vs_needed=p7["network"]["fetched"] / p7["network"]["needed"],
                      shards_in_flight=OUTPUT_SHARDS_IN_FLIGHT)
            result["streamed_push"] = p7
            log(f"streamed + push: {p7['seconds']:.1f} s, peak disk {p7['peak_disk'] / MB:.1f} MB")
        else:
            result["streamed_push"] = {"pending": "hubsoup.merge has no push_to_hub yet (the output side of issue "
                                                  "45): run again once it has"}
            log("streamed + push: pending (no push_to_hub on merge yet)")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    result["load_after"] = os.getloadavg()
    result["targets"] = targets(result)
    write(result)


def targets(r: dict) -> list[dict]:
    largest = max(r["download_only"], r["merge_only"], r["upload_only"])
    rows = []
    st, pt = r["streamed"], r["partial"]
    rows.append({"target": "bytes fetched ≤ 1.05 × needed (full merge)", "value": round(st["fetched_vs_needed"], 4),
                 "met": st["fetched_vs_needed"] <= 1.05})
    rows.append({"target": "bytes fetched ≤ 1.05 × needed (slices over half the layers)",
                 "value": round(pt["fetched_vs_needed"], 4), "met": pt["fetched_vs_needed"] <= 1.05})
    p7 = r.get("streamed_push", {})
    if "pending" in p7:
        rows.append({"target": "wall ≤ 1.2 × max(download, merge, upload), with push", "value": None,
                     "met": None, "note": p7["pending"]})
        rows.append({"target": "peak disk ≤ 4 output shards + read-ahead, with push", "value": None, "met": None,
                     "note": p7["pending"]})
        rows.append({"target": "(inputs only, local output) wall ≤ 1.2 × max(download, merge)",
                     "value": round(st["seconds"] / max(r["download_only"], r["merge_only"]), 3),
                     "met": st["seconds"] <= 1.2 * max(r["download_only"], r["merge_only"])})
        rows.append({"target": "(inputs only) disk besides the output ≤ 1 shard (the Hub cache holds metadata only)",
                     "value": st["peak_disk_without_output"], "met": st["peak_disk_without_output"]
                     <= r["model"]["largest_shard"]})
    else:
        rows.append({"target": "wall ≤ 1.2 × max(download, merge, upload), with push",
                     "value": round(p7["seconds"] / largest, 3), "met": p7["seconds"] <= 1.2 * largest})
        rows.append({"target": "peak disk ≤ 4 output shards + read-ahead, with push", "value": p7["peak_disk"],
                     "met": p7["peak_disk"] <= 4 * r["model"]["largest_shard"]})
    rows.append({"target": "input bytes ≥ 10 × --max-disk of the run with push",
                 "value": round(r["model"]["input_bytes"] / (p7.get("max_disk") or 4 * r["model"]["largest_shard"]), 1),
                 "met": r["model"]["input_bytes"] >= 10 * (p7.get("max_disk") or 4 * r["model"]["largest_shard"])})
    return rows


def machine() -> dict:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def write(r: dict) -> None:
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    name = "hub_stream" + ("_quick" if r["model"]["kind"] == "quick" else "")
    with open(os.path.join(HERE, "results", f"{name}.json"), "w") as f:
        json.dump(r, f, indent=2, default=str)
    st, pt, m = r["streamed"], r["partial"], r["model"]
    mb = lambda n: f"{n / MB:.1f} MB"  # noqa: E731
    lines = [
        "# Hub to Hub: inputs read in place (`benchmarks/bench_hub_stream.py`)", "",
        f"Run {r['started']}, {m['kind']} model: bfloat16 Llama, {m['shards_per_model']} shards per model (largest "
        f"{mb(m['largest_shard'])}), base + 3 fine-tunes = {mb(m['input_bytes'])} on the test Hub server (its own "
        f"process), its link limited to {r['bandwidth'] / MB:g} MB/s; read-ahead {r['read_ahead']}. Load average "
        f"{r['load_before'][0]:.1f} before, {r['load_after'][0]:.1f} after ({r['machine']['cpus']} CPUs, shared); "
        f"the fastest of {len(r['runs']['streamed'])} interleaved runs of each step: {r['runs']}.", "",
        "| step | wall (s) |", "|---|---:|",
        f"| download only (`snapshot_download` of the 4 repos) | {r['download_only']:.1f} |",
        f"| merge only (local files, task arithmetic) | {r['merge_only']:.1f} |",
        f"| upload only (`upload_folder`; the test server takes uploads unthrottled) | {r['upload_only']:.1f} |",
        f"| sequential: download, merge, upload | {r['sequential']:.1f} |",
        f"| **streamed** (inputs read in place, output local) | **{st['seconds']:.1f}** |",
    ]
    p7 = r.get("streamed_push", {})
    if "pending" in p7:
        lines.append(f"| streamed + push | pending: {p7['pending']} |")
    else:
        lines.append(f"| **streamed + push** (shards uploaded as written) | **{p7['seconds']:.1f}** |")
    lines += ["", "| streamed merge | value |", "|---|---:|",
              f"| peak local disk (cache, output, temporary folders) | {mb(st['peak_disk'])} |",
              f"| of which not the output | {mb(st['peak_disk_without_output'])} |",
              f"| --max-disk it ran under | {mb(st['max_disk'])} |",
              f"| bytes fetched / needed (hubsoup's count) | {st['network']['fetched']:,} / {st['network']['needed']:,}"
              f" = {st['fetched_vs_needed']:.4f} |",
              f"| bytes served by the server / the inputs' tensor bytes | {st['fetched_server']:,} / "
              f"{st['needed_tensors']:,} = {st['server_fetched_vs_tensors']:.4f} |",
              f"| files verified against their sha256 (read whole) | {len(st['network']['verified'])} |",
              f"| wall / the largest of download, merge, upload | {st['wall_vs_largest']:.2f} |",
              "", f"Partial read (`slices:` over layers 0-{r['model']['config']['num_hidden_layers'] // 2 - 1} of one "
              f"fine-tune): fetched {mb(pt['fetched_data'] + pt['fetched_headers'])} of its {mb(pt['file_bytes'])} "
              f"(headers {mb(pt['fetched_headers'])}); the tensors it needs: {mb(pt['needed_tensors'])}; hubsoup's "
              f"count fetched / needed = {pt['fetched_vs_needed']:.4f}.", "",
              "| target | value | met |", "|---|---:|---|"]
    for t in r["targets"]:
        met = "pending" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['target']} | {t['value'] if t['value'] is not None else '-'} | {met} |")
    with open(os.path.join(HERE, "results", f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
