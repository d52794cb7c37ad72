"""Which license may a merge be published under? A small, explicit and conservative table.

A merge is a derivative of the base and of every input, so its license must be one that each of
their licenses allows a derivative to carry. hubsoup knows three groups (license IDs as the Hub
writes them in a card's ``license:``); this is a simplification to catch the common mistakes in
unattended pipelines, not legal advice:

* **permissive**, by increasing obligations: ``cc0-1.0``, ``unlicense`` (0) < ``mit``,
  ``bsd-2-clause``, ``bsd-3-clause`` (1) < ``apache-2.0``, ``cc-by-4.0`` (2). A permissive license
  may go into one at the same or a higher level, and into any non-permissive license.
* **copyleft / non-commercial**, each only into itself or what :data:`INTO` lists:
  ``lgpl-3.0`` → ``gpl-3.0``, ``agpl-3.0``; ``gpl-3.0`` → ``agpl-3.0``; ``agpl-3.0``;
  ``cc-by-sa-4.0``; ``cc-by-nc-4.0`` → ``cc-by-nc-sa-4.0``; ``cc-by-nc-sa-4.0``.
* **anything else** (model licenses such as ``llama3``, ``gemma``, ``openrail``; ``other`` with its
  ``license_name``; IDs not listed here) only into itself.

The output license: the pipeline's ``license.output`` when every license may go into it, else
the base's license when every input's may go into it, else the most restrictive of the inputs'
licenses into which all may go. No such license → the merge is refused (``license.allow_mix``
publishes it anyway, without a license in the card). A card without a license does not block a
merge (fine-tunes often omit it); it is reported.

Example:
    >>> combine([("base", "apache-2.0"), ("org/a", "mit")]).license
    'apache-2.0'
    >>> combine([("base", "apache-2.0"), ("org/nc", "cc-by-nc-4.0")]).license
    'cc-by-nc-4.0'
    >>> combine([("base", "apache-2.0"), ("org/nc", "cc-by-nc-4.0")], output="apache-2.0").ok
    False
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

PERMISSIVE = {"cc0-1.0": 0, "unlicense": 0, "mit": 1, "bsd-2-clause": 1, "bsd-3-clause": 1,
              "apache-2.0": 2, "cc-by-4.0": 2}
INTO = {
    "lgpl-3.0": {"gpl-3.0", "agpl-3.0"},
    "gpl-3.0": {"agpl-3.0"},
    "agpl-3.0": set(),
    "cc-by-sa-4.0": set(),
    "cc-by-nc-4.0": {"cc-by-nc-sa-4.0"},
    "cc-by-nc-sa-4.0": set(),
}
NON_COMMERCIAL = {"cc-by-nc-4.0", "cc-by-nc-sa-4.0"}


def normalize(license: object, license_name: object = None) -> str | None:
    """A card's ``license`` as one lower-case ID (``other`` carries its ``license_name``); None if absent."""
    if isinstance(license, list):
        license = license[0] if len(license) == 1 else None
    if not isinstance(license, str) or not license.strip():
        return None
    lic = license.strip().lower()
    if lic == "other" and isinstance(license_name, str) and license_name.strip():
        return f"other:{license_name.strip().lower()}"
    return lic


def may_go_into(a: str, b: str) -> bool:
    """Whether something under license ``a`` may be part of a work published under ``b``."""
    if a == b:
        return True
    if a in PERMISSIVE:
        return PERMISSIVE[a] <= PERMISSIVE[b] if b in PERMISSIVE else True
    return b in INTO.get(a, ())


@dataclass
class LicenseDecision:
    license: str | None
    """The license to publish under (None: the card names none)."""
    ok: bool
    reason: str = ""
    """Why not (when not ``ok``)."""
    unlicensed: list[str] = field(default_factory=list)
    """Who names no license."""

    @property
    def card_license(self) -> str | None:
        """The ``license:`` to put in the card (``other:name`` is ``other``: the card keeps its ``license_name``)."""
        if self.license and self.license.startswith("other:"):
            return "other"
        return self.license


def combine(licenses: Sequence[tuple[str, str | None]], output: str | None = None) -> LicenseDecision:
    """The license of a merge of models with these ``(who, license)``; the base first.

    ``output``: the license the pipeline wants to publish under.
    """
    unlicensed = [who for who, lic in licenses if not lic]
    known = [(who, lic) for who, lic in licenses if lic]
    if output:
        output = normalize(output) or output
        bad = [(who, lic) for who, lic in known if not may_go_into(lic, output)]
        if bad:
            who, lic = bad[0]
            nc = " (non-commercial)" if lic in NON_COMMERCIAL else ""
            return LicenseDecision(None, False, f"{who} is licensed {lic}{nc}, which may not be published under "
                                                f"{output}", unlicensed)
        return LicenseDecision(output, True, "", unlicensed)
    if not known:
        return LicenseDecision(None, True, "", unlicensed)
    ids = list(dict.fromkeys(lic for _, lic in known))
    base_lic = licenses[0][1] if licenses else None
    if base_lic and all(may_go_into(lic, base_lic) for lic in ids):
        return LicenseDecision(base_lic, True, "", unlicensed)
    targets = [t for t in ids if all(may_go_into(lic, t) for lic in ids)]
    if targets:
        # the most restrictive: the one the others may go into, not the reverse (permissive: the highest level)
        targets.sort(key=lambda t: (sum(may_go_into(t, u) for u in ids), t))
        return LicenseDecision(targets[0], True, "", unlicensed)
    listed = ", ".join(f"{who}: {lic}" for who, lic in known)
    return LicenseDecision(None, False, f"licenses cannot be combined ({listed})", unlicensed)


__all__ = ["combine", "normalize", "may_go_into", "LicenseDecision", "PERMISSIVE", "INTO"]
