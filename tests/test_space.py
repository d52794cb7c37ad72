"""The Space example (examples/space/app.py) driven in a real headless Chromium against the test Hub.

The app runs as its own process (``python app.py``) with ``HF_ENDPOINT`` = the test Hub and
alice's token as the machine's token, which Gradio's local OAuth mock signs in with. The browser
signs in, fills the form, merges two tiny fine-tunes published on the test Hub, follows the
progress, cancels a second (slower) run, and the test checks what reached the Hub.

Needs Debian's ``chromium`` + ``chromium-driver`` and the ``selenium`` and ``gradio[oauth]``
packages (the ``test`` extra); without them the test fails with the command that installs them.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

import hubsoup
from hubsoup.testing import make_base, make_finetune
import paths  # tests/paths.py: the repository's root, wherever a test module sits

ROOT = Path(paths.ROOT)
APP = ROOT / "examples" / "space" / "app.py"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"  # Debian's packages, never a downloaded browser
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
CHROME_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--disable-dev-shm-usage", "--window-size=1280,2600",
               # nothing but the app: a page asset from the internet (fonts) fails at once instead of hanging
               "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1"]
PERCENT = re.compile(r"(\d+)%")

pytestmark = pytest.mark.slow


def require_browser() -> None:
    """Fail (never skip) with the install command when the browser or a package is missing."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        pytest.fail(f"{', '.join(missing)} not found: install with `apt-get install -y chromium chromium-driver`")
    for module, install in (("selenium", "selenium"), ("gradio", "'gradio[oauth]'"), ("authlib", "'gradio[oauth]'")):
        try:
            __import__(module)
        except ImportError:
            pytest.fail(f"the Space test needs {module}: `pip install {install}` (or `pip install -e '.[test]'`)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_zoo(hub, root: Path) -> dict[str, str]:
    """alice/base and two fine-tunes (cards name the base), deep enough for a cancellable run."""
    base = make_base("llama", str(root / "base"), layers=16, hidden=64)
    folders = {"base": base,
               "ft-a": make_finetune(base, str(root / "ft-a"), seed=1, base_model="alice/base"),
               "ft-b": make_finetune(base, str(root / "ft-b"), seed=2, base_model="alice/base")}
    for name, folder in folders.items():
        hub.seed(f"alice/{name}", folder)
    return folders


class App:
    """The Space app as its own process, talking to the test Hub as alice (Gradio's local OAuth mock)."""

    def __init__(self, hub, tmp_path: Path):
        self.port, self.log_path, self.tmp = free_port(), tmp_path / "app.log", tmp_path / "app-tmp"
        self.tmp.mkdir()
        self.url = f"http://127.0.0.1:{self.port}/"
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN")}
        env.update(HF_ENDPOINT=hub.endpoint, HF_TOKEN=hub.token("alice"), HF_HOME=str(tmp_path / "app-hf-home"),
                   GRADIO_SERVER_NAME="127.0.0.1", GRADIO_SERVER_PORT=str(self.port), GRADIO_ANALYTICS_ENABLED="False",
                   GRADIO_TEMP_DIR=str(tmp_path / "gradio"), TMPDIR=str(self.tmp),
                   PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, str(APP)], cwd=APP.parent, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 90) -> str:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"the app exited ({self.proc.returncode}):\n{self.output()[-3000:]}")
            try:
                urllib.request.urlopen(self.url, timeout=2).read()
                return self.url
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the app did not answer in {timeout} s:\n{self.output()[-3000:]}")
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture
def app(hub, tmp_path):
    """The app, starting (it needs no model to start: the test builds them meanwhile)."""
    require_browser()
    app = App(hub, tmp_path)
    try:
        yield app
    finally:
        app.stop()
        assert hub.token("alice") not in app.output(), "the app printed the user's token"


@pytest.fixture
def browser(tmp_path, monkeypatch):
    require_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    monkeypatch.setenv("SE_OFFLINE", "true")  # Selenium Manager: never download a browser or driver
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in [*CHROME_ARGS, f"--user-data-dir={tmp_path / 'chromium-profile'}"]:
        opts.add_argument(arg)
    driver = webdriver.Chrome(options=opts, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


# ---- page helpers ------------------------------------------------------------------------------


def wait_for(driver, condition, timeout: float = 60, what: str = "condition"):
    from selenium.common.exceptions import TimeoutException, WebDriverException
    from selenium.webdriver.support.ui import WebDriverWait

    try:  # the page re-renders under us: a stale element or a failing script is "not yet"
        return WebDriverWait(driver, timeout, poll_frequency=0.05,
                             ignored_exceptions=(WebDriverException,)).until(lambda d: condition(d))
    except TimeoutException:
        shown = driver.execute_script(
            "return [...document.querySelectorAll('#status, .toast-body')].map(e => e.innerText).join(' | ')")
        raise AssertionError(f"waited {timeout} s for {what}; the page shows: {shown!r}") from None


def css(driver, selector: str):
    from selenium.webdriver.common.by import By

    return wait_for(driver, lambda d: next(iter(e for e in d.find_elements(By.CSS_SELECTOR, selector)
                                                  if e.is_displayed()), None), 30, selector)


def set_text(driver, elem_id: str, text: str) -> None:
    from selenium.webdriver.common.keys import Keys

    box = css(driver, f"#{elem_id} textarea, #{elem_id} input")
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(Keys.DELETE)
    box.send_keys(text)
    box.send_keys(Keys.TAB)  # blur: Gradio commits the value


def pick_method(driver, name: str) -> None:
    from selenium.webdriver.common.by import By

    css(driver, f"#method input[value='{name}']")  # rendered
    label = driver.find_element(By.XPATH, f"//*[@id='method']//label[.//input[@value='{name}']]")
    label.click()
    css(driver, f"#param-{name}-" + hubsoup_param(name))  # its parameter widgets are shown


def hubsoup_param(method: str) -> str:
    return next(m for m in hubsoup.list_methods() if m["name"] == method)["params"][0]["name"]


# the status line's own text: the progress bar is drawn over #status too (its numbers are not the status)
STATUS_TEXT = "#status [data-testid=\"markdown\"]"


def status(driver) -> str:
    return driver.execute_script(f"return document.querySelector('{STATUS_TEXT}').innerText")


def watch_status(driver) -> None:
    """Record every text the status line shows (a MutationObserver: no update missed by polling)."""
    driver.execute_script("""
        const el = document.querySelector('#status');
        const text = () => (el.querySelector('[data-testid="markdown"]') || {innerText: ''}).innerText;
        window.__seen = [text()];
        window.__whole = [];  // the status line with the progress overlay drawn over it
        if (window.__observer) window.__observer.disconnect();
        window.__observer = new MutationObserver(() => { window.__seen.push(text()); window.__whole.push(el.innerText); });
        window.__observer.observe(el, {subtree: true, childList: true, characterData: true});""")


def seen(driver) -> list[str]:
    return driver.execute_script("return window.__seen")


def repeated(driver) -> list[str]:
    """Texts of the status line that the progress overlay repeats (it shows the bar, the status says the text)."""
    out = []
    for text, whole in zip(driver.execute_script("return window.__seen"), driver.execute_script("return window.__whole")):
        said = text.split("·", 1)[-1].strip()
        if len(said) > 12 and whole.count(said) > 1:
            out.append(whole)
    return out


# ---- the test ----------------------------------------------------------------------------------


def test_space_merges_cancels_and_pushes_in_a_browser(hub, app, browser, tmp_path):
    from selenium.webdriver.common.by import By

    t0 = time.monotonic()
    zoo = build_zoo(hub, tmp_path / "zoo")  # while the app starts
    browser.get(app.wait_ready())
    # sign in: locally Gradio's mock signs in the owner of the app's token (alice)
    login = wait_for(browser, lambda d: next(iter(b for b in d.find_elements(By.TAG_NAME, "button")
                                                  if "Sign in" in b.text), None), 30, "the sign-in button")
    login.click()
    wait_for(browser, lambda d: d.execute_script(
        "return [...document.querySelectorAll('button')].some(b => b.innerText.includes('Logout (alice)'))"),
        30, "signed in as alice")

    # 1. merge ft-a + ft-b with TIES (density from its widget) and push to alice/soup
    set_text(browser, "models", "alice/ft-a\nalice/ft-b")
    set_text(browser, "base", "alice/base")
    pick_method(browser, "ties")
    set_text(browser, "param-ties-density", "0.5")
    set_text(browser, "repo", "soup")
    watch_status(browser)
    css(browser, "#merge").click()
    wait_for(browser, lambda d: "done" in status(d) or "Failed" in status(d), 90, "the merge and push")
    final = status(browser)
    assert final.startswith("100%") and "pushed to alice/soup" in final, final
    percents = [int(m.group(1)) for text in seen(browser) if (m := PERCENT.search(text))]
    assert any(0 < p < 100 for p in percents), f"no intermediate progress shown: {seen(browser)}"
    assert percents == sorted(percents), f"progress went backwards: {percents}"
    assert not repeated(browser), repeated(browser)[:3]  # the overlay does not say the status text again
    card_text = wait_for(browser, lambda d: d.find_element(By.ID, "card").text, 30, "the card")
    assert "ties" in card_text and "alice/ft-a" in card_text
    shot = tmp_path / "space-merged.png"
    browser.save_screenshot(str(shot))
    print(f"\nscreenshot of the merged run: {shot}")

    # on the test Hub: the repo under alice's namespace with weights and card
    files = hub.files("alice/soup")
    weights = [f for f in files if f.endswith(".safetensors")]
    assert weights and "README.md" in files and "config.json" in files
    readme = files["README.md"].decode()
    meta = yaml.safe_load(readme.split("---")[1])
    assert meta["base_model"] == ["alice/ft-a", "alice/ft-b"] and "ties" in meta["tags"]  # a merge's card names its inputs
    recipe = yaml.safe_load(files["hubsoup_recipe.yaml"])
    assert "0.5" in yaml.safe_dump(recipe) and "density" in yaml.safe_dump(recipe)
    # the pushed weights are what the API gives for the same recipe
    (tmp_path / "pushed").mkdir()
    for f in weights:
        (tmp_path / "pushed" / f).write_bytes(files[f])
    want = hubsoup.merge([zoo["ft-a"], zoo["ft-b"]], "ties", base=zoo["base"], out=str(tmp_path / "want"),
                         quiet=True, density=0.5)
    got = {k: v for f in weights for k, v in load_file(tmp_path / "pushed" / f).items()}
    ref = {k: v for f in os.listdir(want.path) if f.endswith(".safetensors")
           for k, v in load_file(os.path.join(want.path, f)).items()}
    assert got.keys() == ref.keys() and all((got[k] == ref[k]).all() for k in ref)

    # 2. a slower run (SFTM: SVDs of every matrix), cancelled while it runs: nothing pushed, nothing left
    commits_before = len(hub.calls("POST", r"/commit/"))
    pick_method(browser, "sftm")
    set_text(browser, "repo", "soup-cancelled")
    watch_status(browser)
    # a slow Hub holds the run's first weights download (30 s): the cancel click lands while the run waits on it,
    # however loaded the machine, and Cancel answers without waiting for that file (issue 48, item 8)
    hub.delay_next(1, 30, method="GET", path=r"/resolve/.*\.safetensors$")
    css(browser, "#merge").click()
    wait_for(browser, lambda d: "done" not in (s := status(d)) and (m := PERCENT.search(s)) and int(m.group(1)) > 0,
             60, "the second run to start")
    css(browser, "#cancel").click()
    clicked = time.monotonic()
    wait_for(browser, lambda d: "Cancelled" in status(d) or "done" in status(d), 60, "the cancellation")
    assert "Cancelled" in status(browser), f"the run was not cancelled: {seen(browser)}"
    assert time.monotonic() - clicked < 15, "Cancel waited for the download in flight"
    shot2 = tmp_path / "space-cancelled.png"
    browser.save_screenshot(str(shot2))
    print(f"screenshot of the cancelled run: {shot2}")
    hub.release_delays()  # the held download answers: the cancelled run unwinds and removes its folder
    assert not hub.exists("alice/soup-cancelled")
    assert len(hub.calls("POST", r"/commit/")) == commits_before

    def left() -> list[str]:  # the app's work folder, hubsoup's temp output, a run's folder (output, Hub cache)
        return ([p.name for p in app.tmp.iterdir() if p.name.startswith("hubsoup")]
                + [q.name for p in app.tmp.iterdir() if p.name.startswith("soup-space-runs-") for q in p.iterdir()])

    deadline = time.monotonic() + 60
    while left() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left(), f"the cancelled run left {left()}"
    assert not hub.exists("alice/soup-cancelled")
    assert len(hub.calls("POST", r"/commit/")) == commits_before
    print(f"space test: {time.monotonic() - t0:.1f} s from building the models to the last check")
