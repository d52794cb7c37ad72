"""The recipe: everything that determines a merge, with a stable hash.

The CLI flags and the Python API both build a recipe; it is stored in the output's
safetensors metadata and as ``hubsoup_recipe.yaml`` beside the weights, and its
hash seeds every random choice (e.g. DARE's masks), so a rerun repeats exactly.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

import yaml

RECIPE_FILE = "hubsoup_recipe.yaml"


@dataclass
class Recipe:
    method: str
    params: dict[str, Any]
    base: dict[str, Any]
    inputs: list[dict[str, Any]]
    dtype: str | None = None
    hubsoup_version: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def identity(self) -> dict[str, Any]:
        """What the hash covers: method, parameters, exact inputs (by SHA when on the Hub), dtype."""
        def pin(ref: dict) -> dict:
            return {k: ref.get(k) for k in ("repo_id", "sha", "path", "kind") if ref.get(k) is not None}
        ident = {"method": self.method, "params": self.params, "base": pin(self.base),
                 "inputs": [pin(i) for i in self.inputs], "dtype": self.dtype}
        if self.extra.get("options"):
            ident["options"] = self.extra["options"]
        return ident

    @property
    def hash(self) -> str:
        blob = json.dumps(self.identity(), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["hash"] = self.hash
        return d

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)

    @classmethod
    def from_yaml(cls, text: str) -> "Recipe":
        d = yaml.safe_load(text)
        d.pop("hash", None)
        return cls(**d)
