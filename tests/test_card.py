"""Model cards: metadata the Hub expects for merges, the body, eval results, licenses, templates."""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
from huggingface_hub import EvalResult, ModelCard
from huggingface_hub.repocard_data import eval_results_to_model_index, model_index_to_eval_results

import hubsoup
from hubsoup import __version__
from hubsoup.card import inherited_license, render
from hubsoup.cli import main
from hubsoup.errors import ParameterError
from hubsoup.methods import get_method
from hubsoup.testing import make_finetune, write_card_metadata

SHA = {"base": "b" * 40, "a": "a" * 40, "b": "c" * 40}


def _licensed_copy(src: str, dest: str, **metadata) -> str:
    shutil.copytree(src, dest)
    if metadata:
        write_card_metadata(dest, **metadata)
    return dest


@pytest.fixture(scope="module")
def folders(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("card-models")
    base = _licensed_copy(model_dir("llama"), str(root / "base"), license="apache-2.0")
    fa = make_finetune(base, str(root / "ft-a"), seed=1)
    write_card_metadata(fa, base_model="alice/base", license="apache-2.0")
    fb = make_finetune(base, str(root / "ft-b"), seed=2, base_model="alice/base")  # silent about the license
    return {"root": root, "base": base, "a": fa, "b": fb}


@pytest.fixture(scope="module")
def local_result(folders):
    return hubsoup.merge([folders["a"], folders["b"]], method="ties", base=folders["base"],
                         out=str(folders["root"] / "soup"), quiet=True, density=0.5)


def _as_hub(result, kinds=("full", "full")):
    """The same result as if base and inputs had come from the Hub (repo IDs + pinned SHAs)."""
    base = dataclasses.replace(result.base, spec="alice/base", repo_id="alice/base", revision=None, sha=SHA["base"])
    inputs = [dataclasses.replace(ref, spec=f"alice/ft-{n}@v1", repo_id=f"alice/ft-{n}", revision="v1", sha=SHA[n],
                                  kind=kind)
              for ref, n, kind in zip(result.inputs, "ab", kinds)]
    return dataclasses.replace(result, base=base, inputs=inputs)


def test_card_metadata_for_hub_inputs(local_result):
    card = render(_as_hub(local_result), repo_id="soup-org/soup")
    d = card.data
    assert d.base_model == ["alice/ft-a", "alice/ft-b"]
    assert d.base_model_relation == "merge"
    assert d.library_name == "transformers"
    assert d.tags == ["merge", "hubsoup", "ties"]
    assert d.license == "apache-2.0"  # the base's; ft-a agrees, ft-b says nothing
    assert "model-index" not in d.to_dict()
    # the metadata parses back identically from the text (what the Hub reads)
    again = ModelCard(str(card))
    assert again.data.to_dict() == d.to_dict()


def test_card_body_says_how_the_model_was_made(local_result):
    result = _as_hub(local_result, kinds=("full", "lora"))
    text = render(result, repo_id="soup-org/soup").text
    method = get_method("ties")
    assert "# soup" in text
    assert "merge of 2 fine-tune(s)" in text and "alice/base" in text
    assert f"]({method.paper_url})" in text
    for name, value in result.params.items():
        assert f"| `{name}` | `{value}` |" in text
    assert f"| base | alice/base | - | {SHA['base']} | full |" in text
    assert f"| input 1 | alice/ft-a | v1 | {SHA['a']} | full fine-tune |" in text
    assert f"| input 2 | alice/ft-b | v1 | {SHA['b']} | LoRA adapter |" in text
    # the card embeds the recipe without local paths (issue 12); the hash is the recipe's own
    assert result.recipe.public_yaml() in text and f"Recipe hash: `{result.recipe.hash}`" in text
    assert __version__ in text
    # a Llama: loaded with its lm_head (AutoModelForCausalLM), tagged text-generation (tests/test_card_hub.py runs it)
    assert 'AutoModelForCausalLM.from_pretrained("soup-org/soup")' in text
    assert render(result).data.pipeline_tag == "text-generation"
    assert "No evaluation results were recorded" in text


def test_local_inputs_list_no_base_model(local_result):
    card = render(local_result)
    assert card.data.base_model is None and "base_model_relation" not in card.data.to_dict()
    assert f'from_pretrained("{local_result.path}")' in card.text
    assert "| input 1 | ft-a | - | local folder | full fine-tune |" in card.text
    # the card written by the merge itself
    written = ModelCard.load(os.path.join(local_result.path, "README.md"))
    assert written.data.license == "apache-2.0" and "ties" in written.data.tags


def test_eval_results_become_a_valid_model_index(local_result):
    results = [
        EvalResult(task_type="text-generation", dataset_type="wikitext", dataset_name="WikiText-2",
                   dataset_split="test", metric_type="perplexity", metric_value=12.5),
        EvalResult(task_type="text-classification", dataset_type="glue", dataset_name="GLUE SST-2",
                   dataset_config="sst2", dataset_split="validation", metric_type="accuracy", metric_value=0.91),
    ]
    card = render(_as_hub(local_result), repo_id="soup-org/soup", eval_results=results)
    meta = card.data.to_dict()
    assert meta["model-index"] == eval_results_to_model_index("soup", results)
    # the round trip huggingface_hub does when it loads a card
    name, parsed = model_index_to_eval_results(meta["model-index"])
    assert name == "soup" and parsed == results
    reloaded = ModelCard(str(card))
    assert reloaded.data.eval_results == results and reloaded.data.model_name == "soup"
    assert "| text-generation | WikiText-2 | test | perplexity | 12.5 |" in card.text
    assert "| text-classification | GLUE SST-2 | validation | accuracy | 0.91 |" in card.text


def test_card_passes_the_hub_metadata_validation(hub, local_result):
    results = [EvalResult(task_type="text-generation", dataset_type="wikitext", dataset_name="WikiText-2",
                          metric_type="perplexity", metric_value=12.5)]
    render(_as_hub(local_result), repo_id="soup-org/soup", eval_results=results).validate()
    assert [c["status"] for c in hub.calls("POST", r"^/api/validate-yaml$")] == [200]


def test_license_rules(folders, local_result, tmp_path):
    assert inherited_license(local_result) == {"license": "apache-2.0"}
    assert render(local_result, license="mit").data.license == "mit"  # explicit wins

    # an input that names another license: none is set, and the card says why
    other = make_finetune(folders["base"], str(tmp_path / "ft-mit"), seed=3)
    write_card_metadata(other, license="mit")
    ref = dataclasses.replace(local_result.inputs[1], spec=other, path=other)
    mixed = dataclasses.replace(local_result, inputs=[local_result.inputs[0], ref])
    card = render(mixed)
    assert card.data.license is None
    assert "base is licensed `apache-2.0`" in card.text and "`ft-mit`: `mit`" in card.text

    # a base whose card is silent: no license
    bare = dataclasses.replace(local_result.base, spec=str(tmp_path), path=str(tmp_path))
    assert render(dataclasses.replace(local_result, base=bare)).data.license is None

    # license: other carries its name and link
    custom = _licensed_copy(folders["base"], str(tmp_path / "custom-base"), license="other",
                            license_name="tiny-license", license_link="https://example.com/LICENSE")
    ref = dataclasses.replace(local_result.base, spec=custom, path=custom)
    silent_inputs = [local_result.inputs[1]]  # ft-b's card names no license
    d = render(dataclasses.replace(local_result, base=ref, inputs=silent_inputs)).data
    assert (d.license, d.license_name, d.license_link) == ("other", "tiny-license", "https://example.com/LICENSE")


TEMPLATE = """---
{{ card_data }}
---

# Custom card for {{ model_name }}

Made with {{ method.name }} ({{ method.paper_url }}) by hubsoup {{ hubsoup_version }}.
{% for i in inputs %}
- {{ i.name }} {{ i.sha or "local" }}
{%- endfor %}
"""


def test_custom_template_from_python_and_cli(folders, local_result, tmp_path, capsys):
    tpl = tmp_path / "my-card.md"
    tpl.write_text(TEMPLATE)
    card = render(_as_hub(local_result), repo_id="soup-org/soup", template=str(tpl))
    assert "# Custom card for soup" in card.text and "](" not in card.text
    assert f"- alice/ft-a {SHA['a']}" in card.text
    assert card.data.base_model_relation == "merge" and card.data.license == "apache-2.0"

    out = tmp_path / "cli-soup"
    rc = main(["merge", folders["a"], folders["b"], "--base", folders["base"], "--method", "linear",
               "--out", str(out), "--card-template", str(tpl), "-q"])
    assert rc == 0
    written = ModelCard.load(str(out / "README.md"))
    assert "# Custom card for cli-soup" in written.text and "- ft-a local" in written.text
    assert written.data.tags == ["merge", "hubsoup", "linear"]

    # a missing template is refused before anything is merged
    rc = main(["merge", folders["a"], folders["b"], "--base", folders["base"], "--method", "linear",
               "--out", str(tmp_path / "never"), "--card-template", str(tmp_path / "nope.md")])
    assert rc == 2 and "card template" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()
    with pytest.raises(ParameterError, match="not found"):
        render(local_result, template=str(tmp_path / "nope.md"))


def _harm_data(rows: dict, methods: dict) -> dict:
    return {"about": "test", "rows": rows, "methods": methods}


def _with_inputs(result, kind: str, n: int, method: str | None = None, **params):
    """``result`` as if it had merged ``n`` inputs of ``kind`` (with ``method`` and structural ``params``)."""
    ref = _as_hub(result).inputs[0]
    inputs = [dataclasses.replace(ref, spec=f"alice/ft-{i}", repo_id=f"alice/ft-{i}", kind=kind) for i in range(n)]
    return dataclasses.replace(_as_hub(result), inputs=inputs, method=method or result.method,
                               params={**result.params, **params})


def test_card_discloses_a_harm_measured_at_the_merges_method_kind_and_count(local_result, monkeypatch):
    """Issue 46: a merge whose method (a modifier's base method included) and inputs' kind and number match a
    setting where hubsoup's benchmark saw the defaults lower a task carries one sentence under the eval results;
    any other merge does not."""
    import hubsoup.methods as M

    harm = {"task": "pydoc_sys", "size": "3.5 points", "range": "0.8 to 6.1 points", "tuned_too": True}
    entry = {"setting": "encoder lora-8", "model": "MiniLM-L6 encoder, text classification", "kind": "lora",
             "n_inputs": 8, "defaults": 0.12, "interval": [0.0, 0.2], "harms": [harm]}
    data = _harm_data({"TIES": {"method": "ties", "params": {}},
                       "LiNeS + TIES": {"method": "lines", "params": {"base_method": "ties"}}},
                      {"ties": {"TIES": [entry, {**entry, "setting": "encoder lora-4", "n_inputs": 4,
                                                 "harms": []}]},
                       "lines": {"LiNeS + TIES": [{**entry, "harms": [{**harm, "task": "deb_dev"}]}]}})
    monkeypatch.setattr(M, "_measured_file", lambda: data)
    sentence = ("In hubsoup's quality benchmark (MiniLM-L6 encoder, text classification), this method at its "
                "defaults lowered one task of 8 below the base model at 8 LoRA adapters: pydoc_sys by 3.5 points "
                "(95 % interval 0.8 to 6.1 points); tuned on validation, it did no better there.")
    text = render(_with_inputs(local_result, "lora", 8), repo_id="soup-org/soup").text
    assert sentence in text
    assert text.index("## Evaluation") < text.index(sentence) < text.index("## How to use")  # under the eval results
    for other in (_with_inputs(local_result, "full", 8), _with_inputs(local_result, "lora", 4),
                  _with_inputs(local_result, "lora", 7), local_result):  # exact count and kind only
        assert "In hubsoup's quality benchmark" not in render(other, repo_id="soup-org/soup").text
    mixed = _with_inputs(local_result, "lora", 8)
    mixed = dataclasses.replace(mixed, inputs=[*mixed.inputs[:7], dataclasses.replace(mixed.inputs[7], kind="full")])
    assert "In hubsoup's quality benchmark" not in render(mixed, repo_id="soup-org/soup").text
    # a modifier matches the row of its base method, not the base method's own row
    assert M.measured_harms("lines", {"base_method": "ties"}, ["lora"] * 8)[0]["harms"][0]["task"] == "deb_dev"
    assert M.measured_harms("lines", {"base_method": "task_arithmetic"}, ["lora"] * 8) == []
    two = {**entry, "harms": [harm, {**harm, "task": "deb_sys", "size": "2.6 points", "tuned_too": False}]}
    monkeypatch.setattr(M, "_measured_file", lambda: _harm_data({"TIES": {"method": "ties", "params": {}}},
                                                                 {"ties": {"TIES": [two]}}))
    text = render(_with_inputs(local_result, "lora", 8), repo_id="soup-org/soup").text
    assert "lowered two tasks of 8 below the base model at 8 LoRA adapters: pydoc_sys by 3.5 points" in text
    assert "deb_sys by 2.6 points (95 % interval 0.8 to 6.1 points). Check" in text  # tuning avoided one: not said


def test_cards_disclose_every_harm_the_shipped_measurements_hold(local_result):
    """The shipped hubsoup/methods/measured.json: a TIES merge of inputs like each harmed TIES setting names each
    harmed task in its card (the data behind the sentence is what the benchmarks measured)."""
    from hubsoup.methods import measured

    for e in measured()["ties"]["TIES"]:
        if not e.get("harms"):
            continue
        text = render(_with_inputs(local_result, e["kind"], e["n_inputs"]), repo_id="soup-org/soup").text
        for h in e["harms"]:
            assert f"{h['task']} by {h['size']} (95 % interval {h['range']})" in text
