"""mergekit configs refused before anything is written: ``--out`` equal to a ``tokenizer_source`` folder (even
with ``--overwrite``), a slice beyond a model's layers (its config without a layer count too), passthrough
slices of models of different hidden sizes. (The commit's atomic exchange, which leaves ``--out`` in place
through a crash, is in tests/output/test_faults.py.)
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from hubsoup.errors import ParameterError
from hubsoup.workflows.rerun import run_config
from hubsoup.testing import make_base, make_finetune, save_tiny_tokenizer


@pytest.fixture(scope="module")
def sizes(tmp_path_factory):
    root = tmp_path_factory.mktemp("lows")
    small = make_base("llama", str(root / "small"), layers=2, hidden=32)
    big = make_base("llama", str(root / "big"), layers=2, hidden=64)
    counted = str(root / "no-layer-count")
    shutil.copytree(small, counted)
    with open(os.path.join(counted, "config.json")) as f:
        cfg = json.load(f)
    del cfg["num_hidden_layers"]
    with open(os.path.join(counted, "config.json"), "w") as f:
        json.dump(cfg, f)
    return {"root": str(root), "small": small, "big": big, "no-layer-count": counted}


def slices(*parts: tuple[str, int, int]) -> str:
    return "merge_method: passthrough\nslices:\n" + "".join(
        f"  - sources:\n      - model: {m}\n        layer_range: [{a}, {b}]\n" for m, a, b in parts)


def test_out_equal_to_the_tokenizer_source_is_refused_even_with_overwrite(sizes, tmp_path):
    base = str(tmp_path / "base")
    shutil.copytree(sizes["small"], base)
    save_tiny_tokenizer(base)
    ft = make_finetune(base, str(tmp_path / "ft"), seed=1)
    tok = str(tmp_path / "tok")
    shutil.copytree(base, tok)
    before = sorted(os.listdir(tok))
    text = (f"merge_method: linear\nmodels:\n  - model: {base}\n    parameters: {{weight: 0.5}}\n"
            f"  - model: {ft}\n    parameters: {{weight: 0.5}}\ntokenizer_source: {tok}\n")
    from hubsoup.errors import OutputExistsError
    from hubsoup.output.folder import write_marker

    with pytest.raises(OutputExistsError, match="hubsoup did not make it"):  # a model folder (issue 44)
        run_config(text, tok, overwrite=True, quiet=True)
    write_marker(tok, "merge")  # even a folder hubsoup made, when it is the tokenizer source
    before = sorted(os.listdir(tok))
    with pytest.raises(ParameterError, match="would delete it"):
        run_config(text, tok, overwrite=True, quiet=True)
    assert sorted(os.listdir(tok)) == before
    assert [p for p in os.listdir(tmp_path) if p.startswith(".tok.")] == []


def test_a_slice_beyond_the_layers_of_a_model_without_a_layer_count_is_a_clear_error(sizes, tmp_path):
    model = sizes["no-layer-count"]
    with pytest.raises(ParameterError, match=r"layer_range' = \[0, 4\] but .* has 2 layers"):
        run_config(slices((model, 0, 4)), str(tmp_path / "out"), quiet=True)
    assert not os.path.exists(tmp_path / "out")


def test_passthrough_slices_of_different_hidden_sizes_are_refused_before_writing(sizes, tmp_path):
    for parts in [((sizes["small"], 0, 2), (sizes["big"], 0, 2)), ((sizes["big"], 0, 1), (sizes["small"], 1, 2))]:
        with pytest.raises(ParameterError, match="models of different sizes .* cannot be stacked"):
            run_config(slices(*parts), str(tmp_path / "out"), quiet=True)
        assert [p for p in os.listdir(tmp_path) if "out" in p] == []
    # same sizes stack as before
    res = run_config(slices((sizes["small"], 0, 2), (sizes["small"], 0, 1)), str(tmp_path / "out"), quiet=True)
    assert json.load(open(os.path.join(res.path, "config.json")))["num_hidden_layers"] == 3
