"""A version that changes with what ships (issue 48, item 7).

The version is written once, ``hubsoup/__init__.py``'s ``__version__``; ``pyproject.toml`` reads it (hatch's
``[tool.hatch.version]``), the wheel ``hubsoup space create`` builds carries it in its name and metadata, and
``CHANGELOG.md`` has a dated section per released version, newest first. While a version is being prepared its
changes sit under ``[Unreleased]`` above the newest dated section, whose version is then older than
``__version__``; the release renames ``[Unreleased]`` to ``[X.Y.Z] - YYYY-MM-DD``.
"""

from __future__ import annotations

import io
import os
import re
import tomllib
import zipfile

from packaging.version import Version

import hubsoup

from paths import ROOT
SECTION = re.compile(r"^## \[(?P<name>[^\]]+)\](?: - (?P<date>\d{4}-\d{2}-\d{2}))?\s*$", re.M)


def _sections() -> list[tuple[str, str | None]]:
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
        return [(m["name"], m["date"]) for m in SECTION.finditer(f.read())]


def test_the_version_is_written_once():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["hatch"]["version"]["path"] == "hubsoup/__init__.py"
    with open(os.path.join(ROOT, "hubsoup", "__init__.py"), encoding="utf-8") as f:
        assert re.findall(r'^__version__ = "([^"]+)"$', f.read(), re.M) == [hubsoup.__version__]
    assert Version(hubsoup.__version__) >= Version("0.2.0")  # 0.1.0 no longer names the code that ships
    assert project["project"]["urls"]["Repository"] == hubsoup.REPOSITORY  # what cards and Spaces link


def test_every_version_has_a_dated_changelog_section_newest_first():
    sections = _sections()
    released = [(Version(n), d) for n, d in sections if n != "Unreleased"]
    assert released and all(d for _, d in released), "a released version without its date"
    assert [v for v, _ in released] == sorted((v for v, _ in released), reverse=True)
    assert [d for _, d in released] == sorted((d for _, d in released), reverse=True)
    names = [n for n, _ in sections]
    if "Unreleased" in names:  # one, on top
        assert names.count("Unreleased") == 1 and names[0] == "Unreleased", names
    newest = released[0][0]
    current = Version(hubsoup.__version__)
    if current == newest:  # released: its section is dated
        return
    # being prepared: newer than every dated section, its changes under [Unreleased]
    assert current > newest and names[0] == "Unreleased", (current, names[:2])


def test_the_spaces_wheel_carries_the_codes_version():
    """Even from an editable install whose metadata is older than the code (the space's wheel is built from the
    running code): the file name and METADATA say ``__version__``."""
    from hubsoup import space

    name, data = space.build_wheel()
    assert name == f"hubsoup-{hubsoup.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        meta = z.read(f"hubsoup-{hubsoup.__version__}.dist-info/METADATA").decode()
    assert re.search(r"^Version: (.+)$", meta, re.M).group(1) == hubsoup.__version__
