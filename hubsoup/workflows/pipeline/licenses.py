"""Which license may a merge be published under? A small, explicit and conservative table.

A merge is a derivative of the base and of every input, so its license must be one that each of
their licenses allows a derivative to carry. Licenses are read as the Hub writes them in a card
(:func:`read`): one ID (``license: apache-2.0``), a list of IDs (every one of them applies), or
``other`` with its ``license_name`` / ``license_link``. This is a simplification to catch the
common mistakes in unattended pipelines, not legal advice:

* **no derivatives**: any ``-nd`` Creative Commons license (``cc-by-nd-4.0``,
  ``cc-by-nc-nd-4.0``, ...) and an ``other`` license whose name says so: the merge is refused.
* **cannot be read**: no license, ``unknown``, an empty list, a mapping, a non-text entry,
  ``other`` without ``license_name`` or ``license_link``: the merge is refused (a card that says
  nothing grants nothing; hubsoup never defaults a license).
* **permissive**, by increasing obligations: ``cc0-1.0``, ``unlicense`` (0) < ``mit``,
  ``bsd-2-clause``, ``bsd-3-clause`` (1) < ``apache-2.0``, ``cc-by-*`` (2). A permissive license
  may go into one at the same or a higher level, and into any non-permissive license.
* **copyleft / non-commercial**, each only into itself or what :func:`may_go_into` lists:
  ``lgpl-3.0`` → ``gpl-3.0``, ``agpl-3.0``; ``gpl-3.0`` → ``agpl-3.0``; ``agpl-3.0``;
  ``cc-by-sa-V``; ``cc-by-nc-V`` → ``cc-by-nc-sa-V``; ``cc-by-nc-sa-V``.
* **anything else** (model licenses such as ``llama3``, ``gemma``, ``openrail``; ``other`` with its
  name; IDs not listed here) only into itself.

The output license: the pipeline's ``license.output`` when every license may go into it, else
the base's license when every input's may go into it, else the most restrictive of the licenses
into which all may go; it is always derived from every input's and the base's. No such license →
the merge is refused (``license.allow_mix`` publishes it anyway, without a license in the card).

Example:
    >>> combine([("base", "apache-2.0"), ("org/a", "mit")]).license
    'apache-2.0'
    >>> combine([("base", "apache-2.0"), ("org/nc", "cc-by-nc-4.0")]).license
    'cc-by-nc-4.0'
    >>> combine([("base", "apache-2.0"), ("org/nc", "cc-by-nc-4.0")], output="apache-2.0").ok
    False
    >>> d = combine([("base", "apache-2.0"), ("org/nd", read({"license": "cc-by-nc-nd-4.0"}))])
    >>> d.ok, d.blocking, d.reason
    (False, True, 'org/nd is licensed cc-by-nc-nd-4.0, whose terms forbid derivatives (ND); a merge is one')
    >>> read({"license": ["mit", "apache-2.0"]}).ids
    ('mit', 'apache-2.0')
    >>> read({"license": {"name": "mit"}}).error
    'the license is a mapping, not a license ID'
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Sequence, Union

PERMISSIVE = {"cc0-1.0": 0, "unlicense": 0, "mit": 1, "bsd-2-clause": 1, "bsd-3-clause": 1,
              "apache-2.0": 2, "cc-by-4.0": 2}
INTO = {
    "lgpl-3.0": {"gpl-3.0", "agpl-3.0"},
    "gpl-3.0": {"agpl-3.0"},
    "agpl-3.0": set(),
}
_CC = re.compile(r"^cc-by(?P<nc>-nc)?(?P<nd>-nd)?(?P<sa>-sa)?(?P<nd2>-nd)?-(?P<v>\d+(\.\d+)?)$")
_ND_WORDS = re.compile(r"(^|[^a-z])(nd|no[- _]?deriv\w*|noderivs?)([^a-z]|$)")
_UNREADABLE_IDS = {"unknown", "none", "null", "no-license", "n/a", "other"}


@dataclass(frozen=True)
class License:
    """A repo's license as its card states it: every ID that applies, or why it cannot be read."""

    ids: tuple[str, ...] = ()
    """Lower-case IDs; ``other`` is ``other:NAME`` (its ``license_name``, else its ``license_link``)."""
    error: str | None = None
    """Why it cannot be read (then ``ids`` is empty)."""
    name: str | None = None
    """``license_name`` of an ``other`` license (for the merge's card)."""
    link: str | None = None
    """``license_link`` of an ``other`` license."""

    def __str__(self) -> str:
        return " + ".join(self.ids) if self.ids else f"unreadable ({self.error})"


LicenseLike = Union[License, str, None]


def read(card: dict[str, Any] | None) -> License:
    """The license of a card's metadata (``license``, ``license_name``, ``license_link``), never guessed."""
    card = card if isinstance(card, dict) else {}
    value = card.get("license")
    name, link = card.get("license_name"), card.get("license_link")
    name = name.strip() if isinstance(name, str) and name.strip() else None
    link = link.strip() if isinstance(link, str) and link.strip() else None
    if value is None or value == "" or value == []:
        return License(error="the card names no license")
    if isinstance(value, dict):
        return License(error="the license is a mapping, not a license ID")
    values = value if isinstance(value, list) else [value]
    ids = []
    for v in values:
        if not isinstance(v, str) or not v.strip():
            return License(error=f"the license list holds {_short(v)}, not a license ID")
        lic = v.strip().lower()
        if lic == "other":
            other = name or link
            if not other:
                return License(error="the license is 'other' without license_name or license_link")
            lic = f"other:{other.lower()}"
        elif lic in _UNREADABLE_IDS:
            return License(error=f"the license is '{lic}'")
        ids.append(lic)
    return License(tuple(dict.fromkeys(ids)), None, name, link)


def normalize(license: object, license_name: object = None) -> str | None:
    """A card's single ``license`` as one lower-case ID (``other`` carries its ``license_name``); None if unreadable."""
    lic = read({"license": license, "license_name": license_name})
    return lic.ids[0] if len(lic.ids) == 1 else None


def forbids_derivatives(lic: str) -> bool:
    """Whether the terms of ``lic`` forbid derivatives (Creative Commons ``-nd``, or an ``other`` name saying so)."""
    m = _CC.match(lic)
    if m:
        return bool(m.group("nd") or m.group("nd2"))
    if lic.startswith("other:"):
        return bool(_ND_WORDS.search(lic[len("other:"):]))
    return False


def non_commercial(lic: str) -> bool:
    m = _CC.match(lic)
    return bool(m and m.group("nc")) or (lic.startswith("other:") and "-nc" in lic)


def _level(lic: str) -> int | None:
    if lic in PERMISSIVE:
        return PERMISSIVE[lic]
    m = _CC.match(lic)
    if m and not (m.group("nc") or m.group("nd") or m.group("sa") or m.group("nd2")):
        return 2  # cc-by-V: attribution only
    return None


def may_go_into(a: str, b: str) -> bool:
    """Whether something under license ``a`` may be part of a work published under ``b``."""
    if a == b:
        return True
    if forbids_derivatives(a):
        return False
    la, lb = _level(a), _level(b)
    if la is not None:
        return la <= lb if lb is not None else True
    m = _CC.match(a)
    if m and m.group("nc") and not m.group("sa"):  # cc-by-nc-V may go into cc-by-nc-sa-V
        return b == f"cc-by-nc-sa-{m.group('v')}"
    return b in INTO.get(a, ())


@dataclass
class LicenseDecision:
    license: str | None
    """The license to publish under (None: the card names none)."""
    ok: bool
    reason: str = ""
    """Why not (when not ``ok``)."""
    unlicensed: list[str] = field(default_factory=list)
    """Who has no readable license (then the merge is refused)."""
    blocking: bool = False
    """Refused for an input's own terms (no derivatives, license unreadable): a failure, not a choice."""
    license_name: str | None = None
    """``license_name`` for the card, when the license is ``other``."""
    license_link: str | None = None

    @property
    def card_license(self) -> str | None:
        """The ``license:`` to put in the card (``other:name`` is ``other``: the card keeps its ``license_name``)."""
        if self.license and self.license.startswith("other:"):
            return "other"
        return self.license


def _as_license(lic: LicenseLike) -> License:
    if isinstance(lic, License):
        return lic
    return read({"license": lic})


def combine(licenses: Sequence[tuple[str, LicenseLike]], output: str | None = None) -> LicenseDecision:
    """The license of a merge of models with these ``(who, license)``; the base first.

    A license is a :class:`License` (:func:`read`) or a license ID. ``output``: the license the
    pipeline wants to publish under.
    """
    read_ = [(who, _as_license(lic)) for who, lic in licenses]
    unlicensed = [who for who, lic in read_ if lic.error]
    for who, lic in read_:
        if lic.error:
            return LicenseDecision(None, False, f"{who}: license cannot be read ({lic.error})", unlicensed, True)
        for i in lic.ids:
            if forbids_derivatives(i):
                return LicenseDecision(None, False, f"{who} is licensed {i}, whose terms forbid derivatives (ND); "
                                                    "a merge is one", unlicensed, True)
    extra = {i: lic for _, lic in read_ for i in lic.ids if i.startswith("other:")}

    def decided(target: str) -> LicenseDecision:
        src = extra.get(target)
        return LicenseDecision(target, True, "", [], False, src.name if src else None, src.link if src else None)

    known = [(who, i) for who, lic in read_ for i in lic.ids]
    if output:
        output = normalize(output) or output.strip().lower()
        bad = [(who, i) for who, i in known if not may_go_into(i, output)]
        if bad:
            who, i = bad[0]
            nc = " (non-commercial)" if non_commercial(i) else ""
            return LicenseDecision(None, False, f"{who} is licensed {i}{nc}, which may not be published under {output}")
        return decided(output)
    if not known:
        return LicenseDecision(None, False, "no license is known", unlicensed, True)
    ids = list(dict.fromkeys(i for _, i in known))
    base = read_[0][1].ids if read_ else ()
    if len(base) == 1 and all(may_go_into(i, base[0]) for i in ids):
        return decided(base[0])
    targets = [t for t in ids if all(may_go_into(i, t) for i in ids)]
    if targets:
        # the most restrictive: the one the others may go into, not the reverse (permissive: the highest level)
        targets.sort(key=lambda t: (sum(may_go_into(t, u) for u in ids), t))
        return decided(targets[0])
    listed = ", ".join(f"{who}: {i}" for who, i in known)
    return LicenseDecision(None, False, f"licenses cannot be combined ({listed})")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


__all__ = ["License", "read", "combine", "normalize", "may_go_into", "forbids_derivatives", "non_commercial",
           "LicenseDecision", "PERMISSIVE", "INTO"]
