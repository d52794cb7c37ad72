"""``hubsoup space create``: a Gradio Space running hubsoup's app, uploaded in one commit.

The Space gets the app (``examples/space/app.py``), a README whose front matter is the Space's
configuration (``cards/space.md``), a ``requirements.txt`` and the wheel of *this* hubsoup, built
from the running install (so no index but PyPI is needed):

* CPU hardware pins torch's CPU build (``--extra-index-url https://download.pytorch.org/whl/cpu`` and
  ``torch==<installed version>+cpu``), so the build does not resolve torch with its CUDA wheels;
* ZeroGPU hardware (``zero-a10g``) adds the ``spaces`` package: the app wraps the merge in ``spaces.GPU``;
* a public Space installs the wheel from its own ``resolve`` URL; a private Space's build cannot fetch
  it (no token), so its requirements list hubsoup's dependencies and the app installs the wheel beside it
  on its first start.

Example:
    >>> files = space_files("alice/merger", hardware="cpu-basic", wheel=("hubsoup-0.2.0-py3-none-any.whl", b""))
    >>> sorted(files)
    ['README.md', 'app.py', 'hubsoup-0.2.0-py3-none-any.whl', 'hubsoup_space.json', 'requirements.txt']
    >>> "torch==" in files["requirements.txt"].decode() and "+cpu" in files["requirements.txt"].decode()
    True
"""

from __future__ import annotations

import base64
import difflib
import hashlib
import io
import json
import os
import re
import shutil
import sys
import tempfile
import zipfile
from importlib import metadata
from typing import TYPE_CHECKING, Any

from hubsoup import REPOSITORY, __version__
from hubsoup.errors import ParameterError, PushError
from hubsoup.hubclient import Token, check_repo_id, hub_api, scrub_secrets, server_detail

if TYPE_CHECKING:
    from huggingface_hub import CommitInfo, HfApi

HARDWARE_CPU = ("cpu-basic", "cpu-upgrade")
HARDWARE_ZERO = ("zero-a10g",)
HARDWARE_GPU = ("t4-small", "t4-medium", "l4x1", "l4x4", "l40sx1", "l40sx4", "l40sx8", "a10g-small",
                "a10g-large", "a10g-largex2", "a10g-largex4", "a100-large", "a100x4", "a100x8")
HARDWARE = HARDWARE_CPU + HARDWARE_ZERO + HARDWARE_GPU
TEMPLATES = {"gradio": "the form: models, method and its parameters",
             "mergekit-gui": "a mergekit YAML config first (as the mergekit-gui Space), the form beside it"}
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
GRADIO_VERSION = "6.31.0"  # the sdk_version when gradio is not installed here (the app is tested with it)
SCOPES = ["read-repos", "write-repos", "manage-repos"]  # private inputs, the push, creating the repo
ZEROGPU_PYTHON = "3.10.13"  # the Python the Hub documents for ZeroGPU Spaces (Spaces ZeroGPU docs, "Compatibility")

_HERE = os.path.dirname(os.path.abspath(__file__))
# installed wheels carry the app inside the package; a source checkout has it under examples/
APP_PATHS = [os.path.join(_HERE, "space_app", "app.py"),
             os.path.join(os.path.dirname(_HERE), "examples", "space", "app.py")]


def app_path() -> str:
    for path in APP_PATHS:
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"the Space app is not in this install (looked in {', '.join(APP_PATHS)})")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _requirements_of_hubsoup() -> list[str]:
    """hubsoup's own dependencies (no extras), as its installed metadata lists them."""
    try:
        reqs = metadata.requires("hubsoup") or []
    except metadata.PackageNotFoundError:
        reqs = []
    return [r for r in reqs if "extra ==" not in r.replace('"', "'").replace("extra==", "extra ==")]


def wheel_name() -> str:
    return f"hubsoup-{__version__}-py3-none-any.whl"


PACKED_SUFFIXES = (".py", ".json", ".md", ".jinja")
"""The package's own files by kind: modules, data (measured defaults, module tables), card and chat templates."""
PACKED_NAMES = ("py.typed",)


def packable(name: str) -> bool:
    """Whether a file of the package folder goes into the Space's (public) wheel: the package's own kinds of
    file only, never a dotfile (``.env``), a cache (``__pycache__``, ``*.pyc``) or anything else left there."""
    return not name.startswith(".") and (name.endswith(PACKED_SUFFIXES) or name in PACKED_NAMES)


def _installed_files() -> set[str] | None:
    """The files an installed (not editable) hubsoup's RECORD lists under ``hubsoup/``, when it is the one
    running; None for a source checkout or an editable install (their RECORD names no package file)."""
    try:
        dist = metadata.distribution("hubsoup")
        if os.path.realpath(str(dist.locate_file("hubsoup/__init__.py"))) != os.path.realpath(
                os.path.join(_HERE, "__init__.py")):
            return None
        known = {str(f).replace(os.sep, "/") for f in dist.files or [] if str(f).startswith("hubsoup/")}
    except (metadata.PackageNotFoundError, OSError, ValueError):
        return None
    return known or None


def _wheel_entries() -> list[tuple[str, str]]:
    """(name in the wheel, local file) of the running hubsoup: its package, card templates and the Space app.

    Only the package's own files (:func:`packable`; of an installed hubsoup, those its RECORD lists): a
    Space is public, and whatever else lies in the package folder (a planted ``.env``) must not go with it."""
    entries = []
    known = _installed_files()
    for root, dirs, names in os.walk(_HERE):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        for n in sorted(names):
            path = os.path.join(root, n)
            name = "hubsoup/" + os.path.relpath(path, _HERE).replace(os.sep, "/")
            if packable(n) and os.path.isfile(path) and not os.path.islink(path) and (known is None or name in known):
                entries.append((name, path))
    have = {name for name, _ in entries}
    top = os.path.dirname(_HERE)
    cards = os.path.join(top, "cards")
    if os.path.isdir(cards):  # a source checkout: the templates sit beside the package
        for n in sorted(os.listdir(cards)):
            path = os.path.join(cards, n)
            if (packable(n) and os.path.isfile(path) and not os.path.islink(path)
                    and f"hubsoup/cards/{n}" not in have):
                entries.append((f"hubsoup/cards/{n}", path))
    if "hubsoup/space_app/app.py" not in have:
        entries.append(("hubsoup/space_app/app.py", app_path()))
    return entries


def build_wheel() -> tuple[str, bytes]:
    """The wheel of the running hubsoup (its files as they are now): ``(file name, bytes)``.

    Made here (a zip with ``*.dist-info``), not by a build tool: the install may not be a source tree,
    and a Space needs exactly the code that made it. Fixed timestamps: the same code gives the same bytes.
    """
    dist_info = f"hubsoup-{__version__}.dist-info"
    try:
        meta = metadata.distribution("hubsoup").read_text("METADATA")
    except metadata.PackageNotFoundError:
        meta = None
    if meta:  # an editable install's metadata may be older than the code: the version is the code's
        meta = re.sub(r"(?m)^Version: .*$", f"Version: {__version__}", meta, count=1)
    else:
        meta = f"Metadata-Version: 2.1\nName: hubsoup\nVersion: {__version__}\n" + "".join(
            f"Requires-Dist: {r}\n" for r in _requirements_of_hubsoup())
    generated = {
        f"{dist_info}/METADATA": meta.encode("utf-8"),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: hubsoup space\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{dist_info}/entry_points.txt": b"[console_scripts]\nhubsoup = hubsoup.cli:main\n",
    }
    files: list[tuple[str, bytes]] = []
    for name, path in _wheel_entries():
        with open(path, "rb") as f:
            files.append((name, f.read()))
    files.extend(generated.items())
    record = []
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files:
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{name},sha256={digest},{len(data)}")
            z.writestr(zipfile.ZipInfo(name, (1980, 1, 1, 0, 0, 0)), data)
        record.append(f"{dist_info}/RECORD,,")
        z.writestr(zipfile.ZipInfo(f"{dist_info}/RECORD", (1980, 1, 1, 0, 0, 0)), "\n".join(record) + "\n")
    return wheel_name(), buf.getvalue()


def requirements(repo_id: str, hardware: str, private: bool, wheel: str, endpoint: str | None = None,
                 wheel_sha256: str | None = None) -> str:
    """The Space's ``requirements.txt`` (see the module docstring). A public Space's hubsoup is the wheel uploaded
    beside the app, pinned by its SHA-256 (``#sha256=``: pip refuses any other bytes under that URL)."""
    from huggingface_hub import constants  # lazy: keeps hubsoup --help free of huggingface_hub

    torch_version = (_version("torch") or "").split("+")[0]
    lines = [f"# written by `hubsoup space create` (hubsoup {__version__}) for {hardware} hardware"]
    if hardware in HARDWARE_CPU:
        lines += ["# torch's CPU build: without it a CPU Space resolves torch with its CUDA wheels",
                  f"--extra-index-url {TORCH_CPU_INDEX}",
                  f"torch=={torch_version}+cpu" if torch_version else "torch"]
    else:
        lines += [f"torch=={torch_version}" if torch_version else "torch"]
    if hardware in HARDWARE_ZERO:
        lines += ["spaces  # ZeroGPU: the app wraps the merge in spaces.GPU"]
    if private:
        lines += ["# a private Space's build cannot fetch the wheel: the app installs it (beside app.py) at its "
                  "first start, with these, hubsoup's dependencies",
                  *(r for r in _requirements_of_hubsoup() if not r.startswith("torch"))]
    else:
        url = f"{(endpoint or constants.ENDPOINT).rstrip('/')}/spaces/{repo_id}/resolve/main/{wheel}"
        pin = f"#sha256={wheel_sha256}" if wheel_sha256 else ""
        lines += ["# this very hubsoup: its wheel, uploaded with the app (pinned by its hash)", f"hubsoup @ {url}{pin}"]
    lines += ["# the Space installs the gradio of README.md's sdk_version; this line is for running app.py elsewhere",
              f"gradio[oauth]=={_version('gradio') or GRADIO_VERSION}"]
    return "\n".join(lines) + "\n"


def readme(repo_id: str, hardware: str, template: str, private: bool) -> str:
    """The Space's README: its configuration as front matter (``cards/space.md``)."""
    import jinja2  # lazy: keeps hubsoup --help free of jinja2

    from hubsoup.card import template_path  # lazy: keeps hubsoup --help free of torch

    with open(template_path("space.md"), encoding="utf-8") as f:
        source = f.read()
    page: jinja2.Template = jinja2.Template(source, keep_trailing_newline=True)  # jinja2 types Template() as Any
    return page.render(
        title=repo_id.split("/")[-1], repo_id=repo_id, sdk_version=_version("gradio") or GRADIO_VERSION,
        python_version=python_version(hardware), hardware=hardware, repository=repository_url(),
        scopes=SCOPES, template=template, template_help=TEMPLATES[template], zerogpu=hardware in HARDWARE_ZERO,
        cpu=hardware in HARDWARE_CPU, private=private, version=__version__, wheel=wheel_name())


def python_version(hardware: str) -> str:
    """The Space's ``python_version``: ZeroGPU's documented one, else the Python running this (which made the wheel).

    >>> python_version("zero-a10g")
    '3.10.13'
    """
    if hardware in HARDWARE_ZERO:
        return ZEROGPU_PYTHON
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def repository_url() -> str:
    """hubsoup's source repository: the ``Repository`` URL of its package metadata (``pyproject.toml``)."""
    return REPOSITORY


def check_hardware(hardware: str) -> None:
    """A Space hardware name, or an error that says which one was meant."""
    if hardware not in HARDWARE:
        close = difflib.get_close_matches(hardware, HARDWARE, n=1)
        raise ParameterError(f"unknown Space hardware '{hardware}'" + (f" (did you mean '{close[0]}'?)" if close else "")
                             + f"; one of: {', '.join(HARDWARE)}")


def check(repo_id: str, hardware: str, template: str) -> None:
    check_repo_id(repo_id)
    check_hardware(hardware)
    if template not in TEMPLATES:
        raise ParameterError(f"unknown Space template '{template}'; one of: {', '.join(TEMPLATES)}")


def space_files(repo_id: str, *, hardware: str = "cpu-basic", template: str = "gradio", private: bool = False,
                wheel: tuple[str, bytes] | None = None, endpoint: str | None = None) -> dict[str, bytes]:
    """Every file of the Space, by its path in the repo."""
    check(repo_id, hardware, template)
    name, data = wheel or build_wheel()
    with open(app_path(), "rb") as f:
        app = f.read()
    settings = {"template": template, "zerogpu": hardware in HARDWARE_ZERO, "hardware": hardware,
                "hubsoup": __version__, "wheel": name}
    return {"app.py": app, "README.md": readme(repo_id, hardware, template, private).encode("utf-8"),
            "requirements.txt": requirements(repo_id, hardware, private, name, endpoint,
                                             hashlib.sha256(data).hexdigest()).encode("utf-8"),
            "hubsoup_space.json": (json.dumps(settings, indent=2) + "\n").encode("utf-8"), name: data}


def write_space(folder: str, repo_id: str, **kwargs: Any) -> str:
    """``--dry-run``: the Space's files in ``folder`` (a new folder; written whole or not at all)."""
    if os.path.exists(folder):
        raise ParameterError(f"'{folder}' already exists: give a new folder for the Space's files")
    files = space_files(repo_id, **kwargs)
    parent = os.path.dirname(os.path.abspath(folder))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".hubsoup-space-", dir=parent)
    try:
        for name, data in files.items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def create_space(repo_id: str, *, hardware: str = "cpu-basic", template: str = "gradio", private: bool = False,
                 token: Token = None, exist_ok: bool = False) -> CommitInfo:
    """Create the Space repo (``space_sdk="gradio"``) and upload its files in one commit.

    Returns:
        ``huggingface_hub.CommitInfo`` of the commit.

    Raises:
        PushError: what the Hub refused (the repo exists, no permission, ...), naming the Space.
    """
    from huggingface_hub import CommitOperationAdd  # lazy: keeps hubsoup --help free of huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError  # lazy: keeps hubsoup --help free of huggingface_hub

    files = space_files(repo_id, hardware=hardware, template=template, private=private)
    api: HfApi = hub_api(token)
    try:
        if api.repo_exists(repo_id, repo_type="space") and not exist_ok:
            raise PushError(f"Space {repo_id} already exists; pass --update to upload the app to it again")
        api.create_repo(repo_id, repo_type="space", space_sdk="gradio", private=private, exist_ok=True,
                        # huggingface_hub types it as its SpaceHardware (a str enum); the Hub takes the name
                        space_hardware=None if hardware == "cpu-basic" else hardware)  # type: ignore[arg-type]
        ops = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=data) for name, data in sorted(files.items())]
        return api.create_commit(repo_id, ops, repo_type="space",
                                 commit_message=f"hubsoup {__version__} Space ({template}, {hardware})")
    except HfHubHTTPError as e:
        raise PushError(f"creating Space {repo_id} failed: {scrub_secrets(server_detail(e), token)}") from e
