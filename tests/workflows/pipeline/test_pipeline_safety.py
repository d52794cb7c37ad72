"""The pipeline with hostile or unlucky candidates, Hubs and runs (issues 31 and 32), on the test Hub.

Licenses as the Hub writes them; private and gated candidates; non-finite scores and overflowing
weights; tampered cached merges; malformed leaderboards and eval data; two runs at once; kills
during merges and pushes; an unchanged leaderboard on a Hub with and without file hashes.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys

import pytest
import yaml
from tests.workflows.pipeline.test_pipeline import (EVAL_DATA, REPO, example, publish, recipe_hash, run,  # noqa: F401
                                                    soup_repos, state, zoo)

from hubsoup.cli import main
from hubsoup.testing import write_card_metadata
from hubsoup.workflows.pipeline.licenses import License, combine, forbids_derivatives, read

LINEAR_PAIRS = [{"method": "linear", "combine": "pairs"}]


def variant(zoo, tmp_path_factory, name: str, source: str = "ft-a", **card) -> str:
    """A copy of a zoo fine-tune with another card (license forms) under ``name``."""
    folder = str(tmp_path_factory.mktemp(name) / name)
    shutil.copytree(zoo[source], folder)
    write_card_metadata(folder, base_model="alice/base", **card)
    return folder


def inputs_of(hub, repo_id) -> list[str]:
    return sorted(i["repo_id"] for i in yaml.safe_load(hub.files(repo_id)["hubsoup_recipe.yaml"])["inputs"])


def card_meta(hub, repo_id) -> dict:
    text = hub.files(repo_id)["README.md"].decode()
    return yaml.safe_load(text.split("---")[1])


# ---- licenses as the Hub writes them -------------------------------------------------------------------


def test_licenses_are_read_as_the_hub_writes_them():
    assert read({"license": "Apache-2.0"}).ids == ("apache-2.0",)
    assert read({"license": ["mit", "apache-2.0"]}).ids == ("mit", "apache-2.0")
    other = read({"license": "other", "license_name": "acme-model-license", "license_link": "https://x/LICENSE"})
    assert other.ids == ("other:acme-model-license",) and other.link == "https://x/LICENSE"
    assert read({"license": "other", "license_link": "https://x/LICENSE"}).ids == ("other:https://x/license",)
    for card, why in [({}, "names no license"), ({"license": []}, "names no license"),
                      ({"license": {"name": "mit"}}, "mapping"), ({"license": ["mit", 3]}, "3"),
                      ({"license": "other"}, "without license_name"), ({"license": "unknown"}, "'unknown'")]:
        lic = read(card)
        assert lic.ids == () and why in lic.error, (card, lic)
    for nd in ("cc-by-nd-4.0", "cc-by-nc-nd-4.0", "cc-by-nc-nd-3.0", "other:acme-nd", "other:no derivatives"):
        assert forbids_derivatives(nd), nd
    for ok in ("cc-by-nc-4.0", "cc-by-sa-4.0", "apache-2.0", "other:acme-model-license", "llama3"):
        assert not forbids_derivatives(ok), ok
    # ND or unreadable anywhere (an input or the base): refused, as a failure, whatever the options
    for lic in ("cc-by-nc-nd-4.0", read({"license": {"name": "mit"}}), None, read({"license": ["cc-by-nd-4.0"]})):
        d = combine([("base", "apache-2.0"), ("org/x", lic)])
        assert not d.ok and d.blocking and d.license is None and "org/x" in d.reason, (lic, d)
        assert not combine([("base", "apache-2.0"), ("org/x", lic)], output="cc-by-nc-nd-4.0").ok
    d = combine([("base", None), ("org/x", "apache-2.0")])
    assert not d.ok and d.blocking and "base: license cannot be read" in d.reason
    # never defaulted: a list license counts every entry; `other` goes only into itself, carrying its name
    assert combine([("base", "apache-2.0"), ("org/x", read({"license": ["mit", "llama3"]}))]).license == "llama3"
    d = combine([("base", "apache-2.0"), ("org/x", other)])
    assert (d.license, d.card_license, d.license_name, d.license_link) == (
        "other:acme-model-license", "other", "acme-model-license", "https://x/LICENSE")
    assert combine([("base", "apache-2.0"), ("a", "cc-by-nc-3.0"), ("b", "cc-by-nc-sa-3.0")]).license == "cc-by-nc-sa-3.0"
    assert not combine([("base", "apache-2.0"), ("a", "cc-by-nc-3.0"), ("b", "cc-by-nc-sa-4.0")]).ok
    assert str(License(("mit", "apache-2.0"))) == "mit + apache-2.0"


@pytest.mark.slow  # a pipeline run with 10 merges
def test_license_forms_on_the_hub_nd_and_unreadable_refused(hub, zoo, tmp_path, tmp_path_factory):
    forms = {
        "ft-nd": {"license": "cc-by-nc-nd-4.0"},
        "ft-map": {"license": {"name": "apache-2.0"}},
        "ft-none": {},
        "ft-list": {"license": ["mit", "apache-2.0"]},
        "ft-other": {"license": "other", "license_name": "acme-model-license",
                     "license_link": "https://example.org/acme/LICENSE"},
    }
    publish(hub, zoo, "base", "ft-a")
    for i, (name, card) in enumerate(forms.items()):
        hub.seed(f"bob/{name}", variant(zoo, tmp_path_factory, name, ["ft-b", "ft-c", "ft-d", "ft-b", "ft-c"][i],
                                        **card))
    hub.login("alice")
    path = example(tmp_path, select=None, eval=None, merges=LINEAR_PAIRS + [{"method": "linear", "combine": "all"}])
    report, out, events = run(path)
    assert report.exit_code == 1, out
    failing = {c.repo_id: c.error for c in report.candidates if c.error}
    assert set(failing) == {"bob/ft-nd", "bob/ft-map", "bob/ft-none"}, failing
    assert "forbid derivatives (ND)" in failing["bob/ft-nd"]
    assert "mapping" in failing["bob/ft-map"] and "names no license" in failing["bob/ft-none"]
    published = {tuple(inputs_of(hub, r)): card_meta(hub, r) for r in soup_repos(hub)}
    # 3 usable candidates: 3 pairs + all; none of them holds a refused candidate
    assert len(published) == 4 and not any(set(k) & set(failing) for k in published), published
    assert published[("bob/ft-a", "bob/ft-list")]["license"] == "apache-2.0"
    for key, meta in published.items():
        if "bob/ft-other" in key:  # the output license is derived from every input: never the base's by default
            assert (meta["license"], meta["license_name"], meta["license_link"]) == (
                "other", "acme-model-license", "https://example.org/acme/LICENSE"), (key, meta)
    # an ND base refuses every merge (a failure, exit status 1); allow_mix does not change that
    hub.seed("alice/base", variant(zoo, tmp_path_factory, "base-nd", "base", license="cc-by-nd-4.0"))
    before = state(hub)
    path = example(tmp_path, select=None, eval=None, merges=LINEAR_PAIRS, license={"allow_mix": True},
                   candidates={"models": ["bob/ft-a", "bob/ft-list"]})
    report, out, events = run(path)
    assert report.exit_code == 1 and [m.status for m in report.merges] == ["refused"], out
    assert "alice/base is licensed cc-by-nd-4.0, whose terms forbid derivatives" in out
    assert {k: v for k, v in state(hub).items() if k[0] == "model"} == {k: v for k, v in before.items()
                                                                        if k[0] == "model"}


# ---- private and gated candidates ---------------------------------------------------------------------


@pytest.mark.slow  # two pipeline runs
def test_private_and_gated_candidates_stay_out_of_public_merges(hub, zoo, tmp_path):
    publish(hub, zoo, "base", "ft-a", "ft-b")
    hub.seed("alice/ft-secret", zoo["ft-c"], private=True)  # alice's own: her token (the run's) can read it
    hub.seed("bob/ft-gated", zoo["ft-d"])
    hub.repos[("model", "bob/ft-gated")].gated = "manual"
    hub.login("alice")
    query = {"query": {"base_model": "alice/base", "limit": 10}}
    path = example(tmp_path, select=None, eval=None, merges=LINEAR_PAIRS, candidates=query)
    report, out, events = run(path)
    assert report.exit_code == 0, out  # left out by policy: reported, not a failure
    left = {c.repo_id: c.skipped for c in report.candidates if c.skipped}
    assert set(left) == {"alice/ft-secret", "bob/ft-gated"} and "allow_private_inputs" in left["bob/ft-gated"]
    assert "left out: candidate alice/ft-secret: private repo" in out
    assert [inputs_of(hub, r) for r in soup_repos(hub)] == [["bob/ft-a", "bob/ft-b"]]
    board = hub.files("soup-org/leaderboard", repo_type="dataset")
    assert b"ft-secret" not in board["leaderboard.json"] and b"ft-secret" not in board["README.md"]
    assert json.loads(board["leaderboard.json"])["private_candidates"] == 1
    assert b"bob/ft-gated" in board["README.md"]  # a gated repo's name is public
    # explicitly allowed: merged and published, and the card says so
    path = example(tmp_path, select=None, eval=None, merges=LINEAR_PAIRS, candidates=query,
                   allow_private_inputs=True)
    report, out, events = run(path)
    assert report.exit_code == 0, out
    repos = {tuple(inputs_of(hub, r)): r for r in soup_repos(hub)}
    assert len(repos) == 6
    card = hub.files(repos[("alice/ft-secret", "bob/ft-gated")])["README.md"].decode()
    assert "Private or gated inputs" in card and "`alice/ft-secret` (private)" in card and "(gated)" in card
    assert "allow_private_inputs: true" in card
    assert "Private or gated inputs" not in hub.files(repos[("bob/ft-a", "bob/ft-b")])["README.md"].decode()


def test_private_base_is_refused_for_public_merges(hub, zoo, tmp_path, capsys):
    hub.seed("alice/base", zoo["base"], private=True)
    publish(hub, zoo, "ft-a", "ft-b")
    hub.login("alice")
    path = example(tmp_path, select=None, eval=None, merges=LINEAR_PAIRS)
    assert main(["pipeline", path]) == 2
    err = capsys.readouterr().err
    assert "base 'alice/base': private repo: not merged into public repos" in err and "allow_private_inputs" in err
    assert soup_repos(hub) == {}


# ---- scores that are not numbers, weights that overflow ---------------------------------------------------


@pytest.fixture(scope="module")
def huge(zoo, tmp_path_factory):
    """ft-b with every float tensor times 1e30: finite weights whose merges' perplexity is not."""
    from safetensors.torch import load_file, save_file

    folder = str(tmp_path_factory.mktemp("huge") / "ft-huge")
    shutil.copytree(zoo["ft-b"], folder)
    path = os.path.join(folder, "model.safetensors")
    tensors = {k: (v * 1e30 if v.is_floating_point() else v) for k, v in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


@pytest.mark.slow  # a pipeline run with 6 merges and evaluations
def test_non_finite_scores_never_win_and_the_rest_is_published(hub, zoo, huge, tmp_path):
    publish(hub, zoo, "base", "ft-a", "ft-c", "ft-d")
    hub.seed("bob/ft-huge", huge)
    hub.login("alice")
    # in bfloat16 (the shipped example's dtype) the merges with ft-huge have losses that overflow
    path = example(tmp_path, merges=LINEAR_PAIRS, select={"metric": "perplexity", "top_k": 1},
                   options={"dtype": "bfloat16"})
    report, out, events = run(path)  # no traceback: the run ends, with its leaderboard
    assert report.exit_code == 1, out
    failed = report.by_status("failed")
    assert len(failed) == 3 and all("bob/ft-huge" in [i.repo_id for i in m.inputs] for m in failed), out
    assert all("constant logits" in m.reason or "non-finite" in m.reason for m in failed), [m.reason for m in failed]
    [rid] = soup_repos(hub)  # top_k 1 among the finite scores
    assert "bob/ft-huge" not in inputs_of(hub, rid)
    finite = [m for m in report.merges if m.score is not None]
    assert len(finite) == 3 and max(finite, key=lambda m: -m.score).repo_id == rid
    board = json.loads((tmp_path / "work" / "leaderboard" / "leaderboard.json").read_text())  # valid JSON
    rows = {r["status"] for r in board["merges"]}
    assert rows == {"published", "not selected", "failed"}
    assert json.loads(hub.files("soup-org/leaderboard", repo_type="dataset")["leaderboard.json"]) == board
    assert "NaN" not in json.dumps(board) and "Infinity" not in json.dumps(board)


@pytest.mark.slow  # a pipeline run with 3 merges and evaluations
def test_nan_and_inf_perplexity_are_failures_not_winners(hub, zoo, tmp_path, monkeypatch):
    import hubsoup.eval.run as eval_run

    publish(hub, zoo, "base", "ft-a", "ft-c", "ft-d")
    hub.login("alice")
    original, calls = eval_run._perplexity, []

    def perplexity(*args, **kwargs):  # the 2nd and 3rd merges' evaluations come out NaN and inf
        res = original(*args, **kwargs)
        calls.append(1)
        if len(calls) > 1:
            res.metrics["perplexity"] = [math.nan, math.inf][len(calls) - 2]
        return res

    monkeypatch.setattr(eval_run, "_perplexity", perplexity)
    path = example(tmp_path, merges=LINEAR_PAIRS, select={"metric": "perplexity", "top_k": 1})
    report, out, events = run(path)
    assert report.exit_code == 1 and len(calls) == 3, out
    first, *bad = sorted(report.merges, key=lambda m: m.label)
    assert [m.status for m in bad] == ["failed", "failed"]
    assert "non-finite sample/perplexity (nan)" in bad[0].reason and "(inf)" in bad[1].reason
    assert first.status == "published" and list(soup_repos(hub)) == [first.repo_id]
    rows = json.loads(hub.files("soup-org/leaderboard", repo_type="dataset")["leaderboard.json"])["merges"]
    assert sorted(r["status"] for r in rows) == ["failed", "failed", "published"]
    assert all(r["scores"] == {"sample/perplexity": None} for r in rows if r["status"] == "failed")


def test_stored_non_finite_scores_are_never_ranked():
    from hubsoup.workflows.pipeline.hubio import check_row, flatten_scores, non_finite

    scores = flatten_scores([{"task": "t", "metrics": {"perplexity": float("nan"), "accuracy": float("inf"),
                                                       "f1": "0.9", "tokens": 10, "ok": 0.5}}])
    assert non_finite(scores) == ["t/accuracy", "t/f1", "t/perplexity"] and scores["t/ok"] == 0.5
    row = check_row({"recipe_hash": "ab" * 32, "status": "not selected", "scores": {"t/perplexity": None},
                     "score": None}, "x")
    assert math.isnan(row["scores"]["t/perplexity"])


# ---- the work folder is a verified cache ------------------------------------------------------------------


@pytest.mark.slow  # three pipeline runs
def test_tampered_cached_merges_are_never_pushed(hub, zoo, tmp_path):
    from safetensors.torch import load_file, save_file

    publish(hub, zoo, "base", "ft-a", "ft-b", "ft-c")
    hub.login("alice")
    # merges written whole to the work folder before their push (not streamed to the Hub: push.stream false)
    path = example(tmp_path, select=None, eval=None, merges=LINEAR_PAIRS, push={"namespace": "soup-org", "stream": False})
    hub.fail_commits(100, status=403)  # every push fails: the merges stay in the work folder only
    report, out, events = run(path)
    assert report.exit_code == 1 and all(t == ["initial commit"] for t in soup_repos(hub).values()), out
    hub.clear_failures()
    merges = tmp_path / "work" / "merges"
    folders = sorted(p for p in merges.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert len(folders) == 3 and all((merges / f"{p.name}.manifest.json").is_file() for p in folders)

    def tamper(folder):
        f = os.path.join(folder, "model.safetensors")
        t = load_file(f)
        name = sorted(t)[0]
        t[name] = t[name] + 1.0
        save_file(t, f, metadata={"format": "pt"})

    good = (folders[0] / "model.safetensors").read_bytes()
    stamps = {p.name: os.stat(p / "model.safetensors").st_mtime_ns for p in folders[1:]}
    tamper(folders[0])
    (folders[1] / "README.md").write_text("---\nlicense: mit\n---\nnot the card\n")  # the card is rendered again
    report, out, events = run(path)
    assert report.exit_code == 0, out
    assert "stale" in out and "differs from its manifest (model.safetensors changed)" in out
    assert out.count("stale ") == 1 and len([e for e in events if e[0] == "pushed"]) == 3
    # only the tampered merge was made again; the others were verified and reused as they were
    assert {p.name: os.stat(p / "model.safetensors").st_mtime_ns for p in folders[1:]} == stamps
    assert (folders[0] / "model.safetensors").read_bytes() == good
    pushed = {recipe_hash(hub, r)[:16]: hub.files(r) for r in soup_repos(hub)}
    assert pushed[folders[0].name]["model.safetensors"] == good  # the merge made again, not the tampered file
    assert b"not the card" not in pushed[folders[1].name]["README.md"]
    assert "license: apache-2.0" in pushed[folders[1].name]["README.md"].decode()

    # tampered between its merge and its push (select.top_k pushes once every merge is scored): not pushed
    shutil.rmtree(tmp_path / "work")
    hub.reset()
    publish(hub, zoo, "base", "ft-a", "ft-b", "ft-c")
    path = example(tmp_path, merges=LINEAR_PAIRS, select={"metric": "perplexity", "top_k": 3})
    victims = []

    def on_event(kind, m):
        if kind == "merged" and not victims:
            victims.append(m.repo_id)
            tamper(m.path)

    from hubsoup.workflows.pipeline import run_pipeline

    report = run_pipeline(path, on_event=on_event, stream=open(os.devnull, "w"))
    [victim] = [m for m in report.merges if m.repo_id == victims[0]]
    assert victim.status == "failed" and "not pushed" in victim.reason and "model.safetensors changed" in victim.reason
    assert report.exit_code == 1 and len(soup_repos(hub)) == 2 and victims[0] not in soup_repos(hub)


def test_merges_pushed_without_evaluation_are_streamed_and_a_failed_push_resumes(hub, zoo, tmp_path):
    publish(hub, zoo, "base", "ft-a", "ft-b", "ft-c")
    hub.login("alice")
    path = example(tmp_path, select=None, eval=None, merges=LINEAR_PAIRS)
    before = hub.lfs_uploaded_objects
    hub.fail_commits(1, status=403)  # the first merge's one commit is refused (not a transient failure)
    report, out, events = run(path)
    assert report.exit_code == 1 and sorted(m.status for m in report.merges) == ["failed", "published", "published"]
    merges = tmp_path / "work" / "merges"
    assert [p for p in os.listdir(merges) if not p.startswith(".hubsoup-push-")] == []  # no merge kept whole
    assert [p for p in os.listdir(merges)] == []  # nor a temporary folder or lock
    assert hub.lfs_uploaded_objects - before == 3  # each merge's shard went up once
    failed = next(m for m in report.merges if m.status == "failed")
    assert soup_repos(hub)[failed.repo_id] == ["initial commit"]  # nothing committed there
    report, out, events = run(path)  # the rerun resumes: the failed merge's shard is not uploaded again
    assert report.exit_code == 0, out
    assert hub.lfs_uploaded_objects - before == 3 and all(len(t) == 2 for t in soup_repos(hub).values())
    assert [e[0] for e in events].count("pushed") == 1
    card = hub.files(failed.repo_id)["README.md"].decode()
    assert "license: apache-2.0" in card and "hubsoup pipeline" in hub.history(failed.repo_id)[0].title


# ---- malformed inputs of the run itself: one clear error, before anything is done --------------------------


@pytest.mark.parametrize("board, where", [
    ({"merges": [{"recipe_hash": "ab" * 32, "status": "not selected", "scores": "abc"}]}, "merges[0].scores"),
    ({"merges": [{"recipe_hash": "ab" * 32, "status": "published", "score": "9"}]}, "merges[0].score"),
    ({"merges": [{"recipe_hash": 7, "status": "published"}]}, "merges[0].recipe_hash"),
    ({"merges": ["row"]}, "merges[0].(row)"),
    ({"merges": {"a": 1}}, "'merges' is a list"),
    ("{not json", "not valid JSON"),
    # issue 44: someone's own file of that name was overwritten; it is kept and the run stops
    ({"title": "our team's board", "rows": [1, 2]}, "has no 'merges': not a pipeline's leaderboard"),
    ([1, 2], "must be a mapping"),
])
def test_malformed_leaderboard_is_a_clear_error_before_anything(hub, zoo, tmp_path, capsys, board, where):
    publish(hub, zoo, "base", "ft-a", "ft-b")
    raw = board if isinstance(board, str) else json.dumps(board)
    hub.seed("soup-org/leaderboard", {"leaderboard.json": raw}, repo_type="dataset")
    commits = len(hub.history("soup-org/leaderboard", repo_type="dataset"))
    hub.login("alice")
    path = example(tmp_path, select=None, eval=None, merges=LINEAR_PAIRS)
    assert main(["pipeline", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: leaderboard soup-org/leaderboard (leaderboard.json)") and where in err, err
    assert "fix or delete" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert soup_repos(hub) == {} and not (tmp_path / "work" / "merges").exists()
    assert len(hub.history("soup-org/leaderboard", repo_type="dataset")) == commits  # the file stays as it was


def test_eval_rows_that_are_not_text_are_a_clear_error(hub, zoo, tmp_path, capsys):
    publish(hub, zoo, "base", "ft-a", "ft-b")
    hub.login("alice")
    data = tmp_path / "eval.jsonl"
    data.write_text('{"text": "w1 w2 w3"}\n{"text": null}\n{"text": "w4"}\n')
    p = example(tmp_path, merges=LINEAR_PAIRS)
    cfg = yaml.safe_load(open(p))
    cfg["eval"]["tasks"] = [f"perplexity:{data},text=text,name=sample"]
    (tmp_path / "pipeline.yml").write_text(yaml.safe_dump(cfg))
    assert main(["pipeline", p]) == 2
    err = capsys.readouterr().err
    assert f"row 2 of {data}: 'text' must be text, got None" in err and "Traceback" not in err
    assert soup_repos(hub) == {} and not (tmp_path / "work" / "merges").exists()


# ---- two runs at once -----------------------------------------------------------------------------------


@pytest.mark.slow  # a subprocess holding the lock, and two pipeline runs
def test_two_runs_at_once_second_fails_cleanly_and_never_marks_the_first_failed(hub, zoo, tmp_path, capsys,
                                                                                 monkeypatch):
    publish(hub, zoo, "base", "ft-a", "ft-b", "ft-c")
    hub.login("alice")
    path = example(tmp_path, select=None, eval=None, merges=LINEAR_PAIRS)
    assert main(["pipeline", path]) == 0
    capsys.readouterr()
    before = state(hub)
    board = (tmp_path / "work" / "leaderboard" / "leaderboard.json").read_text()
    # another run holds the work folder (a process of its own, as a second CI job or terminal would be)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from hubsoup.output.folder import OutputLock\n"
        "with OutputLock(sys.argv[1], what='pipeline work folder'):\n"
        "    print('held', flush=True); time.sleep(60)\n"), str(tmp_path / "work")],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": REPO})
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["pipeline", path]) == 2
        err = capsys.readouterr().err
        assert "pipeline work folder" in err and "is in use by" in err and f"pid {holder.pid}" in err, err
    finally:
        holder.kill()
        holder.wait()
    assert state(hub) == before  # nothing pushed, nothing marked failed
    assert (tmp_path / "work" / "leaderboard" / "leaderboard.json").read_text() == board
    # two runs planned at once on different machines (two work folders): the later one finds each merge it
    # made already published by the other, at push time, and counts it as published, not failed
    from hubsoup.workflows.pipeline import hubio

    monkeypatch.setattr(hubio, "published_recipes", lambda *a, **k: {})  # planned before the first run pushed
    report, out, events = run(path, work_dir=str(tmp_path / "work2"))
    assert report.exit_code == 0, out
    assert [m.status for m in report.merges] == ["published"] * 3
    assert out.count("published by another run meanwhile") == 3
    models = lambda st: {k: v for k, v in st.items() if k[0] == "model"}  # noqa: E731
    assert models(state(hub)) == models(before)
    rows = json.loads(hub.files("soup-org/leaderboard", repo_type="dataset")["leaderboard.json"])["merges"]
    assert [r["status"] for r in rows] == ["published"] * 3


# ---- an unchanged leaderboard makes no commit, on any Hub ------------------------------------------------


@pytest.mark.slow  # two pipeline runs per Hub
@pytest.mark.parametrize("file_hashes", [True, False], ids=["hub", "hub-without-file-hashes"])
def test_second_run_makes_no_commit(hub, zoo, tmp_path, file_hashes):
    hub.file_hashes = file_hashes
    publish(hub, zoo, "base", "ft-a", "ft-b", "ft-c")
    hub.login("alice")
    path = example(tmp_path, merges=LINEAR_PAIRS + [{"method": "linear", "combine": "all"}])
    report, out, events = run(path)
    assert report.exit_code == 0 and report.leaderboard_url, out
    before = state(hub)
    n_commits = len(hub.calls("POST", r"/commit/"))
    report, out, events = run(path)
    assert report.exit_code == 0 and report.leaderboard_url is None, out
    assert state(hub) == before and len(hub.calls("POST", r"/commit/")) == n_commits
    # the Hub really is one without file hashes: huggingface_hub alone commits the same file again
    from huggingface_hub import CommitOperationAdd

    same = hub.files("soup-org/leaderboard", repo_type="dataset")["leaderboard.json"]
    hub.api("alice").create_commit("soup-org/leaderboard", [CommitOperationAdd("leaderboard.json", same)],
                                   commit_message="same", repo_type="dataset")
    changed = hub.head("soup-org/leaderboard", repo_type="dataset") != before[("dataset", "soup-org/leaderboard")]
    assert changed == (not file_hashes)


# ---- killed runs ----------------------------------------------------------------------------------------


def _kill_run(path, marker, mode, token):
    env = {**os.environ, "HF_TOKEN": token, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, os.path.join(REPO, "tests", "pipeline_kill_helper.py"), path,
                           str(marker), mode], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # a subprocess killed, then a rerun
def test_sigterm_during_the_pushes_says_what_was_published(hub, zoo, tmp_path):
    publish(hub, zoo, "base", "ft-a", "ft-b", "ft-c")
    token = hub.login("alice")
    # the pushes of merges written to the work folder (a streamed merge's interruption: tests/output/test_push_stream.py)
    path = example(tmp_path, select=None, eval=None, merges=LINEAR_PAIRS, push={"namespace": "soup-org", "stream": False})
    proc = _kill_run(path, tmp_path / "killed", "push", token)
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert "no output was left behind" not in proc.stderr
    [first] = soup_repos(hub)
    assert "terminated (SIGTERM): 1 merge(s) were published by this run and stay on the Hub" in proc.stderr
    assert f"stay on the Hub: {first}; the push of soup-org/" in proc.stderr and "was in flight" in proc.stderr
    assert len([ln for ln in proc.stderr.splitlines() if ln.strip()]) == 1, proc.stderr  # one line (issue 44)
    report, out, events = run(path)
    assert report.exit_code == 0, out
    assert len(soup_repos(hub)) == 3 and all(len(t) == 2 for t in soup_repos(hub).values())  # one commit each
    assert len([e for e in events if e[0] == "pushed"]) == 2


@pytest.mark.slow  # a subprocess killed, then a rerun
def test_kill_with_top_k_loses_no_finished_merge_that_the_work_folder_keeps(hub, zoo, tmp_path):
    """What a kill loses with select.top_k (documented in run.py and the examples' README): the pushes come
    once every merge is scored, so nothing is on the Hub yet, and the finished merges are in the work folder
    (the CI workflow caches it): the rerun verifies and reuses them, merging only what was not finished."""
    publish(hub, zoo, "base", "ft-a", "ft-b", "ft-c")
    token = hub.login("alice")
    path = example(tmp_path, merges=LINEAR_PAIRS, select={"metric": "perplexity", "top_k": 2})
    proc = _kill_run(path, tmp_path / "killed", "merge", token)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert soup_repos(hub) == {}
    report, out, events = run(path)
    assert report.exit_code == 0, out
    assert out.count("\nreused     ") + out.startswith("reused ") == 1, out  # the finished merge, verified
    assert out.count("merged     ") == 2 and len(soup_repos(hub)) == 2


# ---- the shipped example: installable CI workflow, real evaluation text ---------------------------------


def test_ci_workflow_installs_from_the_repository_url_and_caches_the_work_folder():
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        urls = tomllib.load(f)["project"]["urls"]
    assert {"Homepage", "Repository", "Changelog"} <= set(urls)
    repo_url = urls["Repository"]
    assert repo_url == "https://github.com/hubsoup/hubsoup"
    folder = os.path.join(REPO, "examples", "pipelines")
    with open(os.path.join(folder, "community-merge.yml"), encoding="utf-8") as f:
        text = f.read()
    wf = yaml.safe_load(text)
    env = wf["env"]
    assert env["HUBSOUP_SPEC"].startswith(f"hubsoup @ git+{repo_url}@")  # pip's direct-reference form
    assert text.count(repo_url) == 1  # named once, in the variable the install step uses
    steps = wf["jobs"]["merge"]["steps"]
    runs = "\n".join(s.get("run", "") for s in steps)
    assert 'pip install "$HUBSOUP_SPEC"' in runs and "pip install hubsoup\n" not in runs + "\n"
    assert "download.pytorch.org/whl/cpu" in runs  # torch's CPU build: no CUDA wheels on a CPU runner
    with open(os.path.join(folder, "pipeline.yml"), encoding="utf-8") as f:
        work_dir = yaml.safe_load(f)["work_dir"]
    assert env["WORK_DIR"] == f"examples/pipelines/{work_dir}"
    uses = {s.get("uses", "").split("@")[0]: s for s in steps}
    restore, save = uses["actions/cache/restore"], uses["actions/cache/save"]
    assert restore["with"]["path"] == save["with"]["path"] == "${{ env.WORK_DIR }}"
    assert save["if"] == "always()"  # saved when the run fails, is cancelled or times out
    assert restore["with"]["restore-keys"] and save["with"]["key"].startswith(restore["with"]["restore-keys"])
    order = [s.get("uses", "").split("@")[0] or s.get("name") for s in steps]
    assert order.index("actions/cache/restore") < order.index("Merge, evaluate, publish") < order.index(
        "actions/cache/save")


def test_ci_workflow_runs_in_the_repository_its_instructions_make(tmp_path):
    """Issue 48, item 4: lay out a repository as the workflow's header says; every path the workflow names is
    there, and setup-python's pip cache has a file to hash (without one it fails: "No file matched to
    [**/requirements.txt or **/pyproject.toml]", which such a repository does not have)."""
    import glob
    import shutil

    folder = os.path.join(REPO, "examples", "pipelines")
    text = open(os.path.join(folder, "community-merge.yml"), encoding="utf-8").read()
    header = "".join(line for line in text.splitlines(True) if line.startswith("#"))
    assert "beside it" not in header and ".github/workflows/community-merge.yml" in header
    wf = yaml.safe_load(text)
    env = wf["env"]
    pipeline_dir = os.path.dirname(env["PIPELINE"])
    assert f"in {pipeline_dir}/" in " ".join(header.split())  # the header names the folder the steps use
    repo = tmp_path / "their-repo"  # as the header says: the workflow, pipeline.yml and data/
    (repo / ".github" / "workflows").mkdir(parents=True)
    shutil.copy(os.path.join(folder, "community-merge.yml"), repo / ".github" / "workflows" / "community-merge.yml")
    (repo / pipeline_dir).mkdir(parents=True)
    shutil.copy(os.path.join(folder, "pipeline.yml"), repo / pipeline_dir)
    shutil.copytree(os.path.join(folder, "data"), repo / pipeline_dir / "data")
    assert not glob.glob(str(repo / "**" / "requirements.txt"), recursive=True)
    steps = wf["jobs"]["merge"]["steps"]
    setup = next(s for s in steps if s.get("uses", "").startswith("actions/setup-python"))
    if setup["with"].get("cache") == "pip":
        patterns = setup["with"].get("cache-dependency-path")
        assert patterns, "cache: pip with nothing to hash"
        for pattern in str(patterns).split():
            assert glob.glob(str(repo / pattern), recursive=True), f"{pattern} matches nothing in their repository"
    runs = [s["run"] for s in steps if "hubsoup pipeline" in s.get("run", "")]
    assert runs and all('"$PIPELINE"' in r for r in runs)  # the file the header says to copy
    assert (repo / env["PIPELINE"]).is_file()
    p = yaml.safe_load((repo / env["PIPELINE"]).read_text())
    for task in p["eval"]["tasks"]:  # its data, relative to the pipeline file
        data = task.split(":", 1)[1].split(",")[0]
        assert (repo / pipeline_dir / data).is_file(), data
    assert env["WORK_DIR"] == f"{pipeline_dir}/{p['work_dir']}"


def test_example_evaluation_data_is_real_english_text():
    import re
    import runpy

    path = os.path.join(REPO, "examples", "pipelines", "data", "eval.jsonl")
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert 200 <= len(rows) <= 1000
    words = [w for r in rows for w in r["text"].split()]
    assert all(isinstance(r["text"], str) and len(r["text"].split()) >= 8 for r in rows)
    assert not [w for w in words if re.fullmatch(r"w\d+", w)]  # no test-tokenizer tokens
    common = {"the", "of", "a", "to", "and", "is", "in", "for", "an", "or", "be", "if", "this", "that", "with"}
    assert sum(w.lower() in common for w in words) / len(words) > 0.15  # English prose, not code or tokens
    # written by make_eval.py from this interpreter's standard library docstrings (its origin)
    made = set(runpy.run_path(os.path.join(REPO, "examples", "pipelines", "data", "make_eval.py"))["paragraphs"]())
    assert sum(r["text"] in made for r in rows) / len(rows) > 0.95
