"""Merge throughput on a GPU, against mergekit in the same run; and the host feed's rate on any machine.

**On a GPU** (the default when CUDA is there): base + 3 fine-tunes of a Llama-shaped bf16 model
(random weights, a 1B Llama's widths; ``--layers``, ``--quick``) are made on the GPU and saved, read
once into the page cache, then each method merges them with ``hubsoup merge --device cuda`` and — for
the methods mergekit has — with ``python -m mergekit.scripts.run_yaml CFG OUT --cuda`` on the same
inputs (each run its own process; equivalent parameters, both computing in float32 and writing
bf16). Input GB/s = bytes of every input read (base + fine-tunes) / wall time of the whole process;
"merge GB/s" divides by hubsoup's own merge time instead (no interpreter start or imports). A total
``--budget`` (seconds) skips what would not fit. Writes ``gpu_bench.md`` / ``gpu_bench.json`` to ``--out``.

    python benchmarks/bench_gpu.py --out benchmarks/results            # on a machine with a GPU
    python benchmarks/bench_gpu.py --quick --budget 300 --out "$OUT"   # a lent device's few minutes

Two versions of hubsoup on the same machine and inputs (``benchmarks/gpu_before_after.sh``): ``--tree DIR`` times
the ``hubsoup`` package in DIR (it comes first on the merges' path, and they run there), ``--reuse`` takes the
models already in ``--work``, ``--name`` names the result files, ``--no-mergekit`` leaves mergekit out.

**Host feed** (``--cpu-feed``; any machine): what the host side of a device merge costs. A bf16
model is streamed through the engine with the merge device ``meta`` (no arithmetic) and an
instrumented :class:`~hubsoup.engine.hostfeed.Feed`: the rate at which the host hands stored bytes,
against a plain read of the same files from the page cache and against the host conversion to float32
that the engine did before (``hubsoup.engine.hostfeed``). Writes ``gpu_feed_cpu.md`` / ``.json``.

    python benchmarks/bench_gpu.py --cpu-feed --layers 4 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (label, hubsoup args, mergekit YAML body or None, inputs: "3" = base + 3 fine-tunes, "2" = two fine-tunes)
# mergekit computes in float32 (dtype) and writes bf16 (out_dtype), as hubsoup does.
PLAN = [
    ("task_arithmetic", ["--method", "task_arithmetic", "-p", "scale=1.0"],
     "merge_method: task_arithmetic\nparameters: {normalize: false}\nmodel_params: {weight: 1.0}\n", "3"),
    ("ties", ["--method", "ties", "-p", "density=0.2", "-p", "scope=tensor", "-p", "merge=mean"],
     "merge_method: ties\nparameters: {normalize: true}\nmodel_params: {weight: 1.0, density: 0.2}\n", "3"),
    ("dare_ties", ["--method", "dare", "-p", "p=0.9", "-p", "then=ties", "-p", "convention=mergekit",
                   "-p", "merge=mean"],
     "merge_method: dare_ties\nparameters: {normalize: true}\nmodel_params: {weight: 1.0, density: 0.1}\n", "3"),
    ("slerp", ["--method", "slerp", "-p", "t=0.5"], "merge_method: slerp\nparameters: {t: 0.5}\n", "2"),
    ("sftm", ["--method", "sftm"], None, "3"),  # not in mergekit
]
TARGET_GBS = {"task_arithmetic": 4.0, "ties": 4.0, "dare_ties": 4.0, "slerp": 4.0, "sftm": 0.5}


def llama_shapes(layers: int, hidden: int = 2048, inter: int = 5632, kv: int = 512, vocab: int = 32000) -> dict:
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                       p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                       p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                       p + "mlp.down_proj.weight": (hidden, inter), p + "input_layernorm.weight": (hidden,),
                       p + "post_attention_layernorm.weight": (hidden,)})
    return shapes


def make_models(work: str, layers: int, *, device: str = "cuda", hidden: int = 2048, inter: int = 5632,
                kv: int = 512, vocab: int = 32000) -> tuple[str, list[str], int]:
    """Base + 3 fine-tunes (bf16), made on ``device`` and saved; returns (base, fine-tunes, parameters)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=kv // 64, vocab_size=vocab,
                      tie_word_embeddings=False, torch_dtype="bfloat16",
                      architectures=["LlamaForCausalLM"])  # mergekit picks its architecture from this list
    shapes = llama_shapes(layers, hidden, inter, kv, vocab)
    g = torch.Generator(device=device).manual_seed(0)
    base = {k: (torch.randn(s, generator=g, device=device) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}
    folders = []
    for j in range(4):
        d = os.path.join(work, "base" if j == 0 else f"ft{j}")
        os.makedirs(d, exist_ok=True)
        tensors = base if j == 0 else {k: (v.float() + torch.randn(v.shape, generator=g, device=device) * 0.002
                                           ).to(torch.bfloat16) for k, v in base.items()}
        save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, os.path.join(d, "model.safetensors"),
                  metadata={"format": "pt"})
        cfg.save_pretrained(d)
        folders.append(d)
    n_params = sum(v.numel() for v in base.values())
    return folders[0], folders[1:], n_params


TREE = ROOT
"""The folder whose ``hubsoup`` package the merges time (``--tree``): first on their path, and their working
directory (``python -m`` puts the working directory first on ``sys.path``)."""


def child_env() -> dict:
    """The timed tree first on PYTHONPATH, what was there after it (a device's carried wheels)."""
    old = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": TREE + (os.pathsep + old if old else ""), "PYTHONUNBUFFERED": "1"}


def existing_models(work: str) -> tuple[str, list[str], int] | None:
    """The base + 3 fine-tunes a previous run saved in ``work`` (``--reuse``): (base, fine-tunes, parameters)."""
    folders = [os.path.join(work, "base" if j == 0 else f"ft{j}") for j in range(4)]
    files = [os.path.join(d, "model.safetensors") for d in folders]
    if not all(os.path.isfile(f) and os.path.isfile(os.path.join(os.path.dirname(f), "config.json")) for f in files):
        return None
    with open(files[0], "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    n_params = 0
    for k, v in header.items():
        if k != "__metadata__":
            n = 1
            for d in v["shape"]:
                n *= d
            n_params += n
    return folders[0], folders[1:], n_params


def plain_read(paths: list[str], chunk: int = 64 << 20) -> tuple[int, float]:
    """Bytes and seconds to read ``paths`` from the page cache into one reused buffer (os.readv)."""
    buf = bytearray(chunk)
    view = memoryview(buf)
    total, t = 0, time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            while True:
                n = os.readv(fd, [view])
                if n <= 0:
                    break
                total += n
        finally:
            os.close(fd)
    return total, time.perf_counter() - t


def weight_files(folders: list[str]) -> list[str]:
    return [os.path.join(d, f) for d in folders for f in sorted(os.listdir(d)) if f.endswith(".safetensors")]


# ------------------------------------------------------------------------------------------------
# --cpu-feed: the host side of a device merge, on this machine
# ------------------------------------------------------------------------------------------------

def run_cpu_feed(args) -> dict:
    import torch

    from hubsoup.engine import Job, hostfeed, stream
    from hubsoup.plan import Plan
    from hubsoup.sources.compat import open_models

    base, fts, n_params = make_models(args.work, args.layers, device="cpu", hidden=args.hidden,
                                      inter=args.hidden * 11 // 4, kv=max(64, args.hidden // 4), vocab=args.vocab)
    paths = weight_files([base, *fts])
    plain_read(paths)  # into the page cache
    reads = [plain_read(paths) for _ in range(args.repeat)]
    read_bytes, read_s = reads[0][0], min(s for _, s in reads)

    def feed_pass(checks: bool = True) -> tuple[int, float, float]:
        """One pass of the engine over every tensor, on ``meta``; ``checks=False``: the NaN/inf counts made
        without meta's Python kernels (on ``meta`` each elementwise op runs torch's Python reference
        implementation, which a CUDA kernel launch does not)."""
        feeds = []

        def make(device):
            if torch.device(device).type == "cpu":
                return None
            feeds.append(hostfeed.Feed(device, transfer=lambda staged: staged.to("meta")))
            return feeds[-1]

        real, hostfeed.for_device = hostfeed.for_device, make
        count = hostfeed.nonfinite_count
        if not checks:
            hostfeed.nonfinite_count = lambda t: torch.zeros((), dtype=torch.int64, device=t.device)
        try:
            base_ckpt, sources = open_models(fts, base=base)
            job = Job(Plan.of(base_ckpt, "meta"), base_ckpt, sources, quiet=True)
            t = time.perf_counter()
            for work in stream(job, mergeable_only=True):
                work.base()
                work.deltas()
            wall = time.perf_counter() - t
            return sum(f.handed_bytes for f in feeds), sum(f.host_seconds for f in feeds), wall
        finally:
            hostfeed.for_device = real
            hostfeed.nonfinite_count = count

    def convert_pass() -> tuple[int, float]:
        """The host's share before the feed: every stored tensor converted to float32 on the CPU."""
        base_ckpt, sources = open_models(fts, base=base)
        job = Job(Plan.of(base_ckpt, "cpu"), base_ckpt, sources, quiet=True)
        total, t = 0, time.perf_counter()
        for work in stream(job, mergeable_only=True):
            for raw in (work.raw_base(), *work.input_weights()):
                raw.to(torch.float32)
                total += raw.numel() * raw.element_size()
        return total, time.perf_counter() - t

    feed_runs = [feed_pass() for _ in range(args.repeat)]
    bare_s = min(feed_pass(checks=False)[2] for _ in range(args.repeat))
    conv_runs = [convert_pass() for _ in range(args.repeat)]
    fed_bytes, fed_s = feed_runs[0][0], min(s for _, s, _ in feed_runs)
    pass_s = min(w for _, _, w in feed_runs)
    conv_bytes, conv_s = conv_runs[0][0], min(s for _, s in conv_runs)
    res = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "params": n_params,
           "layers": args.layers, "hidden": args.hidden, "input_gb": read_bytes / 1e9,
           "plain_read_gb_s": read_bytes / read_s / 1e9, "feed_gb_s": fed_bytes / fed_s / 1e9,
           "engine_pass_gb_s": fed_bytes / pass_s / 1e9, "engine_pass_no_meta_checks_gb_s": fed_bytes / bare_s / 1e9,
           "feed_bytes": fed_bytes, "old_host_convert_gb_s": conv_bytes / conv_s / 1e9, "repeat": args.repeat}
    res["feed_vs_read"] = res["feed_gb_s"] / res["plain_read_gb_s"]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_feed_cpu.json"), "w") as f:
        json.dump(res, f, indent=2)
    lines = ["# The host feed's rate on a CPU machine", "",
             f"`python benchmarks/bench_gpu.py --cpu-feed --layers {args.layers} --hidden {args.hidden} --vocab "
             f"{args.vocab}`: base + 3 bf16 fine-tunes ({n_params / 1e6:.0f}M parameters each, "
             f"{read_bytes / 1e9:.2f} GB in all), warm in the page cache; {res['cpus']} CPUs, torch "
             f"{res['torch']} ({res['torch_threads']} threads). Best of {args.repeat}.", "",
             "| what the host does | GB/s |", "|---|---|",
             f"| plain read of the weight files (os.readv, page cache) | {res['plain_read_gb_s']:.2f} |",
             f"| host feed: stored bf16 → staging buffers (the engine thread's time inside the feed; reads staged ahead run in reader threads meanwhile) | {res['feed_gb_s']:.2f} |",
             f"| the engine's whole pass on `meta` (feed + engine + meta ops' Python overhead) | "
             f"{res['engine_pass_gb_s']:.2f} |",
             f"| the same pass, its NaN/inf counts made without meta's Python kernels | "
             f"{res['engine_pass_no_meta_checks_gb_s']:.2f} |",
             f"| before the feed: stored bf16 → float32 on the host | {res['old_host_convert_gb_s']:.2f} |", "",
             f"The feed hands {res['feed_vs_read']:.2f}× the plain read's rate. On a GPU machine its staging "
             "buffers are pinned and the device copies them while reader threads stage the next tensor. The "
             "engine's pass on `meta` bounds a device merge's host side from below: on `meta` each elementwise "
             "op (the casts, the NaN/inf counts) runs torch's Python reference implementation, where a GPU "
             "launches a kernel; the pass without the counts' meta kernels shows how much of it that is."]
    with open(os.path.join(args.out, "gpu_feed_cpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return res


# ------------------------------------------------------------------------------------------------
# on a GPU: hubsoup vs mergekit
# ------------------------------------------------------------------------------------------------

def mergekit_config(body: str, base: str, fts: list[str], inputs: str) -> str:
    """The same config bench_merge's 1B profile writes (float32 compute, bf16 out)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_merge import mergekit_config_1b  # stdlib imports only: fine on a bare GPU box

    return mergekit_config_1b(body, base, fts, inputs)


def timed(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[float, int, str, str]:
    t = time.perf_counter()
    try:
        r = subprocess.run(cmd, env={**child_env(), **(env or {})}, capture_output=True, text=True,
                           timeout=max(1.0, timeout), cwd=TREE)
        return time.perf_counter() - t, r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        return time.perf_counter() - t, 124, out, err + f"\n(timed out after {timeout:.0f} s)"


def run_gpu(args) -> dict:
    import torch

    t_start = time.perf_counter()
    deadline = t_start + args.budget
    layers = args.layers or (8 if args.quick else 16)
    t0 = time.perf_counter()
    cuda = args.device == "cuda"
    have = existing_models(args.work) if args.reuse else None
    if have is not None:
        base, fts, n_params = have
        print(f"models: reused from {args.work}", flush=True)
    elif cuda:
        base, fts, n_params = make_models(args.work, layers)
        torch.cuda.synchronize()
    else:  # a dry run of the whole comparison on the CPU (small shapes): commands, configs, results
        base, fts, n_params = make_models(args.work, layers, device="cpu", hidden=256, inter=704, kv=64, vocab=1000)
    made_s = time.perf_counter() - t0
    size = os.path.getsize(os.path.join(base, "model.safetensors"))
    paths = weight_files([base, *fts])
    plain_read(paths)  # warm the page cache
    read_bytes, read_s = plain_read(paths)
    start_s, rc, which, err = timed([sys.executable, "-c", "import torch, hubsoup.api; torch.zeros(1, device='cuda')"
                                     "; torch.cuda.synchronize(); print(hubsoup.api.__file__)" if cuda else
                                     "import torch, hubsoup.api; print(hubsoup.api.__file__)"], 120)
    print(f"timed hubsoup: {which.strip() or '?'} (rc={rc}){err[-300:] if rc else ''}", flush=True)
    print(f"models: {n_params / 1e9:.2f}B params, {size / 1e9:.2f} GB each, made in {made_s:.1f} s; page cache read "
          f"{read_bytes / read_s / 1e9:.1f} GB/s; interpreter + imports + CUDA start {start_s:.1f} s", flush=True)
    mk_py = args.mergekit_python
    rows: list[dict] = []
    ratios: dict[str, float] = {}
    res = {"device": torch.cuda.get_device_name(0) if cuda else "cpu (dry run)", "torch": torch.__version__, "python": platform.python_version(),
           "params": n_params, "layers": layers, "model_gb": size / 1e9, "made_s": made_s,
           "page_cache_gb_s": read_bytes / read_s / 1e9, "startup_s": start_s, "rows": rows, "ratios": ratios,
           "mergekit_python": mk_py, "mergekit": mergekit_version(mk_py), "hubsoup": which.strip(),
           "tree": TREE}
    for label, hub_args, mk_body, inputs in PLAN:
        if args.methods and label not in args.methods:
            continue
        ins = fts if inputs == "3" else fts[:2]
        read = size * (len(ins) + (1 if inputs == "3" else 0))
        tools = [("hubsoup", None, {})] + ([("mergekit", mk_body, {})] if mk_body and not args.no_mergekit else [])
        for v in args.variant or []:  # extra hubsoup runs with an environment variable set (a measurement aid)
            which, _, assignment = v.partition(":")
            if which == label:
                key, _, value = assignment.partition("=")
                tools.append((f"hubsoup {key}={value}", None, {key: value}))
        for tool, body, tool_env in tools:
            left = deadline - time.perf_counter()
            row = {"method": label, "tool": tool, "inputs": len(ins), "input_gb": read / 1e9}
            if left < 10:
                row.update(ok=False, skipped="budget spent")
                rows.append(row)
                print(f"{label:<16} {tool:<9} skipped (budget)", flush=True)
                continue
            out = os.path.join(args.work, f"out-{label}-{tool.split()[0]}")
            if tool.startswith("hubsoup"):
                cmd = [sys.executable, "-m", "hubsoup", "merge", *ins, *(["--base", base] if inputs == "3" else []),
                       *hub_args, "--device", args.device, "--out", out, "--overwrite"]
            else:
                cfg = os.path.join(args.work, f"{label}.yml")
                with open(cfg, "w") as f:
                    f.write(mergekit_config(body, base, fts, inputs))
                cmd = [mk_py, "-m", "mergekit.scripts.run_yaml", cfg, out, *(["--cuda"] if cuda else []),
                       "--no-copy-tokenizer"]
            feed_log = os.path.join(args.work, f"feed-{label}.jsonl")
            if os.path.exists(feed_log):
                os.remove(feed_log)
            wall, rc, stdout, stderr = timed(cmd, min(left, args.run_timeout),
                                             {"HUBSOUP_FEED_LOG": feed_log, **tool_env} if tool.startswith("hubsoup")
                                             else None)
            if tool.startswith("hubsoup"):
                row["feed"] = feed_summary(feed_log)
            row.update(wall_s=wall, ok=rc == 0, rc=rc, input_gb_per_s=read / 1e9 / wall,
                       stderr=(stderr or "")[-600:] if rc else "")
            m = re.search(r"in ([0-9.]+)s ->", stdout + stderr) if tool.startswith("hubsoup") else None
            if m:
                row["merge_s"] = float(m.group(1))
                row["merge_gb_per_s"] = read / 1e9 / row["merge_s"]
            if tool == "mergekit" and rc == 0:
                row["agreement"] = agreement(os.path.join(args.work, f"out-{label}-hubsoup"), out)
            rows.append(row)
            _ratios(rows, ratios)
            res["total_s"] = time.perf_counter() - t_start
            write_gpu_results(args, res)  # after every run: a run cut short still leaves its results
            print(f"{label:<16} {tool:<9} {wall:7.1f} s  {read / 1e9 / wall:6.2f} GB/s input"
                  + (f"  (merge {row['merge_s']:.1f} s, {row['merge_gb_per_s']:.2f} GB/s)" if m else "")
                  + f"  rc={rc}" + (f"\n{stderr[-600:]}" if rc else ""), flush=True)
    res["total_s"] = time.perf_counter() - t_start
    write_gpu_results(args, res)
    return res


def feed_summary(path: str) -> dict | None:
    """The host feed's counts of one hubsoup run (every pass's feed, summed): bytes handed to the device, the
    host's own staging time, and the rate that makes (the host side's ceiling)."""
    try:
        with open(path, encoding="utf-8") as f:
            recs = [json.loads(line) for line in f if line.strip()]
    except OSError:
        return None
    writer = [r["writer"] for r in recs if "writer" in r]
    recs = [r for r in recs if "handed_bytes" in r]
    if not recs:
        return None
    handed = sum(r["handed_bytes"] for r in recs)
    host = sum(r["host_seconds"] for r in recs)
    return {"passes": len(recs), "handed_gb": handed / 1e9, "host_s": host,
            "staged_gb": sum(r.get("staged_bytes", 0) for r in recs) / 1e9,
            "read_wait_s": sum(r.get("read_wait_s", 0.0) for r in recs),
            "back_wait_s": sum(r.get("back_wait_s", 0.0) for r in recs),
            "writer_wait_s": sum(w["wait_s"] for w in writer), "writer_close_s": sum(w["close_s"] for w in writer),
            "host_gb_per_s": handed / 1e9 / host if host else None,
            "pinned_buffers": sum(r.get("pinned_buffers", 0) for r in recs) if any("pinned_buffers" in r for r in recs)
            else None,
            "pass_s": sum(r["open_seconds"] for r in recs)}


def _ratios(rows: list[dict], ratios: dict[str, float]) -> None:
    for label, *_ in PLAN:
        h = next((r for r in rows if r["method"] == label and r["tool"] == "hubsoup" and r.get("ok")), None)
        k = next((r for r in rows if r["method"] == label and r["tool"] == "mergekit" and r.get("ok")), None)
        if h and k:
            ratios[label] = h["wall_s"] / k["wall_s"]


def agreement(a: str, b: str, names=("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                                      "model.layers.1.mlp.down_proj.weight")) -> dict | None:
    """Relative L2 difference of a few tensors of two outputs (same method, hubsoup and mergekit)."""
    try:
        from safetensors import safe_open

        def tensor(folder, name):
            for f in sorted(os.listdir(folder)):
                if f.endswith(".safetensors"):
                    with safe_open(os.path.join(folder, f), "pt") as h:
                        if name in h.keys():
                            return h.get_tensor(name).double()
            return None

        out = {}
        for n in names:
            x, y = tensor(a, n), tensor(b, n)
            if x is not None and y is not None:
                out[n] = float((x - y).norm() / y.norm().clamp_min(1e-30))
        return out
    except Exception as e:  # a report, never a reason to lose the timings
        return {"error": str(e)[:200]}


def mergekit_version(python: str) -> str | None:
    r = subprocess.run([python, "-c", "from importlib.metadata import version; print(version('mergekit'))"],
                       env=child_env(), capture_output=True, text=True)
    return r.stdout.strip() or None if r.returncode == 0 else None


def write_gpu_results(args, res: dict) -> None:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump(res, f, indent=2)
    lines = ["# Merge throughput on a GPU, hubsoup vs mergekit", "",
             f"{res['device']}, torch {res['torch']}, mergekit {res.get('mergekit') or '?'}. A "
             f"{res['params'] / 1e9:.2f}B-parameter Llama-shaped bf16 model ({res['layers']} layers, "
             f"{res['model_gb']:.2f} GB), base + 3 fine-tunes (two fine-tunes for slerp), random weights; each "
             "merge its own process, inputs warm in the page cache (read at "
             f"{res['page_cache_gb_s']:.1f} GB/s by a plain read). hubsoup: `hubsoup merge --device cuda`; mergekit: "
             "`python -m mergekit.scripts.run_yaml CFG OUT --cuda` (dtype float32, out_dtype bfloat16). Interpreter, "
             f"imports and CUDA start cost {res['startup_s']:.1f} s of every process; *merge GB/s* leaves them out "
             f"(hubsoup's own merge time). Timed hubsoup: `{res.get('hubsoup') or '?'}`.", "",
             "| method | tool | wall (s) | input GB | input GB/s | merge GB/s | hubsoup / mergekit wall | target | "
             "host feed |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        if r.get("skipped"):
            lines.append(f"| {r['method']} | {r['tool']} | skipped ({r['skipped']}) | | | | | |")
            continue
        ratio = res["ratios"].get(r["method"]) if r["tool"] == "hubsoup" else None
        target = (f"≥ {TARGET_GBS[r['method']]} GB/s" + (", ≤ 0.3×" if r["method"] != "sftm" else "")
                  if r["tool"] == "hubsoup" else "")
        fd = r.get("feed")
        feed = (f"{fd['handed_gb']:.1f} GB in {fd['host_s']:.1f} s host time ({fd['passes']} pass(es), "
                f"{fd['pass_s']:.1f} s streaming)" if fd else "")
        if fd and "read_wait_s" in fd:
            feed += (f"; waited {fd['read_wait_s']:.1f} s for reads, {fd['back_wait_s']:.1f} s for outputs, "
                     f"{fd['writer_wait_s']:.1f} s for the writer, {fd['writer_close_s']:.1f} s closing (sync)")
        if fd and fd.get("pinned_buffers") is not None:
            feed += f"; {fd['pinned_buffers']} page-locked buffers"
        lines.append(f"| {r['method']} | {r['tool']} | {r['wall_s']:.1f} | {r['input_gb']:.1f} | "
                     f"{r['input_gb_per_s']:.2f} | {r.get('merge_gb_per_s', float('nan')):.2f} | "
                     f"{'' if ratio is None else f'{ratio:.2f}×'} | {target} | {feed} |" + ("" if r["ok"] else " (failed)"))
    lines += ["", "*host feed*: what hubsoup's host side did (`HUBSOUP_FEED_LOG`): stored bytes handed to the GPU, "
              "the host's own time staging them (reading into pinned memory, waiting for a free buffer), and the "
              "time its passes streamed; host time well below the streaming time means the host was not the "
              "bottleneck."]
    agree = [(r["method"], r["agreement"]) for r in res["rows"] if r.get("agreement")]
    if agree:
        lines += ["", "Agreement (relative L2 difference hubsoup vs mergekit on three tensors; DARE's masks and TIES' "
                  "ties differ by design): " + "; ".join(f"{m}: " + ", ".join(f"{v:.1e}" if isinstance(v, float) else
                                                                               str(v) for v in d.values())
                                                        for m, d in agree) + "."]
    lines += ["", f"Whole run {res.get('total_s', 0):.0f} s. Reproduce: `python benchmarks/bench_gpu.py"
              f"{' --quick' if args.quick else ''}` on a machine with a GPU and mergekit importable."]
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/hubsoup-gpu-bench")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (GPU: 16, --quick 8; --cpu-feed: 4)")
    ap.add_argument("--quick", action="store_true", help="fewer layers: the whole GPU run in a few minutes")
    ap.add_argument("--budget", type=float, default=3600.0, help="seconds for the whole GPU run; later runs skipped")
    ap.add_argument("--run-timeout", type=float, default=600.0, help="seconds for one merge")
    ap.add_argument("--methods", nargs="*", help="only these labels (task_arithmetic ties dare_ties slerp sftm)")
    ap.add_argument("--mergekit-python", default=sys.executable,
                    help="the interpreter that imports mergekit (default: this one, e.g. mergekit on PYTHONPATH)")
    ap.add_argument("--no-mergekit", action="store_true")
    ap.add_argument("--tree", default=ROOT, help="the folder whose hubsoup package is timed (default: this checkout)")
    ap.add_argument("--reuse", action="store_true", help="take the models already saved in --work, if complete")
    ap.add_argument("--name", default="gpu_bench", help="result files' name: NAME.md and NAME.json in --out")
    ap.add_argument("--variant", action="append", metavar="LABEL:ENV=VALUE",
                    help="an extra hubsoup run of LABEL with an environment variable set, e.g. "
                         "ties:HUBSOUP_DEVICE_SELECT=histogram (repeatable)")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the GPU comparison at tiny sizes")
    ap.add_argument("--cpu-feed", action="store_true", help="measure the host feed on this machine (no GPU needed)")
    ap.add_argument("--hidden", type=int, default=2048, help="--cpu-feed: hidden size")
    ap.add_argument("--vocab", type=int, default=32000, help="--cpu-feed: vocabulary")
    ap.add_argument("--repeat", type=int, default=3, help="--cpu-feed: best of this many")
    args = ap.parse_args()
    global TREE
    TREE = os.path.abspath(args.tree)
    args.work, args.out = os.path.abspath(args.work), os.path.abspath(args.out)  # the merges run in TREE
    sys.path.insert(0, ROOT)
    if args.cpu_feed:
        args.layers = args.layers or 4
        run_cpu_feed(args)
        return
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_gpu.py: no CUDA device here; --cpu-feed measures the host side without one")
    run_gpu(args)


if __name__ == "__main__":
    main()
