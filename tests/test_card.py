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
