"""Cards that load as they say (issue 32, item 4): every python block of every generated card runs as written,
locally against the output folder and, once pushed, against the test Hub; a LoRA output names peft's
``task_type`` of its base, so ``AutoPeftModelForCausalLM`` loads it; cards are titled by the repo they are pushed
to; ``base_model_relation`` is right in every path; the parameter table says what each default is.

The snippets run in one fresh interpreter (transformers imported once), each from its own working folder:
a local card's snippet from an unrelated folder (it names absolute paths), a pushed card's from an unrelated
folder too, except a LoRA adapter of a base that is only a local folder: its published snippet names the base
by its folder name (no path is ever published), so it runs from the folder that holds the base.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

import hubsoup
from hubsoup import continual
from hubsoup.hub import push_folder
from hubsoup.testing import make_adapter, make_base, make_finetune, save_tiny_tokenizer

PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
PROBE = """
import json as _json, torch as _torch
_info = {"model": type(model).__name__, "base": type(getattr(model, "base_model", model)).__name__}
with _torch.no_grad():
    _res = model(**tokenizer(["w1 w2 w3"], return_tensors="pt"))
_info["logits"] = list(_res.logits.shape)
print("RESULT " + _json.dumps(_info), flush=True)
"""


def _meta(text: str) -> dict:
    return yaml.safe_load(text.split("---\n")[1])


def _blocks(text: str) -> str:
    found = PYTHON_BLOCK.findall(text)
    assert found, "the card has no python block"
    return "\n".join(found)


def _set_base_name(adapter: str, name: str) -> None:
    path = os.path.join(adapter, "adapter_config.json")
    cfg = json.load(open(path))
    cfg["base_model_name_or_path"] = name
    json.dump(cfg, open(path, "w"))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Outputs of every kind, made from local folders: name -> (result, the folder holding its base)."""
    root = tmp_path_factory.mktemp("snippets")
    llama = make_base("llama", str(root / "llama"))
    save_tiny_tokenizer(llama)
    fts = [make_finetune(llama, str(root / f"ft{i}"), seed=i) for i in (1, 2)]
    out = {"full": hubsoup.merge(fts, method="ties", base=llama, out=str(root / "merge"), quiet=True, density=0.5)}
    adapters = [make_adapter(root / f"lora{i}", "llama", seed=i, r=4, lora_alpha=8,
                             target_modules=["q_proj", "v_proj"]) for i in (1, 2)]
    out["lora-local-base"] = hubsoup.merge(adapters, method="task_arithmetic", base=llama, out=str(root / "adapter"),
                                           quiet=True, output_format="lora", rank=8, scale=0.5)
    continual.init(fts, base=llama, out=str(root / "soup"), quiet=True)
    out["continual"] = continual.add(str(root / "soup"), [make_finetune(llama, str(root / "ft3"), seed=3)], quiet=True)
    return {"root": str(root), "llama": llama, "adapters": adapters, "fts": fts, **out}


def _run(programs: list[tuple[str, str, str]], env: dict) -> dict[str, dict]:
    """(name, code, working folder) in one interpreter; name -> what the probe saw."""
    driver = ("import json, os, sys\nprograms = json.loads(sys.stdin.read())\n"
              "for name, code, cwd in programs:\n"
              "    os.chdir(cwd)\n"
              "    print('NAME ' + name, flush=True)\n"
              "    exec(compile(code, name, 'exec'), {})\n")
    proc = subprocess.run([sys.executable, "-c", driver], input=json.dumps(programs), capture_output=True, text=True,
                          env={**os.environ, "TRANSFORMERS_VERBOSITY": "error", **env}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-3000:]
    got, name = {}, None
    for line in proc.stdout.splitlines():
        if line.startswith("NAME "):
            name = line[5:]
        elif line.startswith("RESULT "):
            got[name] = json.loads(line[7:])
    return got


def test_lora_output_names_peft_task_type_and_auto_peft_loads_it(made):
    from peft import AutoPeftModelForCausalLM, PeftModel

    folder = made["lora-local-base"].path
    cfg = json.load(open(os.path.join(folder, "adapter_config.json")))
    assert cfg["task_type"] == "CAUSAL_LM"  # the base is a LlamaForCausalLM
    model = AutoPeftModelForCausalLM.from_pretrained(folder)  # the base from base_model_name_or_path
    assert isinstance(model, PeftModel) and type(model.get_base_model()).__name__ == "LlamaForCausalLM"


def test_lora_task_type_follows_the_base_architecture(tmp_path):
    """A classifier base: SEQ_CLS, whatever task the adapters say; AutoPeftModelForSequenceClassification loads it."""
    import transformers as tf
    from peft import AutoPeftModelForSequenceClassification

    cfg = tf.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, num_labels=3)
    base = str(tmp_path / "bert")
    tf.BertForSequenceClassification(cfg).save_pretrained(base)
    adapters = [make_adapter(tmp_path / f"a{i}", "bert", seed=i, r=2, target_modules=["query", "value"])
                for i in (1, 2)]
    out = hubsoup.merge(adapters, method="task_arithmetic", base=base, out=str(tmp_path / "out"), quiet=True,
                        output_format="lora", rank=4)
    assert json.load(open(os.path.join(out.path, "adapter_config.json")))["task_type"] == "SEQ_CLS"
    model = AutoPeftModelForSequenceClassification.from_pretrained(out.path)
    assert type(model.get_base_model()).__name__ == "BertForSequenceClassification"


@pytest.mark.slow
def test_every_card_snippet_runs_locally_and_once_pushed(made, hub, tmp_path):
    """Each card's python blocks, as written: locally against the folder, then as pushed against the test Hub."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # a LoRA merge of adapters on the Hub over a base on the Hub
    hub.seed("alice/base", made["llama"])
    for i, a in enumerate(made["adapters"], 1):
        _set_base_name(a, "alice/base")
        hub.seed(f"alice/lora{i}", a)
    hub_lora = hubsoup.merge(["alice/lora1", "alice/lora2"], method="task_arithmetic", out=str(tmp_path / "hub-lora"),
                             quiet=True, output_format="lora", rank=8, scale=0.5)
    outputs = {k: made[k] for k in ("full", "lora-local-base", "continual")}
    outputs["lora-hub-base"] = hub_lora

    local = [(f"local {k}", _blocks(open(os.path.join(r.path, "README.md")).read()) + PROBE, str(elsewhere))
             for k, r in outputs.items()]
    assert 'from_pretrained("alice/base")' in local[-1][1]  # a Hub base by its ID, never its cache folder
    pushed, cards = [], {}
    for kind, r in outputs.items():
        repo = f"alice/{kind}-soup"
        push_folder(r.path, repo, token=hub.token("alice"))
        cards[kind] = text = hub.files(repo)["README.md"].decode()
        # no path of this machine, and titled by the repo, not by the folder ("merge", "adapter", ...)
        assert made["root"] not in text and str(tmp_path) not in text
        assert f"\n# {kind}-soup\n" in text and f"\n# {os.path.basename(r.path)}\n" not in text
        where = made["root"] if kind == "lora-local-base" else str(elsewhere)  # see the module's docstring
        pushed.append((f"pushed {kind}", _blocks(text) + PROBE, where))
    got = _run(local + pushed, {"HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0",
                                "HF_HOME": str(tmp_path / "fresh-hf-home")})
    assert set(got) == {name for name, _, _ in local + pushed}
    for name, info in got.items():
        assert info["logits"] == [1, 3, 128], (name, info)
        if "lora" in name:
            assert info["model"].startswith("PeftModel") and info["base"] == "LoraModel", (name, info)
        else:
            assert info["model"] == "LlamaForCausalLM", (name, info)

    # base_model_relation: merge for merges, adapter (with base_model) only when the base is on the Hub
    meta = {k: _meta(t) for k, t in cards.items()}
    assert "base_model" not in meta["full"] and "base_model_relation" not in meta["full"]  # all local: nothing to relate
    assert "base_model" not in meta["lora-local-base"] and "base_model_relation" not in meta["lora-local-base"]
    assert meta["lora-hub-base"]["base_model"] == ["alice/base"]
    assert meta["lora-hub-base"]["base_model_relation"] == "adapter"
    assert "base_model_relation" not in meta["continual"]
    # the pushed adapter names its base as the card does: AutoPeftModel loads the Hub one from the Hub
    on_hub = json.loads(hub.files("alice/lora-hub-base-soup")["adapter_config.json"])
    assert on_hub["base_model_name_or_path"] == "alice/base" and on_hub["task_type"] == "CAUSAL_LM"
    local_base = json.loads(hub.files("alice/lora-local-base-soup")["adapter_config.json"])
    assert local_base["base_model_name_or_path"] == "llama"  # its folder's name, never its path


def test_merge_of_hub_inputs_relates_as_merge(made, hub, tmp_path):
    for i, ft in enumerate(made["fts"], 1):
        hub.seed(f"alice/ft{i}", ft)
    out = hubsoup.merge(["alice/ft1", "alice/ft2"], method="linear", base=made["llama"], out=str(tmp_path / "m"),
                        quiet=True)
    meta = _meta(open(os.path.join(out.path, "README.md")).read())
    assert meta["base_model"] == ["alice/ft1", "alice/ft2"] and meta["base_model_relation"] == "merge"


def test_local_base_copy_of_a_hub_model_relates_as_merge_and_adapter(made, tmp_path):
    """A local base whose card names its Hub model (the demo's case): merge, and the LoRA adapter loads that."""
    from hubsoup.testing import write_card_metadata

    base = make_base("llama", str(tmp_path / "copy"))
    save_tiny_tokenizer(base)
    write_card_metadata(base, base_model="upstream/base")
    fts = [make_finetune(base, str(tmp_path / f"ft{i}"), seed=i) for i in (1, 2)]
    full = hubsoup.merge(fts, method="linear", base=base, out=str(tmp_path / "m"), quiet=True)
    meta = _meta(open(os.path.join(full.path, "README.md")).read())
    assert meta["base_model"] == ["upstream/base"] and meta["base_model_relation"] == "merge"
    lora = hubsoup.merge(fts, method="linear", base=base, out=str(tmp_path / "l"), quiet=True,
                         output_format="lora", rank=4)
    meta = _meta(open(os.path.join(lora.path, "README.md")).read())
    assert meta["base_model"] == ["upstream/base"] and meta["base_model_relation"] == "adapter"
    from hubsoup.card import render

    code = _blocks(str(render(lora, repo_id="alice/l")))  # as pushed: the base from the Hub
    assert 'from_pretrained("upstream/base")' in code and 'from_pretrained(base, "alice/l")' in code


def test_parameter_table_says_what_the_default_is(made, tmp_path):
    fts = made["fts"]
    given = hubsoup.merge(fts, method="dare", base=made["llama"], out=str(tmp_path / "a"), quiet=True,
                          convention="mergekit", p=0.5)
    default = hubsoup.merge(fts, method="dare", base=made["llama"], out=str(tmp_path / "b"), quiet=True, p=0.5)

    def row(result, name):
        text = open(os.path.join(result.path, "README.md")).read()
        return next(line for line in text.splitlines() if line.startswith(f"| `{name}` |"))

    assert "given (default: `paper`)" in row(given, "convention")
    assert "mergekit's convention" not in row(default, "convention")
    assert "default" in row(default, "convention") and "`paper`" in row(default, "convention")
    assert "given (default: `0.9`)" in row(given, "p")
