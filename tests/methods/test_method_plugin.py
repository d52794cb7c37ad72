"""A method kept in a package of its own is found by the CLI through the ``hubsoup.methods`` entry-point group
(issue 33): examples/method_plugin is pip-installed into a temporary folder and ``hubsoup merge --method
sign_max`` merges with it, bit for bit as the method's own math says; its recipe names the package and version the
method comes from, and ``hubsoup run`` without the package says which one to install (issue 47)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hubsoup.testing import make_base, make_finetune
from method_helpers import state

from paths import ROOT
PLUGIN = os.path.join(ROOT, "examples", "method_plugin")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "--target", str(target), PLUGIN], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert any(p.endswith(".dist-info") for p in os.listdir(target))
    return str(target)


def _env(site: str) -> dict[str, str]:
    # the installed plug-in first, then this hubsoup (the worktree's, as the test process imports it)
    import hubsoup

    here = os.path.dirname(os.path.dirname(hubsoup.__file__))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([site, here])}


@pytest.mark.slow
def test_the_cli_finds_an_installed_method_package(installed, tmp_path):
    base = make_base("llama", str(tmp_path / "base"))
    fts = [make_finetune(base, str(tmp_path / f"ft{i}"), seed=i) for i in (1, 2)]
    env = _env(installed)
    listed = subprocess.run([sys.executable, "-m", "hubsoup", "methods"], capture_output=True, text=True, env=env,
                            timeout=120)
    assert listed.returncode == 0 and "sign_max" in listed.stdout, listed.stderr[-2000:]
    out = tmp_path / "merged"
    proc = subprocess.run([sys.executable, "-m", "hubsoup", "merge", *fts, "--base", base, "--method", "sign_max",
                           "--param", "scale=0.5", "--out", str(out), "-q"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    merged, b = state(str(out)), state(base)
    a1, a2 = state(fts[0]), state(fts[1])
    for k in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight"):
        taus = torch.stack([a1[k].float() - b[k].float(), a2[k].float() - b[k].float()])
        want = (b[k].float() + taus.sign().mean(dim=0) * taus.abs().amax(dim=0) * 0.5).to(b[k].dtype)
        assert torch.equal(merged[k], want), k
    without = subprocess.run([sys.executable, "-m", "hubsoup", "methods"], capture_output=True, text=True,
                             env=_env(str(tmp_path / "empty")), timeout=120)
    assert "sign_max" not in without.stdout  # found through the installed package, nowhere else


def test_a_broken_plugin_leaves_the_built_in_methods_usable(tmp_path, monkeypatch, caplog):
    from importlib.metadata import EntryPoint

    from hubsoup.methods import _base

    ep = EntryPoint(name="broken", value="no_such_module_hubsoup:Nothing", group=_base.ENTRY_POINT_GROUP)
    monkeypatch.setattr(_base, "entry_points", lambda group: [ep] if group == _base.ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(_base, "_plugins_loaded", False)
    assert _base.get_method("ties").name == "ties"
    assert "broken" in caplog.text and "not loaded" in caplog.text


@pytest.mark.slow
def test_a_recipe_names_the_package_its_method_comes_from(installed, tmp_path):
    """Issue 47, item 6: a method registered through the entry point is recorded in the recipe (and so in the card)
    with its package's name and version, outside the hash; ``hubsoup run`` of that recipe where the package is not
    installed says which package and version to install, instead of "unknown method"; where it is, it merges the
    same bytes again."""
    import yaml

    from hubsoup.recipe import Recipe

    base = make_base("llama", str(tmp_path / "base"))
    fts = [make_finetune(base, str(tmp_path / f"ft{i}"), seed=i) for i in (1, 2)]
    env, bare = _env(installed), _env(str(tmp_path / "empty"))
    out = tmp_path / "merged"
    proc = subprocess.run([sys.executable, "-m", "hubsoup", "merge", *fts, "--base", base, "--method", "sign_max",
                           "--out", str(out), "-q"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = (out / "hubsoup_recipe.yaml").read_text()
    record = {"sign_max": {"distribution": "hubsoup-sign-max", "version": "0.1.0"}}
    assert yaml.safe_load(text)["extra"]["plugins"] == record
    recipe = Recipe.from_yaml(text)
    assert recipe.plugins == record
    recipe.plugins = {}
    assert recipe.hash == yaml.safe_load(text)["hash"]  # outside the hash: the same merge, the same seeds
    assert "hubsoup-sign-max" in (out / "README.md").read_text()  # the card's recipe

    refused = subprocess.run([sys.executable, "-m", "hubsoup", "run", str(out / "hubsoup_recipe.yaml"), "--out",
                              str(tmp_path / "again")], capture_output=True, text=True, env=bare, timeout=300)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "hubsoup-sign-max 0.1.0" in refused.stderr and "pip install 'hubsoup-sign-max==0.1.0'" in refused.stderr
    assert "unknown method" not in refused.stderr and not (tmp_path / "again").exists()

    again = subprocess.run([sys.executable, "-m", "hubsoup", "run", str(out / "hubsoup_recipe.yaml"), "--out",
                            str(tmp_path / "again"), "-q"], capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()

    wrapped = subprocess.run([sys.executable, "-c", "from hubsoup.methods import plugin_distributions as p; "
                              "print(p('lines', {'base_method': 'sign_max'}), p('lines', {'base_method': 'ties'}))"],
                             capture_output=True, text=True, env=env, timeout=120)
    assert wrapped.stdout.split() == ["{'sign_max':", "{'distribution':", "'hubsoup-sign-max',", "'version':",
                                      "'0.1.0'}}", "{}"], wrapped.stderr[-2000:]


def test_a_recipe_records_no_built_in_method_and_refuses_a_malformed_record():
    from hubsoup.errors import MethodError, ParameterError
    from hubsoup.methods import check_plugins, plugin_distributions
    from hubsoup.recipe import Recipe, recipe_for
    from hubsoup.sources import InputRef

    assert plugin_distributions("lines", {"base_method": "ties"}) == {}
    r = recipe_for("ties", {"density": 0.2}, InputRef("org/base", "org/base", sha="1" * 40),
                   [InputRef("org/a", "org/a", sha="2" * 40)], dtype=None)
    assert r.plugins == {} and "plugins" not in r.to_dict()["extra"]
    with pytest.raises(MethodError, match=r"method 'nope' comes from the package pkg-nope 2\.0, which is not installed "
                                          r"here: pip install 'pkg-nope==2\.0'"):
        check_plugins({"nope": {"distribution": "pkg-nope", "version": "2.0"}})
    check_plugins({"ties": {"distribution": "pkg", "version": "1"}})  # registered here: nothing to install
    bad = r.to_yaml().replace("extra: {}", "extra:\n  plugins:\n    nope: pkg-nope")
    with pytest.raises(ParameterError, match="'extra.plugins' entry 'nope' must name a package"):
        Recipe.from_yaml(bad, verify=False)
