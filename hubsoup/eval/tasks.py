"""Task specs: what to evaluate, on which data, how."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from hubsoup.errors import ParameterError

KINDS = ("classification", "perplexity")
_LOCAL_FORMATS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


@dataclass
class TaskSpec:
    """One evaluation task.

    Written on the command line as ``KIND:DATA[,key=value...]``, e.g.
    ``classification:data/val.csv,text=sentence,label=label,name=sst`` or
    ``perplexity:org/wiki-sample,split=test,text=text``.
    """

    kind: str
    data: str
    name: str = ""
    split: str = "validation"
    config: str | None = None
    text: str = "text"
    text_pair: str | None = None
    label: str = "label"
    head: str | None = None
    """A frozen classifier head (safetensors with ``weight`` [C, H] and ``bias`` [C]) applied to the
    pooled encoder output; without one the model must have its own classification head."""
    pooling: str = "mean"
    max_length: int = 256
    limit: int | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ParameterError(f"task kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.pooling not in ("mean", "cls"):
            raise ParameterError(f"task '{self.display_name}': pooling must be mean or cls, got {self.pooling!r}")
        if not self.name:
            self.name = os.path.splitext(os.path.basename(self.data.rstrip("/")))[0] or self.data

    @property
    def display_name(self) -> str:
        return self.name or self.data

    @property
    def is_local(self) -> bool:
        return os.path.exists(os.path.expanduser(self.data))

    @classmethod
    def parse(cls, spec: str) -> "TaskSpec":
        if ":" not in spec:
            raise ParameterError(f"task spec {spec!r}: expected KIND:DATA[,key=value...] with KIND one of {', '.join(KINDS)}")
        kind, rest = spec.split(":", 1)
        parts = [p for p in rest.split(",") if p]
        if not parts:
            raise ParameterError(f"task spec {spec!r}: no data given")
        known = {f.name for f in fields(cls)} - {"kind", "data", "extra"}
        kw: dict = {}
        for part in parts[1:]:
            if "=" not in part:
                raise ParameterError(f"task spec {spec!r}: expected key=value, got {part!r}")
            k, v = part.split("=", 1)
            if k not in known:
                raise ParameterError(f"task spec {spec!r}: unknown key {k!r} (known: {', '.join(sorted(known))})")
            kw[k] = int(v) if k in ("max_length", "limit") else v
        return cls(kind=kind.strip(), data=parts[0], **kw)

    def load(self):
        """The task's examples as a ``datasets.Dataset``."""
        import datasets

        try:
            if self.is_local:
                path = os.path.expanduser(self.data)
                fmt = _LOCAL_FORMATS.get(os.path.splitext(path)[1].lower())
                if fmt is None:
                    raise ParameterError(f"task '{self.name}': cannot tell the format of {path} "
                                         f"(use one of {', '.join(_LOCAL_FORMATS)})")
                kw = {"delimiter": "\t"} if path.endswith(".tsv") else {}
                ds = datasets.load_dataset(fmt, data_files=path, split="train", **kw)
            else:
                ds = datasets.load_dataset(self.data, self.config, split=self.split)
        except ParameterError:
            raise
        except Exception as e:  # noqa: BLE001 - one clear line for the user
            raise ParameterError(f"task '{self.name}': cannot load data {self.data!r}: {e}") from e
        need = [self.text] + ([self.label] if self.kind == "classification" else []) + ([self.text_pair] if self.text_pair else [])
        missing = [c for c in need if c not in ds.column_names]
        if missing:
            raise ParameterError(f"task '{self.name}': column {missing[0]!r} not in {self.data} "
                                 f"(columns: {', '.join(ds.column_names)}); set text=/label= in the task spec")
        if self.limit is not None:
            ds = ds.select(range(min(self.limit, len(ds))))
        return ds
