"""A pipeline merge given as a mergekit config (``merges: [{config: FILE}]``), one document or a mergekit-multi
stream: run as ``hubsoup run`` runs it, on the test Hub, with the pipeline's evaluation, licenses, push and
leaderboard applied to its final output; the models the config names are its inputs (access and license)."""

from __future__ import annotations

import json
import os

import pytest
import yaml
from tests.workflows.pipeline.test_pipeline import (example, publish, run, soup_repos,  # noqa: F401 (the zoo fixture)
                                                    state, zoo)

from hubsoup.errors import ParameterError
from hubsoup.workflows.pipeline import load_pipeline

TIES = ("merge_method: ties\nbase_model: alice/base\nmodels:\n  - model: bob/ft-a\n    parameters: {weight: 0.7, "
        "density: 0.5}\n  - model: bob/ft-b\n    parameters: {weight: 0.3, density: 0.8}\ndtype: float32\n")
STAGES = ("name: soup-ab\nmerge_method: linear\nmodels:\n  - model: bob/ft-a\n    parameters: {weight: 1.0}\n"
          "  - model: bob/ft-b\n    parameters: {weight: 1.0}\ndtype: float32\n---\n"
          "merge_method: slerp\nbase_model: alice/base\nmodels:\n  - model: alice/base\n  - model: soup-ab\n"
          "parameters: {t: 0.5}\ndtype: float32\n")


def _pipeline(tmp_path, merges, **kw) -> str:
    (tmp_path / "ties.yml").write_text(TIES)
    (tmp_path / "stages.yml").write_text(STAGES)
    return example(tmp_path, select=None, merges=merges, candidates={"models": []}, **kw)


@pytest.mark.slow  # two pipeline runs with merges, evaluations and pushes on the test Hub
def test_a_mergekit_config_merge_is_evaluated_published_and_not_made_twice(hub, zoo, tmp_path):  # noqa: F811
    import torch

    from hubsoup.workflows.rerun import run_config
    from tests.formats.test_mergekit_compat import load_dir

    publish(hub, zoo, "base", "ft-a", "ft-b")
    hub.login("alice")
    path = _pipeline(tmp_path, [{"config": "ties.yml", "name": "mk-ties"}, {"config": "stages.yml"}])
    report, out, events = run(path)
    assert report.exit_code == 0, out
    assert sorted(k for k, _ in events if k == "pushed") == ["pushed", "pushed"], events
    repos = soup_repos(hub)
    assert len(repos) == 2
    for m in report.merges:
        assert m.status == "published" and {i.repo_id for i in m.inputs} >= {"bob/ft-a", "bob/ft-b"}
        files = hub.files(m.repo_id)
        assert {"README.md", "hubsoup_recipe.yaml", "eval_results.json"} <= set(files)
        card = files["README.md"].decode()
        assert "license: apache-2.0" in card and "perplexity" in card and "mergekit" in card
        recipe = yaml.safe_load(files["hubsoup_recipe.yaml"])
        assert recipe["hash"] == m.recipe_hash
        if m.spec.name == "mk-ties":  # Hub inputs pinned to their commits (the staged one's are its stages)
            assert all(len(i["spec"].split("@")[1]) == 40 for i in recipe["inputs"]) and "@" in recipe["base"]["spec"]
        else:
            assert "Merge stages" in card and "soup-ab" in card
    ties = next(m for m in report.merges if m.spec.name == "mk-ties")
    assert ties.spec.method == "ties" and ties.repo_id.startswith("soup-org/ties-")
    # the pipeline's output is `hubsoup run`'s of the same config (the same pinned models)
    direct = tmp_path / "direct"
    run_config(TIES, str(direct), token=None, quiet=True)
    got = load_dir(ties.path)
    want = load_dir(str(direct))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    board = json.loads((tmp_path / "work" / "leaderboard" / "leaderboard.json").read_text())
    assert {r["recipe_hash"] for r in board["merges"]} == {m.recipe_hash for m in report.merges}
    assert all(r["status"] == "published" and r["scores"] for r in board["merges"])

    # again, with the work folder gone: nothing merged, nothing pushed (the names hold the pinned configs' ids)
    before = state(hub)
    import shutil

    shutil.rmtree(tmp_path / "work")
    report, out, events = run(path)
    assert report.exit_code == 0 and not [e for e in events if e[0] in ("merged", "pushed")], (events, out)
    models = lambda st: {k: v for k, v in st.items() if k[0] == "model"}  # noqa: E731
    assert models(state(hub)) == models(before)


def test_config_merges_without_evaluation_are_streamed_to_the_hub(hub, zoo, tmp_path):  # noqa: F811
    publish(hub, zoo, "base", "ft-a", "ft-b")
    hub.login("alice")
    path = _pipeline(tmp_path, [{"config": "ties.yml", "name": "mk-ties"}, {"config": "stages.yml"}], eval=None)
    report, out, events = run(path)
    assert report.exit_code == 0, out
    assert [m.status for m in report.merges] == ["published", "published"]
    # nothing of the final merges in the work folder: only the multi-stage config's earlier stage, as beside an output
    stages = [p for p in os.listdir(tmp_path / "work" / "merges")]
    assert len(stages) == 1 and stages[0].endswith(".stages") and os.listdir(tmp_path / "work" / "merges" /
                                                                             stages[0]) == ["soup-ab"]
    for m in report.merges:
        files = hub.files(m.repo_id)
        card = files["README.md"].decode()
        assert "license: apache-2.0" in card and "mergekit" in card and yaml.safe_load(
            files["hubsoup_recipe.yaml"])["hash"] == m.recipe_hash
        if m.spec.name != "mk-ties":
            assert "Merge stages" in card and "soup-ab" in card  # the final stage pushed, its card naming every stage


def test_a_config_merge_with_a_forbidden_license_is_refused(hub, zoo, tmp_path):  # noqa: F811
    publish(hub, zoo, "base", "ft-a", "ft-nc")
    hub.login("alice")
    (tmp_path / "nc.yml").write_text(TIES.replace("bob/ft-b", "bob/ft-nc"))
    path = _pipeline(tmp_path, [{"config": "nc.yml"}], license={"output": "apache-2.0"})
    report, out, events = run(path)
    [m] = report.merges
    assert m.status == "refused" and "may not be published under apache-2.0" in m.reason, m.reason
    assert soup_repos(hub) == {}


def test_config_merge_errors_name_the_key(tmp_path):
    (tmp_path / "ties.yml").write_text(TIES)
    (tmp_path / "recipe.yml").write_text("method: ties\n")
    good = {"base": "org/base", "merges": [{"config": "ties.yml"}], "push": {"namespace": "org"},
            "candidates": {"models": ["org/a"]}}
    for merges, push, msg in (
            ([{"config": "nope.yml"}], None, "'merges[0].config' 'nope.yml': no such file"),
            ([{"config": "recipe.yml"}], None, "is not a mergekit config"),
            ([{"config": "ties.yml", "method": "ties"}], None, "give 'config' alone"),
            ([{"combine": "pairs"}], None, "needs 'method'"),
            (None, {"namespace": "org", "name": "{method}-soup"}, "must contain {hash8} or {hash}")):
        data = {**good, **({"merges": merges} if merges else {}), **({"push": push} if push else {})}
        p = tmp_path / "p.yml"
        p.write_text(yaml.safe_dump(data))
        with pytest.raises(ParameterError) as e:
            load_pipeline(str(p))
        assert msg in str(e.value) and "\n" not in str(e.value), str(e.value)
    p = tmp_path / "p.yml"
    p.write_text(yaml.safe_dump({k: v for k, v in good.items() if k != "candidates"}))
    spec = load_pipeline(str(p)).merges[0]
    assert spec.method == "ties" and spec.text == TIES  # no candidates needed: the config names its models
    # the YAML text itself (a server's pipeline, hub_only: no file is read)
    from hubsoup.sources.access import scope

    inline = {**good, "merges": [{"config": TIES}]}
    with scope(hub_only=True):
        assert load_pipeline(inline).merges[0].text == TIES.strip()
        with pytest.raises(ParameterError, match="a hub_only run never reads"):
            load_pipeline({**good, "merges": [{"config": "ties.yml"}]})
