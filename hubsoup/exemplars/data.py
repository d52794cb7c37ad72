"""Exemplars: where they come from (files, saved datasets, the Hub), which task they belong to, and batches."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from hubsoup.errors import ExemplarError, InputError, MethodError
from hubsoup.hubclient import Token
from hubsoup.sources.access import hub_only, load_hub_dataset, require_hub_dataset

if TYPE_CHECKING:  # the method kit's types only: methods (LOT) import exemplars, not the reverse
    import datasets  # and datasets' (~7 s to import: loaded lazily where exemplars are read)

    from hubsoup.methods import InputInfo

log = logging.getLogger(__name__)


# --- exemplars ----------------------------------------------------------------------------

_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet",
             ".txt": "text", ".arrow": "arrow"}


def parse_exemplar_specs(specs: Sequence[str] | dict[Any, Any] | None) -> dict[str, str]:
    """``["task=path", ...]`` (or a dict) → ``{task: path}``."""
    if not specs:
        return {}
    if isinstance(specs, dict):
        return {str(k): str(v) for k, v in specs.items()}
    out = {}
    for s in specs:
        if "=" not in s:
            raise ExemplarError(f"exemplars: expected TASK=PATH_OR_DATASET, got {s!r}")
        k, v = s.split("=", 1)
        k, v = k.strip(), v.strip()
        if not k or not v:
            raise ExemplarError(f"exemplars: expected TASK=PATH_OR_DATASET, got {s!r}")
        if k in out:
            raise ExemplarError(f"exemplars: task {k!r} is given twice")
        out[k] = v
    return out


def load_exemplar_rows(spec: str, task: str, n: int, seed: int = 0, *, token: Token) -> datasets.Dataset:
    """Up to ``n`` rows (a ``datasets.Dataset``) from a local file/folder or a Hub dataset ID (asked with ``token``,
    the run's: :attr:`hubsoup.methods.PrepareContext.token`; no default, so a caller cannot forget it).

    ``org/name`` or ``org/name:split`` (default split ``train``); files by extension
    (json/jsonl/csv/tsv/parquet/txt/arrow); a folder saved with ``save_to_disk`` or of such
    files. More rows than ``n``: a seeded random sample (the paper draws them at random).
    """
    import datasets  # lazy: datasets costs ~7 s to import here (torch ~6 s); only LOT's exemplars from the Hub need it

    if hub_only():  # a server's run: a Hub dataset by its name alone, never a path of the host
        require_hub_dataset(spec, f"exemplars for task '{task}'")
    where = f"exemplars for task '{task}' ({spec})"
    path, local = os.path.expanduser(spec), not hub_only()
    try:
        if local and os.path.isfile(path):
            ext = os.path.splitext(path)[1].lower()
            if ext not in _BUILDERS:
                raise ExemplarError(f"{where}: unknown file type {ext!r}; use one of {', '.join(sorted(_BUILDERS))}")
            kw = {"delimiter": "\t"} if ext == ".tsv" else {}
            ds = datasets.load_dataset(_BUILDERS[ext], data_files=path, split="train", **kw)
        elif local and os.path.isdir(path):
            if os.path.isfile(os.path.join(path, "dataset_info.json")) or os.path.isfile(os.path.join(path, "state.json")):
                ds = datasets.load_from_disk(path)
            else:
                ds = datasets.load_dataset(path)
        else:
            name, _, split = spec.partition(":")
            if hub_only():  # the Hub with this run's token and cache, never a folder of the host
                ds = load_hub_dataset(name, f"exemplars for task '{task}'", token=token, split=split or "train")
            else:
                ds = datasets.load_dataset(name, split=split or "train", token=token)
    except InputError:  # ours (an ExemplarError, a hub_only refusal): already one clear line
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; one clear line
        raise ExemplarError(f"{where}: cannot load ({type(e).__name__}: {e})") from e
    if isinstance(ds, (datasets.DatasetDict, dict)):
        split = "train" if "train" in ds else next(iter(ds))
        ds = ds[split]
    if len(ds) == 0:
        raise ExemplarError(f"{where}: the dataset is empty")
    if len(ds) > n:
        ds = ds.shuffle(seed=seed).select(range(n))
    elif len(ds) < n:
        log.warning("%s: only %d rows, fewer than n_exemplars=%d; using them all", where, len(ds), n)
    return ds


def _text_column(ds: datasets.Dataset, where: str, text_column: str | None) -> str:
    if text_column:
        if text_column not in ds.column_names:
            raise ExemplarError(f"{where}: no column {text_column!r} (columns: {', '.join(ds.column_names)})")
        return text_column
    if "text" in ds.column_names:
        return "text"
    strings: list[str] = [c for c, f in ds.features.items() if getattr(f, "dtype", None) in ("string", "large_string")]
    if len(strings) == 1:
        return strings[0]
    raise ExemplarError(
        f"{where}: cannot tell which column to tokenize (columns: {', '.join(ds.column_names)}); "
        "give a 'text' column, a single string column, 'input_ids', or pass --param text_column=NAME")


@dataclass
class Batch:
    inputs: dict[str, torch.Tensor]
    mask: torch.Tensor | None
    """(B, S) bool: real (not padding) positions, for ops whose rows are token positions."""


def make_batches(ds: datasets.Dataset, task: str, spec: str, *, tokenizer: Any, vocab_size: int | None,
                 max_length: int, batch_size: int, text_column: str | None = None) -> list[Batch]:
    """Tokenised, right-padded batches (or ``pixel_values`` batches) of one task's exemplars."""
    where = f"exemplars for task '{task}' ({spec})"
    if "pixel_values" in ds.column_names:
        px = torch.tensor(ds["pixel_values"], dtype=torch.float32)
        return [Batch({"pixel_values": px[i:i + batch_size]}, None) for i in range(0, len(px), batch_size)]
    if "input_ids" in ds.column_names:
        seqs = [list(map(int, r))[:max_length] for r in ds["input_ids"]]
    else:
        col = _text_column(ds, where, text_column)
        if tokenizer is None:
            raise ExemplarError(f"{where}: the base model has no tokenizer to tokenize column '{col}'; "
                                "add one to the base folder, or give exemplars as input_ids")
        texts = ds[col]
        bad = [i for i, t in enumerate(texts) if not isinstance(t, str) or not t.strip()]
        if bad:
            raise ExemplarError(f"{where}: row {bad[0]} of column '{col}' is not a non-empty string "
                                f"({texts[bad[0]]!r}); it cannot be tokenized")
        try:
            enc = tokenizer(list(texts), truncation=True, max_length=max_length, add_special_tokens=True)
        except Exception as e:  # noqa: BLE001
            raise ExemplarError(f"{where}: the base's tokenizer failed on them ({type(e).__name__}: {e})") from e
        seqs = [list(ids) for ids in enc["input_ids"]]
    empty = [i for i, s in enumerate(seqs) if not s]
    if empty:
        raise ExemplarError(f"{where}: row {empty[0]} tokenizes to no tokens")
    top = max(max(s) for s in seqs)
    if vocab_size is not None and (top >= vocab_size or min(min(s) for s in seqs) < 0):
        raise ExemplarError(f"{where}: token id {top} is outside the model's vocabulary of {vocab_size}; "
                            "the tokenizer does not belong to this base model")
    pad = 0
    if tokenizer is not None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    batches = []
    for i in range(0, len(seqs), batch_size):
        chunk = seqs[i:i + batch_size]
        L = max(len(s) for s in chunk)
        ids = torch.full((len(chunk), L), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), L), dtype=torch.bool)
        for j, s in enumerate(chunk):
            ids[j, :len(s)] = torch.tensor(s)
            mask[j, :len(s)] = True
        batches.append(Batch({"input_ids": ids, "attention_mask": mask.long()}, mask))
    return batches


def _task_names(info: InputInfo, i: int) -> set[str]:
    names = {str(i + 1), info.label, info.spec, info.spec.rstrip("/")}
    if info.repo_id:
        names |= {info.repo_id, info.repo_id.split("/")[-1]}
    if info.path:
        names |= {os.path.basename(os.path.abspath(info.path)), os.path.abspath(info.path)}
    return {n for n in names if n}


def match_tasks(inputs: Sequence[InputInfo], specs: dict[str, str]) -> list[tuple[int, str, str]]:
    """(input index, task name, exemplar spec) for every input; clear errors otherwise.

    A task is named by the input as given, its folder name, its repo name (``org/name`` or
    ``name``) or its 1-based position.
    """
    names = [_task_names(src, i) for i, src in enumerate(inputs)]
    taken: dict[int, str] = {}
    for task in specs:
        hits = [i for i, n in enumerate(names) if task in n]
        if not hits:
            raise MethodError(f"LOT: exemplars given for task '{task}', which names no input; name a task by the "
                              "input as given, its folder or repo name, or its position (1, 2, ...): "
                              + ", ".join(src.label for src in inputs))
        if len(hits) > 1:
            raise MethodError(f"LOT: task name '{task}' fits inputs {', '.join(str(h + 1) for h in hits)}; "
                              "name them by position (1, 2, ...)")
        if hits[0] in taken:
            raise MethodError(f"LOT: input {hits[0] + 1} ('{inputs[hits[0]].label}') has exemplars twice "
                              f"('{taken[hits[0]]}' and '{task}')")
        taken[hits[0]] = task
    missing = [i for i in range(len(inputs)) if i not in taken]
    if missing:
        i = missing[0]
        raise MethodError(f"LOT needs exemplars for every task; none for input {i + 1} ('{inputs[i].label}'): "
                          f"pass --exemplars {sorted(names[i], key=len)[0]}=PATH_OR_DATASET")
    return [(i, taken[i], specs[taken[i]]) for i in range(len(inputs))]
