"""The demo's training: the encoder, pooled features, frozen linear heads and fine-tuning under them.

Used by ``hubsoup demo`` and by ``benchmarks/quality``:

* **heads**: the protocol of the merging papers' CLIP zero-shot heads: one linear head per
  task, trained on the *frozen pre-trained* encoder's mean-pooled output (multinomial
  logistic regression, L2 chosen on validation; :func:`train_head`, :func:`train_heads`) and
  then frozen for good: fine-tunes train the encoder under it, and every encoder (base,
  fine-tune or merge) is scored on a task with that task's head (heads are written in the
  format of :mod:`hubsoup.eval.heads`, which ``hubsoup.eval``'s ``head=`` task option reads);
* **fine-tuning**: full or LoRA (peft) fine-tunes of the encoder under a frozen head
  (:func:`finetune`).

The base encoder is all-MiniLM-L6-v2 (see :func:`hubsoup.demo.data.minilm_path`).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
from huggingface_hub import ModelCard, ModelCardData
from transformers import AutoModel, AutoTokenizer
from transformers.utils import logging as hf_logging

from hubsoup.demo.data import TaskData
from hubsoup.eval.heads import mean_pool, save_head

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# --------------------------------------------------------------------------------------------
# Encoder, pooled features, heads
# --------------------------------------------------------------------------------------------


def quiet_transformers() -> None:
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # transformers.utils.logging: unannotated
    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # as above


def load_encoder(path: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    quiet_transformers()
    return AutoModel.from_pretrained(path), AutoTokenizer.from_pretrained(path)


@torch.no_grad()
def embed(model: torch.nn.Module, tok: PreTrainedTokenizerBase, texts: Sequence[str], *, max_length: int = 64, batch_size: int = 64) -> torch.Tensor:
    """Mean-pooled encoder features [N, H] (float32), model in eval mode."""
    model.eval()
    out = []
    for i in range(0, len(texts), batch_size):
        enc = tok(list(texts[i:i + batch_size]), padding=True, truncation=True, max_length=max_length,
                  return_tensors="pt")
        out.append(mean_pool(model(**enc).last_hidden_state, enc["attention_mask"]).float())
    return torch.cat(out) if out else torch.zeros(0)


def _fit_logreg(x: torch.Tensor, y: torch.Tensor, n_classes: int, l2: float, iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.zeros(n_classes, x.shape[1], requires_grad=True)
    b = torch.zeros(n_classes, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=iters, history_size=20, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ w.T + b, y) + l2 * (w * w).sum()
        loss.backward()  # type: ignore[no-untyped-call]  # torch: Tensor.backward is unannotated
        return loss

    opt.step(closure)  # type: ignore[no-untyped-call]  # torch: LBFGS.step is unannotated
    return w.detach(), b.detach()


def train_head(x_train: torch.Tensor, y_train: Sequence[int], x_val: torch.Tensor, y_val: Sequence[int],
               n_classes: int, *, l2_grid: Sequence[float] = (1e-3, 1e-2, 1e-1, 1.0), iters: int = 300,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Multinomial logistic regression on standardised features, L2 chosen on validation accuracy.

    The standardisation is folded back into the returned ``weight`` [C, H] / ``bias`` [C], which
    act on the raw pooled features.
    """
    torch.manual_seed(seed)
    mu, sd = x_train.mean(0), x_train.std(0).clamp(min=1e-6)
    zt, zv = (x_train - mu) / sd, (x_val - mu) / sd
    yt, yv = torch.tensor(list(y_train)), torch.tensor(list(y_val))
    best: tuple[float, float, torch.Tensor, torch.Tensor] | None = None
    scores = {}
    for l2 in l2_grid:
        w, b = _fit_logreg(zt, yt, n_classes, l2, iters)
        acc = float(((zv @ w.T + b).argmax(1) == yv).float().mean())
        scores[l2] = acc
        if best is None or acc > best[0] + 1e-9:
            best = (acc, l2, w, b)
    assert best is not None  # l2_grid holds at least one value
    acc, l2, w, b = best
    weight = w / sd
    bias = b - weight @ mu
    train_acc = float(((x_train @ weight.T + bias).argmax(1) == yt).float().mean())
    return weight.contiguous(), bias.contiguous(), {"l2": l2, "val_accuracy": acc, "train_accuracy": train_acc,
                                                    "val_accuracy_by_l2": {str(k): v for k, v in scores.items()}}


def few_shot(task: TaskData, per_class: int, split: str = "train") -> tuple[list[str], list[int]]:
    """The first ``per_class`` examples of each class of a (shuffled) split: a head's training set."""
    index = {l: i for i, l in enumerate(task.labels)}
    count: dict[str, int] = {}
    texts, ids = [], []
    for text, label in task.splits[split]:
        if count.get(label, 0) < per_class:
            count[label] = count.get(label, 0) + 1
            texts.append(text)
            ids.append(index[label])
    return texts, ids


def train_heads(base_dir: str, tasks: Mapping[str, TaskData], paths: Mapping[str, str], *, per_class: int,
                max_length: int, tag: bool = False, log: Callable[[str], None] | None = None,
                source: str | None = None) -> dict[str, dict[str, Any]]:
    """One frozen linear head per task on the frozen encoder at ``base_dir``, written to ``paths[task]``.

    Each head is trained (:func:`train_head`) on the pooled features of the first ``per_class``
    training examples of each class (:func:`few_shot`), its L2 chosen on the validation split.
    ``tag`` also stores the task name and the chosen L2 in each head file's metadata, ``source`` a
    line saying where the head comes from (shown in the cards of models scored with it); ``log``
    gets one line per head. Returns task -> head statistics (those of :func:`train_head` plus
    ``train_examples``).
    """
    model, tok = load_encoder(base_dir)
    stats = {}
    for name, task in tasks.items():
        texts, ids = few_shot(task, per_class)
        xt = embed(model, tok, texts, max_length=max_length)
        xv = embed(model, tok, task.texts("validation"), max_length=max_length)
        w, b, st = train_head(xt, ids, xv, task.label_ids("validation"), len(task.labels))
        st["train_examples"] = len(texts)
        meta = {"task": name, "l2": st["l2"]} if tag else {}
        save_head(paths[name], w, b, task.labels, **meta, **({"source": source} if source else {}))
        if log:
            log(f"  head {name:<13} L2 {st['l2']:g}: train acc {st['train_accuracy']:.3f}, "
                f"val acc {st['val_accuracy']:.3f}")
        stats[name] = st
    return stats


# --------------------------------------------------------------------------------------------
# Fine-tuning under a frozen head
# --------------------------------------------------------------------------------------------

LORA_TARGETS = r".*encoder\.layer\.\d+\..*(query|key|value|dense)$"
"""peft ``target_modules`` regex: q/k/v and every dense layer of the transformer blocks (not the
unused pooler)."""


@dataclass
class FinetuneConfig:
    lora: bool = False
    steps: int = 150
    batch_size: int = 16
    lr: float = 5e-5
    warmup: float = 0.1
    weight_decay: float = 0.0
    max_length: int = 64
    seed: int = 0
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    freeze_word_embeddings: bool = False
    """Leave the word-embedding matrix (half of MiniLM's weights) untouched: a faster step."""


def finetune(base_dir: str, out_dir: str, texts: Sequence[str], labels: Sequence[int], weight: torch.Tensor,
             bias: torch.Tensor, cfg: FinetuneConfig, *, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Fine-tune the encoder at ``base_dir`` under the frozen head (``weight``, ``bias``).

    Cross-entropy of ``head(mean_pool(encoder(x)))``; AdamW, linear warm-up then linear decay;
    batches drawn in a seeded shuffle, epoch after epoch, for ``cfg.steps`` steps. Writes a
    ``save_pretrained`` encoder (full) or a PEFT adapter (``cfg.lora``) plus the tokenizer to
    ``out_dir``. Returns training statistics.
    """
    model: Any  # the encoder, or peft's model around it: its modules are reached by name (BertModel's embeddings)
    model, tok = load_encoder(base_dir)
    torch.manual_seed(cfg.seed)
    if cfg.lora:
        # lazy: peft (~1.5 s here after transformers) only for the demo's LoRA fine-tunes
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                                                 lora_dropout=cfg.lora_dropout, target_modules=LORA_TARGETS))
    elif cfg.freeze_word_embeddings:
        model.embeddings.word_embeddings.weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    warm = max(1, int(cfg.warmup * cfg.steps))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, max(0.0, (cfg.steps - s) / max(1, cfg.steps - warm))))
    enc = tok(list(texts), truncation=True, max_length=cfg.max_length)
    ids, y = enc["input_ids"], torch.tensor(list(labels))
    w, b = weight.float(), bias.float()
    g = torch.Generator().manual_seed(cfg.seed)
    order: list[int] = []
    model.train()
    t0, losses, hits = time.perf_counter(), [], []
    for step in range(cfg.steps):
        if len(order) < cfg.batch_size:
            order += torch.randperm(len(ids), generator=g).tolist()
        batch, order = order[:cfg.batch_size], order[cfg.batch_size:]
        padded = tok.pad({"input_ids": [ids[i] for i in batch]}, return_tensors="pt")
        hidden = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).last_hidden_state
        logits = mean_pool(hidden, padded["attention_mask"]) @ w.T + b
        loss = torch.nn.functional.cross_entropy(logits, y[batch])
        loss.backward()  # type: ignore[no-untyped-call]  # torch: Tensor.backward is unannotated
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        hits.append(float((logits.argmax(1) == y[batch]).float().mean()))
        if log and (step + 1) % max(1, cfg.steps // 5) == 0:
            k = max(1, cfg.steps // 5)
            log(f"  step {step + 1}/{cfg.steps}: loss {sum(losses[-k:]) / k:.3f}, "
                f"batch accuracy {sum(hits[-k:]) / k:.3f} ({time.perf_counter() - t0:.0f}s)")
    model.eval()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    k = max(1, cfg.steps // 5)
    return {"steps": cfg.steps, "seconds": round(time.perf_counter() - t0, 1),
            "final_loss": sum(losses[-k:]) / k, "final_batch_accuracy": sum(hits[-k:]) / k,
            "examples_seen": cfg.steps * cfg.batch_size, "train_examples": len(ids),
            "epochs": round(cfg.steps * cfg.batch_size / max(1, len(ids)), 2)}


def save_base(src: str, out_dir: str, *, base_model: str | None = None) -> str:
    """Re-save a pre-trained encoder with ``save_pretrained`` (so base and fine-tunes have the
    same tensor names: non-persistent buffers such as ``position_ids`` are dropped), keeping
    its tokenizer and model card; ``base_model``: the Hub model this copy is, written into the
    card's metadata (so cards of merges built on it name the real upstream model)."""
    model, tok = load_encoder(src)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    card = os.path.join(src, "README.md")
    if os.path.isfile(card):
        shutil.copyfile(card, os.path.join(out_dir, "README.md"))
        if base_model:
            metadata_update_local(os.path.join(out_dir, "README.md"), base_model=base_model)
    elif base_model:
        write_card(out_dir, base_model=base_model)
    return out_dir


def metadata_update_local(path: str, **metadata: Any) -> None:
    """Set metadata keys of the model card at ``path`` (a local file), keeping its body."""
    card = ModelCard.load(path)
    for k, v in metadata.items():
        setattr(card.data, k, v)
    card.save(path)


def write_card(folder: str, **metadata: Any) -> None:
    """A minimal model card holding ``metadata`` (e.g. ``base_model``) and a one-line body."""
    body = metadata.pop("body", "")
    card = ModelCard.from_template(ModelCardData(**metadata))
    if body:
        card = ModelCard(f"---\n{card.data.to_yaml()}\n---\n\n{body}\n")
    card.save(os.path.join(folder, "README.md"))


__all__ = ["quiet_transformers", "load_encoder", "embed", "train_head", "few_shot", "train_heads", "LORA_TARGETS",
           "FinetuneConfig", "finetune", "save_base", "write_card"]
