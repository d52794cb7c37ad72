"""Cards that load as they say (issue 32, item 4): every python block of every generated card runs as written,
locally against the output folder and, once pushed, against the test Hub; a LoRA output names peft's
``task_type`` of its base, so ``AutoPeftModelForCausalLM`` loads it; cards are titled by the repo they are pushed
to; ``base_model_relation`` is right in every path; the parameter table says what each default is.

The snippets run in one fresh interpreter (transformers imported once), each from its own working folder:
a local card's snippet from an unrelated folder (it names absolute paths), a pushed card's from an unrelated
folder too, except a LoRA adapter of a base that is only a local folder: its published snippet names the base
by its folder name (no path is ever published), so it runs from the folder that holds the base; run from
anywhere else it stops with one line saying so (never transformers' OSError). Issue 48 adds the other output
kinds: an evolve output, a mergekit-multi (stages) output and a pipeline's merges, locally and pushed.
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

    # the pushed card of the local-only base, run anywhere else: one line saying what to do, not an OSError
    code = _blocks(cards["lora-local-base"])
    proc = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0",
                               "HF_HOME": str(tmp_path / "fresh-hf-home"), "TRANSFORMERS_VERBOSITY": "error"})
    assert proc.returncode == 1 and "OSError" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "this adapter's base, `llama`, is not on the Hub: set base_path to your copy of it" in proc.stderr


@pytest.mark.slow
def test_evolve_stages_and_pipeline_snippets_run_locally_and_once_pushed(made, hub, zoo_on_hub, tmp_path):
    """Issue 48, item 4: every output kind's card runs as written: an evolve output (titled and loading its
    folder, then the repo; never its temporary folder), a mergekit-multi stages output and a pipeline's merges
    (one of them a stages config), locally and as pushed."""
    pytest.importorskip("optuna")
    from hubsoup.workflows.evolve import evolve
    from hubsoup.workflows.pipeline import run_pipeline
    from hubsoup.workflows.rerun import run_stages

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    data = tmp_path / "val.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(f"w{(i * 7 + j) % 100}" for j in range(10))}) + "\n"
                            for i in range(6)))
    ev = evolve({"base": made["llama"], "models": made["fts"], "method": "task_arithmetic",
                 "space": {"scale": [0.2, 1.0]}, "optimizer": "random", "trials": 2, "population": 2,
                 "eval": {"tasks": [f"perplexity:{data}"]}}, str(tmp_path / "evolved"), quiet=True)
    stages = (f"name: ab\nmerge_method: linear\nmodels:\n  - model: {made['fts'][0]}\n    parameters: {{weight: 1.0}}\n"
              f"  - model: {made['fts'][1]}\n    parameters: {{weight: 1.0}}\ndtype: float32\n---\n"
              f"merge_method: slerp\nbase_model: {made['llama']}\nmodels:\n  - model: {made['llama']}\n"
              f"  - model: ab\nparameters: {{t: 0.5}}\ndtype: float32\n")
    (tmp_path / "stages.yml").write_text(stages)
    staged = run_stages(stages, str(tmp_path / "staged"), quiet=True)
    outputs = {"evolve": ev.result.path, "stages": staged.path}
    local = [(f"local {k}", _blocks(open(os.path.join(p, "README.md")).read()) + PROBE, str(elsewhere))
             for k, p in outputs.items()]
    assert "\n# evolved\n" in open(os.path.join(ev.result.path, "README.md")).read()
    pushed = []
    for kind, path in outputs.items():
        push_folder(path, f"alice/{kind}-soup", token=hub.token("alice"))
        text = hub.files(f"alice/{kind}-soup")["README.md"].decode()
        assert f"\n# {kind}-soup\n" in text and str(tmp_path) not in text and ".hubsoup-best" not in text
        pushed.append((f"pushed {kind}", _blocks(text) + PROBE, str(elsewhere)))

    # a pipeline of two merges, one a stages config, pushed to soup-org
    (tmp_path / "hub-stages.yml").write_text(
        "name: ab\nmerge_method: linear\nmodels:\n  - model: bob/ft1\n    parameters: {weight: 1.0}\n"
        "  - model: bob/ft2\n    parameters: {weight: 1.0}\ndtype: float32\n---\n"
        "merge_method: slerp\nbase_model: alice/llama\nmodels:\n  - model: alice/llama\n  - model: ab\n"
        "parameters: {t: 0.5}\ndtype: float32\n")
    pipeline = {"base": "alice/llama", "candidates": {"models": ["bob/ft1", "bob/ft2"]},
                "merges": [{"method": "linear", "combine": "all"}, {"config": "hub-stages.yml"}],
                "push": {"namespace": "soup-org", "name": "{method}-{hash8}"}, "work_dir": str(tmp_path / "work"),
                "license": {"allow_mix": True}}
    (tmp_path / "pipeline.yml").write_text(yaml.safe_dump(pipeline))
    report = run_pipeline(str(tmp_path / "pipeline.yml"), stream=open(os.devnull, "w"))
    assert report.exit_code == 0 and len(report.merges) == 2, [(m.status, m.error) for m in report.merges]
    for m in report.merges:
        text = hub.files(m.repo_id)["README.md"].decode()
        assert str(tmp_path) not in text
        pushed.append((f"pushed pipeline {m.repo_id}", _blocks(text) + PROBE, str(elsewhere)))
    got = _run(local + pushed, {"HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0",
                                "HF_HOME": str(tmp_path / "fresh-hf-home")})
    assert set(got) == {name for name, _, _ in local + pushed}
    for name, info in got.items():
        assert info["model"] == "LlamaForCausalLM" and info["logits"] == [1, 3, 128], (name, info)


@pytest.fixture
def zoo_on_hub(made, hub):
    """The tiny base and fine-tunes on the test Hub (alice/llama; bob's fine-tunes name it), licensed."""
    from hubsoup.testing import write_card_metadata

    hub.login("alice")
    write_card_metadata(made["llama"], license="apache-2.0")
    hub.seed("alice/llama", made["llama"])
    for i, ft in enumerate(made["fts"], 1):
        write_card_metadata(ft, base_model="alice/llama", license="apache-2.0")
        hub.seed(f"bob/ft{i}", ft)


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
