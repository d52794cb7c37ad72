"""Issue 44, item 6: recipes verify themselves.

The probe's tampered recipes (``hash:`` zeros, an input's digest zeros, ``base.path`` pointing elsewhere with
``spec`` unchanged) reran silently as another model. Now: the recorded hash is checked when the recipe is read
(naming ``hash``), ``spec`` and ``path`` (or ``repo_id``) must name the same input, and before a rerun every local
input's folder must still have the digest the recipe recorded (naming the input). The hash that seeds random
choices is unchanged (the digest is checked on its own): an untampered rerun of DARE repeats byte for byte.
"""

from __future__ import annotations

import hashlib
import os

import pytest
import yaml

import hubsoup
from hubsoup.cli import main
from hubsoup.errors import ParameterError
from hubsoup.recipe import RECIPE_FILE, Recipe


@pytest.fixture()
def made(llama, tmp_path, monkeypatch):
    """A DARE merge (random masks seeded by the recipe's hash) of local folders, and its recipe's text."""
    base, fts = llama
    monkeypatch.chdir(tmp_path)
    res = hubsoup.merge(fts[:2], "dare", base=base, out=str(tmp_path / "soup"), quiet=True)
    with open(tmp_path / "soup" / RECIPE_FILE, encoding="utf-8") as f:
        return res, f.read()


def sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def write(tmp_path, name: str, text: str, change) -> str:
    d = yaml.safe_load(text)
    change(d)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return str(path)


def rehash(d: dict) -> None:
    """What a careful tamperer does: the hash made to match the edited recipe."""
    d["hash"] = Recipe.from_yaml(yaml.safe_dump(d), verify=False).hash


def test_an_untampered_recipe_reruns_byte_for_byte(made, tmp_path):
    res, text = made
    again = hubsoup.run_recipe(str(tmp_path / "soup"), str(tmp_path / "again"), quiet=True)
    assert again.recipe.hash == res.recipe.hash
    assert sha(tmp_path / "again" / "model.safetensors") == sha(tmp_path / "soup" / "model.safetensors")


@pytest.mark.parametrize("case, change, field", [
    ("hash zeros", lambda d: d.update(hash="0" * 64), "'hash'"),
    ("a parameter edited", lambda d: d["params"].update(density=0.9), "'hash'"),
    ("input digest zeros", lambda d: d["inputs"][0].update(digest="0" * 16), "'inputs[0]'"),
    ("input digest zeros, rehashed", lambda d: (d["inputs"][0].update(digest="0" * 16), rehash(d)), "'inputs[0]'"),
    ("base.path elsewhere, spec unchanged", lambda d: d["base"].update(path=d["inputs"][1]["path"]), "'base.spec'"),
    ("base.path elsewhere, rehashed", lambda d: (d["base"].update(path=d["inputs"][1]["path"]), rehash(d)),
     "'base.spec'"),
    ("base swapped whole, rehashed", lambda d: (d["base"].update(path=d["inputs"][1]["path"],
                                                                  spec=d["inputs"][1]["spec"]), rehash(d)), "'base'"),
])
def test_a_tampered_recipe_is_refused_naming_the_field_before_anything(made, tmp_path, case, change, field, capsys):
    _, text = made
    path = write(tmp_path, "tampered", text, change)
    assert main(["run", path, "--out", str(tmp_path / "out"), "-q"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("error: recipe: ") and field in err[0], (case, err)
    assert not os.path.exists(tmp_path / "out") and not [n for n in os.listdir(tmp_path) if n.startswith(".out.")]


def test_an_input_folder_changed_since_the_merge_is_named(made, tmp_path, llama):
    """The folder the recipe names holds other weights now (same path, same spec): its digest says so."""
    import shutil

    _, text = made
    d = yaml.safe_load(text)
    moved = tmp_path / "ft-copy"
    shutil.copytree(d["inputs"][0]["path"], moved)
    path = write(tmp_path, "copied", text, lambda d: (d["inputs"][0].update(path=str(moved), spec=str(moved)),
                                                      rehash(d)))
    hubsoup.run_recipe(path, str(tmp_path / "same"), quiet=True)  # the same bytes elsewhere: the same input
    other = llama[1][2]
    shutil.rmtree(moved)
    shutil.copytree(other, moved)
    with pytest.raises(ParameterError, match=r"'inputs\[0\]' .* is not the folder the recipe recorded"):
        hubsoup.run_recipe(path, str(tmp_path / "other"), quiet=True)
    assert not os.path.exists(tmp_path / "other")


def test_a_hub_inputs_spec_and_repo_must_agree_and_a_servers_text_is_checked_too():
    text = yaml.safe_dump({
        "method": "linear", "params": {}, "dtype": None,
        "base": {"spec": "alice/base", "repo_id": "alice/base", "sha": "1" * 40, "kind": "full"},
        "inputs": [{"spec": "alice/ft-a", "repo_id": "mallory/ft-evil", "sha": "2" * 40, "kind": "full"}]})
    with pytest.raises(ParameterError, match=r"'inputs\[0\].spec' 'alice/ft-a' and 'inputs\[0\].repo_id'"):
        Recipe.from_yaml(text)
    good = Recipe.from_yaml(text.replace("mallory/ft-evil", "alice/ft-a"))
    zeros = good.to_yaml().replace(good.hash, "'" + "0" * 64 + "'")
    with pytest.raises(ParameterError, match="'hash' is 000000000000"):
        hubsoup.run_recipe(zeros, "unused-out", hub_only=True)
    assert not os.path.exists("unused-out")


def test_a_recipe_written_by_hand_without_a_hash_still_runs(made, tmp_path):
    """No ``hash:`` (a recipe written by hand): nothing recorded to check; its inputs' digests still are."""
    _, text = made
    path = write(tmp_path, "by-hand", text, lambda d: d.pop("hash"))
    assert hubsoup.run_recipe(path, str(tmp_path / "by-hand-out"), quiet=True).recipe.hash
    bad = write(tmp_path, "by-hand-bad", text, lambda d: (d.pop("hash"), d["inputs"][1].update(digest="f" * 16)))
    with pytest.raises(ParameterError, match=r"'inputs\[1\]'"):
        hubsoup.run_recipe(bad, str(tmp_path / "by-hand-bad-out"), quiet=True)
