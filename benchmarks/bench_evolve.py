"""`hubsoup evolve` throughput: trials per hour on a SmolLM2-135M-shaped model, and each trial's overhead.

A made model of SmolLM2-135M's shape (Llama, hidden 576, 30 layers, 9 heads / 3 KV heads, vocab 49152,
tied embeddings; random weights: no Hub at benchmark time) and three "fine-tunes" (seeded noise), merged
with TIES over density, the merge rule and 2 inputs... x 4 layer groups of weights (CMA-ES), scored by
perplexity on a small local text set. Reported per trial: the merge, building the model from the merged
tensors, the evaluation, and the overhead = trial time on the driver minus merge and eval (target
<= 10 % of the trial). mergekit-evolve is not compared: it needs `mergekit[evolve]` (cma, lm_eval, ray)
and schedules one Ray actor per GPU (`get_torch_accelerator_count()`), so it does not run on a CPU-only
machine (checked with mergekit 0.1.5 in benchmarks/.work/mergekit-venv).

Writes benchmarks/results/evolve_bench.md and .json.

    python benchmarks/bench_evolve.py [--trials 8 --population 4] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
QUICK = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


def build(root: str, size: dict, n_inputs: int, log) -> tuple[str, list[str], str]:
    import torch
    import transformers as tf

    from hubsoup.testing import make_finetune, save_tiny_tokenizer

    base = os.path.join(root, "base")
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**size, max_position_embeddings=2048)).eval()
    model.save_pretrained(base)
    save_tiny_tokenizer(base, vocab=min(size["vocab_size"], 1000))
    log(f"  base: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params")
    fts = [make_finetune(base, os.path.join(root, f"ft{i}"), seed=i, scale=0.002) for i in range(1, n_inputs + 1)]
    data = os.path.join(root, "val.jsonl")
    with open(data, "w") as f:
        for i in range(16):
            f.write(json.dumps({"text": " ".join(f"w{(i * 37 + j * 11) % 900}" for j in range(48))}) + "\n")
    return base, fts, data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--population", type=int, default=4)
    ap.add_argument("--inputs", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a 4-layer model instead of SmolLM2-135M's shape")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per trial (the config's resources.cpus)")
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    from hubsoup.workflows.evolve import evolve

    def log(msg: str) -> None:
        print(msg, flush=True)

    size = QUICK if args.quick else SMOLLM2_135M
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        base, fts, data = build(tmp, size, args.inputs, log)
        log(f"  models built in {time.perf_counter() - t0:.1f}s")
        cfg = {"base": base, "models": fts, "method": "ties",
               "space": {"density": [0.1, 0.9], "merge": {"choices": ["mean", "sum"]},
                         "weight": {"range": [0.0, 1.0], "per": "input", "layer_groups": 4}},
               "optimizer": "cmaes", "trials": args.trials, "population": args.population, "seed": 0,
               "eval": {"tasks": [f"perplexity:{data}"], "batch_size": 8}, "resources": {"cpus": args.threads}}
        # a warm-up study of one trial: imports and first-use costs (datasets, metric modules) are not trials
        evolve({**cfg, "trials": 1, "population": 1, "optimizer": "random"}, os.path.join(tmp, "warm"), quiet=True)
        t0 = time.perf_counter()
        res = evolve(cfg, os.path.join(tmp, "out"), quiet=True)
        total = time.perf_counter() - t0
    per = res.seconds
    merge = [s["merge"] for s in per]
    build_s = [s.get("build", 0.0) for s in per]
    ev = [s["eval"] for s in per]
    trial = res.study_seconds / len(per)  # the driver's time per trial: asks, dispatch, trial, tell, table
    overhead = [trial - m - e for m, e in zip(merge, ev)]
    row = {
        "model": "SmolLM2-135M shape (made)" if not args.quick else "quick 4-layer",
        "size": size, "inputs": args.inputs, "trials": len(per), "population": args.population,
        "optimizer": "cmaes", "threads": args.threads, "genes": 2 + args.inputs * 4,
        "study_seconds": round(res.study_seconds, 2), "write_best_seconds": round(res.write_seconds, 2),
        "total_seconds": round(total, 2), "trials_per_hour": round(3600 * len(per) / res.study_seconds, 1),
        "per_trial": {"merge": round(statistics.mean(merge), 3), "build": round(statistics.mean(build_s), 3),
                      "eval": round(statistics.mean(ev), 3), "trial": round(trial, 3),
                      "overhead": round(statistics.mean(overhead), 3),
                      "overhead_fraction": round(statistics.mean(overhead) / trial, 4)},
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared), torch threads {args.threads}, "
                   f"load average {os.getloadavg()[1]:.1f} at the end",
        "mergekit_evolve": "needs mergekit[evolve] (cma, lm_eval, ray) and one GPU per Ray actor",
    }
    os.makedirs(RESULTS, exist_ok=True)
    name = "evolve_bench" + ("_quick" if args.quick else "")
    with open(os.path.join(RESULTS, name + ".json"), "w") as f:
        json.dump(row, f, indent=2)
    p = row["per_trial"]
    md = f"""# hubsoup evolve: trials per hour and per-trial overhead

`python benchmarks/bench_evolve.py {' '.join(sys.argv[1:])}` ({time.strftime('%Y-%m-%d')}; {row['machine']}).

Model: {row['model']}, {args.inputs} fine-tunes, TIES over density, merge rule and {args.inputs} x 4 layer-group
weights ({row['genes']} genes), CMA-ES, population {args.population}, {len(per)} trials, scored by perplexity
(16 texts x 48 tokens). Each trial merges into memory, builds the model from the merged tensors and evaluates it;
nothing is written until the best is (once, {row['write_best_seconds']} s).

| per trial | seconds |
|---|---|
| merge (in memory) | {p['merge']} |
| build the model from the merged tensors | {p['build']} |
| evaluate | {p['eval']} |
| **trial, on the driver** (study time / trials) | **{p['trial']}** |
| overhead = trial - merge - eval | {p['overhead']} ({100 * p['overhead_fraction']:.1f} % of the trial; target <= 10 %) |

**{row['trials_per_hour']} trials per hour** ({row['study_seconds']} s for {len(per)} trials).

mergekit-evolve was not run: {row['mergekit_evolve']}; hubsoup's numbers stand alone.
"""
    with open(os.path.join(RESULTS, name + ".md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
