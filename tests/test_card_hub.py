"""Cards that hold up on the Hub (issue 13): every kind of generated card parses with huggingface_hub,
names its metrics exactly, labels frozen-head scores, publishes no local path, and its "how to use"
snippet really loads the model with the right class (executed in a subprocess)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.repocard_data import model_index_to_eval_results

import hubsoup
from hubsoup import continual
from hubsoup.card import render
from hubsoup.eval import TaskSpec
from hubsoup.eval.heads import save_head
from hubsoup.testing import make_adapter, make_base, make_finetune, save_tiny_tokenizer

REPO = "alice/soup"  # the repo ID the snippets name; replaced by the output folder when run here
SNIPPET = re.compile(r"## How to use\s+```python\n(.*?)```", re.S)


def _bert_classifier(folder: str) -> str:
    """A tiny BertForSequenceClassification (3 labels) with a tokenizer."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, num_labels=3,
                        id2label={0: "a", 1: "b", 2: "c"}, label2id={"a": 0, "b": 1, "c": 2})
    tf.BertForSequenceClassification(cfg).eval().save_pretrained(folder)
    save_tiny_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """One output of every kind the product writes, merged from tiny models; name -> (MergeResult, base folder)."""
    root = tmp_path_factory.mktemp("cardhub")
    out: dict = {}
    # a tiny Llama-like causal LM (untied lm_head), with a tokenizer
    llama = make_base("llama", str(root / "llama"))
    save_tiny_tokenizer(llama)
    lfts = [make_finetune(llama, str(root / f"llama-ft{i}"), seed=i) for i in (1, 2)]
    out["causal"] = (hubsoup.merge(lfts, method="ties", base=llama, out=str(root / "causal"), quiet=True,
                                   density=0.5), llama)
    # a tiny BERT classifier, evaluated with its own head on a local csv
    data_dir = root / "private-data"
    data_dir.mkdir()
    csv = data_dir / "val.csv"
    csv.write_text("text,label\n" + "".join(f"w{i} w{i + 3} w{(i * 7) % 50},{'abc'[i % 3]}\n" for i in range(30)))
    bert = _bert_classifier(str(root / "bert"))
    bfts = [make_finetune(bert, str(root / f"bert-ft{i}"), seed=i) for i in (1, 2)]
    out["classifier"] = (hubsoup.merge(bfts, method="task_arithmetic", base=bert, out=str(root / "classifier"),
                                       quiet=True, evaluate=[f"classification:{csv},name=toy"]), bert)
    # an encoder scored with an external frozen head (the merging papers' protocol)
    enc = make_base("bert", str(root / "encoder"))
    save_tiny_tokenizer(enc)
    efts = [make_finetune(enc, str(root / f"enc-ft{i}"), seed=i, scale=0.2) for i in (1, 2)]
    g = torch.Generator().manual_seed(3)
    head = str(data_dir / "toy-head.safetensors")
    save_head(head, torch.randn(3, 32, generator=g), torch.zeros(3), ["a", "b", "c"],
              source="trained on the frozen base encoder by this test")
    spec = TaskSpec.parse(f"classification:{csv},head={head},name=toy,split=validation")
    out["search"] = (hubsoup.search(efts, "task_arithmetic", base=enc, out=str(root / "search"),
                                    grid={"scale": [0.5, 1.0]}, tasks=[spec], quiet=True).result, enc)
    # LoRA adapters merged into a LoRA adapter of the Llama
    adapters = [make_adapter(root / f"lora{i}", "llama", seed=i, r=4, lora_alpha=8,
                             target_modules=["q_proj", "v_proj"]) for i in (1, 2)]
    out["lora"] = (hubsoup.merge(adapters, method="task_arithmetic", base=llama, out=str(root / "lora"),
                                 quiet=True, output_format="lora", rank=8, scale=0.5), llama)
    # a continual soup: two models, then a third one added
    soup = str(root / "continual")
    continual.init(lfts, base=llama, out=soup, quiet=True)
    third = make_finetune(llama, str(root / "llama-ft3"), seed=3)
    out["continual"] = (continual.add(soup, [third], quiet=True), llama)
    return {"root": str(root), "csv": str(csv), "head": head, **out}


def _card(outputs, kind: str) -> ModelCard:
    """The card as pushed to ``alice/soup`` (rendered with that repo ID)."""
    result, _ = outputs[kind]
    return render(result, repo_id=REPO, folder=result.path)


def _snippet(card: ModelCard) -> str:
    found = SNIPPET.search(card.text)
    assert found, "the card has no python 'How to use' block"
    return found.group(1)


@pytest.fixture(scope="module")
def ran(outputs):
    """Every kind's snippet, with the repo IDs pointed at the local folders, run in one fresh interpreter.

    Returns kind -> what the loaded objects are (class names, logits shape, tokenizer class)."""
    probe = """
import json, torch
info = {"model": type(model).__name__, "base": type(getattr(model, "base_model", model)).__name__}
if "tokenizer" in dir():
    info["tokenizer"] = type(tokenizer).__name__
    enc = tokenizer(["w1 w2 w3"], return_tensors="pt")
    with torch.no_grad():
        res = model(**enc)
    info["logits"] = list(res.logits.shape) if hasattr(res, "logits") else None
    info["hidden"] = list(res.last_hidden_state.shape) if hasattr(res, "last_hidden_state") else None
print("RESULT " + json.dumps(info))
"""
    programs = {}
    for kind in ("causal", "classifier", "search", "lora", "continual"):
        result, base = outputs[kind]
        code = _snippet(_card(outputs, kind))
        code = code.replace(f'"{REPO}"', json.dumps(result.path))
        code = code.replace(f'"{result.base.public_name}"', json.dumps(base))  # a LoRA's base (local here)
        assert REPO not in code
        programs[kind] = code + probe
    driver = ("import json, sys\nprograms = json.loads(sys.stdin.read())\n"
              "for kind, code in programs.items():\n"
              "    print('KIND ' + kind, flush=True)\n"
              "    exec(compile(code, kind, 'exec'), {})\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([sys.executable, "-c", driver], input=json.dumps(programs), capture_output=True,
                          text=True, env=env, cwd=outputs["root"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, kind = {}, None
    for line in proc.stdout.splitlines():
        if line.startswith("KIND "):
            kind = line[5:]
        elif line.startswith("RESULT "):
            got[kind] = json.loads(line[7:])
    return got


KINDS = ("causal", "classifier", "search", "lora", "continual")


@pytest.mark.parametrize("kind", KINDS)
def test_card_loads_and_its_metadata_parses(outputs, kind):
    result, _ = outputs[kind]
    written = ModelCard.load(os.path.join(result.path, "README.md"))  # the card the merge wrote
    pushed = _card(outputs, kind)
    for card in (written, ModelCard(str(pushed))):
        again = ModelCardData(**card.data.to_dict())  # what huggingface_hub parses back from the YAML
        assert again.to_dict() == card.data.to_dict()
        index = card.data.to_dict().get("model-index")
        if index:
            name, results = model_index_to_eval_results(index)
            assert name == card.data.model_name and results == card.data.eval_results
    # hubsoup is not on PyPI: no link to a PyPI page, and the card says how to install it
    assert "pypi.org" not in pushed.text and "install it from its\nsource repository" in pushed.text
    # nothing local: no path of this machine in the published card
    for needle in (outputs["root"], os.path.expanduser("~") + "/"):
        assert needle not in pushed.text, needle


EXPECT = {  # kind -> (Auto class in the snippet, pipeline_tag, library)
    "causal": ("AutoModelForCausalLM", "text-generation", "transformers"),
    "classifier": ("AutoModelForSequenceClassification", "text-classification", "transformers"),
    "search": ("AutoModel", "feature-extraction", "transformers"),
    "lora": ("AutoModelForCausalLM", "text-generation", "peft"),
    "continual": ("AutoModelForCausalLM", "text-generation", "transformers"),
}


@pytest.mark.parametrize("kind", KINDS)
def test_snippet_names_the_class_of_the_architecture(outputs, kind):
    card = _card(outputs, kind)
    cls, tag, library = EXPECT[kind]
    code = _snippet(card)
    assert f"{cls}.from_pretrained(" in code and card.data.pipeline_tag == tag and card.data.library_name == library
    if kind == "lora":
        assert "PeftModel.from_pretrained(base, \"alice/soup\")" in code
        # a base that is only a local folder: named by its folder name, with a guard (issue 48, item 4)
        assert f'base_path = "{outputs[kind][0].base.public_name}"' in code and f"{cls}.from_pretrained(base_path)" in code
    else:
        assert f'{cls}.from_pretrained("{REPO}")' in code


@pytest.mark.slow
def test_snippets_run_and_load_the_right_class(ran):
    vocab = 128
    assert ran["causal"]["model"] == "LlamaForCausalLM"
    assert ran["causal"]["logits"] == [1, 3, vocab]  # the lm_head is there: logits over the vocabulary
    assert ran["continual"]["model"] == "LlamaForCausalLM" and ran["continual"]["logits"] == [1, 3, vocab]
    assert ran["classifier"]["model"] == "BertForSequenceClassification" and ran["classifier"]["logits"] == [1, 3]
    assert ran["search"]["model"] == "BertModel" and ran["search"]["hidden"] == [1, 3, 32]
    # a LoRA output loads as a PeftModel over the base's causal LM
    assert ran["lora"]["model"].startswith("PeftModel") and ran["lora"]["base"] == "LoraModel"
    assert ran["lora"]["logits"] == [1, 3, vocab]
    assert all(info.get("tokenizer") for info in ran.values())  # every snippet loads the tokenizer too


def test_lora_snippet_gives_the_adapters_merge(outputs):
    """What the LoRA card's snippet loads equals peft's own loading of the adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    result, base = outputs["lora"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), result.path)
    assert isinstance(model, PeftModel)
    assert any("lora_A" in k for k in model.state_dict())


def test_eval_results_name_the_metric_exactly(outputs):
    card = _card(outputs, "classifier")
    index = card.data.to_dict()["model-index"]
    _, results = model_index_to_eval_results(index)
    assert {(r.metric_type, r.metric_name) for r in results} == {("accuracy", "Accuracy"), ("macro_f1", "Macro-F1")}
    assert all(r.dataset_name == "toy" and r.task_type == "text-classification" for r in results)
    # a local data file is no dataset type: the task's name is (and the dataset's name) (issue 48, item 8)
    assert all(r.dataset_type == "toy" for r in results)
    assert "val.csv" not in json.dumps(index)
    assert "private-data" not in card.text and "private-data" not in json.dumps(index)
    assert "| text-classification | toy | validation | Macro-F1 (`macro_f1`) |" in card.text
    assert "frozen head" not in card.text  # its own classification head: nothing external


def test_frozen_head_scores_are_labelled(outputs):
    card = _card(outputs, "search")
    _, results = model_index_to_eval_results(card.data.to_dict()["model-index"])
    assert {r.metric_type for r in results} == {"accuracy", "macro_f1"}
    for r in results:
        assert re.fullmatch(r"(Accuracy|Macro-F1) \(frozen head toy-head\.safetensors@sha256:[0-9a-f]{12}\)",
                            r.metric_name), r.metric_name
    text = card.text
    assert "not part of this\nrepository" in text
    assert re.search(r"\| toy \| `toy-head\.safetensors@sha256:[0-9a-f]{12}` \| mean \| "
                     r"trained on the frozen base encoder by this test \|", text)
    assert "## Hyper-parameter search" in text
    assert outputs["head"] not in text and "private-data" not in text


def test_old_eval_results_read_back_with_macro_f1(outputs, tmp_path):
    """eval_results.json written before the rename (``f1``) still renders, as ``macro_f1``."""
    import shutil

    from hubsoup.api import MergeResult

    folder = tmp_path / "old"
    shutil.copytree(outputs["classifier"][0].path, folder)
    rows = json.loads((folder / "eval_results.json").read_text())
    for row in rows:
        row["metrics"]["f1"] = row["metrics"].pop("macro_f1")
        row.pop("config", None)
    (folder / "eval_results.json").write_text(json.dumps(rows))
    again = MergeResult.from_folder(str(folder))
    assert [set(r.metrics) for r in again.evaluation] == [{"accuracy", "macro_f1"}]
    card = render(again, repo_id=REPO)
    _, results = model_index_to_eval_results(card.data.to_dict()["model-index"])
    assert {r.metric_type for r in results} == {"accuracy", "macro_f1"}
    assert card.data.pipeline_tag == "text-classification"


def test_head_source_naming_a_local_path_is_not_published(tmp_path):
    from hubsoup.card import _heads_view
    from hubsoup.eval import TaskResult

    task = TaskSpec(kind="classification", data="x.csv", name="t")
    leaky = TaskResult(task, {"accuracy": 1.0}, 1,
                       {"head": {"file": "h.safetensors@sha256:0", "source": f"trained from {tmp_path}/x"}})
    assert _heads_view([leaky])[0]["source"] == ""
