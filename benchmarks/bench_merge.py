#!/usr/bin/env python3
"""Benchmark hubsoup's merge against mergekit on a ~0.5 GB model: wall time, peak memory, agreement.

What it does (all in one run, every merge in a fresh process):

1. Builds, once, under ``benchmarks/.work/models`` (git-ignored): a LlamaForCausalLM base of
   ~134M parameters in float32 (~0.54 GB, ``save_pretrained`` with 200MB shards) and 3
   "fine-tunes" (base + seeded Gaussian noise, one shard at a time via
   ``hubsoup.testing.make_finetune``); plus a "deep" variant with 2x the layers (same
   tensor sizes) and its 3 fine-tunes.
2. Measures the I/O floor: the time to read every input byte once, cold (after
   ``echo 3 > /proc/sys/vm/drop_caches``, root only) and warm.
3. Merges the 3 fine-tunes with task arithmetic (weights 1, scale/lambda 1) and TIES
   (density 0.2, weight 1, disjoint mean = mergekit's ``normalize: true``), with hubsoup
   (``scope=tensor``, as mergekit ranks per tensor, and hubsoup's default ``scope=model``)
   and with mergekit (``mergekit-yaml ... --lazy-unpickle``), each run its own process:
   wall time, ``ru_maxrss`` of that process (``os.wait4``), and peak anonymous /
   file-backed RSS sampled from ``/proc/PID/status`` every 20 ms.
4. Compares hubsoup's and mergekit's outputs tensor by tensor (max |diff|, #differing).
5. Repeats task arithmetic and TIES on the deep model, to show peak memory does not grow
   with depth.
6. Writes ``benchmarks/results/merge_bench.{md,json}``.

mergekit runs from its own virtualenv (it must not share hubsoup's): ``--mergekit-python``
names its interpreter; by default ``benchmarks/.work/mergekit-venv`` is created if missing
with ``pip install -c constraints.txt torch==2.13.0 mergekit==0.1.5``.

Usage::

    python benchmarks/bench_merge.py              # full run, ~5 min on 2 idle cores
    python benchmarks/bench_merge.py --quick      # tiny smoke test (~1 min)
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MERGEKIT_SPEC = "mergekit==0.1.5"
SHARD_BYTES = 200_000_000  # input and output shards: 200MB (= 50M float32 parameters)
NOISE = 0.01  # std of the "fine-tuning" noise added to every float tensor (weights are ~N(0, 0.02))
SEEDS = (1, 2, 3)
MB = 1024 * 1024

# ~134M parameters, ~0.54 GB in float32. Largest tensors: embed_tokens / lm_head, 32000 x 768.
FULL = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
            num_attention_heads=12, num_key_value_heads=12)
QUICK = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=8)
# --profile 1b (issue 11): the TinyLlama-1.1B shape in bfloat16, ~1.1B parameters, 2.2 GB per model
BIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
           num_attention_heads=32, num_key_value_heads=4)
QUICK_BIG = dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2)
BUILD_VERSION = 1  # bump when the way models are built changes (invalidates the cache)


# --------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------
def model_config(size: dict, layers: int, dtype: str = "float32"):
    import transformers as tf

    return tf.LlamaConfig(**{**size, "num_hidden_layers": layers}, max_position_embeddings=2048,
                          tie_word_embeddings=False, dtype=dtype)


def build_models(root: str, size: dict, layers: int, log, dtype: str = "float32") -> tuple[str, list[str]]:
    """Base + 3 fine-tunes under ``root/L{layers}``; cached (rebuilt only if the recipe changed)."""
    import torch

    from hubsoup.testing import make_finetune

    folder = os.path.join(root, f"L{layers}")
    want = {"version": BUILD_VERSION, "size": size, "layers": layers, "noise": NOISE, "seeds": list(SEEDS),
            "shard_bytes": SHARD_BYTES}
    if dtype != "float32":
        want["dtype"] = dtype
    base, fts = os.path.join(folder, "base"), [os.path.join(folder, f"ft{s}") for s in SEEDS]
    if built(folder, want):
        return base, fts
    t0 = time.perf_counter()
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(model_config(size, layers, dtype)).to(getattr(torch, dtype))
    model.save_pretrained(base, max_shard_size=SHARD_BYTES)
    n = sum(p.numel() for p in model.parameters())
    del model
    log(f"  built base L{layers}: {n / 1e6:.1f}M params in {time.perf_counter() - t0:.1f}s")
    for s, ft in zip(SEEDS, fts):
        t1 = time.perf_counter()
        make_finetune(base, ft, seed=s, scale=NOISE)  # one shard in memory at a time
        log(f"  built {os.path.basename(ft)} L{layers} in {time.perf_counter() - t1:.1f}s")
    stamp(folder, want)
    return base, fts


def built(folder: str, want: dict) -> bool:
    """True when ``folder`` holds a build whose recipe (its ``built.json``) is ``want``: reuse it. Else the folder
    is emptied for a new build, which :func:`stamp` marks done once complete (a killed build is never reused)."""
    path = os.path.join(folder, "built.json")
    if os.path.isfile(path):
        with open(path) as f:
            if json.load(f) == want:
                return True
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    return False


def stamp(folder: str, want: dict) -> None:
    with open(os.path.join(folder, "built.json"), "w") as f:
        json.dump(want, f)


def shard_files(folder: str) -> list[str]:
    return sorted(glob.glob(os.path.join(folder, "*.safetensors")))


def dir_bytes(folders: list[str]) -> int:
    return sum(os.path.getsize(p) for d in folders for p in shard_files(d))


# --------------------------------------------------------------------------------------------
# I/O floor
# --------------------------------------------------------------------------------------------
def drop_caches() -> str | None:
    """Drop the page cache; returns None on success, else why not."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return None
    except OSError as e:
        return f"{type(e).__name__}: {e}"


def read_all(files: list[str]) -> tuple[int, float]:
    buf = bytearray(16 * MB)
    view = memoryview(buf)
    total, t0 = 0, time.perf_counter()
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while True:
                n = f.readinto(view)
                if not n:
                    break
                total += n
    return total, time.perf_counter() - t0


KEEP_CACHES = False
"""--keep-caches: no cold read (dropping the page cache slows everyone else on a shared machine)."""


def io_floor(folders: list[str]) -> dict:
    files = [p for d in folders for p in shard_files(d)]
    out: dict = {"files": len(files)}
    err = "skipped (--keep-caches)" if KEEP_CACHES else drop_caches()
    if err is None:
        nbytes, secs = read_all(files)
        out.update(cold_s=round(secs, 3), cold_gbps=round(nbytes / secs / 1e9, 2))
    else:
        out["cold_error"] = err
    nbytes, secs = read_all(files)
    out.update(bytes=nbytes, warm_s=round(secs, 3), warm_gbps=round(nbytes / secs / 1e9, 2))
    return out


# --------------------------------------------------------------------------------------------
# one measured run = one fresh process
# --------------------------------------------------------------------------------------------
@dataclass
class Run:
    label: str
    tool: str
    method: str
    scope: str
    layers: int
    out: str
    rc: int = 0
    wall_s: float = 0.0
    user_s: float = 0.0
    sys_s: float = 0.0
    maxrss_mb: float = 0.0  # ru_maxrss of the process (anonymous + file-backed resident pages)
    peak_anon_mb: float = 0.0  # sampled RssAnon peak: memory the process allocated
    peak_file_mb: float = 0.0  # sampled RssFile peak: mmapped file pages (e.g. safetensors inputs)
    samples: int = 0
    others_cpu: float = 0.0  # share of the machine's CPU used by *other* processes during the run (0..1)
    load1: float = 0.0  # 1-min load average when the run started
    log: str = ""
    extra: dict = field(default_factory=dict)


def _status_kb(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "RssAnon:", "RssFile:", "RssShmem:")):
                    k, v = line.split(":", 1)
                    out[k] = int(v.split()[0])
    except OSError:
        pass
    return out


# A small launcher process forks and execs the command and reports os.wait4's rusage. Why not
# spawn the command straight from this script: Linux carries the RSS high-water mark of the
# pre-exec address space into the new program (fs/exec.c: setmax_mm_hiwater_rss), and a child
# forked from this script (torch loaded, models built) would start with *our* RSS as its maxrss.
# Forked from a ~10 MB `python -S` instead, the command's ru_maxrss is its own.
_LAUNCHER = r"""
import json, os, sys, time
log, cmd = sys.argv[1], sys.argv[2:]
fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    os.dup2(fd, 1); os.dup2(fd, 2); os.close(fd)
    try:
        os.execvp(cmd[0], cmd)
    finally:
        os._exit(127)
os.close(fd)
print(pid, flush=True)
_, status, ru = os.wait4(pid, 0)
wall = time.perf_counter() - t0
print(json.dumps({"rc": os.waitstatus_to_exitcode(status), "wall": wall, "utime": ru.ru_utime,
                  "stime": ru.ru_stime, "maxrss_kb": ru.ru_maxrss}), flush=True)
"""


def _cpu_busy_s() -> float:
    """Machine-wide busy CPU seconds since boot (all cores), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return (sum(v[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def measure(cmd: list[str], run: Run, env: dict, log_path: str, cwd: str = REPO) -> Run:
    """Run ``cmd`` as its own process: wall time, rusage (os.wait4) and sampled RSS peaks."""
    run.load1 = round(os.getloadavg()[0], 2)
    busy0 = _cpu_busy_s()
    peaks = {"RssAnon": 0, "RssFile": 0, "VmRSS": 0}
    n = [0]
    done = threading.Event()
    with open(log_path, "w") as logf:
        logf.write(" ".join(cmd) + "\n\n")
    launcher = subprocess.Popen([sys.executable, "-S", "-c", _LAUNCHER, log_path, *cmd], stdout=subprocess.PIPE,
                                text=True, env=env, cwd=cwd)
    pid = int(launcher.stdout.readline())

    def sample():
        while not done.is_set():
            st = _status_kb(pid)
            if st:
                n[0] += 1
                for k in peaks:
                    peaks[k] = max(peaks[k], st.get(k, 0))
            done.wait(0.02)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    tail = launcher.stdout.read()
    launcher.wait()
    done.set()
    th.join()
    try:
        r = json.loads(tail.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        r = {"rc": launcher.returncode or 1, "wall": 0.0, "utime": 0.0, "stime": 0.0, "maxrss_kb": 0}
    run.rc = r["rc"]
    run.wall_s = round(r["wall"], 2)
    run.user_s, run.sys_s = round(r["utime"], 2), round(r["stime"], 2)
    run.maxrss_mb = round(r["maxrss_kb"] / 1024, 1)  # Linux: KiB
    run.peak_anon_mb = round(peaks["RssAnon"] / 1024, 1)
    run.peak_file_mb = round(peaks["RssFile"] / 1024, 1)
    run.samples = n[0]
    if run.wall_s > 0:
        others = _cpu_busy_s() - busy0 - run.user_s - run.sys_s
        run.others_cpu = round(min(max(others / (run.wall_s * (os.cpu_count() or 1)), 0.0), 1.0), 3)
    run.log = os.path.relpath(log_path, REPO)
    return run


def child_env() -> dict:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    return env


def hubsoup_cmd(method: str, scope: str, base: str, fts: list[str], out: str) -> list[str]:
    cmd = [sys.executable, "-m", "hubsoup", "merge", *fts, "--base", base, "--method", method,
           "--out", out, "--overwrite", "--quiet", "--shard-size", str(SHARD_BYTES)]
    if method == "task_arithmetic":
        cmd += ["--param", "scale=1.0"]  # mergekit: weight 1 each, lambda 1, normalize false
    else:
        cmd += ["--param", "density=0.2", "--param", f"scope={scope}", "--param", "merge=mean"]
    return cmd


def mergekit_config(method: str, base: str, fts: list[str]) -> str:
    lines = [f"merge_method: {method}", f"base_model: {base}", "dtype: float32", "models:"]
    for ft in fts:
        lines.append(f"  - model: {ft}")
        lines.append("    parameters: {weight: 1.0" + (", density: 0.2}" if method == "ties" else "}"))
    if method == "ties":
        lines.append("parameters: {normalize: true}")
    else:
        lines.append("parameters: {normalize: false}")
    return "\n".join(lines) + "\n"


def mergekit_cmd(python: str, cfg_path: str, out: str, bytes_per_param: int = 4) -> list[str]:
    return [python, "-m", "mergekit.scripts.run_yaml", cfg_path, out, "--lazy-unpickle", "--quiet",
            "--no-copy-tokenizer", "--out-shard-size", str(SHARD_BYTES // bytes_per_param)]  # in parameters


def import_baseline(python: str, module: str, work: str, name: str, env: dict) -> Run:
    run = Run(f"import {module}", name, "-", "-", 0, "")
    return measure([python, "-c", f"import {module}"], run, env, os.path.join(work, "logs", f"import-{name}.log"))


# --------------------------------------------------------------------------------------------
# comparing outputs
# --------------------------------------------------------------------------------------------
def _open_all(folder: str) -> dict:
    from safetensors import safe_open

    where = {}
    for p in shard_files(folder):
        h = safe_open(p, framework="pt")
        for k in h.keys():
            where[k] = h
    return where


def compare(a: str, b: str) -> dict:
    """Max |a-b| over every tensor of two checkpoints, and how many entries differ."""
    ta, tb = _open_all(a), _open_all(b)
    only_a, only_b = sorted(set(ta) - set(tb)), sorted(set(tb) - set(ta))
    max_abs, worst, ndiff, total, rel = 0.0, None, 0, 0, 0.0
    per_tensor = {}
    for k in sorted(set(ta) & set(tb)):
        x, y = ta[k].get_tensor(k), tb[k].get_tensor(k)
        if x.shape != y.shape or x.dtype != y.dtype:
            per_tensor[k] = f"shape/dtype {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}"
            continue
        d = (x.float() - y.float()).abs()
        m = float(d.max()) if d.numel() else 0.0
        nd = int((d > 0).sum())
        ndiff += nd
        total += d.numel()
        if nd:
            per_tensor[k] = {"max_abs": m, "n_diff": nd, "numel": d.numel()}
        if m > max_abs:
            max_abs, worst = m, k
            rel = m / max(float(y.abs().max()), 1e-30)
    return {"max_abs_diff": max_abs, "worst_tensor": worst, "max_rel_to_tensor_max": rel, "n_diff": ndiff,
            "numel": total, "frac_diff": ndiff / max(total, 1), "tensors_differing": len(per_tensor),
            "only_in_a": only_a[:5], "only_in_b": only_b[:5],
            "differing": sorted(per_tensor)[:200],
            "top_tensors": dict(sorted(((k, v) for k, v in per_tensor.items() if isinstance(v, dict)),
                                       key=lambda kv: -kv[1]["max_abs"])[:5])}


def explain_ties_diff(base: str, fts: list[str], hub: str, mk: str, names: list[str], density: float = 0.2) -> dict:
    """Attribute every entry where hubsoup's per-tensor TIES differs from mergekit's to a cause.

    The two differ by design in two places (everything else is the same arithmetic):

    * ``threshold_tie``: hubsoup keeps every |τ| ≥ the k-th largest, so all entries tied at the
      threshold; mergekit keeps exactly k = max(1, ⌊density·n⌋) entries chosen by argsort
      (ties broken arbitrarily). Counted: differing entries where some input has |τ| equal to
      its threshold while more than k of its entries reach it.
    * ``zero_sum_sign``: where the kept deltas sum to exactly 0, hubsoup elects the tensor's
      majority sign, mergekit +1 (``sum >= 0``).
    """
    import torch

    b, f, h, m = _open_all(base), [_open_all(d) for d in fts], _open_all(hub), _open_all(mk)
    out = {"tensors": len(names), "differing": 0, "threshold_tie": 0, "zero_sum_sign": 0, "unexplained": 0,
           "extra_kept_at_threshold": 0}
    for k in names:
        x = b[k].get_tensor(k).float()
        diff = h[k].get_tensor(k).float() != m[k].get_tensor(k).float()
        tie = torch.zeros_like(diff)
        kept = []
        for fi in f:
            d = fi[k].get_tensor(k).float() - x
            n = d.numel()
            kk = max(1, int(density * n))
            thr = torch.kthvalue(d.abs().flatten(), n - kk + 1).values
            extra = int((d.abs() >= thr).sum()) - kk
            out["extra_kept_at_threshold"] += extra
            if extra > 0:
                tie |= d.abs() == thr
            kept.append(torch.where(d.abs() >= thr, d, torch.zeros_like(d)))
        st = torch.stack(kept)
        zero = (st != 0).any(0) & (st.sum(0) == 0)
        out["differing"] += int(diff.sum())
        out["threshold_tie"] += int((diff & tie).sum())
        out["zero_sum_sign"] += int((diff & zero & ~tie).sum())
        out["unexplained"] += int((diff & ~zero & ~tie).sum())
    return out


# --------------------------------------------------------------------------------------------
# environment
# --------------------------------------------------------------------------------------------
def ensure_mergekit(python: str | None, work: str, log) -> str:
    if python:
        return python
    venv = os.path.join(work, "mergekit-venv")
    py = os.path.join(venv, "bin", "python")
    if not os.path.isfile(py):
        log(f"creating mergekit venv at {os.path.relpath(venv, REPO)} ({MERGEKIT_SPEC}, torch pinned by constraints.txt)")
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run([py, "-m", "pip", "install", "-q", "-c", os.path.join(REPO, "constraints.txt"),
                        "torch==2.13.0", MERGEKIT_SPEC], check=True)
    return py


def versions(py: str, modules: list[str]) -> dict:
    code = ("import importlib.metadata as m, json, sys; "
            f"print(json.dumps({{k: m.version(k) for k in {modules!r}}} | {{'python': sys.version.split()[0]}}))")
    r = subprocess.run([py, "-c", code], capture_output=True, text=True, env=child_env())
    try:
        return json.loads(r.stdout)
    except json.JSONDecodeError:
        return {"error": r.stderr.strip()[-300:]}


def code_fingerprint() -> str:
    """Hash of hubsoup's source files: the working tree may change under a long benchmark."""
    import hashlib

    h = hashlib.sha1()
    for p in sorted(glob.glob(os.path.join(REPO, "hubsoup", "**", "*.py"), recursive=True)):
        h.update(os.path.relpath(p, REPO).encode())
        with open(p, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:10]


def machine_info() -> dict:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "?")
    except OSError:
        pass
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(next(l for l in f if l.startswith("MemTotal")).split()[1]) // 1024
    except (OSError, StopIteration):
        pass
    rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_mib": mem, "kernel": platform.release(),
            "platform": platform.platform(), "hubsoup_git_head": rev or "?",
            "note": "hubsoup measured from the working tree (editable install); it may differ from HEAD"}


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------
def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if b else None


def summarize(runs: list[Run]) -> dict:
    """Repeats of one configuration: the fastest run's time (least disturbed), the largest memory peaks."""
    best = min(runs, key=lambda r: r.wall_s)
    return {"label": best.label, "tool": best.tool, "method": best.method, "scope": best.scope, "layers": best.layers,
            "n": len(runs), "rc": max(r.rc for r in runs), "wall_s": best.wall_s,
            "wall_all": [r.wall_s for r in runs], "cpu_s": round(best.user_s + best.sys_s, 2),
            "user_s": best.user_s, "sys_s": best.sys_s,
            "maxrss_mb": max(r.maxrss_mb for r in runs), "peak_anon_mb": max(r.peak_anon_mb for r in runs),
            "peak_file_mb": max(r.peak_file_mb for r in runs), "others_cpu": best.others_cpu, "load1": best.load1}


def write_report(res: dict, md_path: str) -> None:
    L = []
    m = res["machine"]
    v = res["versions"]
    L.append("# hubsoup vs mergekit: merge benchmark\n")
    L.append(f"`python benchmarks/bench_merge.py` on {res['date']} ({res['total_s']:.0f} s in all, "
             f"{res['repeat']} run(s) per configuration). Machine: {m['cpu']}, {m['cores']} cores, "
             f"{m['mem_mib'] / 1024:.1f} GiB RAM, Linux {m['kernel']}. hubsoup {v['hubsoup'].get('hubsoup')} "
             f"(git {m['hubsoup_git_head']} + working tree, sources {'/'.join(res.get('hubsoup_code', []))}), mergekit {v['mergekit'].get('mergekit', '-')}; "
             f"torch {v['hubsoup'].get('torch')} / {v['mergekit'].get('torch', '-')}, transformers "
             f"{v['hubsoup'].get('transformers')} / {v['mergekit'].get('transformers', '-')}, safetensors "
             f"{v['hubsoup'].get('safetensors')} / {v['mergekit'].get('safetensors', '-')} (hubsoup venv / mergekit venv).\n")
    md = res["models"]
    L.append(f"Inputs: LlamaForCausalLM, float32, base + 3 fine-tunes (base + N(0, {NOISE}²) noise on every tensor): "
             f"{md['main']['layers']} layers = {md['main']['params_m']:.0f}M params = "
             f"{md['main']['bytes_per_model'] / 1e9:.2f} GB per model, {md['main']['input_bytes'] / 1e9:.2f} GB read per "
             f"merge; deep variant {md['deep']['layers']} layers = {md['deep']['params_m']:.0f}M params "
             f"({md['deep']['bytes_per_model'] / 1e9:.2f} GB per model), same tensor sizes. Largest tensor "
             f"{md['main']['largest_tensor_mb']:.0f} MB (embed_tokens, lm_head). Input and output shards 200 MB. Every "
             "merge is its own process, the tools' CLIs (`python -m hubsoup merge ... --shard-size 200000000`, "
             "`mergekit-yaml cfg.yml out --lazy-unpickle --out-shard-size 50000000 --no-copy-tokenizer`), "
             "inputs warm in the page cache; wall time includes interpreter start and imports.\n")
    io = res["io_floor"]
    cold = (f"cold **{io['cold_s']:.2f} s** ({io['cold_gbps']} GB/s, after `echo 3 > /proc/sys/vm/drop_caches`)"
            if "cold_s" in io else f"cold: not measured ({io.get('cold_error')})")
    L.append(f"**I/O floor** (read the {io['bytes'] / 1e9:.2f} GB of inputs once): {cold}; "
             f"warm {io['warm_s']:.2f} s ({io['warm_gbps']} GB/s).\n")
    L.append("| run | layers | wall s | CPU s (user+sys) | peak RSS MB | peak anon MB | peak file-backed MB | others' CPU |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in res["summary"]:
        bad = "" if r["rc"] == 0 else " **(failed)**"
        L.append(f"| {r['label']}{bad} | {r['layers'] or '-'} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | "
                 f"{r['maxrss_mb']:.0f} | {r['peak_anon_mb']:.0f} | {r['peak_file_mb']:.0f} | {r['others_cpu']:.0%} |")
    L.append("")
    L.append("- *peak RSS*: `ru_maxrss` of the merge process (`os.wait4`, launched from a small `python -S` so it "
             "does not inherit the benchmark's own high-water mark): resident anonymous memory **plus** resident pages "
             "of memory-mapped files. *anon* / *file-backed*: peaks of `RssAnon` / `RssFile` from `/proc/PID/status` "
             "sampled every 20 ms. File-backed pages are the mmapped safetensors inputs: clean page cache the kernel "
             "can reclaim, but counted in RSS (and by `top`, and in a container's memory accounting).")
    L.append("- *others' CPU*: share of the machine's CPU used by other processes during the run (from /proc/stat). "
             "Above ~10% the wall times are disturbed; CPU seconds are less so.\n")
    L.append("## Ratios hubsoup / mergekit (< 1: hubsoup better)\n")
    L.append("| comparison | layers | wall time | CPU time | peak RSS | peak anon |")
    L.append("|---|---:|---:|---:|---:|---:|")
    for c in res["ratios"]:
        L.append(f"| {c['what']} | {c['layers']} | {c['time']} | {c['cpu']} | {c['maxrss']} | {c['anon']} |")
    L.append("")
    if res["diffs"]:
        L.append("## Agreement with mergekit\n")
        L.append("| outputs compared | max abs diff | entries differing | tensors differing | worst tensor |")
        L.append("|---|---:|---:|---:|---|")
        for c in res["diffs"]:
            d = c["diff"]
            L.append(f"| {c['what']} | {d['max_abs_diff']:.3g} | {d['n_diff']} / {d['numel']} ({d['frac_diff']:.1e}) | "
                     f"{d['tensors_differing']} | {d['worst_tensor'] or '-'} |")
        L.append("")
        t = res.get("ties_explained")
        if t:
            L.append(f"Per-tensor TIES, every differing entry attributed ({t['tensors']} differing tensors checked "
                     f"against the inputs): {t['threshold_tie']} at a **threshold tie** (hubsoup keeps every |τ| equal "
                     f"to the k-th largest, {t['extra_kept_at_threshold']} entries more than k in those tensors; "
                     f"mergekit keeps exactly k by argsort), {t['zero_sum_sign']} where the kept deltas **sum to exactly "
                     f"0** (hubsoup elects the tensor's majority sign, mergekit +1), {t['unexplained']} unexplained. "
                     "With scope=model hubsoup ranks magnitudes over the whole model (as the TIES paper), so it "
                     "trims a different set of entries than mergekit's per-tensor ranking: a different method, "
                     "compared for reference only.\n")
    if res.get("depth"):
        a, b = md["main"]["layers"], md["deep"]["layers"]
        L.append(f"## Memory vs depth ({a} → {b} layers, same tensor sizes)\n")
        L.append(f"| tool / method | peak RSS MB | peak anon MB | peak file-backed MB | wall s |")
        L.append("|---|---|---|---|---|")
        for d in res["depth"]:
            L.append(f"| {d['what']} | {d['maxrss'][0]:.0f} → {d['maxrss'][1]:.0f} | {d['anon'][0]:.0f} → "
                     f"{d['anon'][1]:.0f} | {d['file'][0]:.0f} → {d['file'][1]:.0f} | {d['wall'][0]:.1f} → "
                     f"{d['wall'][1]:.1f} |")
        L.append("")
    if res.get("notes"):
        L.append("## Notes\n")
        for note in res["notes"]:
            L.append(f"- {note}")
    with open(md_path, "w") as f:
        f.write("\n".join(L) + "\n")


# --------------------------------------------------------------------------------------------
def record_run(cmd: list[str], run: Run, env: dict, log_path: str, runs: dict, res: dict, log) -> Run:
    """Measure one merge (:func:`measure`), log its line and add it to ``runs`` and ``res["runs"]``."""
    measure(cmd, run, env, log_path)
    log(f"  {run.label:<38} {run.wall_s:6.1f}s cpu {run.user_s + run.sys_s:6.1f}s  rss {run.maxrss_mb:6.0f} MB  "
        f"anon {run.peak_anon_mb:6.0f} MB  file {run.peak_file_mb:6.0f} MB  others {run.others_cpu:4.0%}  rc={run.rc}")
    if run.rc != 0:
        log(f"  !! {run.label} failed, see {run.log}")
    runs.setdefault(run.label, []).append(run)
    res["runs"].append(asdict(run))
    return run


def finish_run(res: dict, t_start: float, path: str, writer, out_root: str, keep: bool, log) -> int:
    """Note contention, remove the outputs (unless ``keep``), write ``path``.json and .md (by ``writer``);
    the exit status: 0 when every configuration succeeded."""
    busy = [r for r in res["summary"] if r.get("others_cpu", 0) > 0.10]
    if busy:
        res["notes"].append(f"{len(busy)} configuration(s) ran while other processes used >10% of the machine's CPU "
                            f"(max {max(r['others_cpu'] for r in busy):.0%}): their wall times are inflated; compare CPU "
                            "seconds, or rerun with --repeat N on a quiet machine.")
    if not keep:
        shutil.rmtree(out_root, ignore_errors=True)
    res["total_s"] = round(time.perf_counter() - t_start, 1)
    with open(path + ".json", "w") as f:
        json.dump(res, f, indent=2, default=str)
    writer(res, path + ".md")
    log(f"wrote {os.path.relpath(path, REPO)}.{{md,json}} in {res['total_s']:.0f}s")
    return 0 if all(r["rc"] == 0 for r in res["summary"]) else 1


def setup_run(res: dict, mk_py: str | None, inputs: list[str], out_root: str, log) -> str:
    """Record both tools' versions and the I/O floor of ``inputs`` in ``res``; returns ``out_root``, emptied."""
    mods = ["torch", "transformers", "safetensors", "numpy"]
    res["versions"] = {"hubsoup": versions(sys.executable, ["hubsoup", *mods]),
                       "mergekit": versions(mk_py, ["mergekit", *mods]) if mk_py else {}}
    if mk_py and res["versions"]["mergekit"].get("torch", "").split("+")[0] != "2.13.0":
        res["notes"].append(f"WARNING: the mergekit venv has torch {res['versions']['mergekit'].get('torch')}, not 2.13.0")
    log("I/O floor: reading all inputs once (cold, then warm)")
    res["io_floor"] = io_floor(inputs)
    log(f"  {res['io_floor']}")
    shutil.rmtree(out_root, ignore_errors=True)
    os.makedirs(out_root)
    return out_root


# --------------------------------------------------------------------------------------------
# --profile 1b: a ~1B-parameter bf16 model, more methods, the issue-11 targets
# --------------------------------------------------------------------------------------------
# (label, tool, hubsoup --param list or mergekit YAML body, which inputs: "3" = base + 3 fine-tunes,
# "2" = two fine-tunes, no base). mergekit loads in float32 and writes bfloat16, as hubsoup computes.
PLAN_1B = [
    ("task_arithmetic", "hubsoup", ["--method", "task_arithmetic", "--param", "scale=1.0"], "3"),
    ("task_arithmetic", "mergekit", "merge_method: task_arithmetic\nparameters: {normalize: false}\n"
                                    "model_params: {weight: 1.0}\n", "3"),
    ("ties", "hubsoup", ["--method", "ties", "--param", "density=0.2", "--param", "scope=tensor",
                         "--param", "merge=mean"], "3"),
    ("ties", "mergekit", "merge_method: ties\nparameters: {normalize: true}\n"
                         "model_params: {weight: 1.0, density: 0.2}\n", "3"),
    ("ties (scope=model)", "hubsoup", ["--method", "ties", "--param", "density=0.2", "--param", "merge=mean"], "3"),
    ("dare_ties", "hubsoup", ["--method", "dare", "--param", "then=ties", "--param", "p=0.8",
                              "--param", "convention=mergekit"], "3"),
    ("dare_ties", "mergekit", "merge_method: dare_ties\nparameters: {normalize: true}\n"
                              "model_params: {weight: 1.0, density: 0.2}\n", "3"),
    ("slerp", "hubsoup", ["--method", "slerp", "--param", "t=0.5"], "2"),
    ("slerp", "mergekit", "merge_method: slerp\nparameters: {t: 0.5}\n", "2"),
    ("sftm", "hubsoup", ["--method", "sftm"], "3"),  # not in mergekit
]


def mergekit_config_1b(body: str, base: str, fts: list[str], inputs: str) -> str:
    head, _, mp = body.partition("model_params: ")
    models = fts if inputs == "3" else fts[:2]
    lines = [head.rstrip("\n"), f"base_model: {base if inputs == '3' else fts[0]}", "dtype: float32",
             "out_dtype: bfloat16", "models:"]
    for m in models:
        lines.append(f"  - model: {m}")
        if mp:
            lines.append(f"    parameters: {mp.strip()}")
    return "\n".join(lines) + "\n"


def run_1b(args, work: str, results: str, log) -> int:
    """hubsoup vs mergekit on a ~1.1B-parameter bfloat16 Llama (base + 3 fine-tunes): wall, CPU and peak
    RSS per method and their ratios, the cold read of every input byte, and the issue-11 targets."""
    t_start = time.perf_counter()
    size = QUICK_BIG if args.quick else BIG
    layers = size["num_hidden_layers"]
    mk_py = None if args.no_mergekit else ensure_mergekit(args.mergekit_python, work, log)
    env = child_env()
    log("building / checking the bf16 models")
    base, fts = build_models(os.path.join(work, "models-1b-quick" if args.quick else "models-1b"), size, layers,
                             log, dtype="bfloat16")
    from hubsoup.sources import open_input

    ck = open_input(base)
    numel = sum(math.prod(ck.info(k).shape) for k in ck.keys())
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine_info(), "quick": args.quick,
                 "profile": "1b", "repeat": args.repeat,
                 "model": {"shape": size, "dtype": "bfloat16", "params_m": round(numel / 1e6, 1),
                           "bytes_per_model": dir_bytes([base]), "input_bytes": dir_bytes([base, *fts])},
                 "runs": [], "summary": [], "ratios": [], "targets": [], "notes": []}
    out_root = setup_run(res, mk_py, [base, *fts], os.path.join(work, "out-1b"), log)
    runs: dict[str, list[Run]] = {}
    only = set(args.only.split(",")) if args.only else None
    prev_path = os.path.join(results, "merge_bench_1b.json")
    if only and os.path.isfile(prev_path):  # keep the other methods' runs of the last results on these models
        with open(prev_path) as f:
            prev = json.load(f)
        if prev.get("model", {}).get("shape") == size:
            # the targets keep the full run's read times: a cold read swings 4x between runs on this VM
            res["notes"].append(f"I/O floor measured now: {res['io_floor']}; the targets use the full run's.")
            res["io_floor"] = prev["io_floor"]
            if not res["versions"]["mergekit"]:  # --no-mergekit: the kept mergekit runs' versions
                res["versions"]["mergekit"] = prev.get("versions", {}).get("mergekit", {})
            for r in prev["runs"]:
                # --no-mergekit: mergekit's runs of the re-run methods are kept too (its code did not change)
                if r["method"] not in only or (args.no_mergekit and r["tool"] == "mergekit"):
                    res["runs"].append(r)
                    runs.setdefault(r["label"], []).append(Run(**r))
            res["notes"] += [n for n in prev.get("notes", []) if " re-run on " in n]  # the earlier re-runs
            res["notes"].append(f"{', '.join(sorted(only))} re-run on {res['date']}; the other runs are from "
                                f"{prev['date']} or the re-runs above.")
    for rep in range(args.repeat):
        for method, tool, spec, inputs in PLAN_1B:
            if (tool == "mergekit" and not mk_py) or (only and method not in only):
                continue
            label = f"{tool} {method}"
            read_all([p for d in (base, *fts) for p in shard_files(d)])  # inputs warm for every run alike
            slug = "".join(c if c.isalnum() else "_" for c in label)
            out = os.path.join(out_root, slug)
            shutil.rmtree(out, ignore_errors=True)
            if tool == "hubsoup":
                ins = [*fts, "--base", base] if inputs == "3" else fts[:2]
                cmd = [sys.executable, "-m", "hubsoup", "merge", *ins, *spec, "--out", out, "--overwrite", "--quiet",
                       "--shard-size", str(SHARD_BYTES)]
            else:
                cfg = out + ".yml"
                with open(cfg, "w") as fh:
                    fh.write(mergekit_config_1b(spec, base, fts, inputs))
                cmd = mergekit_cmd(mk_py, cfg, out, bytes_per_param=2)  # bfloat16
            run = Run(label, tool, method, "-", layers, out)
            if tool == "hubsoup":
                run.extra["hubsoup_code"] = code_fingerprint()
            record_run(cmd, run, env, os.path.join(work, "logs", f"1b-{slug}.{rep}.log"), runs, res, log)
            shutil.rmtree(out, ignore_errors=True)  # 2.2 GB each
    summ = {lab: summarize(rs) for lab, rs in runs.items()}
    res["summary"] = list(summ.values())
    ok = lambda lab: lab in summ and summ[lab]["rc"] == 0  # noqa: E731
    in_gb = res["model"]["input_bytes"] / 1e9
    for method in dict.fromkeys(m for m, *_ in PLAN_1B):
        h, m = f"hubsoup {method}", f"mergekit {method}"
        if ok(h):
            summ[h]["input_gbps"] = round((in_gb if method != "slerp" else in_gb / 2) / summ[h]["wall_s"], 3)
        if ok(h) and ok(m):
            hr, mr = summ[h], summ[m]
            res["ratios"].append({"what": method, "time": _ratio(hr["wall_s"], mr["wall_s"]),
                                  "cpu": _ratio(hr["cpu_s"], mr["cpu_s"]), "maxrss": _ratio(hr["maxrss_mb"], mr["maxrss_mb"]),
                                  "anon": _ratio(hr["peak_anon_mb"], mr["peak_anon_mb"])})
    ratio = {r["what"]: r for r in res["ratios"]}
    cold = res["io_floor"].get("cold_s")

    def target(what: str, value, limit: float) -> None:
        res["targets"].append({"target": what, "value": value, "limit": limit,
                               "met": None if value is None else value <= limit})
    for method in ("task_arithmetic", "ties"):
        target(f"{method}: hubsoup / mergekit wall time", ratio.get(method, {}).get("time"), 0.5)
        target(f"{method}: hubsoup / mergekit peak RSS", ratio.get(method, {}).get("maxrss"), 0.9)
    ta = summ.get("hubsoup task_arithmetic", {}).get("wall_s") if ok("hubsoup task_arithmetic") else None
    target("task_arithmetic wall / cold read of every input byte", _ratio(ta, cold) if ta and cold else None, 2.0)
    ties = summ.get("hubsoup ties", {}).get("wall_s") if ok("hubsoup ties") else None
    target("ties wall / task_arithmetic wall (hubsoup)", _ratio(ties, ta) if ties and ta else None, 2.0)
    return finish_run(res, t_start, os.path.join(results, "merge_bench_1b"), write_report_1b, out_root, False, log)


def write_report_1b(res: dict, path: str) -> None:
    m, io = res["model"], res["io_floor"]
    lines = ["# hubsoup vs mergekit on a ~1B-parameter bfloat16 model (issue 11)", "",
             f"`python benchmarks/bench_merge.py --profile 1b` on {res['date']} ({res['total_s']:.0f} s in all, "
             f"{res['repeat']} run(s) per configuration). Machine: {res['machine'].get('cpu', '')}, "
             f"{res['machine'].get('cores', os.cpu_count())} cores. Versions: "
             + "; ".join(f"{tool} venv: " + ", ".join(f"{k} {v}" for k, v in vs.items())
                         for tool, vs in res["versions"].items() if vs) + ".", "",
             f"Inputs: LlamaForCausalLM {m['shape']}, bfloat16, {m['params_m']:.0f}M parameters = "
             f"{m['bytes_per_model'] / 1e9:.2f} GB per model, base + 3 fine-tunes = {m['input_bytes'] / 1e9:.2f} GB "
             "(SLERP reads 2 fine-tunes). Every merge is its own process through the tools' CLIs, inputs warm in "
             "the page cache; mergekit loads in float32 and writes bfloat16 (`dtype: float32`, `out_dtype: "
             "bfloat16`), as hubsoup computes in float32 and writes the inputs' dtype.", "",
             f"**Read every input byte once**: cold {io.get('cold_s', '—')} s ({io.get('cold_gbps', '—')} GB/s"
             f"{'; ' + io['cold_error'] if io.get('cold_error') else ''}), warm {io.get('warm_s')} s.", "",
             "| run | wall s | CPU s | peak RSS MB | peak anon MB | input GB/s | others' CPU |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in res["summary"]:
        if r["rc"] != 0:
            lines.append(f"| {r['label']} | failed or stopped (exit {r['rc']}; its log: {r.get('log') or 'logs/'}) "
                         "| | | | | |")
            continue
        lines.append(f"| {r['label']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['maxrss_mb']:.0f} | "
                     f"{r['peak_anon_mb']:.0f} | {r.get('input_gbps', '—')} | {r.get('others_cpu', 0):.0%} |")
    lines += ["", "## Ratios hubsoup / mergekit (< 1: hubsoup better)", "",
              "| method | wall time | CPU time | peak RSS | peak anon |", "|---|---:|---:|---:|---:|"]
    for r in res["ratios"]:
        lines.append(f"| {r['what']} | {r['time']} | {r['cpu']} | {r['maxrss']} | {r['anon']} |")
    lines += ["", "## Issue 11 targets (2 cores)", "", "| target | value | limit | met |", "|---|---:|---:|---|"]
    for t in res["targets"]:
        met = "—" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['target']} | {t['value'] if t['value'] is not None else '—'} | ≤ {t['limit']} | {met} |")
    if res["notes"]:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in res["notes"]]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mergekit-python", help="python of a venv with mergekit installed "
                                              "(default: benchmarks/.work/mergekit-venv, created if missing)")
    ap.add_argument("--work", default=os.path.join(HERE, ".work"), help="cache/scratch folder (git-ignored)")
    ap.add_argument("--results", default=os.path.join(HERE, "results"), help="where merge_bench.{md,json} go")
    ap.add_argument("--quick", action="store_true", help="tiny models: a smoke test of the script (results go to "
                                                         "WORK/results-quick unless --results is given)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per configuration, interleaved; the table shows the "
                                                          "fastest run's time and the largest memory peaks")
    ap.add_argument("--no-deep", action="store_true", help="skip the 2x-depth runs")
    ap.add_argument("--deep-mergekit-ties", action="store_true", help="also run mergekit's TIES on the deep model "
                                                                      "(slow: ~2.5x its 12-layer time)")
    ap.add_argument("--no-mergekit", action="store_true", help="only hubsoup")
    ap.add_argument("--keep-outputs", action="store_true", help="keep the merged models under WORK/out")
    ap.add_argument("--profile", choices=["default", "1b"], default="default",
                    help="1b: a ~1.1B-parameter bfloat16 Llama (9 GB of inputs), task arithmetic, TIES, DARE-TIES, "
                         "SLERP and SFTM, the issue-11 targets; results in merge_bench_1b.{md,json} (~1 h on 2 cores)")
    ap.add_argument("--keep-caches", action="store_true", help="skip the cold read (it drops the machine's page "
                                                                "cache, which slows every other process)")
    ap.add_argument("--only", help="with --profile 1b: re-run only these methods (comma-separated, e.g. slerp,ties), "
                                   "keeping the other runs of the last merge_bench_1b.json")
    args = ap.parse_args()
    global KEEP_CACHES
    KEEP_CACHES = args.keep_caches

    t_start = time.perf_counter()
    work = os.path.abspath(args.work)
    os.makedirs(os.path.join(work, "logs"), exist_ok=True)
    results = args.results
    if args.quick and results == os.path.join(HERE, "results"):
        results = os.path.join(work, "results-quick")
    os.makedirs(results, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    if args.profile == "1b":
        return run_1b(args, work, results, log)
    size = QUICK if args.quick else FULL
    layers = size["num_hidden_layers"]
    mk_py = None if args.no_mergekit else ensure_mergekit(args.mergekit_python, work, log)
    env = child_env()

    models_root = os.path.join(work, "models-quick" if args.quick else "models")
    log("building / checking models")
    base, fts = build_models(models_root, size, layers, log)
    deep = None if args.no_deep else build_models(models_root, size, 2 * layers, log)

    def model_facts(b: str, n_layers: int) -> dict:
        from hubsoup.sources import open_input

        ck = open_input(b)
        infos = [ck.info(k) for k in ck.keys()]
        numels = [math.prod(i.shape) for i in infos]
        per = dir_bytes([b])
        return {"layers": n_layers, "params_m": sum(numels) / 1e6, "bytes_per_model": per, "input_bytes": 4 * per,
                "largest_tensor_mb": max(numels) * 4 / 1e6, "tensors": len(infos)}

    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine_info(), "quick": args.quick,
                 "repeat": args.repeat, "models": {"main": model_facts(base, layers)}, "runs": [], "summary": [],
                 "ratios": [], "diffs": [], "notes": []}
    res["models"]["deep"] = model_facts(deep[0], 2 * layers) if deep else res["models"]["main"]
    out_root = setup_run(res, mk_py, [base, *fts], os.path.join(work, "out"), log)
    runs: dict[str, list[Run]] = {}

    def do(label: str, tool: str, method: str, scope: str, b: str, f: list[str], n_layers: int, rep: int) -> Run:
        read_all([p for d in (b, *f) for p in shard_files(d)])  # inputs warm for every run alike
        slug = "".join(c if c.isalnum() else "_" for c in label)
        out = os.path.join(out_root, slug)
        run = Run(label, tool, method, scope, n_layers, out)
        if tool == "hubsoup":
            cmd = hubsoup_cmd(method, scope, b, f, out)
        else:
            cfg = out + ".yml"
            with open(cfg, "w") as fh:
                fh.write(mergekit_config(method, b, f))
            cmd = mergekit_cmd(mk_py, cfg, out)
        if os.path.exists(out):
            shutil.rmtree(out)
        if tool == "hubsoup":
            run.extra["hubsoup_code"] = code_fingerprint()
        return record_run(cmd, run, env, os.path.join(work, "logs", f"{slug}.{rep}.log"), runs, res, log)

    log("import baselines (python -c 'import ...')")
    for py, mod, name in [(sys.executable, "hubsoup.api", "hubsoup"), (mk_py, "mergekit.merge", "mergekit")]:
        if py:
            r = import_baseline(py, mod, work, name, env)
            runs[r.label] = [r]
            res["runs"].append(asdict(r))
            log(f"  import {mod}: {r.wall_s:.1f}s rss {r.maxrss_mb:.0f} MB anon {r.peak_anon_mb:.0f} MB")

    plan = [("hubsoup task_arithmetic", "hubsoup", "task_arithmetic", "-"),
            ("mergekit task_arithmetic", "mergekit", "task_arithmetic", "-"),
            ("hubsoup ties (scope=tensor)", "hubsoup", "ties", "tensor"),
            ("mergekit ties", "mergekit", "ties", "tensor"),
            ("hubsoup ties (scope=model)", "hubsoup", "ties", "model")]
    plan = [p for p in plan if p[1] == "hubsoup" or mk_py]
    deep_plan = [p for p in plan if p[3] != "model" and (p[1:3] != ("mergekit", "ties") or args.deep_mergekit_ties)]
    for rep in range(args.repeat):
        log(f"merging the {layers}-layer model (round {rep + 1}/{args.repeat})")
        for label, tool, method, scope in plan:
            do(label, tool, method, scope, base, fts, layers, rep)
        if deep:
            log(f"merging the {2 * layers}-layer model, same tensor sizes (round {rep + 1}/{args.repeat})")
            for label, tool, method, scope in deep_plan:
                do(f"{label} L{2 * layers}", tool, method, scope, deep[0], deep[1], 2 * layers, rep)

    summ = {lab: summarize(rs) for lab, rs in runs.items()}
    res["summary"] = list(summ.values())
    ok = lambda lab: lab in summ and summ[lab]["rc"] == 0  # noqa: E731
    if mk_py:
        for what, h, m in [("task_arithmetic", "hubsoup task_arithmetic", "mergekit task_arithmetic"),
                           ("ties (hubsoup scope=tensor)", "hubsoup ties (scope=tensor)", "mergekit ties"),
                           ("ties (hubsoup scope=model)", "hubsoup ties (scope=model)", "mergekit ties")]:
            for suffix, n_layers in [("", layers)] + ([(f" L{2 * layers}", 2 * layers)] if deep else []):
                if ok(h + suffix) and ok(m + suffix):
                    hr, mr = summ[h + suffix], summ[m + suffix]
                    res["ratios"].append({"what": what, "layers": n_layers, "time": _ratio(hr["wall_s"], mr["wall_s"]),
                                          "cpu": _ratio(hr["cpu_s"], mr["cpu_s"]),
                                          "maxrss": _ratio(hr["maxrss_mb"], mr["maxrss_mb"]),
                                          "anon": _ratio(hr["peak_anon_mb"], mr["peak_anon_mb"])})
        log("comparing outputs")
        for what, h, m in [("task_arithmetic", "hubsoup task_arithmetic", "mergekit task_arithmetic"),
                           ("ties, hubsoup scope=tensor", "hubsoup ties (scope=tensor)", "mergekit ties"),
                           ("ties, hubsoup scope=model", "hubsoup ties (scope=model)", "mergekit ties")]:
            if ok(h) and ok(m):
                d = compare(runs[h][-1].out, runs[m][-1].out)
                res["diffs"].append({"what": f"{what} vs mergekit", "diff": d})
                log(f"  {what}: max|diff| {d['max_abs_diff']:.3g}, {d['n_diff']} entries differ in "
                    f"{d['tensors_differing']} tensors")
                if "scope=tensor" in what and d["differing"]:
                    t = explain_ties_diff(base, fts, runs[h][-1].out, runs[m][-1].out, d["differing"])
                    res["ties_explained"] = t
                    log(f"  ties differences explained: {t}")

    if deep:
        res["depth"] = []
        for lab in ["hubsoup task_arithmetic", "hubsoup ties (scope=tensor)", "mergekit task_arithmetic", "mergekit ties"]:
            deep_lab = f"{lab} L{2 * layers}"
            if ok(lab) and ok(deep_lab):
                a, b2 = summ[lab], summ[deep_lab]
                res["depth"].append({"what": lab, "maxrss": [a["maxrss_mb"], b2["maxrss_mb"]],
                                     "anon": [a["peak_anon_mb"], b2["peak_anon_mb"]],
                                     "file": [a["peak_file_mb"], b2["peak_file_mb"]], "wall": [a["wall_s"], b2["wall_s"]]})

    codes = sorted({r["extra"].get("hubsoup_code") for r in res["runs"] if r["extra"].get("hubsoup_code")})
    res["hubsoup_code"] = codes
    if len(codes) > 1:
        res["notes"].append(f"WARNING: hubsoup's source files changed during the benchmark ({len(codes)} versions: "
                            f"{', '.join(codes)}; see each run's extra.hubsoup_code in the JSON): runs of different "
                            "versions are mixed in these tables.")
    return finish_run(res, t_start, os.path.join(results, "merge_bench"), write_report, out_root, args.keep_outputs,
                      log)


if __name__ == "__main__":
    sys.exit(main())
