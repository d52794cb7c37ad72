"""The one-engine redesign's public contracts: options, the card channel, the engine's one loop."""

from __future__ import annotations

import os

import pytest

import hubsoup
from hubsoup import continual, engine
from hubsoup.api import MergeResult
from hubsoup.errors import MethodError, OutputExistsError, ParameterError
from hubsoup.options import MergeOptions
from hubsoup.testing import make_base, make_finetune


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("redesign")
    base = make_base("llama", str(root / "base"))
    return base, [make_finetune(base, str(root / f"ft{i}"), seed=i) for i in (1, 2, 3)]


def test_misspelt_option_is_an_unknown_option_not_a_method_parameter(zoo, tmp_path):
    base, fts = zoo
    with pytest.raises(ParameterError, match=r"unknown option 'overwite' \(did you mean 'overwrite'\?\)"):
        hubsoup.merge(fts, "ties", base=base, out=str(tmp_path / "o"), overwite=True)
    with pytest.raises(ParameterError, match="densty"):  # a misspelt method parameter stays one
        hubsoup.merge(fts, "ties", base=base, out=str(tmp_path / "o"), densty=0.2)
    assert not os.path.exists(tmp_path / "o")


def test_options_object_and_keywords_agree(zoo, tmp_path):
    base, fts = zoo
    a = hubsoup.merge(fts, "task_arithmetic", base=base, out=str(tmp_path / "a"),
                      options=MergeOptions(dtype="bfloat16", quiet=True))
    b = hubsoup.merge(fts, "task_arithmetic", base=base, out=str(tmp_path / "b"), dtype="bfloat16", quiet=True)
    assert a.recipe.hash == b.recipe.hash and a.recipe.dtype == "bfloat16"
    with pytest.raises(OutputExistsError):
        hubsoup.merge(fts, "task_arithmetic", base=base, out=str(tmp_path / "a"), options=MergeOptions(quiet=True))
    with pytest.raises(ParameterError, match="dtype must be one of"):
        MergeOptions(dtype="float8")
    with pytest.raises(ParameterError, match="shape_mismatch"):
        MergeOptions(shape_mismatch="pad")
    assert "token" not in repr(MergeOptions(token="hf_secret")) and "hf_secret" not in repr(MergeOptions(token="hf_secret"))


def test_register_refuses_a_duplicate_name():
    from dataclasses import dataclass

    from hubsoup.methods import Method, register

    @dataclass
    class P:
        pass

    class Clash(Method):
        name = "ties"
        summary = "x"
        Params = P

    with pytest.raises(MethodError, match="taken"):
        register(Clash)


def test_card_sections_survive_a_rerender(zoo, tmp_path):
    base, fts = zoo
    soup = str(tmp_path / "soup")
    res = continual.init(fts[:2], base=base, out=soup, quiet=True)
    assert "## Continual merging" in res.card
    # a re-render (as push_to_hub does with eval results or a template) keeps the section
    res.write_card(license="mit")
    assert "## Continual merging" in res.card and "license: mit" in res.card
    again = MergeResult.from_folder(soup)
    again.write_card(license="apache-2.0")
    card = open(os.path.join(soup, "README.md")).read()
    assert "## Continual merging" in card and "license: apache-2.0" in card


def test_every_output_goes_through_the_one_stream(zoo, tmp_path, monkeypatch):
    """Full and LoRA outputs, continual passes: each is a consumer of engine.stream (which unmaps per block)."""
    base, fts = zoo
    calls = []
    real = engine.stream

    def counting(job, **kw):
        calls.append(kw.get("desc", ""))
        yield from real(job, **kw)
    monkeypatch.setattr(engine, "stream", counting)
    import hubsoup.workflows.continual as cont

    monkeypatch.setattr(cont, "stream", counting)
    releases = []
    real_release = engine.Job.release
    monkeypatch.setattr(engine.Job, "release", lambda self: (releases.append(1), real_release(self)))

    hubsoup.merge(fts, "ties", base=base, out=str(tmp_path / "full"), quiet=True)
    n_full = len(calls)
    hubsoup.merge(fts, "task_arithmetic", base=base, out=str(tmp_path / "lora"), quiet=True,
                  output_format="lora", rank=4)
    n_lora = len(calls) - n_full
    continual.init(fts[:2], base=base, out=str(tmp_path / "c"), quiet=True)
    n_cont = len(calls) - n_full - n_lora
    assert n_full == 3  # TIES (scope=model): two statistics passes + the output pass
    assert n_lora == 1 and n_cont == 2  # continual: the state pass + writing the model
    assert len(releases) >= 6 * 4  # once per block per pass (a tiny llama has several blocks)
