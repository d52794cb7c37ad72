"""Unattended merge pipelines (``hubsoup pipeline``) against the test Hub.

Three tiny Llama fine-tunes of ``alice/base`` are published by bob; the pipeline (the shipped
``examples/pipelines/pipeline.yml`` with the test Hub's names substituted) finds them through a
Hub query, merges, evaluates, selects and pushes to ``soup-org``, and writes a leaderboard.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import yaml

from hubsoup.cli import main
from hubsoup.errors import ParameterError
from hubsoup.public import local_path_in_file
from hubsoup.testing import make_base, make_finetune, save_tiny_tokenizer, write_card_metadata
from hubsoup.workflows.pipeline import load_pipeline, run_pipeline
from hubsoup.workflows.pipeline.licenses import combine

from paths import ROOT as REPO
EXAMPLE = os.path.join(REPO, "examples", "pipelines", "pipeline.yml")
# word-level text of the tiny test tokenizer (w0 .. w122): the example's real English text would be all [UNK]
EVAL_DATA = os.path.join(REPO, "tests", "fixtures", "pipeline", "eval-tiny-tokenizer.jsonl")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """A tiny Llama base with a tokenizer (apache-2.0) and fine-tunes of it."""
    root = tmp_path_factory.mktemp("pipeline-zoo")
    base = make_base("llama", str(root / "base"))
    save_tiny_tokenizer(base)
    write_card_metadata(base, license="apache-2.0")
    out = {"base": base}
    for i, name in enumerate(["ft-a", "ft-b", "ft-c", "ft-d", "ft-nc", "ft-gpl"], start=1):
        folder = make_finetune(base, str(root / name), seed=i)
        lic = {"ft-nc": "cc-by-nc-4.0", "ft-gpl": "gpl-3.0"}.get(name, "apache-2.0")
        write_card_metadata(folder, base_model="alice/base", license=lic)
        out[name] = folder
    bad = str(root / "ft-broken")
    shutil.copytree(out["ft-a"], bad)
    with open(os.path.join(bad, "model.safetensors"), "wb") as f:
        f.write(b"\x00" * 64 + b"not a safetensors file")
    out["ft-broken"] = bad
    gpt2 = make_base("gpt2", str(root / "gpt2"))
    write_card_metadata(gpt2, base_model="alice/base", license="apache-2.0")
    out["ft-gpt2"] = gpt2
    return out


def publish(hub, zoo, *names):
    shas = {}
    for name in names:
        repo = "alice/base" if name == "base" else f"bob/{name}"
        shas[name] = hub.seed(repo, zoo[name])
    return shas


def example(tmp_path, **changes) -> str:
    """The shipped example pipeline, pointed at the test Hub's repos; written to tmp_path/pipeline.yml."""
    with open(EXAMPLE, encoding="utf-8") as f:
        p = yaml.safe_load(f)
    p["base"] = "alice/base"
    p["candidates"] = {"query": {"base_model": "alice/base", "author": "bob", "limit": 10}}
    p["eval"]["tasks"] = [f"perplexity:{EVAL_DATA},text=text,name=sample"]
    p["eval"]["limit"] = 8
    p["push"]["namespace"] = "soup-org"
    p["leaderboard"]["repo"] = "soup-org/leaderboard"
    p["options"] = {}
    p["work_dir"] = str(tmp_path / "work")
    p["retry"] = {"attempts": 4, "base_wait": 0.01, "max_wait": 0.05}
    for k, v in changes.items():
        if v is None:
            p.pop(k, None)
        else:
            p[k] = v
    path = tmp_path / "pipeline.yml"
    path.write_text(yaml.safe_dump(p))
    return str(path)


def soup_repos(hub) -> dict[str, list[str]]:
    """soup-org's model repos -> commit titles (newest first)."""
    return {rid: [c.title for c in hub.history(rid)] for (t, rid) in hub.repos if t == "model" and rid.startswith("soup-org/")}


def state(hub) -> dict:
    return {(t, rid): hub.head(rid, repo_type=t) for (t, rid) in hub.repos}


def run(path, **kw):
    buf = io.StringIO()
    events = []
    report = run_pipeline(path, stream=buf, on_event=lambda kind, m: events.append((kind, m.label)), **kw)
    return report, buf.getvalue(), events


def recipe_hash(hub, repo_id) -> str:
    return yaml.safe_load(hub.files(repo_id)["hubsoup_recipe.yaml"])["hash"]


# ---- the whole round: merges, evals, selection, pushes, leaderboard; again: nothing new -------------


@pytest.mark.slow  # several pipeline runs (a subprocess for the kill)
def test_pipeline_run_rerun_and_new_candidate(hub, zoo, tmp_path, capsys):
    publish(hub, zoo, "base", "ft-a", "ft-b", "ft-c")
    hub.login("alice")
    path = example(tmp_path)
    assert main(["pipeline", path]) == 0
    out = capsys.readouterr().out
    # pairs of 3 (ties) + all 3 (task arithmetic) = 4 merges; the best 3 by perplexity are published
    repos = soup_repos(hub)
    assert len(repos) == 3, out
    for rid, titles in repos.items():
        assert len(titles) == 2 and titles[0].startswith("Upload ") and "recipe" in titles[0]  # one commit each
        files = hub.files(rid)
        assert {"model.safetensors", "README.md", "hubsoup_recipe.yaml", "eval_results.json"} <= set(files)
        card = files["README.md"].decode()
        assert "license: apache-2.0" in card and "perplexity" in card
        assert rid.split("/")[1].endswith(recipe_hash(hub, rid)[:8])  # name template {method}-{inputs_short}-{hash8}
        for name, data in files.items():  # its eval data is a local file: by name and hash only (issue 48, item 2)
            assert local_path_in_file(name, data) is None, (rid, name)
    board = json.loads((tmp_path / "work" / "leaderboard" / "leaderboard.json").read_text())
    rows = board["merges"]
    assert [r["status"] for r in rows].count("published") == 3 and [r["status"] for r in rows].count("not selected") == 1
    pub = [r for r in rows if r["status"] == "published"]
    rejected = [r for r in rows if r["status"] == "not selected"][0]
    assert max(r["scores"]["sample/perplexity"] for r in pub) <= rejected["scores"]["sample/perplexity"]
    for r in rows:
        assert all("@" in i and len(i.split("@")[1]) == 40 for i in r["inputs"])  # inputs@SHA
        assert r["method"] in ("ties", "task_arithmetic") and r["recipe_hash"]
    assert {r["url"] for r in pub} == {f"{hub.endpoint}/{rid}" for rid in repos}
    md = (tmp_path / "work" / "leaderboard" / "leaderboard.md").read_text()
    assert "| model | status |" in md and "sample/perplexity" in md
    remote = json.loads(hub.files("soup-org/leaderboard", repo_type="dataset")["leaderboard.json"])
    assert remote == board
    for name, data in hub.files("soup-org/leaderboard", repo_type="dataset").items():
        assert local_path_in_file(name, data) is None, name

    # again: nothing new on the Hub, nothing merged (the rejected merge is remembered by the Hub's leaderboard)
    before = state(hub)
    shutil.rmtree(tmp_path / "work")  # the Hub, not a local file, says what is done
    report, out, events = run(path)
    assert report.exit_code == 0 and state(hub) == before, out
    assert not [e for e in events if e[0] in ("merged", "pushed")], events
    assert "0 pushed, 3 already published" in out

    # idempotent by recipe hash, whatever the repo names: another name template finds the same merges
    p = yaml.safe_load(open(path))
    p["push"]["name"] = "soup-{hash8}"
    other = tmp_path / "other.yml"
    other.write_text(yaml.safe_dump(p))
    report, out, events = run(str(other))
    models = lambda st: {k: v for k, v in st.items() if k[0] == "model"}  # noqa: E731 (the leaderboard names change)
    assert models(state(hub)) == models(before) and not [e for e in events if e[0] in ("merged", "pushed")]

    # a fourth candidate: only the merges that involve it are made
    publish(hub, zoo, "ft-d")
    report, out, events = run(path)
    merged = [label for kind, label in events if kind == "merged"]
    assert merged and all("bob/ft-d" in label for label in merged), merged
    assert len(merged) == 4  # 3 new pairs + the new all-4 merge
    assert report.exit_code == 0
    assert len(soup_repos(hub)) >= 3
    for rid, titles in soup_repos(hub).items():
        assert len(titles) == 2  # no repo got a second commit
    hashes = [recipe_hash(hub, rid) for rid in soup_repos(hub)]
    assert len(hashes) == len(set(hashes))


# ---- failures are isolated --------------------------------------------------------------------------


def test_broken_candidates_are_reported_and_the_rest_is_done(hub, zoo, tmp_path, capsys):
    publish(hub, zoo, "base", "ft-a", "ft-b", "ft-broken", "ft-gpt2")
    hub.seed("bob/ft-private", zoo["ft-c"], private=True)
    hub.login("alice")
    path = example(tmp_path, select=None, merges=[{"method": "ties", "params": {"density": 0.5}, "combine": "pairs"},
                                                  {"method": "linear", "combine": "all"}],
                   candidates={"query": {"author": "bob"}, "models": ["bob/ft-private", "bob/no-such-model"]})
    rc = main(["pipeline", path])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "candidate bob/no-such-model" in out and "not found" in out
    assert "candidate bob/ft-private" in out  # private (401/404): reported, not fatal
    assert "candidate bob/ft-gpt2" in out, out
    assert "bob/ft-broken" in out
    repos = soup_repos(hub)
    # ties(ft-a, ft-b) and the all-merge without the broken candidate are published
    inputs = sorted(tuple(i["repo_id"] for i in yaml.safe_load(hub.files(r)["hubsoup_recipe.yaml"])["inputs"])
                    for r in repos)
    assert inputs == [("bob/ft-a", "bob/ft-b"), ("bob/ft-a", "bob/ft-b")], out
    assert sorted(yaml.safe_load(hub.files(r)["hubsoup_recipe.yaml"])["method"] for r in repos) == ["linear", "ties"]
    board = json.loads((tmp_path / "work" / "leaderboard" / "leaderboard.json").read_text())
    failed = {c["repo_id"] for c in board["candidates"] if c["status"] == "failed"}
    assert failed == {"bob/ft-broken", "bob/ft-gpt2", "bob/ft-private", "bob/no-such-model"}
    assert str(tmp_path) not in json.dumps(board)  # no local path on a published leaderboard
    assert "soup-org/leaderboard" in {rid for (t, rid) in hub.repos if t == "dataset"}


# ---- a crash loses only the merge in progress -----------------------------------------------------------


@pytest.mark.slow  # several pipeline runs (a subprocess for the kill)
def test_kill_mid_run_then_rerun_completes_without_duplicates(hub, zoo, tmp_path):
    publish(hub, zoo, "base", "ft-a", "ft-b", "ft-c")
    token = hub.login("alice")
    path = example(tmp_path, select=None)
    marker = tmp_path / "killed"
    env = {**os.environ, "HF_TOKEN": token, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "pipeline_kill_helper.py"), path, str(marker)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert marker.exists()
    assert len(soup_repos(hub)) == 1  # the first merge was published, the second died while being written
    merges = tmp_path / "work" / "merges"
    assert any(n.startswith(".") for n in os.listdir(merges))  # its temporary output is left behind

    report, out, events = run(path)
    assert report.exit_code == 0, out
    repos = soup_repos(hub)
    assert len(repos) == 4  # 3 pairs + all
    assert all(len(titles) == 2 for titles in repos.values())  # one commit each: no duplicate push
    hashes = [recipe_hash(hub, r) for r in repos]
    assert len(set(hashes)) == 4
    assert len([e for e in events if e[0] == "pushed"]) == 3
    assert not any(n.startswith(".") for n in os.listdir(merges))  # the crashed run's temporary output is gone


# ---- licenses --------------------------------------------------------------------------------------


def test_license_table():
    assert combine([("base", "apache-2.0"), ("a", "mit")]).license == "apache-2.0"
    assert combine([("base", "mit"), ("a", "apache-2.0")]).license == "apache-2.0"
    assert combine([("base", "apache-2.0"), ("a", "cc-by-nc-4.0")]).license == "cc-by-nc-4.0"
    assert combine([("base", "llama3"), ("a", "mit")]).license == "llama3"
    assert combine([("base", "lgpl-3.0"), ("a", "gpl-3.0")]).license == "gpl-3.0"
    bad = combine([("base", "apache-2.0"), ("a", "cc-by-nc-4.0")], output="apache-2.0")
    assert not bad.ok and "a is licensed cc-by-nc-4.0 (non-commercial)" in bad.reason
    assert not combine([("base", "gpl-3.0"), ("a", "cc-by-nc-4.0")]).ok
    assert not combine([("base", "llama3"), ("a", "gemma")]).ok
    assert combine([("base", "apache-2.0"), ("a", None)]).unlicensed == ["a"]


def test_incompatible_licenses_are_refused(hub, zoo, tmp_path):
    publish(hub, zoo, "base", "ft-a", "ft-nc", "ft-gpl")
    hub.login("alice")
    merges = [{"method": "linear", "combine": "pairs"}]
    # publishing under apache-2.0: every merge with the non-commercial or the GPL input is refused
    path = example(tmp_path, select=None, merges=merges, license={"output": "apache-2.0"})
    report, out, events = run(path)
    assert report.exit_code == 0
    refused = report.by_status("refused")
    assert len(refused) == 3 and all("may not be published under apache-2.0" in m.reason for m in refused)
    assert soup_repos(hub) == {}
    # the licenses' own choice: ft-a + ft-nc is published non-commercial; nc + gpl cannot be combined
    path = example(tmp_path, select=None, merges=merges)
    report, out, events = run(path)
    by_inputs = {tuple(sorted(i.repo_id for i in m.inputs)): m for m in report.merges}
    assert by_inputs[("bob/ft-a", "bob/ft-nc")].status == "published"
    assert by_inputs[("bob/ft-a", "bob/ft-gpl")].status == "published"  # apache-2.0 may go into GPLv3
    assert "license: cc-by-nc-4.0" in hub.files(by_inputs[("bob/ft-a", "bob/ft-nc")].repo_id)["README.md"].decode()
    assert "license: gpl-3.0" in hub.files(by_inputs[("bob/ft-a", "bob/ft-gpl")].repo_id)["README.md"].decode()
    nc_gpl = by_inputs[("bob/ft-gpl", "bob/ft-nc")]
    assert nc_gpl.status == "refused" and "cannot be combined" in nc_gpl.reason
    assert len(soup_repos(hub)) == 2
    # allow_mix publishes it anyway, the card naming no license
    path = example(tmp_path, select=None, merges=merges, license={"allow_mix": True})
    report, out, events = run(path)
    assert [e for e in events if e[0] == "pushed"] == [("pushed", "linear(bob/ft-gpl, bob/ft-nc)")]
    assert len(soup_repos(hub)) == 3


# ---- dry run ----------------------------------------------------------------------------------------


def test_dry_run_prints_the_plan_and_changes_nothing(hub, zoo, tmp_path, capsys):
    publish(hub, zoo, "base", "ft-a", "ft-b", "ft-c")
    hub.login("alice")
    path = example(tmp_path)
    before = state(hub)
    n_requests = len(hub.requests)
    assert main(["pipeline", path, "--dry-run", "--token-env", "HF_TOKEN"]) == 0
    out = capsys.readouterr().out
    assert "merges: 4 to do, 0 already published" in out
    assert out.count("  to do ") == 4 and "soup-org/ties-ft-a-ft-b-" in out
    size = os.path.getsize(os.path.join(zoo["ft-a"], "model.safetensors"))
    assert f"download: {4 * size / 1e3:.1f} kB of weights" in out  # base + 3 candidates
    assert state(hub) == before
    new = hub.requests[n_requests:]
    assert not [r for r in new if r["path"].endswith(".safetensors")]  # no weights downloaded
    assert not [r for r in new if r["method"] in ("POST", "PUT", "DELETE") and "paths-info" not in r["path"]]
    assert not (tmp_path / "work" / "merges").exists()
    # after a real run the dry run says what is published where
    assert main(["pipeline", path]) == 0
    capsys.readouterr()
    assert main(["pipeline", path, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "0 to do, 3 already published" in out and "already published at http" in out
    assert "not selected on an earlier run" in out
    rc = main(["pipeline", path, "--token-env", "NO_SUCH_VARIABLE"])
    assert rc == 2 and "NO_SUCH_VARIABLE" in capsys.readouterr().err


def test_dry_run_shows_no_third_party_bars(hub, zoo, tmp_path, capfd):
    """Issue 48, item 6: reading the evaluation data for the plan prints no datasets bars ("Generating
    validation split"); data never read before (a cached one would print none anyway)."""
    publish(hub, zoo, "base", "ft-a", "ft-b")
    hub.login("alice")
    data = tmp_path / "fresh.jsonl"
    data.write_text(open(EVAL_DATA, encoding="utf-8").read() + json.dumps({"text": f"w1 w2 {tmp_path.name}"}) + "\n")
    path = example(tmp_path)
    p = yaml.safe_load(open(path))
    p["eval"]["tasks"] = [f"perplexity:{data},text=text,name=sample"]
    (tmp_path / "pipeline.yml").write_text(yaml.safe_dump(p))
    capfd.readouterr()
    assert main(["pipeline", path, "--dry-run"]) == 0
    err = capfd.readouterr().err
    assert "Generating" not in err and "examples/s" not in err, err


# ---- rate limits and server errors --------------------------------------------------------------------


def test_rate_limits_and_server_errors_are_retried(hub, zoo, tmp_path):
    publish(hub, zoo, "base", "ft-a", "ft-b")
    hub.login("alice")
    path = example(tmp_path, select=None, merges=[{"method": "ties", "combine": "all"}])
    hub.fail_next(2, 503, method="GET", path=r"^/api/models/bob/ft-a/revision/")
    hub.fail_next(1, 429, method="GET", path=r"^/api/models$", headers={"Retry-After": "0"})
    hub.fail_commits(2, status=429)
    hub.fail_next(1, 502, path=r"/resolve/.*model\.safetensors$")  # GET, or HEAD when cached
    report, out, events = run(path)
    assert report.exit_code == 0, out
    assert hub.pending_failures == 0
    [rid] = soup_repos(hub)
    assert len(soup_repos(hub)[rid]) == 2
    assert [r["status"] for r in hub.calls("POST", r"/commit/")].count(429) == 2
    # a failure that does not go away is reported after the bounded retries, and the run goes on
    hub.fail_next(50, 503, method="GET", path=r"^/api/models/bob/ft-b/revision/")
    report, out, events = run(path)
    assert report.exit_code == 1 and "bob/ft-b" in out and "server error 503" in out
    assert len(hub.calls("GET", r"^/api/models/bob/ft-b/revision/")) < 20


# ---- the file -----------------------------------------------------------------------------------------


def test_pipeline_file_errors_name_the_key(tmp_path):
    good = {"base": "org/base", "candidates": {"models": ["org/a"]}, "merges": [{"method": "ties"}],
            "push": {"namespace": "org"}}
    assert load_pipeline(good).merges[0].combine == "all"
    assert load_pipeline(EXAMPLE).select.top_k == 3  # the shipped example is valid
    cases = [
        ({**good, "merge": []}, "unknown key 'merge'"),
        ({**good, "merges": [{"method": "ties", "parms": {}}]}, "unknown key 'merges[0].parms' (did you mean 'params'?)"),
        ({**good, "candidates": {"query": {"base_model": "x/y", "limt": 3}}}, "unknown key 'candidates.query.limt'"),
        ({**good, "merges": [{"method": "ties", "combine": "triples"}]}, "merges[0].combine"),
        ({**good, "merges": [{"method": "no-such-method"}]}, "merges[0].method"),
        ({**good, "push": {"namespace": "org", "name": "{method}-{nope}"}}, "unknown field '{nope}'"),
        ({**good, "select": {"top_k": 2}}, "give 'eval.tasks' too"),
        ({k: v for k, v in good.items() if k != "push"}, "'push' is missing"),
        ({**good, "push": {"namespace": "org", "private": "yes"}}, "'push.private' must be true or false"),
        ({**good, "options": {"overwrite": True}}, "unknown key 'options.overwrite'"),
    ]
    for data, msg in cases:
        with pytest.raises(ParameterError, match=None) as e:
            load_pipeline(data)
        assert msg in str(e.value), (msg, str(e.value))
    p = tmp_path / "p.yml"
    p.write_text(yaml.safe_dump({**good, "merges": [{"method": "ties", "combine": {"with": "org/b"}}]}))
    m = load_pipeline(str(p)).merges[0]
    assert (m.combine, m.partner) == ("with", "org/b")


def test_a_mergekit_config_given_as_pipeline_says_what_runs_it(tmp_path):
    """A mergekit config (one document, or a mergekit-multi stream of stages) given as the pipeline file is refused
    in one line naming `hubsoup run` and the pipeline's `merges: [{config: FILE}]` (tests/workflows/pipeline/test_pipeline_mergekit.py)."""
    one = "merge_method: linear\nmodels: [{model: org/a}, {model: org/b}]\n"
    for text, kind in ((one, "mergekit config, not a pipeline"),
                       ("name: s1\n" + one + "---\nmerge_method: linear\nmodels: [{model: s1}, {model: org/c}]\n",
                        "mergekit config (mergekit-multi stages), not a pipeline")):
        p = tmp_path / "cfg.yml"
        p.write_text(text)
        with pytest.raises(ParameterError) as e:
            load_pipeline(str(p))
        assert kind in str(e.value) and f"hubsoup run {p} OUT_DIR" in str(e.value) and "\n" not in str(e.value)
        assert "merges as {config: FILE}" in str(e.value)  # what a pipeline takes instead
