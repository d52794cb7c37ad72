"""Full and LoRA causal-LM fine-tunes of SmolLM2-135M, one per in-domain domain.

Next-token cross-entropy on the domain's train split (windows of :data:`TRAIN_LEN` tokens: each
128-token sequence cut in two, to keep a full-model step affordable on 2 CPU cores), AdamW, 10 %
linear warm-up then linear decay, batch 8, seeded. Full: every weight (tied embeddings
included), saved as a float32 safetensors checkpoint with the tokenizer; LoRA: peft r=8,
alpha=16 on every attention and MLP projection (q/k/v/o, gate/up/down), saved as a peft adapter.

Each fine-tune's validation perplexity on its own domain is measured before (the base) and
after; a fine-tune that does not lower it fails the build. Cached under
``benchmarks/.work/quality_lm/finetunes/{full,lora}/DOMAIN`` with ``train_stats.json``; reused
while the data, the base and the configuration match (fingerprint).

Usage: ``python -m benchmarks.quality_lm.finetune [full,lora]``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.quality import debian
from benchmarks.quality_lm import data
from benchmarks.quality_lm.base import WORK

FT_DIR = os.path.join(WORK, "finetunes")
TRAIN_LEN = 64
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LMFinetuneConfig:
    lora: bool = False
    steps: int = 24
    batch_size: int = 8
    lr: float = 1e-4
    warmup: float = 0.1
    max_length: int = TRAIN_LEN
    seed: int = 0
    lora_r: int = 8
    lora_alpha: int = 16


CONFIGS = {
    "full": LMFinetuneConfig(lora=False, steps=24, lr=1e-4),
    "lora": LMFinetuneConfig(lora=True, steps=32, lr=1e-3),
}


def ft_dir(kind: str, domain: str) -> str:
    return os.path.join(FT_DIR, kind, domain)


def _train_ids(tok, texts: list[str], length: int) -> list[list[int]]:
    out = []
    for t in texts:
        ids = tok(t, add_special_tokens=False)["input_ids"]
        out += [ids[i:i + length] for i in range(0, len(ids) - length // 2, length)]
    return [x for x in out if len(x) >= length // 2]


def val_nll(model, tok, texts: list[str]) -> float:
    """Mean token NLL of ``model`` on ``texts`` (the evaluation's masking: padding excluded)."""
    import torch

    tot, n = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(texts), 16):
            enc = tok(texts[i:i + 16], padding=True, truncation=True, max_length=data.EVAL_MAX_LENGTH,
                      return_tensors="pt")
            logits = model(**enc).logits[:, :-1].float()
            mask = enc["attention_mask"][:, 1:].bool() & enc["attention_mask"][:, :-1].bool()
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), enc["input_ids"][:, 1:], reduction="none")
            tot += float((nll * mask).sum())
            n += int(mask.sum())
    return tot / n


def finetune(base_dir: str, out_dir: str, texts: list[str], val: list[str], cfg: LMFinetuneConfig, log=print) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(cfg.seed)
    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if cfg.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                                                 target_modules=LORA_TARGETS, task_type="CAUSAL_LM"))
    ids = _train_ids(tok, texts, cfg.max_length)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    warm = max(1, int(cfg.warmup * cfg.steps))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, max(0.0, (cfg.steps - s) / max(1, cfg.steps - warm))))
    g = torch.Generator().manual_seed(cfg.seed)
    order: list[int] = []
    t0, losses = time.perf_counter(), []
    model.train()
    for step in range(cfg.steps):
        if len(order) < cfg.batch_size:
            order += torch.randperm(len(ids), generator=g).tolist()
        batch, order = order[:cfg.batch_size], order[cfg.batch_size:]
        enc = tok.pad({"input_ids": [ids[i] for i in batch]}, return_tensors="pt")
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        loss = model(**enc, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        k = max(1, cfg.steps // 4)
        if (step + 1) % k == 0:
            log(f"  step {step + 1}/{cfg.steps}: loss {sum(losses[-k:]) / k:.3f} ({time.perf_counter() - t0:.0f}s)")
    seconds = time.perf_counter() - t0
    after = val_nll(model, tok, val)
    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    model.save_pretrained(tmp)  # full: float32 safetensors (tied lm_head dropped, as in the base); LoRA: adapter
    tok.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return {"steps": cfg.steps, "seconds": round(seconds, 1), "train_sequences": len(ids),
            "tokens_seen": cfg.steps * cfg.batch_size * cfg.max_length, "first_loss": losses[0],
            "final_loss": sum(losses[-max(1, cfg.steps // 4):]) / max(1, cfg.steps // 4), "val_nll": after}


def build(base_dir: str, kinds=("full", "lora"), log=print, force: bool = False) -> dict[str, dict[str, dict]]:
    """Fine-tune (or reuse) each in-domain domain; returns kind -> domain -> statistics (with the base's and
    the fine-tune's validation perplexity on that domain)."""
    with open(os.path.join(base_dir, "model.safetensors"), "rb") as f:
        f.seek(0, 2)
        base_fp = f.tell()
    base_nll: dict[str, float] = {}
    out: dict[str, dict[str, dict]] = {}
    for kind in kinds:
        out[kind] = {}
        for i, name in enumerate(data.IN_DOMAIN):
            cfg = replace(CONFIGS[kind], seed=200 + i)
            folder = ft_dir(kind, name)
            stamp = os.path.join(folder, "train_stats.json")
            train, val = data.read(name, "train"), data.read(name, "validation")
            fp = debian.fingerprint(asdict(cfg), train, val, base_fp)
            if not force and os.path.isfile(stamp):
                with open(stamp, encoding="utf-8") as f:
                    st = json.load(f)
                if st.get("fingerprint") == fp:
                    out[kind][name] = {**st, "cached": True}
                    continue
            if name not in base_nll:
                import torch
                from transformers import AutoModelForCausalLM, AutoTokenizer

                base_nll[name] = val_nll(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                         AutoTokenizer.from_pretrained(base_dir), val)
            log(f"fine-tuning {name} ({kind}, {cfg.steps} steps of {cfg.batch_size} x {cfg.max_length} tokens, "
                f"lr {cfg.lr:g}) ...")
            st = finetune(base_dir, folder, train, val, cfg, log=log)
            st.update({"fingerprint": fp, "config": asdict(cfg), "base_val_nll": base_nll[name],
                       "base_val_ppl": math.exp(base_nll[name]), "val_ppl": math.exp(st["val_nll"])})
            if not st["val_nll"] < base_nll[name] - 0.01:
                raise SystemExit(f"the {kind} fine-tune on {name} did not lower its validation perplexity "
                                 f"({st['base_val_ppl']:.2f} -> {st['val_ppl']:.2f})")
            with open(stamp, "w", encoding="utf-8") as f:
                json.dump(st, f, indent=2)
            log(f"  done in {debian.fmt_seconds(st['seconds'])}: validation perplexity on {name} "
                f"{st['base_val_ppl']:.2f} (base) -> {st['val_ppl']:.2f}")
            out[kind][name] = {**st, "cached": False}
    return out


if __name__ == "__main__":
    from benchmarks.quality_lm import base
    from hubsoup.demo import train as demo_train

    demo_train.quiet_transformers()
    kinds = sys.argv[1].split(",") if len(sys.argv) > 1 else ["full", "lora"]
    b = base.build()
    data.build(b)
    t0 = time.perf_counter()
    build(b, kinds)
    print(f"fine-tunes: {time.perf_counter() - t0:.0f}s")
