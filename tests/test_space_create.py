"""``hubsoup space create`` (issue 32, item 1) and the Space app's mergekit tab and visitor messages (item 2).

The slow test builds the Space's folder, installs its ``requirements.txt`` into a fresh venv and drives the app
from there in headless Chromium. Here there is no pytorch index (only PyPI, and pip's find-links holding torch's
CPU wheel), so that test drops the ``--extra-index-url https://download.pytorch.org/whl/cpu`` line. The fresh venv
is not filled from the index (several minutes of downloads and unpacking, the same files this test environment
was installed from): it gets exactly the distributions that the Space's requirements pull in, walked from
their metadata (``Requires-Dist`` with markers and extras, hubsoup's own from the wheel the Space ships) and
linked from this environment, where each must be installed at a version the requirement allows; nothing else.
Then pip installs the requirements into it with no index (``-c /work/main/constraints.txt``-style pins): it finds
every pin satisfied, installs hubsoup from the wheel the Space's requirements name (its URL on the test Hub), and
``pip check`` finds nothing missing. A dependency the wheel or the requirements forgot is missing from the venv,
and the app fails to start there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import types
import zipfile
from pathlib import Path

import pytest
import yaml

import hubsoup
from hubsoup import space
from hubsoup.cli import main
from hubsoup.errors import ParameterError
import paths  # tests/paths.py: the repository's root, wherever a test module sits

ROOT = Path(paths.ROOT)


def _front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


@pytest.fixture(scope="module")
def wheel():
    return space.build_wheel()


def test_space_files_for_cpu_hardware(wheel):
    files = space.space_files("alice/merger", wheel=wheel, endpoint="https://hub.example")
    req = files["requirements.txt"].decode()
    torch_version = __import__("torch").__version__.split("+")[0]
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in req.splitlines()
    assert f"torch=={torch_version}+cpu" in req.splitlines()
    pin = f"#sha256={__import__('hashlib').sha256(wheel[1]).hexdigest()}"  # pip refuses other bytes at that URL
    assert f"hubsoup @ https://hub.example/spaces/alice/merger/resolve/main/{wheel[0]}{pin}" in req.splitlines()
    assert "spaces" not in req.split()
    meta = _front_matter(files["README.md"].decode())
    import gradio

    assert meta["sdk"] == "gradio" and meta["sdk_version"] == gradio.__version__ and meta["app_file"] == "app.py"
    assert meta["hf_oauth"] is True and meta["hf_oauth_scopes"] == ["read-repos", "write-repos", "manage-repos"]
    assert meta["title"] == "merger" and meta["suggested_hardware"] == "cpu-basic"
    from huggingface_hub import SpaceCardData

    assert SpaceCardData(**meta).to_dict()["sdk"] == "gradio"  # huggingface_hub reads it as a Space's config
    assert files["app.py"] == (ROOT / "examples" / "space" / "app.py").read_bytes()
    assert json.loads(files["hubsoup_space.json"]) == {"template": "gradio", "zerogpu": False, "hardware": "cpu-basic",
                                                        "hubsoup": hubsoup.__version__, "wheel": wheel[0]}


def test_space_files_zerogpu_private_and_template(wheel):
    files = space.space_files("alice/merger", hardware="zero-a10g", template="mergekit-gui", private=True, wheel=wheel)
    req = files["requirements.txt"].decode().splitlines()
    assert "download.pytorch.org" not in "\n".join(req) and any(r.startswith("spaces") for r in req)
    # private: the build cannot fetch the wheel by URL; hubsoup's dependencies are listed, the app installs it
    assert not any(r.startswith("hubsoup @") for r in req)
    assert any(r.startswith("transformers") for r in req) and any(r.startswith("peft") for r in req)
    assert json.loads(files["hubsoup_space.json"])["zerogpu"] is True
    assert json.loads(files["hubsoup_space.json"])["template"] == "mergekit-gui"
    assert "spaces.GPU" in files["README.md"].decode()
    meta = _front_matter(files["README.md"].decode())
    assert meta["python_version"] == "3.10.13"  # what the Hub documents for ZeroGPU
    assert f"[hubsoup]({hubsoup.REPOSITORY})" in files["README.md"].decode()  # a real link, never https://github.com/


def test_bad_hardware_template_and_repo_are_refused(wheel, capsys):
    with pytest.raises(ParameterError, match="unknown Space hardware 'zero-a100'.*did you mean 'zero-a10g'"):
        space.space_files("alice/x", hardware="zero-a100", wheel=wheel)
    # on the command line too: "did you mean", not argparse's list of choices (issue 48, item 8)
    with pytest.raises(SystemExit):
        main(["space", "create", "alice/x", "--hardware", "zero-a10", "--dry-run", "x"])
    assert "did you mean 'zero-a10g'" in capsys.readouterr().err
    with pytest.raises(ParameterError, match="unknown Space template"):
        space.space_files("alice/x", template="streamlit", wheel=wheel)
    with pytest.raises(hubsoup.HubsoupError):
        space.space_files("not a repo", wheel=wheel)


def test_wheel_is_this_hubsoup_and_installable(wheel, tmp_path):
    name, data = wheel
    assert name == f"hubsoup-{hubsoup.__version__}-py3-none-any.whl"
    z = zipfile.ZipFile(__import__("io").BytesIO(data))
    names = set(z.namelist())
    for want in ("hubsoup/__init__.py", "hubsoup/py.typed", "hubsoup/cards/merge.md", "hubsoup/cards/space.md",
                 "hubsoup/space_app/app.py", "hubsoup/space.py"):
        assert want in names, want
    assert not any("__pycache__" in n for n in names)
    dist = f"hubsoup-{hubsoup.__version__}.dist-info"
    meta = z.read(f"{dist}/METADATA").decode()
    assert "Name: hubsoup" in meta and "Requires-Dist: torch" in meta
    assert z.read("hubsoup/space.py") == Path(space.__file__).read_bytes()  # the running code, as it is
    assert space.build_wheel()[1] == data  # the same code gives the same bytes
    # pip accepts it (RECORD hashes checked) into a target folder, without its dependencies
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target",
                           str(tmp_path / "t"), str(_write(tmp_path / name, data))], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "t" / "hubsoup" / "py.typed").is_file()


def test_the_wheel_packs_only_the_packages_own_files(tmp_path, monkeypatch):
    """A Space is public: a ``.env``, a cache, a key or any other file left in the package folder stays out of
    its wheel (issue 44: a planted ``.env`` went into a public Space); what goes in is what git tracks."""
    import shutil

    pkg = tmp_path / "src" / "hubsoup"
    shutil.copytree(Path(space.__file__).parent, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "cards", tmp_path / "src" / "cards")
    planted = {".env": "HF_TOKEN=hf_secret", "__pycache__/space.cpython-311.pyc": "x", "secret.txt": "x",
               "id_rsa": "x", ".git/config": "x", "methods/.netrc": "x", "methods/__pycache__/ties.cpython-311.pyc": "x",
               "formats/notes.key": "x", "wandb/run.log": "x"}
    for rel, text in planted.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    (tmp_path / "src" / "cards" / ".env").write_text("HF_TOKEN=hf_secret")
    (tmp_path / "private.json").write_text("{}")
    (pkg / "leak.json").symlink_to(tmp_path / "private.json")  # a link out: its name is fine, its target is not ours
    monkeypatch.setattr(space, "_HERE", str(pkg))
    names = {n for n, _ in space._wheel_entries()}
    assert not [n for n in names if any(n.endswith(rel) for rel in planted) or n.endswith((".env", "leak.json"))]
    assert "hubsoup/space.py" in names and "hubsoup/cards/merge.md" in names and "hubsoup/py.typed" in names
    # of the real tree: exactly the files git tracks (package, card templates) and the app, nothing else
    tracked = subprocess.run(["git", "ls-files", "hubsoup", "cards"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode == 0 and tracked.stdout:
        monkeypatch.undo()
        want = {("hubsoup/cards/" + t.split("/", 1)[1]) if t.startswith("cards/") else t
                for t in tracked.stdout.split()} | {"hubsoup/space_app/app.py"}
        assert {n for n, _ in space._wheel_entries()} == want


def test_an_installed_hubsoup_packs_what_its_record_lists(tmp_path, monkeypatch):
    """Installed from a wheel (not editable), the Space's wheel takes only the files hubsoup's RECORD lists."""
    here = Path(space.__file__).parent

    class Installed:
        files = [Path("hubsoup/__init__.py"), Path("hubsoup/space.py"), Path("hubsoup-0.dist-info/RECORD")]

        @staticmethod
        def locate_file(name):
            return here.parent / name

    monkeypatch.setattr(space.metadata, "distribution", lambda name: Installed)
    names = {n for n, _ in space._wheel_entries()}
    assert {n for n in names if not n.startswith(("hubsoup/cards/", "hubsoup/space_app/"))} == \
        {"hubsoup/__init__.py", "hubsoup/space.py"}


@pytest.mark.parametrize("repo", ["alice/merger\n", "alice/mer--ger", "alice/mergér", "alice/" + "m" * 97])
def test_space_names_the_hub_refuses_are_refused_before_any_work(repo, monkeypatch, capsys):
    built = []
    monkeypatch.setattr(space, "build_wheel", lambda: built.append(1) or ("w.whl", b""))
    assert main(["space", "create", repo]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "is not a Hub repo ID" in err[0] and not built, err


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_dry_run_writes_the_folder_and_refuses_an_existing_one(tmp_path, capsys):
    out = tmp_path / "space"
    assert main(["space", "create", "alice/merger", "--dry-run", str(out), "--hardware", "zero-a10g"]) == 0
    assert sorted(os.listdir(out)) == sorted(["README.md", "app.py", "requirements.txt", "hubsoup_space.json",
                                              space.wheel_name()])
    assert "spaces" in (out / "requirements.txt").read_text()
    assert main(["space", "create", "alice/merger", "--dry-run", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["space"]  # no temporary folder left


def test_space_create_on_the_test_hub(hub, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", hub.token("alice"))
    assert main(["space", "create", "alice/merger", "--hardware", "cpu-basic"]) == 0
    assert "spaces/alice/merger" in capsys.readouterr().out
    assert hub.exists("alice/merger", repo_type="space")
    files = hub.files("alice/merger", repo_type="space")
    assert sorted(set(files) - {".gitattributes"}) == sorted(["README.md", "app.py", "requirements.txt",
                                                              "hubsoup_space.json", space.wheel_name()])
    assert len(hub.history("alice/merger", repo_type="space")) == 2  # the repo's first commit, then ours: one
    assert f"{hub.endpoint}/spaces/alice/merger/resolve/main/{space.wheel_name()}" in files["requirements.txt"].decode()
    # again: refused, unless --update
    assert main(["space", "create", "alice/merger"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["space", "create", "alice/merger", "--update"]) == 0


# ---- the app's own logic (imported with a test Hub token for Gradio's local sign-in mock) ----------------------


@pytest.fixture
def app_module(hub, monkeypatch, tmp_path):
    """examples/space/app.py imported from a Space folder whose hubsoup_space.json says ZeroGPU. Outside a ZeroGPU
    Space (no ``SPACES_ZERO_GPU``) the real ``spaces.GPU`` returns the function as it is; the ZeroGPU worker itself
    is tested through spaces' real queue by tests/test_space_zerogpu.py."""
    pytest.importorskip("spaces", reason="a ZeroGPU Space's app imports `spaces` (the test extra)")
    monkeypatch.setenv("HF_TOKEN", hub.token("alice"))
    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    monkeypatch.delenv("SPACES_ZERO_GPU", raising=False)
    folder = tmp_path / "space"
    space.write_space(str(folder), "alice/merger", hardware="zero-a10g", template="mergekit-gui")
    spec = importlib.util.spec_from_file_location("space_app_under_test", folder / "app.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_app_zerogpu_tab_validation_and_visitor_messages(app_module):
    app = app_module
    assert app.FIRST_TAB == "mergekit"  # the mergekit-gui template opens on the config
    assert app.ZEROGPU and callable(app.merge_on_gpu)  # a generator over plain data: see test_space_zerogpu.py

    ok = app.validate_config(app.EXAMPLE_CONFIG)
    assert ok.startswith("**Valid**") and "`org/fine-tune-a`" in ok and "ties" in ok
    assert "no 'merge_method'" in app.validate_config("models: []\n")
    assert "not a Hub repo name" in app.validate_config(app.EXAMPLE_CONFIG.replace("org/fine-tune-a", "/etc"))
    shown = app.validate_config(app.EXAMPLE_CONFIG.replace("density", "densty"))  # mergekit ignores it: said so
    assert shown.startswith("**Valid**") and "Ignored, as mergekit ignores them" in shown
    assert "`models[0].parameters.densty`" in shown

    from hubsoup.errors import InputError, PushError

    gated = InputError("input 'org/llama': the repo is gated; accept its terms on the Hub and log in "
                       "(hf auth login or HF_TOKEN)")
    msg = app.visitor_message(gated, "alice/soup")
    assert "request access" in msg and "hf auth login" not in msg and "HF_TOKEN" not in msg
    missing = InputError("input 'org/nope': repo org/nope not found on https://hub (or it is private and no valid "
                         "token was given: log in with `hf auth login` or set HF_TOKEN)")
    msg = app.visitor_message(missing, "alice/soup")
    assert "Check the repo name" in msg and "sign in" in msg and "hf auth" not in msg

    class Resp:
        status_code = 403

    cause = Exception("forbidden")
    cause.response = Resp()
    denied = PushError("push of 'x' to bob/soup failed: permission denied. The local output is intact; retry with: "
                       "hubsoup push x bob/soup")
    denied.__cause__ = cause
    msg = app.visitor_message(denied, "bob/soup")
    assert "You may not write to bob/soup" in msg and "hubsoup push" not in msg


# ---- the Space as deployed: its requirements in a fresh venv, its app in a browser ------------------------------

YAML_CONFIG = ["merge_method: ties", "base_model: alice/base",
               "models: [{model: alice/ft-a, parameters: {weight: 1.0, density: 0.5}}, "
               "{model: alice/ft-b, parameters: {weight: 1.0, density: 0.5}}]",
               "dtype: float32"]


def _link_requirements(lines: list[str], wheel: Path, site: Path) -> set[str]:
    """Link into ``site`` the distributions that ``lines`` (requirement lines; ``hubsoup @ URL`` stands for
    ``wheel``) pull in, from this environment: each must be installed here at a version its requirement allows.
    Returns their canonical names (hubsoup not among them: pip installs it from its URL)."""
    import email
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    def wanted(req: Requirement, extras: frozenset) -> bool:
        return req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras | {""})

    with zipfile.ZipFile(wheel) as z:
        meta = email.message_from_bytes(z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))))
    todo = [(Requirement(r), frozenset()) for r in meta.get_all("Requires-Dist") or []]
    for line in lines:
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            req = Requirement(line)
            if canonicalize_name(req.name) != "hubsoup":
                todo.append((req, frozenset()))
    extras_seen: dict[str, frozenset] = {}
    dists: dict[str, metadata.Distribution] = {}
    while todo:
        req, parent_extras = todo.pop()
        if not wanted(req, parent_extras):
            continue
        name = canonicalize_name(req.name)
        assert name != "hubsoup", f"hubsoup's wheel requires itself: {req}"
        try:
            dist = dists.get(name) or metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            pytest.fail(f"the Space needs {req}, which this environment does not have")
        assert req.specifier.contains(dist.version, prereleases=True), f"{req} but {dist.version} is installed"
        new = frozenset(req.extras) - extras_seen.get(name, frozenset())
        if name in dists and not new:
            continue
        dists[name] = dist
        extras_seen[name] = extras_seen.get(name, frozenset()) | new
        # its requirements without an extra (again, harmless) and those of the extras asked for the first time
        todo += [(Requirement(sub), new) for sub in dist.requires or []]
    for name, dist in dists.items():
        assert dist.files, f"{name} {dist.version}: no RECORD, its files are unknown"
        for top in {f.parts[0] for f in dist.files if f.parts[0] != ".."}:
            target = site / top
            if not target.exists():
                target.symlink_to(Path(dist.locate_file(top)))
    return set(dists)


@pytest.mark.slow
def test_space_installs_in_a_fresh_venv_and_merges_a_mergekit_config_in_a_browser(hub, tmp_path, monkeypatch):
    """``hubsoup space create`` to the test Hub; its files installed (see the module docstring for the one line
    dropped) and its app run from a fresh venv; in Chromium: sign in, paste a mergekit config, see it validated,
    merge and push, with the status and progress bar at the top."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    from tests.test_space import (CHROME_ARGS, CHROMEDRIVER, CHROMIUM, PERCENT, build_zoo, css, free_port,
                            require_browser, seen, status, wait_for, watch_status)

    require_browser()
    monkeypatch.setenv("HF_TOKEN", hub.token("alice"))
    assert main(["space", "create", "alice/merger", "--template", "mergekit-gui"]) == 0
    folder = tmp_path / "space"
    folder.mkdir()
    for name, data in hub.files("alice/merger", repo_type="space").items():
        (folder / name).write_bytes(data)
    req = (folder / "requirements.txt").read_text()
    assert f"hubsoup @ {hub.endpoint}/spaces/alice/merger/resolve/main/" in req  # fetched from the test Hub
    offline = [line for line in req.splitlines() if not line.startswith("--extra-index-url")]  # no pytorch index here
    (folder / "requirements-here.txt").write_text("\n".join(offline) + "\n")
    venv = tmp_path / "venv"
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HF_HUB_OFFLINE", "HF_TOKEN")}
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, env=env, check=True).stdout.strip())
    wheel_file = next(folder.glob("hubsoup-*.whl"))
    linked = _link_requirements(offline, wheel_file, site)
    assert {"torch", "gradio", "transformers", "safetensors", "huggingface-hub"} <= linked, linked
    assert "hubsoup" not in linked and "pytest" not in linked and "selenium" not in linked  # only what it needs
    # pip (this environment's, run for the venv's interpreter): no index, every requirement must be satisfied
    pip = [sys.executable, "-m", "pip", "--python", str(py)]
    proc = subprocess.run([*pip, "install", "-q", "--no-index", "-r", str(folder / "requirements-here.txt"),
                           "-c", str(ROOT / "constraints.txt")], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    proc = subprocess.run([*pip, "check"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(f"\nfresh venv of {len(linked)} distributions and the Space's hubsoup: {time.monotonic() - started:.1f} s")
    where = subprocess.run([str(py), "-c", "import hubsoup, torch; print(hubsoup.__file__, torch.__version__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path)
    assert str(venv) in where.stdout and "+cpu" in where.stdout, where.stdout + where.stderr  # the venv's own

    zoo_started = time.monotonic()
    build_zoo(hub, tmp_path / "zoo")
    port = free_port()
    log = open(tmp_path / "app.log", "wb")
    app_env = {**env, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": hub.token("alice"), "HF_HOME": str(tmp_path / "hf"),
               "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port),
               "GRADIO_ANALYTICS_ENABLED": "False", "GRADIO_TEMP_DIR": str(tmp_path / "gradio")}
    app = subprocess.Popen([str(py), "app.py"], cwd=folder, env=app_env, stdout=log, stderr=subprocess.STDOUT)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    monkeypatch.setenv("SE_OFFLINE", "true")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in [*CHROME_ARGS, f"--user-data-dir={tmp_path / 'profile'}"]:
        opts.add_argument(arg)
    browser = webdriver.Chrome(options=opts, service=Service(CHROMEDRIVER))
    try:
        url = f"http://127.0.0.1:{port}/"
        deadline = time.monotonic() + 120
        while True:
            assert app.poll() is None, (tmp_path / "app.log").read_text()[-3000:]
            try:
                __import__("urllib.request").request.urlopen(url, timeout=2).read()
                break
            except OSError:
                assert time.monotonic() < deadline, (tmp_path / "app.log").read_text()[-3000:]
                time.sleep(0.3)
        browser.get(url)
        login = wait_for(browser, lambda d: next(iter(b for b in d.find_elements(By.TAG_NAME, "button")
                                                      if "Sign in" in b.text), None), 30, "the sign-in button")
        login.click()
        wait_for(browser, lambda d: d.execute_script(
            "return [...document.querySelectorAll('button')].some(b => b.innerText.includes('Logout (alice)'))"),
            30, "signed in as alice")
        # the mergekit-gui template opens on the config tab; the example config is validated on load
        wait_for(browser, lambda d: "Valid" in d.find_element(By.ID, "mergekit-check").text, 30, "validation")
        editor = css(browser, "#mergekit-yaml .cm-content")
        editor.click()
        editor.send_keys(Keys.CONTROL, "a")
        editor.send_keys(Keys.DELETE)
        editor.send_keys("merge_method: tiez")
        wait_for(browser, lambda d: "Not valid" in d.find_element(By.ID, "mergekit-check").text, 30, "a refusal")
        editor.send_keys(Keys.CONTROL, "a")
        editor.send_keys(Keys.DELETE)
        for line in YAML_CONFIG:
            editor.send_keys(line, Keys.ENTER)
        wait_for(browser, lambda d: "`alice/ft-b`" in d.find_element(By.ID, "mergekit-check").text
                 or "alice/ft-b" in d.find_element(By.ID, "mergekit-check").text, 30, "the config validated")
        assert "Valid" in browser.find_element(By.ID, "mergekit-check").text
        name = css(browser, "#repo textarea, #repo input")
        name.send_keys(Keys.CONTROL, "a")
        name.send_keys("soup-yaml", Keys.TAB)
        # the status line sits above the tabs: seen wherever the visitor is
        top = browser.execute_script("return [document.querySelector('#status').getBoundingClientRect().top, "
                                     "document.querySelector('#tabs').getBoundingClientRect().top]")
        assert top[0] < top[1], top
        watch_status(browser)
        css(browser, "#merge-yaml").click()
        wait_for(browser, lambda d: d.execute_script(
            "return !!document.querySelector('#status .progress-bar, #status .eta-bar, #status .progress-level')"),
            60, "the progress bar drawn over the status line")
        wait_for(browser, lambda d: "done" in status(d) or "Failed" in status(d), 120, "the merge and push")
        final = status(browser)
        assert final.startswith("100%") and "pushed to alice/soup-yaml" in final, final
        percents = [int(m.group(1)) for text in seen(browser) if (m := PERCENT.search(text))]
        assert percents == sorted(percents) and any(0 < p < 100 for p in percents), percents
        assert not any("/tmp" in text or str(tmp_path) in text for text in seen(browser))  # no server path shown
        card_text = browser.find_element(By.ID, "card").text
        assert "soup-yaml" in card_text and str(tmp_path) not in card_text
    finally:
        browser.quit()
        app.terminate()
        app.wait(20)
        log.close()
    files = hub.files("alice/soup-yaml")
    assert any(f.endswith(".safetensors") for f in files) and "mergekit" in files["hubsoup_recipe.yaml"].decode()
    assert "\n# soup-yaml\n" in files["README.md"].decode()
    assert hub.token("alice") not in (tmp_path / "app.log").read_text()
    print(f"\nfresh-venv Space: app start to pushed merge {time.monotonic() - zoo_started:.1f} s")


@pytest.mark.slow
def test_app_one_visitors_run_never_shows_anothers(app_module):
    """Two visitors' runs at once (one thread each, as Gradio runs them): each sees its own progress and error."""
    import threading

    app = app_module
    both_running = threading.Barrier(2, timeout=30)

    def merge_job(job, progress, cancel, before_push=None):  # the merge a job describes, here one that fails as its visitor's
        user = job["inputs"][0]
        progress(0.5, "merge", f"merging for {user}")
        both_running.wait()  # the other visitor's run is at the same point
        time.sleep(0.5)
        raise hubsoup.HubsoupError(f"{user}'s own failure")

    app.merge_job = merge_job

    def visitor(user: str):
        profile = types.SimpleNamespace(username=user)
        oauth = types.SimpleNamespace(token=f"token-of-{user}")
        request = types.SimpleNamespace(session_hash=f"session-{user}")
        return app.run_job({"inputs": [user], "method": "linear"}, "soup", False, profile, oauth, request,
                           lambda *a, **k: None)

    seen: dict[str, list[str]] = {}

    def drive(user):
        seen[user] = [s for s, _ in visitor(user)]

    threads = [threading.Thread(target=drive, args=(u,)) for u in ("ann", "bob")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for me, other in (("ann", "bob"), ("bob", "ann")):
        text = "\n".join(seen[me])
        assert f"merging for {me}" in text and f"{me}'s own failure" in text, text
        assert other not in text, text
    assert not app.RUNNING  # both sessions released
