"""`hubsoup evolve` and mergekit-evolve side by side at equal work: trials per hour, startup, peak memory, best score.

Equal work (issue 49): a ~37.8M-parameter Llama (bf16; 8 layers, hidden 512, vocabulary 12 000, made here with
random weights: no Hub at benchmark time), 2 fine-tunes (seeded noise), task arithmetic with 8 genes = 4 layer
groups x 2 models (weights in [0, 1], started at 0.5, CMA-ES step 1/6), 9 trials in generations of 4, 4, 1, scored
by the same custom lm-eval task (rolling log-likelihood of 24 texts of 96 words: word perplexity), at the same
evaluation batch size (1: mergekit's in-memory mode builds lm-eval's model wrapper without its --batch-size) and one
thread per trial (mergekit's Ray actor asks for one CPU; hubsoup's `resources.cpus: 1`). Both tools first score one
fixed merge (every weight 0.5) and must agree exactly. hubsoup's layer groups are the anchors of a gradient,
mergekit's constant blocks (`layer_granularity: 2`): the same merge computation either way.

mergekit-evolve 0.1.5 runs from its own venv, `benchmarks/.work/mergekit-evolve-venv` (created if missing:
`pip install -c constraints.txt torch==2.13.0 'mergekit[evolve]==0.1.5'`, which takes the CPU torch wheel), with
three workarounds applied at run time by a `sitecustomize.py` this script writes to
`benchmarks/.work/mergekit-evolve-patches/` (on PYTHONPATH for mergekit's processes only; mergekit's code is not
changed on disk): (1) a stand-in for `lm_eval.models.vllm_causallms` (mergekit's actor module names its class in an
annotation; the real module imports vLLM, which needs CUDA; never called without --vllm); (2) a fake GPU for Ray
(each evaluator actor asks for `num_gpus=1`; the local cluster is told it has one, torch never sees it); (3)
`--in-memory`: `ReturnTensor.tensor_task` typed `Task` instead of `Task[torch.Tensor]`, which pydantic cannot
validate a merge task against. With HUBSOUP_BENCH_TIMINGS the same file notes each trial's start, end of merge and
end of evaluation (measurement only).

Measured per tool and round, from the tool's own process tree: startup (launch to the first trial's start),
trials per hour (9 trials over first start to last end: the search's rate, asking and telling included), each
trial's merge and evaluation, peak memory (the process tree's RSS sampled every 0.2 s: mergekit's includes Ray's
processes, which it needs), the best score (minus word perplexity), total wall. Writes
benchmarks/results/evolve_bench.{md,json}.

    python benchmarks/bench_evolve.py                # one round per size: ~5 min on 2 shared cores (+ the venv once)
    python benchmarks/bench_evolve.py --rounds 3     # hubsoup, mergekit, hubsoup, ... (interleaved)
    python benchmarks/bench_evolve.py --no-mergekit  # hubsoup alone
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORK = os.path.join(HERE, ".work")
RESULTS = os.path.join(HERE, "results")
VENV = os.path.join(WORK, "mergekit-evolve-venv")
PATCHES = os.path.join(WORK, "mergekit-evolve-patches")
MERGEKIT_SPEC = "mergekit[evolve]==0.1.5"
SIZE = dict(vocab_size=12000, hidden_size=512, intermediate_size=1392, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=8, tie_word_embeddings=False, max_position_embeddings=512)
EVALS = {"standard": (24, 96), "light": (8, 32)}
"""The lm-eval task's texts: (how many, words each). Both tools evaluate at batch 1 on one thread: the forward passes
are the same work for both, so the lighter the evaluation, the more the rest of a trial shows."""
HUBSOUP_TREE = ROOT
"""The folder whose ``hubsoup`` package is timed (``--tree``: an older commit's, from ``git archive``)."""
IDLE_LOAD = 1.5  # 1-minute load average at most this on 2 cores: only the benchmark ran (its one thread)
TRIALS, POPULATION, MAX_FEVALS = 9, 4, 5  # mergekit: generations of 4 while evaluations < 5, then the mean: 4, 4, 1

SITECUSTOMIZE = '''"""mergekit-evolve 0.1.5 on a CPU-only machine: workarounds applied as the modules they patch are imported
(written by hubsoup's benchmarks/bench_evolve.py; on PYTHONPATH for mergekit's processes only)."""
import importlib.abc
import importlib.machinery
import sys


class _Patches(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "lm_eval.models.vllm_causallms":
            return importlib.machinery.ModuleSpec(name, _VllmStandIn())
        then = {"lm_eval.models": _with_vllm_stand_in, "ray": _fake_gpu, "mergekit.io.tasks": _in_memory_fix,
                "mergekit.evo.actors": _timings}.get(name)
        if then is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            spec.loader = _After(spec.loader, then)
        return spec


class _After(importlib.abc.Loader):
    def __init__(self, loader, then):
        self.loader, self.then = loader, then

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.then(module)


class _VllmStandIn(importlib.abc.Loader):
    """1. vLLM stand-in: mergekit.evo.actors names lm_eval.models.vllm_causallms.VLLM in a class annotation, and
    lm-eval's module imports vllm (CUDA only). mergekit-evolve without --vllm never calls it."""

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        class VLLM:
            AUTO_MODEL_CLASS = None

        module.VLLM = VLLM


def _with_vllm_stand_in(models):
    import lm_eval.models.vllm_causallms  # noqa: F401 - the stand-in, as an attribute of lm_eval.models


def _fake_gpu(ray):
    """2. A fake GPU for Ray: each evaluator actor asks for num_gpus=1; the local cluster mergekit-evolve starts is
    told it has one. torch never sees it (the merge and the evaluation run on the CPU)."""
    init = ray.init

    def init_with_a_gpu(*args, **kwargs):
        if not args and kwargs.get("address") is None:
            kwargs.setdefault("num_gpus", 1)
        return init(*args, **kwargs)

    ray.init = init_with_a_gpu


def _in_memory_fix(tasks):
    """3. --in-memory: ReturnTensor.tensor_task is typed Task[torch.Tensor], which pydantic cannot validate a merge
    task against (it tries to build the abstract class); typed Task, as SaveTensor's is."""
    tasks.ReturnTensor.model_fields["tensor_task"].annotation = tasks.Task
    tasks.ReturnTensor.model_rebuild(force=True)


def _timings(actors):
    """Measurement only: with HUBSOUP_BENCH_TIMINGS=FILE, one JSON line per trial start (its genotype made a merge
    config), end of merge (the weights are in the model) and end of evaluation, with the pid and time."""
    import json
    import os
    import time

    path = os.environ.get("HUBSOUP_BENCH_TIMINGS")
    if not path:
        return

    def note(event, **kw):
        with open(path, "a") as f:
            f.write(json.dumps({"event": event, "pid": os.getpid(), "t": time.time(), **kw}) + "\\n")

    import mergekit.evo.genome as genome

    make_config = genome.ModelGenome.genotype_merge_config

    def timed_config(self, genotype):
        note("start")
        return make_config(self, genotype)

    genome.ModelGenome.genotype_merge_config = timed_config
    eval_model = actors._eval_model

    def timed_eval(*args, **kwargs):
        note("merged")
        out = eval_model(*args, **kwargs)
        note("end", score=out.get("score"))
        return out

    actors._eval_model = timed_eval


sys.meta_path.insert(0, _Patches())
'''

MERGEKIT_FIXED = '''import json, os, sys
import lm_eval.tasks, yaml
from mergekit.evo.config import EvolMergeConfiguration
from mergekit.evo.genome import ModelGenome
from mergekit.options import MergeOptions
import mergekit.evo.actors as actors
cfg_path, tasks, storage, weights = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
cfg = EvolMergeConfiguration.model_validate(yaml.safe_load(open(cfg_path)))
genome = ModelGenome(cfg.genome)
opts = MergeOptions(transformers_cache=os.path.join(storage, "transformers_cache"),
                    lora_merge_cache=os.path.join(storage, "lora_merge_cache"), cuda=False, low_cpu_memory=False,
                    out_shard_size=1_000_000_000_000, random_seed=0, quiet=True, read_to_gpu=False,
                    copy_tokenizer=True, safe_serialization=True)  # as mergekit-evolve --in-memory --no-merge-cuda
cls = actors.InMemoryMergeEvaluator.__ray_metadata__.modified_class.__mro__[1]  # the class under @ray.remote
ev = cls(cfg, genome, opts, model_storage_path=os.path.join(storage, "merged"), vllm=False, batch_size=1,
         task_manager=lm_eval.tasks.TaskManager(include_path=[tasks]))
x = genome.initial_genotype()
for g in range(x.shape[0]):
    for m in range(x.shape[1]):
        x[g, m, 0, 0] = weights[m][g]
r = ev.evaluate_genotype(x.view(-1).numpy())
from mergekit.merge import run_merge
run_merge(genome.genotype_merge_config(x.view(-1).numpy()), os.path.join(storage, "merged-fixed"), opts)  # on disk
print("RESULT " + json.dumps({"score": r["score"], "results": r["results"],
                              "folder": os.path.join(storage, "merged-fixed")}))
'''

HUBSOUP_FIXED = '''import json, sys
import torch
from hubsoup.eval import TaskSpec, evaluate_model
from hubsoup.workflows.trial import run_trial
base, ft1, ft2, task, weights, folder = sys.argv[1:7]
r = run_trial({"number": 0, "inputs": [ft1, ft2], "base": base, "method": "task_arithmetic",
               "params": {"scale": 1.0, "weights": json.loads(weights)}, "tasks": [task], "batch_size": 1,
               "threads": 1})
out = {"own": r["metrics"]["wordppl"]["word_perplexity"]}
if folder:  # mergekit's merge of the same point, as mergekit wrote it
    torch.set_num_threads(1)
    [t] = evaluate_model(folder, [TaskSpec.parse(task)], tokenizer=base, batch_size=1, quiet=True)
    out["mergekit_merge"] = t.metrics["word_perplexity"]
print("RESULT " + json.dumps(out))
'''

HUBSOUP_RUN = '''import json, sys, time
from hubsoup.workflows.evolve import evolve
config, out, events = sys.argv[1], sys.argv[2], sys.argv[3]


def note(event, **kw):
    with open(events, "a") as f:
        f.write(json.dumps({"event": event, "t": time.time(), **kw}) + "\\n")


def progress(done, stage, msg):
    if msg.startswith("trial "):  # a trial told (the driver's progress report, as it arrives)
        note("end", number=int(msg.split()[1].rstrip(":")), score=float(msg.split()[-1]) if "score" in msg else None)


res = evolve(config, out, progress=progress)
for s in res.seconds:
    note("seconds", **s)
note("done", best=res.best_score, study_seconds=res.study_seconds, write_seconds=res.write_seconds)
'''


def log(msg: str) -> None:
    print(msg, flush=True)


def build(root: str) -> dict:
    """Base, 2 fine-tunes, a word tokenizer, the texts and the lm-eval task (in ``root``; made again each run)."""
    import torch
    import transformers as tf

    from hubsoup.testing import make_finetune, save_tiny_tokenizer

    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    base = os.path.join(root, "base")
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**SIZE)).to(torch.bfloat16).eval()
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(base)
    save_tiny_tokenizer(base, vocab=SIZE["vocab_size"])
    fts = [make_finetune(base, os.path.join(root, f"ft{i}"), seed=i, scale=0.01) for i in (1, 2)]
    return {"base": base, "fts": fts, "params_m": round(params / 1e6, 2),
            "tasks": {name: write_task(os.path.join(root, f"tasks-{name}"), *size) for name, size in EVALS.items()}}


def write_task(tasks: str, docs: int, words: int) -> str:
    """The custom lm-eval task ``wordppl`` (rolling log-likelihood: word perplexity) in folder ``tasks``."""
    os.makedirs(tasks)
    data = os.path.join(tasks, "val.jsonl")
    with open(data, "w") as f:
        for i in range(docs):
            f.write(json.dumps({"text": " ".join(f"w{(i * 37 + j * 11 + (j * j) % 7) % 11000}"
                                                 for j in range(words))}) + "\n")
    with open(os.path.join(tasks, "wordppl.yaml"), "w") as f:
        f.write(f"""task: wordppl
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {data}
output_type: loglikelihood_rolling
validation_split: validation
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
metadata:
  version: 1.0
""")
    return tasks


def ensure_venv() -> str:
    py = os.path.join(VENV, "bin", "python")
    if not os.path.isfile(os.path.join(VENV, "bin", "mergekit-evolve")):
        log(f"creating {os.path.relpath(VENV, ROOT)}: {MERGEKIT_SPEC}, torch pinned by constraints.txt (CPU wheel)")
        subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
        subprocess.run([py, "-m", "pip", "install", "-q", "-c", os.path.join(ROOT, "constraints.txt"),
                        "torch==2.13.0", MERGEKIT_SPEC], check=True)
    torch_version = subprocess.run([py, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                                   text=True, check=True).stdout.strip()
    if "+cu" in torch_version or not torch_version.startswith("2.13.0"):
        raise SystemExit(f"{VENV}: torch {torch_version}, expected the CPU wheel of 2.13.0")
    os.makedirs(PATCHES, exist_ok=True)
    with open(os.path.join(PATCHES, "sitecustomize.py"), "w") as f:
        f.write(SITECUSTOMIZE)
    return py


def versions(py: str, names: list[str]) -> dict:
    code = ("import importlib.metadata as m, json, sys; "
            f"print(json.dumps({{k: m.version(k) for k in {names!r}}} | {{'python': sys.version.split()[0]}}))")
    r = subprocess.run([py, "-c", code], capture_output=True, text=True)
    return json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr[-300:]}


def env(extra: dict | None = None, *, mergekit: bool = False) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    e.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
             HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=PATCHES if mergekit else HUBSOUP_TREE)
    e.update(extra or {})
    return e


class Sampler:
    """The peak RSS of a process and its descendants (summed), sampled every 0.2 s."""

    def __init__(self, pid: int):
        import psutil

        self.proc, self.peak, self.peak_one = psutil.Process(pid), 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                procs = [self.proc, *self.proc.children(recursive=True)]
            except psutil.Error:
                break
            rss = []
            for p in procs:
                try:
                    rss.append(p.memory_info().rss)
                except psutil.Error:
                    pass
            self.peak, self.peak_one = max(self.peak, sum(rss)), max(self.peak_one, max(rss, default=0))
            self._stop.wait(0.2)

    def stop(self) -> tuple[int, int]:
        self._stop.set()
        self._thread.join()
        return self.peak, self.peak_one


def run(cmd: list[str], environ: dict, out_log: str, timeout: float) -> tuple[float, float, int, int, int]:
    """``cmd`` in its own process group; (launch time, wall, return code, peak tree RSS, peak single RSS)."""
    t0 = time.time()
    with open(out_log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=environ, cwd=WORK,
                                start_new_session=True)
        sampler = Sampler(proc.pid)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            rc = proc.wait()
        peak, one = sampler.stop()
    return t0, time.time() - t0, rc, peak, one


def fixed_merge(models: dict, py_mk: str | None, mk_cfg: str, spec: str, tasks: str) -> dict:
    """Both tools score one fixed merge, mergekit's merge of the point where every weight is 0.5 (mergekit-evolve's
    start): mergekit's in-memory evaluator, and hubsoup's evaluation of that merge as mergekit writes it to disk;
    the word perplexities must be equal. (hubsoup's own merge of the point computes in float32 and rounds once,
    mergekit's in bfloat16 step by step: a few weights differ in the last bit, and so does its score, also given.)"""
    weights = [[0.5] * 4, [0.5] * 4]
    base, (ft1, ft2) = models["base"], models["fts"]
    out: dict = {"weights": weights}
    folder = ""
    if py_mk:
        storage = os.path.join(WORK, "evolve-bench", "mk-fixed")
        shutil.rmtree(storage, ignore_errors=True)
        r = subprocess.run([py_mk, "-W", "ignore", "-c", MERGEKIT_FIXED, mk_cfg, tasks, storage,
                            json.dumps(weights)], capture_output=True, text=True, env=env(mergekit=True), cwd=WORK)
        line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"mergekit's fixed merge failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        got = json.loads(line[7:])
        out["mergekit"], folder = got["results"]["wordppl"]["word_perplexity,none"], got["folder"]
    r = subprocess.run([sys.executable, "-c", HUBSOUP_FIXED, base, ft1, ft2, spec, json.dumps(weights), folder],
                       capture_output=True, text=True, env=env(), cwd=WORK)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"hubsoup's fixed merge failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    got = json.loads(line[7:])
    out["hubsoup_own_merge"] = got["own"]
    if py_mk:
        out["hubsoup"] = got["mergekit_merge"]
        out["equal"] = out["mergekit"] == out["hubsoup"]
        shutil.rmtree(folder, ignore_errors=True)
    return out


def summarize(t0: float, starts: list[float], ends: list[float], merges: list[float], evals: list[float]) -> dict:
    """``starts``/``ends``/``merges``/``evals`` in trial order (the first trial first)."""
    n = len(ends)
    span = max(ends) - min(starts)
    later = sorted(ends)
    return {"trials": n, "startup_s": round(min(starts) - t0, 2), "first_result_s": round(later[0] - t0, 2),
            "search_s": round(span, 2), "trials_per_hour": round(3600 * n / span, 1),
            # after the first trial (which builds what the others reuse): n - 1 trials from its end to the last end
            "steady_trials_per_hour": round(3600 * (n - 1) / (later[-1] - later[0]), 1),
            "first_trial_s": round(ends[0] - starts[0], 3), "first_merge_s": round(merges[0], 3),
            "merge_s": round(statistics.mean(merges[1:]), 3), "eval_s": round(statistics.mean(evals[1:]), 3),
            "trial_s": round(statistics.mean(e - s for s, e in list(zip(starts, ends))[1:]), 3)}


def run_hubsoup(models: dict, spec: str, i: int, label: str) -> dict:
    folder = os.path.join(WORK, "evolve-bench", f"hubsoup-{label}-{i}")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    cfg = {"base": models["base"], "models": models["fts"], "method": "task_arithmetic", "params": {"scale": 1.0},
           "space": {"weight": {"range": [0.0, 1.0], "per": "input", "layer_groups": 4}},
           "optimizer": "cmaes", "trials": TRIALS, "population": POPULATION, "seed": 0,
           "eval": {"tasks": [spec], "batch_size": 1}, "resources": {"cpus": 1}}
    import yaml

    cfg_file = os.path.join(folder, "evolve.yml")
    with open(cfg_file, "w") as f:
        yaml.safe_dump(cfg, f)
    events = os.path.join(folder, "events.jsonl")
    t0, wall, rc, peak, one = run([sys.executable, "-c", HUBSOUP_RUN, cfg_file, os.path.join(folder, "out"), events],
                                  env(), os.path.join(folder, "log.txt"), 1800)
    if rc != 0:
        raise SystemExit(f"hubsoup evolve failed (rc {rc}); see {folder}/log.txt")
    ev = [json.loads(x) for x in open(events)]
    ends = {e["number"]: e for e in ev if e["event"] == "end"}
    secs = {e["number"]: e for e in ev if e["event"] == "seconds"}
    order = sorted(ends)
    # a trial's own time, measured where it ran; the session's opening (once: the inputs read into memory, the model
    # and lm-eval's tasks built, the imports they need) is setup before the first trial, as mergekit's is at startup
    starts = [ends[n]["t"] - secs[n]["total"] + secs[n].get("open", 0.0) for n in order]
    row = summarize(t0, starts, [ends[n]["t"] for n in order], [secs[n]["merge"] for n in order],
                    [secs[n]["eval"] for n in order])
    row.update(tool="hubsoup", wall_s=round(wall, 2), peak_rss_mb=round(peak / 2**20), peak_single_rss_mb=round(one / 2**20),
               best_score=max(e["score"] for e in ends.values() if e["score"] is not None),
               scores=[ends[n]["score"] for n in order], setup_s=round(secs[order[0]].get("open", 0.0), 2))
    return row


def run_mergekit(py: str, models: dict, mk_cfg: str, i: int, label: str, tasks: str) -> dict:
    folder = os.path.join(WORK, "evolve-bench", f"mergekit-{label}-{i}")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    events = os.path.join(folder, "events.jsonl")
    cmd = [os.path.join(VENV, "bin", "mergekit-evolve"), mk_cfg, "--storage-path", os.path.join(folder, "storage"),
           "--in-memory", "--no-merge-cuda", "--num-gpus", "1", "--max-fevals", str(MAX_FEVALS),
           "--force-population-size", str(POPULATION), "--batch-size", "1", "--random-seed", "0",
           "--task-search-path", tasks]
    t0, wall, rc, peak, one = run(cmd, env({"HUBSOUP_BENCH_TIMINGS": events, "RAY_DEDUP_LOGS": "0"}, mergekit=True),
                                  os.path.join(folder, "log.txt"), 1800)
    if rc != 0:
        raise SystemExit(f"mergekit-evolve failed (rc {rc}); see {folder}/log.txt")
    ev = [json.loads(x) for x in open(events)]
    actor = next(e["pid"] for e in ev if e["event"] == "end")
    ev = [e for e in ev if e["pid"] == actor]  # the driver makes merge configs too (for its best-so-far report)
    starts = [e["t"] for e in ev if e["event"] == "start"]
    merged = [e["t"] for e in ev if e["event"] == "merged"]
    ends = [e for e in ev if e["event"] == "end"]
    row = summarize(t0, starts, [e["t"] for e in ends], [m - s for s, m in zip(starts, merged)],
                    [e["t"] - m for m, e in zip(merged, ends)])
    row.update(tool="mergekit-evolve", wall_s=round(wall, 2), peak_rss_mb=round(peak / 2**20),
               peak_single_rss_mb=round(one / 2**20), best_score=max(e["score"] for e in ends),
               scores=[e["score"] for e in ends])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1, help="runs of each tool, interleaved (default 1)")
    ap.add_argument("--no-mergekit", action="store_true", help="hubsoup alone")
    ap.add_argument("--evals", default="standard,light", help=f"evaluation sizes, of {', '.join(EVALS)}")
    ap.add_argument("--report", action="store_true", help="write the .md again from the .json, run nothing")
    ap.add_argument("--tree", help="time the hubsoup package in this folder (`git archive SHA hubsoup cards | tar -x "
                    "-C DIR`), e.g. the code before a change, against the same mergekit runs")
    ap.add_argument("--batch-probe", action="store_true",
                    help="only lm-eval's evaluation of the base at batch sizes 1-24 on one thread, each size's task "
                         "(results/evolve_eval_batch.md): what evaluation batching can save")
    ap.add_argument("--name", default="evolve_bench", help="result files: results/NAME.md and .json")
    args = ap.parse_args()
    global HUBSOUP_TREE
    HUBSOUP_TREE = os.path.abspath(args.tree) if args.tree else ROOT
    if args.report:
        with open(os.path.join(RESULTS, f"{args.name}.json")) as f:
            res = json.load(f)
        with open(os.path.join(RESULTS, f"{args.name}.md"), "w") as f:
            f.write(report(res))
        return
    sys.path.insert(0, ROOT)
    os.makedirs(os.path.join(WORK, "evolve-bench"), exist_ok=True)
    load = [os.getloadavg()[0]]
    log("building the models ...")
    models = build(os.path.join(WORK, "evolve-bench", "models"))
    if args.batch_probe:
        return batch_probe(models, load)
    mk_cfg = os.path.join(WORK, "evolve-bench", "mergekit-evolve.yml")
    with open(mk_cfg, "w") as f:
        json.dump({"genome": {"models": models["fts"], "merge_method": "task_arithmetic", "base_model": models["base"],
                              "layer_granularity": SIZE["num_hidden_layers"] // 4, "normalize": False},
                   "tasks": [{"name": "wordppl", "metric": "word_perplexity,none", "weight": -1.0}],
                   "apply_chat_template": False, "fewshot_as_multiturn": False}, f)  # JSON is YAML
    py_mk = None if args.no_mergekit else ensure_venv()

    def spec(label: str) -> str:
        return f"lm-eval:wordppl,task_dir={models['tasks'][label]},metric=word_perplexity"

    log("scoring one fixed merge with both tools ...")
    fixed = fixed_merge(models, py_mk, mk_cfg, spec("standard"), models["tasks"]["standard"])
    log(f"  {fixed}")
    if py_mk and not fixed["equal"]:
        raise SystemExit("the tools score the same merge differently: not equal work")
    rows = []
    for label in args.evals.split(","):
        for i in range(args.rounds):
            for tool in ("hubsoup", "mergekit") if py_mk else ("hubsoup",):
                before = os.getloadavg()[0]
                log(f"{label} evaluation, round {i + 1}: {tool} ...")
                row = run_hubsoup(models, spec(label), i, label) if tool == "hubsoup" else \
                    run_mergekit(py_mk, models, mk_cfg, i, label, models["tasks"][label])
                row.update(eval=label, round=i + 1, load_before=round(before, 2),
                           load_after=round(os.getloadavg()[0], 2))
                load.append(row["load_after"])
                log(f"  {row['trials_per_hour']} trials/h ({row['steady_trials_per_hour']} after the first), "
                    f"startup {row['startup_s']} s, first trial {row['first_trial_s']} s, merge {row['merge_s']} s, "
                    f"eval {row['eval_s']} s, peak {row['peak_rss_mb']} MB, best {row['best_score']:.6g}, "
                    f"load {row['load_before']} -> {row['load_after']}")
                rows.append(row)
    ratios = {}
    for label in args.evals.split(","):
        hs = [r for r in rows if r["tool"] == "hubsoup" and r["eval"] == label]
        mk = [r for r in rows if r["tool"] == "mergekit-evolve" and r["eval"] == label]
        ratios[label] = {
            "trials_per_hour": [round(h["trials_per_hour"] / m["trials_per_hour"], 2) for h, m in zip(hs, mk)],
            "steady_trials_per_hour": [round(h["steady_trials_per_hour"] / m["steady_trials_per_hour"], 2)
                                       for h, m in zip(hs, mk)],
            "time_to_first_result": [round(m["first_result_s"] / h["first_result_s"], 2) for h, m in zip(hs, mk)],
            "peak_rss": [round(h["peak_rss_mb"] / m["peak_rss_mb"], 2) for h, m in zip(hs, mk)]}
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": "python benchmarks/bench_evolve.py " +
           " ".join(sys.argv[1:]), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "load_average_1min": load, "hubsoup_tree": os.path.basename(HUBSOUP_TREE) if args.tree else None,
           "model": {**SIZE, "params_m": models["params_m"], "dtype": "bfloat16"},
           "evals": {k: {"docs": d, "words": w} for k, (d, w) in EVALS.items()}, "batch_size": 1, "threads": 1,
           "fixed_merge": fixed, "runs": rows, "ratios": ratios, "versions": {"hubsoup venv": versions(sys.executable, [
               "torch", "transformers", "lm_eval", "optuna", "cmaes"])}}
    if py_mk:
        res["versions"]["mergekit venv"] = versions(py_mk, ["mergekit", "torch", "transformers", "lm_eval", "cma",
                                                            "ray"])
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{args.name}.json"), "w") as f:
        json.dump(res, f, indent=2)
    with open(os.path.join(RESULTS, f"{args.name}.md"), "w") as f:
        f.write(report(res))
    log(report(res))


BATCHES = (1, 4, 8, 16, 24)


def batch_probe(models: dict, load: list[float]) -> None:
    """lm-eval's ``evaluate`` of the base (one model, tasks built once, one thread), best of 3 per batch size."""
    import torch
    import transformers as tf
    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager, get_task_dict

    torch.set_num_threads(1)
    model = tf.AutoModelForCausalLM.from_pretrained(models["base"], dtype=torch.bfloat16).eval()
    tok = tf.AutoTokenizer.from_pretrained(models["base"])
    rows = []
    for label, folder in models["tasks"].items():
        tasks = get_task_dict(["wordppl"], TaskManager(include_path=folder))
        for bs in BATCHES:
            lm = HFLM(pretrained=model, tokenizer=tok, batch_size=bs)
            times, score = [], None
            for _ in range(3):
                t = time.perf_counter()
                score = evaluate(lm, tasks, verbosity="ERROR")["results"]["wordppl"]["word_perplexity,none"]
                times.append(time.perf_counter() - t)
            rows.append({"eval": label, "batch_size": bs, "seconds": round(min(times), 3), "word_perplexity": score})
            log(f"  {label} batch {bs}: {rows[-1]['seconds']} s")
    load.append(os.getloadavg()[0])
    L = ["# lm-eval's evaluation by batch size (what batching can save a trial)\n",
         f"`python benchmarks/bench_evolve.py --batch-probe` ({time.strftime('%Y-%m-%d %H:%M')}; {platform.machine()}, "
         f"{os.cpu_count()} cores, 1-minute load average {', '.join(str(round(x, 1)) for x in load)}). The base of "
         "bench_evolve's work (37.79M-parameter bf16 Llama), one thread, lm-eval's `evaluate` on tasks built once, "
         "best of 3.\n", "| evaluation | batch size | seconds | x batch 1 | word perplexity |", "|---|---|---|---|---|"]
    for r in rows:
        one = next(x for x in rows if x["eval"] == r["eval"] and x["batch_size"] == 1)["seconds"]
        L.append(f"| {r['eval']} | {r['batch_size']} | {r['seconds']} | {round(r['seconds'] / one, 2)} | "
                 f"{r['word_perplexity']!r} |")
    with open(os.path.join(RESULTS, "evolve_eval_batch.json"), "w") as f:
        json.dump({"rows": rows, "load_average_1min": load}, f, indent=2)
    with open(os.path.join(RESULTS, "evolve_eval_batch.md"), "w") as f:
        f.write("\n".join(L) + "\n")


def report(res: dict) -> str:
    rows, fixed = res["runs"], res["fixed_merge"]
    m = res["model"]
    L = [f"# hubsoup evolve vs mergekit-evolve at equal work\n",
         *([f"hubsoup timed from `{res['hubsoup_tree']}` (`--tree`: an older commit's package), not this checkout.\n"]
           if res.get("hubsoup_tree") else []),
         f"`{res['command']}` ({res['date']}; {res['machine']}, 1-minute load average "
         f"{', '.join(str(round(x, 1)) for x in res['load_average_1min'])} over the run, "
         + ("the benchmark's own processes: an idle machine" if max(res["load_average_1min"]) <= IDLE_LOAD else
            "shared with other work, so absolute times are several times an idle machine's")
         + "; the ratio of each interleaved pair is the robust number).\n",
         f"Work: a Llama of {m['params_m']}M parameters ({m['num_hidden_layers']} layers, hidden {m['hidden_size']}, "
         f"vocabulary {m['vocab_size']}, {m['dtype']}, random weights), 2 fine-tunes, task arithmetic over 8 genes "
         f"(4 layer groups x 2 models, weights in [0, 1] from 0.5, CMA-ES step 1/6), {TRIALS} trials in generations of "
         f"4, 4, 1, scored by one custom lm-eval task (rolling log-likelihood; score = minus word perplexity) at "
         "evaluation batch size 1, one thread per trial, in two sizes: "
         + "; ".join(f"**{k}**, {v['docs']} texts of {v['words']} words" for k, v in res["evals"].items())
         + " (the forward passes are the same work for both tools; the lighter evaluation shows more of the rest "
         "of a trial). Both tools score one fixed merge (standard evaluation), mergekit's merge of the point where "
         "every weight is 0.5 (in memory, and as mergekit writes it to disk for hubsoup): "
         + (f"word perplexity {fixed['mergekit']!r} (mergekit) and {fixed['hubsoup']!r} (hubsoup): "
            f"{'equal' if fixed.get('equal') else 'NOT equal'}. hubsoup's own merge of that point scores "
            f"{fixed['hubsoup_own_merge']!r}: it computes task arithmetic in float32 and rounds once to bfloat16, "
            "mergekit step by step in bfloat16, so a few weights differ in the last bit.\n" if "mergekit" in fixed
            else f"hubsoup's merge of that point: {fixed['hubsoup_own_merge']!r} (mergekit not run).\n"),
         "| evaluation | round | tool | trials/hour (9) | after the first (8) | startup (s) | first trial (s) | first result (s) | "
         "later trials: merge / eval / trial (s) | peak RSS, process tree (MB) | largest process (MB) | best score | "
         "wall (s) | load before/after |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        L.append(f"| {r['eval']} | {r['round']} | {r['tool']} | **{r['trials_per_hour']}** | {r['steady_trials_per_hour']} | "
                 f"{r['startup_s']} | {r['first_trial_s']} | {r['first_result_s']} | {r['merge_s']} / {r['eval_s']} / "
                 f"{r['trial_s']} | {r['peak_rss_mb']} | {r['peak_single_rss_mb']} | {r['best_score']:.6g} | "
                 f"{r['wall_s']} | {r['load_before']} / {r['load_after']} |")
    for label, r in res["ratios"].items():
        pairs = list(zip([x for x in rows if x["tool"] == "hubsoup" and x["eval"] == label],
                         [x for x in rows if x["tool"] == "mergekit-evolve" and x["eval"] == label]))
        if pairs:  # the rest of a trial: beyond the evaluation hubsoup runs (lm-eval's evaluate on tasks built once)
            rest = [(round(h["trial_s"] - h["eval_s"], 3), round(m["trial_s"] - h["eval_s"], 3)) for h, m in pairs]
            what = ("hubsoup's evaluation, as that commit ran it," if res.get("hubsoup_tree") else
                    "lm-eval's evaluation on prebuilt tasks")
            L.append(f"\n{label} evaluation: of a later trial, {what} takes "
                     f"{', '.join(str(h['eval_s']) for h, _ in pairs)} s (hubsoup's); the rest of the trial takes "
                     f"hubsoup {', '.join(str(a) for a, _ in rest)} s and mergekit "
                     f"{', '.join(str(b) for _, b in rest)} s (its merge, and `simple_evaluate` building its tasks "
                     "again and reporting its environment). Were the rest of hubsoup's trial free, its rate would "
                     "be at most mergekit's trial over hubsoup's evaluation: "
                     f"{', '.join(str(round(m['trial_s'] / h['eval_s'], 2)) for h, m in pairs)}x mergekit's.")
        if r["trials_per_hour"]:
            L.append(f"\n**{label} evaluation, hubsoup / mergekit-evolve per interleaved pair: trials per hour "
                     f"{', '.join(map(str, r['trials_per_hour']))} (target >= 3); after the first trial "
                     f"{', '.join(map(str, r['steady_trials_per_hour']))}; time to the first result "
                     f"{', '.join(map(str, r['time_to_first_result']))}x shorter; peak memory "
                     f"{', '.join(map(str, r['peak_rss']))}x.**")
    L.append("""
Columns: trials/hour over all 9 trials (first start to last end); after the first: the 8 later trials, from the
first trial's end to the last's; startup: launch to the first trial's start; first result: launch to the first
trial's end. Timings: a trial runs from its start (hubsoup: its result's arrival minus the trial's own time, measured where it
ran; mergekit: its genotype turned into a merge config, in the evaluator actor) to its score; trials/hour counts the
9 trials over the first start to the last end, the driver's asking and telling between generations included.
hubsoup's setup before the first trial (its session: the inputs read into memory, the candidate model built from
the config, lm-eval's tasks built, and the imports these need) counts in its startup, as mergekit's imports do in
its own; every trial writes the merge into that model in place. mergekit's merge ends when its weights are in the model; its evaluation is `simple_evaluate`
(tasks and datasets built, the environment report, the evaluation), hubsoup's is lm-eval's `evaluate` on tasks
built once. mergekit's tree includes Ray (GCS, raylet, dashboard agent, the actor).

mergekit-evolve needed three workarounds on this CPU-only machine, applied at run time by a `sitecustomize.py`
(benchmarks/bench_evolve.py writes it; mergekit's files are unchanged): a stand-in for
`lm_eval.models.vllm_causallms` (mergekit names its class in an annotation; the module imports vLLM, CUDA-only), a
fake GPU for Ray (each evaluator actor asks for one), and `ReturnTensor.tensor_task` typed `Task` so that
`--in-memory` validates. Flags: `--in-memory --no-merge-cuda --num-gpus 1 --max-fevals 5 --force-population-size 4
--batch-size 1 --random-seed 0` (its in-memory evaluator ignores `--batch-size`: batch 1). Its CMA-ES (`cma`) is
seeded from the clock: its scores differ run to run; hubsoup's repeat.
""")
    return "\n".join(L)


if __name__ == "__main__":
    main()
