"""``hub_only`` (issue 31): a server's run takes Hub repo IDs only, has its own cache and a download budget.

Every entry point a server calls (merge, continual, run of a recipe or mergekit config, plan, pipeline)
refuses a local path by its text alone, before anything on the disk is looked at (the ``probes`` fixture
records every path the process stats, lists or opens), with a message that is the same whether the path
exists or not. Hub runs on the test Hub (``tests/hub_server.py``).
"""

from __future__ import annotations

import os
import shutil
import time

import pytest
import yaml
from safetensors.torch import load_file

import hubsoup
from hubsoup.cli import main
from hubsoup.errors import HubsoupError, InputError, ParameterError
from hubsoup.testing import make_finetune, write_card_metadata

@pytest.fixture(params=["file hashes", "no file hashes"])
def hub(hub, request):
    """Each test that uses the Hub runs on the test Hub and on a Hub that reports no file hashes (issue 31)."""
    hub.file_hashes = request.param == "file hashes"
    return hub


MARK = "SECRETMARK"  # every local folder of these tests has it in its path: any probe of one is seen


@pytest.fixture(scope="module")
def zoo(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"{MARK}-zoo")
    base = str(root / "base")
    shutil.copytree(model_dir("llama"), base)
    write_card_metadata(base, license="apache-2.0")
    fa = make_finetune(base, str(root / "ft-a"), seed=1, base_model="alice/base")
    fb = make_finetune(base, str(root / "ft-b"), seed=2, base_model="alice/base")
    return {"root": str(root), "base": base, "ft-a": fa, "ft-b": fb}


@pytest.fixture
def seeded(hub, zoo):
    for name in ("base", "ft-a", "ft-b"):
        hub.seed(f"alice/{name}", zoo[name])
    return hub



def marked(probes) -> list[str]:
    return [p for p in probes if MARK in p]


def refusal(role: str, spec: str) -> str:
    return f"{role} '{spec}': only Hub repo IDs (org/name[@revision]) are accepted here, not local paths"


def local_specs(zoo) -> dict[str, str]:
    return {"existing folder": zoo["ft-a"], "missing folder": os.path.join(zoo["root"], "nope"),
            "relative": f"./{MARK}/ft-a", "home": f"~/{MARK}", "dotdot": f"../{MARK}/ft-a",
            "three parts": f"{MARK}/ft-a/x", "a file": os.path.join(zoo["ft-a"], "config.json"),
            "hub cache": f"/root/.cache/huggingface/hub/models--alice--{MARK}/snapshots/0123"}


# ---- 1. the refusal: by the text alone, the same message whether the path exists or not -------------


@pytest.mark.parametrize("how", ["existing folder", "missing folder", "relative", "home", "dotdot", "three parts",
                                 "a file", "hub cache"])
def test_merge_refuses_a_local_input_or_base_before_the_disk(zoo, tmp_path, probes, how):
    spec = local_specs(zoo)[how]
    probes.clear()
    with pytest.raises(InputError) as e:
        hubsoup.merge([spec, "alice/ft-b"], "linear", base="alice/base", out=str(tmp_path / "soup"), hub_only=True)
    assert str(e.value) == refusal("input", spec)
    with pytest.raises(InputError) as e:
        hubsoup.merge(["alice/ft-a", "alice/ft-b"], "linear", base=spec, out=str(tmp_path / "soup"), hub_only=True)
    assert str(e.value) == refusal("base", spec)
    assert marked(probes) == [], marked(probes)
    assert not os.path.exists(tmp_path / "soup")


def test_the_message_says_nothing_about_the_host(zoo, tmp_path):
    """An existing folder, a file and a missing path get the same words: the visitor learns nothing."""
    specs = [zoo["ft-a"], os.path.join(zoo["ft-a"], "config.json"), os.path.join(zoo["root"], "nope")]
    messages = []
    for spec in specs:
        with pytest.raises(InputError) as e:
            hubsoup.merge([spec], "linear", base="alice/base", out=str(tmp_path / "soup"), hub_only=True)
        messages.append(str(e.value).replace(spec, "SPEC"))
        assert "is a file" not in str(e.value) and "config.json in" not in str(e.value)
    assert len(set(messages)) == 1, messages


def test_a_repo_id_shaped_folder_in_the_working_folder_is_never_looked_at(seeded, zoo, tmp_path, probes,
                                                                           monkeypatch):
    """``{MARK}/ft-a`` is a folder here and a valid repo ID: a hub_only run asks the Hub only."""
    work = tmp_path / "cwd"
    shutil.copytree(zoo["ft-a"], work / MARK / "ft-a")
    monkeypatch.chdir(work)
    probes.clear()
    with pytest.raises(InputError) as e:
        hubsoup.merge([f"{MARK}/ft-a", "alice/ft-b"], "linear", base="alice/base", out=str(tmp_path / "soup"),
                      hub_only=True, cache_dir=str(tmp_path / "cache"))
    assert f"repo {MARK}/ft-a not found" in str(e.value)
    assert [p for p in probes if p.startswith((MARK, str(work / MARK)))] == []


# ---- 2. every entry point -------------------------------------------------------------------------


def test_every_entry_point_refuses_local_paths(zoo, tmp_path, probes):
    from hubsoup import continual
    from hubsoup.recipe import Recipe
    from hubsoup.workflows.rerun import run_config, run_recipe
    from hubsoup.sources import InputRef

    local, out = zoo["ft-a"], str(tmp_path / "out")
    probes.clear()
    cases = {
        "continual init": lambda: continual.init([local], base="alice/base", out=out, hub_only=True),
        "continual add (model)": lambda: continual.add("alice/soup", [local], out=out, hub_only=True),
        "continual add (soup)": lambda: continual.add(local, ["alice/ft-a"], out=out, hub_only=True),
        "continual add (in place)": lambda: continual.add(local, ["alice/ft-a"], hub_only=True),
        "continual export": lambda: continual.export(local, out=out, hub_only=True),
        "mergekit models": lambda: run_config(f"merge_method: linear\nmodels:\n  - model: {local}\n"
                                              "    parameters: {weight: 1.0}\n", out, hub_only=True),
        "mergekit one-line text": lambda: run_config("{merge_method: linear, models: [{model: " + local + "}]}",
                                                     out, hub_only=True),
        "mergekit slices": lambda: run_config(
            "merge_method: passthrough\nslices:\n  - sources:\n      - model: alice/ft-a\n        layer_range: [0, 1]\n"
            f"  - sources:\n      - model: {local}\n        layer_range: [0, 1]\n", out, hub_only=True),
        "mergekit tokenizer_source": lambda: run_config(
            "merge_method: linear\nmodels:\n  - model: alice/ft-a\n    parameters: {weight: 1.0}\n"
            f"tokenizer_source: {local}\n", out, hub_only=True),
        "mergekit LoRA": lambda: run_config(f"merge_method: linear\nbase_model: alice/base+{local}\nmodels:\n"
                                            "  - model: alice/ft-a\n    parameters: {weight: 1.0}\n", out,
                                            hub_only=True),
        "recipe input": lambda: run_recipe(Recipe(method="linear", params={}, base=InputRef("alice/base", "alice/base"),
                                                  inputs=[InputRef(local, path=local)]).to_yaml(), out, hub_only=True),
        "evaluation data": lambda: hubsoup.merge(["alice/ft-a"], "linear", base="alice/base", out=out, hub_only=True,
                                                 evaluate=[f"classification:{local}/val.csv"]),
        "evaluation head": lambda: hubsoup.merge(["alice/ft-a"], "linear", base="alice/base", out=out, hub_only=True,
                                                 evaluate=[f"classification:org/data,head={local}/head.safetensors"]),
        "exemplars": lambda: hubsoup.merge(["alice/ft-a", "alice/ft-b"], "lot", base="alice/base", out=out,
                                           hub_only=True, exemplars=[f"a={local}/a.jsonl", "b=org/data"]),
    }
    for what, call in cases.items():
        with pytest.raises(HubsoupError) as e:
            call()
        msg = str(e.value)
        assert "only Hub" in msg and "accepted here, not local paths" in msg, (what, msg)
        assert "\n" not in msg
    assert marked(probes) == [], marked(probes)
    assert not os.path.exists(out)


def test_a_hub_model_plus_adapter_reference_is_accepted_when_both_parts_are_hub_ids(seeded, zoo, tmp_path, probes):
    """``alice/ft-a+alice/lora`` (a LoRA applied on read, SECURITY.md lists it) was refused under ``hub_only``
    as a "local path" (issue 44): both parts are Hub IDs, so it merges, bit for bit as without ``hub_only``;
    a local folder on either side of the ``+`` is still refused by its text, nothing on the disk looked at."""
    from hubsoup.testing import write_adapter
    from hubsoup.workflows.rerun import run_config

    seeded.seed("alice/lora", write_adapter(str(tmp_path / "lora"), zoo["base"], seed=3, r=2))
    ref = hubsoup.merge(["alice/ft-a+alice/lora", "alice/ft-b"], "linear", base="alice/base", out=str(tmp_path / "ref"),
                        quiet=True)
    got = hubsoup.merge(["alice/ft-a+alice/lora", "alice/ft-b"], "linear", base="alice/base",
                        out=str(tmp_path / "api"), hub_only=True, cache_dir=str(tmp_path / "c1"), quiet=True)
    config = ("merge_method: linear\nmodels:\n  - model: alice/ft-a+alice/lora\n    parameters: {weight: 0.5}\n"
              "  - model: alice/ft-b\n    parameters: {weight: 0.5}\n")
    mk = run_config(config, str(tmp_path / "mk"), hub_only=True, cache_dir=str(tmp_path / "c2"), quiet=True)
    mk_ref = run_config(config, str(tmp_path / "mk-ref"), quiet=True)
    for a, b in ((ref.path, got.path), (mk_ref.path, mk.path)):
        wa, wb = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
        assert wa.keys() == wb.keys() and all(bool((wa[k] == wb[k]).all()) for k in wa)
    probes.clear()
    for spec in (f"{zoo['ft-a']}+alice/lora", f"alice/ft-a+{zoo['root']}/lora", "alice/ft-a+../lora", "alice/ft-a+"):
        with pytest.raises(InputError, match="only Hub repo IDs"):
            hubsoup.merge([spec], "linear", base="alice/base", out=str(tmp_path / "no"), hub_only=True,
                          cache_dir=str(tmp_path / "c3"))
    assert marked(probes) == [] and not os.path.exists(tmp_path / "no")


def test_a_device_map_file_and_a_card_template_are_local_paths(zoo, tmp_path, probes):
    probes.clear()
    with pytest.raises(ParameterError, match="not a file"):
        hubsoup.MergeOptions(hub_only=True, device_map=os.path.join(zoo["root"], "map.json"))
    assert hubsoup.MergeOptions(hub_only=True, device_map="auto").device_map == "auto"
    assert marked(probes) == []
    result = hubsoup.merge([zoo["ft-a"], zoo["ft-b"]], "linear", base=zoo["base"], out=str(tmp_path / "s"),
                           quiet=True)
    result.hub_only = True  # as a hub_only run's result
    with pytest.raises(ParameterError, match="hub_only"):
        result.write_card(template=os.path.join(zoo["root"], "card.md"))


def test_cli_hub_only(zoo, tmp_path, capsys, probes):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"merge_method: linear\nmodels:\n  - model: {zoo['ft-a']}\n    parameters: {{weight: 1.0}}\n")
    probes.clear()
    for args in (["merge", zoo["ft-a"], "--base", "alice/base", "--method", "linear", "--out", tmp_path / "o",
                  "--hub-only"],
                 ["merge", "alice/ft-a", "--base", "alice/base", "--method", "linear", "--out", tmp_path / "o",
                  "--hub-only", "--card-template", f"{zoo['root']}/card.md"],
                 ["plan", zoo["ft-a"], "--hub-only"],
                 ["continual", "init", zoo["ft-a"], "--base", "alice/base", "--out", tmp_path / "o", "--hub-only"],
                 ["run", recipe, "--out", tmp_path / "o", "--hub-only"]):
        rc = main([str(a) for a in args])
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "local" in lines[0], (args, err)
        assert "Traceback" not in err
    assert marked(probes) == [], marked(probes)


def test_pipeline_hub_only_refuses_local_eval_data(zoo, tmp_path, probes):
    from hubsoup.workflows.pipeline import run_pipeline

    (tmp_path / "val.csv").write_text("text,label\na,0\n")
    pipeline = {"base": "alice/base", "candidates": {"models": ["alice/ft-a", "alice/ft-b"]},
                "merges": [{"method": "linear"}], "push": {"namespace": "alice"}, "work_dir": str(tmp_path / "w"),
                "eval": {"tasks": [f"classification:{MARK}.csv"]}}
    probes.clear()
    with pytest.raises(InputError, match="only Hub dataset IDs"):
        run_pipeline(pipeline, hub_only=True)
    assert marked(probes) == []


# ---- 3. Hub runs: the run's own cache, a budget, offline ---------------------------------------------


def _tree(folder: str) -> set[tuple[str, int]]:
    """Every file under ``folder`` with its size (what a run writing there would change)."""
    return {(os.path.join(d, f), os.path.getsize(os.path.join(d, f)) if os.path.exists(os.path.join(d, f)) else -1)
            for d, _, files in os.walk(folder) for f in files}


def test_hub_only_merge_downloads_into_its_own_cache(seeded, zoo, tmp_path):
    from huggingface_hub import constants

    cache = tmp_path / "run-cache"
    before = _tree(constants.HF_HUB_CACHE)  # earlier tests of the session may have filled it: what it holds now
    res = hubsoup.merge(["alice/ft-a", "alice/ft-b"], "linear", base="alice/base", out=str(tmp_path / "soup"),
                        hub_only=True, cache_dir=str(cache), quiet=True)
    assert {p.name for p in cache.iterdir() if p.name.startswith("models--")} == {
        "models--alice--base", "models--alice--ft-a", "models--alice--ft-b"}
    assert _tree(constants.HF_HUB_CACHE) == before, "a hub_only run with a cache_dir wrote to the shared Hub cache"
    want = hubsoup.merge([zoo["ft-a"], zoo["ft-b"]], "linear", base=zoo["base"], out=str(tmp_path / "want"),
                         quiet=True)
    got, ref = load_file(os.path.join(res.path, "model.safetensors")), load_file(os.path.join(want.path,
                                                                                                "model.safetensors"))
    assert got.keys() == ref.keys() and all((got[k] == ref[k]).all() for k in ref)


def test_the_download_budget_is_checked_before_any_weight_moves(seeded, zoo, tmp_path):
    weights = os.path.getsize(os.path.join(zoo["ft-a"], "model.safetensors"))
    out = tmp_path / "soup"
    with pytest.raises(InputError, match=r"may download at most .*sizes from the Hub.*nothing was downloaded"):
        hubsoup.merge(["alice/ft-a", "alice/ft-b"], "linear", base="alice/base", out=str(out), hub_only=True,
                      cache_dir=str(tmp_path / "c1"), max_download=2 * weights, quiet=True)
    # only the headers were read (range requests, 206): no weight file was downloaded
    assert [c for c in seeded.calls("GET", r"/resolve/")
            if c["path"].endswith(".safetensors") and c["status"] != 206] == []
    assert not out.exists()
    # enough for the three: it merges
    hubsoup.merge(["alice/ft-a", "alice/ft-b"], "linear", base="alice/base", out=str(out), hub_only=True,
                  cache_dir=str(tmp_path / "c2"), max_download=4 * weights, quiet=True)
    assert (out / "model.safetensors").is_file()


def test_a_huge_metadata_file_is_refused_before_it_is_downloaded(seeded, zoo, tmp_path):
    """A hostile repo's 'tokenizer.json' is charged from the Hub's sizes before the metadata download."""
    big = {**{n: open(os.path.join(zoo["base"], n), "rb").read() for n in os.listdir(zoo["base"])
              if os.path.isfile(os.path.join(zoo["base"], n))}, "tokenizer.json": b"x" * 3_000_000}
    seeded.seed("alice/big-base", big)
    with pytest.raises(InputError, match="base 'alice/big-base': this run may download at most"):
        hubsoup.merge(["alice/ft-a"], "linear", base="alice/big-base", out=str(tmp_path / "s"), hub_only=True,
                      cache_dir=str(tmp_path / "c"), max_download="2MB", quiet=True)
    assert not [c for c in seeded.calls("GET", r"/alice/big-base/resolve/") if "tokenizer" in c["path"]]


def test_hub_only_offline_needs_a_cache_of_its_own(zoo, tmp_path):
    """Offline, the shared cache would be opened without the Hub checking this run's token: refused."""
    with pytest.raises(InputError, match="needs a cache of its own"):
        hubsoup.merge(["alice/ft-a"], "linear", base="alice/base", out=str(tmp_path / "s"), hub_only=True)


def test_another_token_never_opens_what_the_first_one_cached(hub, zoo, tmp_path):
    """alice merges her private fine-tune (the shared cache now holds it); bob, in a hub_only run, can
    neither name it (the Hub answers him 404) nor give its snapshot's path."""
    hub.seed("alice/base", zoo["base"])
    hub.seed("alice/private-ft", zoo["ft-a"], private=True)
    hubsoup.merge(["alice/private-ft"], "linear", base="alice/base", out=str(tmp_path / "alice-soup"),
                  token=hub.token("alice"), quiet=True)  # fills the shared cache
    snapshot = hubsoup.MergeResult.from_folder(str(tmp_path / "alice-soup")).inputs[0]
    bob = dict(token=hub.token("bob"), hub_only=True, quiet=True)
    for cache in (None, str(tmp_path / "bob-cache")):  # the shared cache, or a cache of his own: the same answer
        with pytest.raises(InputError, match="repo alice/private-ft not found"):
            hubsoup.merge(["alice/private-ft"], "linear", base="alice/base", out=str(tmp_path / "bob"),
                          cache_dir=cache, **bob)
    sha = snapshot.sha
    with pytest.raises(InputError, match="not found"):
        hubsoup.merge([f"alice/private-ft@{sha}"], "linear", base="alice/base", out=str(tmp_path / "bob"), **bob)
    from huggingface_hub import constants

    path = os.path.join(constants.HF_HUB_CACHE, "models--alice--private-ft", "snapshots", sha)
    assert os.path.isdir(path)
    with pytest.raises(InputError, match="not local paths"):
        hubsoup.merge([path], "linear", base="alice/base", out=str(tmp_path / "bob"), **bob)
    assert not os.path.exists(tmp_path / "bob")


def test_a_hub_card_naming_a_local_base_is_refused_in_hub_only(hub, zoo, tmp_path, probes):
    ft = make_finetune(zoo["base"], str(tmp_path / "ft"), seed=3, base_model=zoo["base"])
    hub.seed("alice/ft", ft)
    probes.clear()
    with pytest.raises(HubsoupError, match="not a Hub repo ID"):
        hubsoup.merge(["alice/ft"], "linear", out=str(tmp_path / "s"), hub_only=True, cache_dir=str(tmp_path / "c"))
    assert [p for p in marked(probes) if p.startswith(zoo["base"])] == []


# ---- 3b. evaluation data and exemplars: the Hub dataset of that name, never a folder or another token's cache --


def test_hub_only_eval_data_never_reads_a_server_folder_or_a_packaged_builder(seeded, zoo, tmp_path, probes,
                                                                             monkeypatch):
    """``datasets.load_dataset("org/name")`` reads a folder ``org/name`` of the working folder before the Hub, and
    ``csv``/``json`` read the working folder's files: a hub_only run asks the Hub only, or refuses the name."""
    work = tmp_path / f"{MARK}-cwd"
    (work / MARK / "data").mkdir(parents=True)
    (work / MARK / "data" / "val.jsonl").write_text('{"text": "server secret"}\n')
    (work / "val.csv").write_text("text,label\nserver secret,0\n")
    (work / "val.json").write_text('{"text": "server secret"}\n')
    monkeypatch.chdir(work)
    out = str(tmp_path / "soup")
    probes.clear()
    with pytest.raises(HubsoupError) as e:
        hubsoup.merge(["alice/ft-a"], "linear", base="alice/base", out=out, hub_only=True,
                      cache_dir=str(tmp_path / "cache"), evaluate=[f"perplexity:{MARK}/data"])
    assert "doesn't exist on the Hub" in str(e.value) or "not found" in str(e.value), e.value
    for builder in ("perplexity:json", "classification:csv", "perplexity:text"):
        with pytest.raises(InputError, match="only Hub dataset IDs"):
            hubsoup.merge(["alice/ft-a"], "linear", base="alice/base", out=out, hub_only=True, evaluate=[builder])
    with pytest.raises(InputError, match="only Hub dataset IDs"):
        hubsoup.merge(["alice/ft-a"], "lot", base="alice/base", out=out, hub_only=True,
                      exemplars={"1": "json"})
    # datasets stats the name (``os.path.isdir``) before it sees the hf:// prefix, and ignores the answer: nothing
    # in the folder, nor the working folder's data files, is ever listed or opened
    touched = [p for p in marked(probes) if os.path.basename(p.rstrip("/")) in ("val.jsonl", "val.csv", "val.json")
               or os.path.abspath(p) in (str(work), str(work / MARK / "data"), str(work / MARK)) and p != f"{MARK}/data"]
    assert touched == [], touched
    assert not os.path.exists(out)


def test_hub_only_eval_data_follows_the_runs_token_not_the_datasets_cache(seeded, zoo, tmp_path):
    """The server's login (alice) filled the shared datasets cache with her private dataset; bob's hub_only run,
    with his own token, gets the Hub's answer to him (not found), not the cached copy."""
    hub = seeded
    api = hub.api("alice")
    api.create_repo("alice/private-data", repo_type="dataset", private=True)
    api.upload_file(path_or_fileobj=b'{"text": "alice private text"}\n' * 4, path_in_repo="train.jsonl",
                    repo_id="alice/private-data", repo_type="dataset")
    hub.login("alice")  # the server's own token
    from hubsoup.eval import TaskSpec

    spec = "perplexity:alice/private-data,split=train"
    assert len(TaskSpec.parse(spec).load()) == 4  # loaded once by the server: now in the shared datasets cache
    out = str(tmp_path / "bob")
    for cache in (None, str(tmp_path / "bob-cache")):
        with pytest.raises(HubsoupError, match="alice/private-data") as e:
            hubsoup.merge(["alice/ft-a"], "linear", base="alice/base", out=out, hub_only=True, quiet=True,
                          token=hub.token("bob"), cache_dir=cache, evaluate=[spec])
        assert "exist" in str(e.value) or "not found" in str(e.value) or "access" in str(e.value), e.value
    assert not os.path.exists(out)
    # and alice's own hub_only run, with her token, reads it from the Hub into her run's cache
    from hubsoup.sources.access import scope

    mine = tmp_path / "alice-cache"
    with scope(hub_only=True, cache_dir=str(mine)):
        assert TaskSpec.parse(spec).load(hub.token("alice"))["text"][0] == "alice private text"
    assert os.path.isdir(mine / "datasets")


# ---- 4. untrusted YAML: bounded ----------------------------------------------------------------------


BOMB = ("a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
        "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
        "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]\n"
        "g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]\nh: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]\n"
        "merge_method: *h\nmodels: *h\n")


@pytest.mark.parametrize("kind", ["mergekit config", "recipe", "pipeline", "method parameter"])
def test_a_yaml_alias_bomb_is_refused_at_once_with_one_line(tmp_path, capsys, kind):
    assert len(BOMB.encode()) < 420
    path = tmp_path / "bomb.yaml"
    text = BOMB if kind != "recipe" else BOMB.replace("merge_method: *h\nmodels: *h\n", "method: *h\nparams: *h\n")
    path.write_text(text)
    t0 = time.perf_counter()
    if kind == "pipeline":
        args = ["pipeline", path, "--dry-run"]
    elif kind == "method parameter":
        args = ["merge", "a/b", "--base", "a/c", "--method", "linear", "--out", tmp_path / "o",
                "--param", "weights=" + "{" + ", ".join(f"{c}: &{c} [" + ", ".join([f'*{p}'] * 9 if p else ['x'] * 9)
                                                           + "]" for p, c in zip(["", *"abcdefg"], "abcdefgh")) + "}"]
    else:
        args = ["run", path, "--out", tmp_path / "o"]
    rc = main([str(a) for a in args])
    took = time.perf_counter() - t0
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "too many YAML nodes" in lines[0], err
    assert len(lines[0]) < 300 and took < 1.0, (took, lines)


def test_error_messages_quote_untrusted_values_short():
    from hubsoup.recipe import Recipe

    huge = "A" * 100_000
    with pytest.raises(ParameterError) as e:
        Recipe.from_yaml(yaml.safe_dump({"method": [huge], "params": {}}))
    assert len(str(e.value)) < 200 and "\n" not in str(e.value)
    with pytest.raises(ParameterError) as e:
        hubsoup.merge(["a/b"], "ties", base="a/c", out="x", density="1\n2" + huge)
    assert len(str(e.value)) < 200 and "\\n" in str(e.value) and "\n" not in str(e.value)
    from hubsoup.formats.mergekit import read_config

    with pytest.raises(ParameterError) as e:
        read_config("merge_method: linear\nmodels:\n  - model: {path: " + huge + "}\n", resolve=False)
    assert len(str(e.value)) < 300


# ---- 5. a merge of private or gated inputs is not pushed publicly unless the run says so -------------


def test_a_merge_of_private_or_gated_inputs_is_not_pushed_publicly(hub, zoo, tmp_path, capsys):
    hub.seed("alice/base", zoo["base"])
    hub.seed("alice/private-ft", zoo["ft-a"], private=True)
    hub.seed("alice/gated-ft", zoo["ft-b"])
    hub.repos[("model", "alice/gated-ft")].gated = "auto"
    hub.login("alice")
    res = hubsoup.merge(["alice/private-ft", "alice/gated-ft"], "linear", base="alice/base", out=str(tmp_path / "s"),
                        quiet=True)
    assert res.restricted == [{"repo": "alice/gated-ft", "why": "gated"},
                              {"repo": "alice/private-ft", "why": "private"}]
    assert "## Private or gated inputs" in res.card and "`alice/private-ft` (private)" in res.card
    commits = len(hub.calls("POST", r"/commit/"))
    with pytest.raises(hubsoup.HubsoupError, match=r"alice/public is public and the merge contains 'alice/gated-ft' "
                                                   r"\(gated\), 'alice/private-ft' \(private\).*--allow-private-inputs"):
        res.push_to_hub("alice/public")
    assert not hub.exists("alice/public") and len(hub.calls("POST", r"/commit/")) == commits
    # the CLI says it in one line too; into an existing public repo as well
    hub.api("alice").create_repo("alice/existing")
    rc = main(["push", str(tmp_path / "s"), "alice/existing"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "refused" in err
    # private: fine; allowed explicitly: pushed, and the card says so
    res.push_to_hub("alice/private-soup", private=True)
    assert hub.repos[("model", "alice/private-soup")].private
    rc = main(["push", str(tmp_path / "s"), "alice/public-soup", "--allow-private-inputs"])
    assert rc == 0, capsys.readouterr().err
    card = hub.files("alice/public-soup")["README.md"].decode()
    assert "## Private or gated inputs" in card and "`alice/private-ft` (private)" in card


def test_an_input_made_private_after_the_merge_is_caught_at_push(hub, zoo, tmp_path):
    """The Hub is asked at push time, with the pushing token: a folder merged while the input was public."""
    for name in ("base", "ft-a"):
        hub.seed(f"alice/{name}", zoo[name])
    hub.login("alice")
    res = hubsoup.merge(["alice/ft-a"], "linear", base="alice/base", out=str(tmp_path / "s"), quiet=True)
    assert res.restricted == []
    hub.repos[("model", "alice/ft-a")].private = True
    with pytest.raises(hubsoup.HubsoupError, match="'alice/ft-a' \\(private\\)"):
        res.push_to_hub("alice/soup")
    res.push_to_hub("alice/soup", allow_private_inputs=True)
    assert "`alice/ft-a` (private)" in hub.files("alice/soup")["README.md"].decode()


def test_soups_search_and_sweep_refuse_local_paths_too(zoo, tmp_path, probes):
    from hubsoup.workflows.search import search
    from hubsoup.workflows.soups import greedy_soup
    from hubsoup.workflows.sweep import sweep

    local, out = zoo["ft-a"], str(tmp_path / "out")
    probes.clear()
    for call in (lambda: greedy_soup([local, "alice/ft-b"], lambda p: 0.0, out=out, base="alice/base", hub_only=True),
                 lambda: search([local], "linear", out=out, grid={"weights": [[1.0]]}, base="alice/base",
                                score_fn=lambda p: 0.0, hub_only=True),
                 lambda: sweep(["alice/ft-a", "alice/ft-b"], "task_arithmetic", out, "0.5", base=local, hub_only=True)):
        with pytest.raises(InputError, match="not local paths"):
            call()
    assert marked(probes) == [] and not os.path.exists(out)
