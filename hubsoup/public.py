"""What may be published: the rules that name a local file or folder without its path.

A leaf (it imports only :mod:`hubsoup.untrusted`): the recipe, the card, evaluation details, the push and
a mergekit config's public text all follow these rules, so none of them imports another for them.

Example:
    >>> looks_local("org/model"), looks_local("./my-finetune")
    (False, True)
    >>> public_value({"scale": 0.5, "ref": "org/model"})
    {'scale': 0.5, 'ref': 'org/model'}
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any, Callable, Iterator, Mapping, TypeGuard, cast

import yaml

from hubsoup.errors import ParameterError
from hubsoup.untrusted import load_yaml


def looks_local(value: Any) -> TypeGuard[str]:
    """Whether a string names a file or folder of this machine (not a Hub ID or a plain value)."""
    if not isinstance(value, str) or not value or "\n" in value:
        return False
    if value.startswith(("/", "~", "./", "../", "\\")) or re.match(r"^[A-Za-z]:[\\/]", value):
        return True
    return ("/" in value or os.sep in value) and os.path.exists(value)


def public_file_ref(path: str) -> str:
    """A local file or folder named without its path: ``name@sha256:<12 hex>`` of its content.

    A file is hashed whole; a folder by its files' relative names, sizes and first 64 KiB. A path
    that no longer exists keeps only its name (its path is never hashed: that could be guessed).
    """
    p = os.path.expanduser(path)
    name = os.path.basename(os.path.normpath(p)) or "local"
    h = hashlib.sha256()
    if os.path.isfile(p):
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    elif os.path.isdir(p):
        for root, dirs, files in os.walk(p):
            dirs.sort()
            for fn in sorted(files):
                fp = os.path.join(root, fn)
                h.update(f"{os.path.relpath(fp, p)}\0{os.path.getsize(fp)}\0".encode())
                with open(fp, "rb") as f:
                    h.update(f.read(64 * 1024))
    else:
        return f"{name}@local"
    return f"{name}@sha256:{h.hexdigest()[:12]}"


def public_value(value: Any) -> Any:
    """``value`` with every string that names a local file replaced by :func:`public_file_ref` (also ``KEY=PATH``)."""
    if isinstance(value, dict):
        return {k: public_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [public_value(v) for v in value]
    if isinstance(value, str):
        if looks_local(value):
            return public_file_ref(value)
        key, sep, rest = value.partition("=")
        if sep and looks_local(rest):
            return f"{key}={public_file_ref(rest)}"
    return value


# top-level folders of a system, which name nothing of the user's (``/usr/bin/time`` in a card is not a leak)
_SYSTEM_DIRS = frozenset({"usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "proc", "sys", "dev",
                          "boot", "run", "snap", "System", "Library", "Applications"})
# an absolute path in text: not inside a URL (no ``://``-host or word before its slash), two components at least
_ABS_PATH = re.compile(r"(?:^|(?<=[\s\"'`(=,:;\[{<>|*])|(?<=file://))(/[\w.@+~-]+(?:/[\w.@+~-]*)+)")
_WINDOWS_PATH = re.compile(r"(?<![\w/])([A-Za-z]:\\[^\s\"'<>|]+)")
_TEXT_LIMIT = 32 * 1024 * 1024


def local_paths_in_text(text: str) -> list[str]:
    """The absolute paths of this machine that ``text`` holds: a path whose top folder exists here and is not a
    system folder (``/tmp/...``, ``/home/...``, ``/work/...``; not ``/usr/...``, not a URL's path), and the home folder.

    Example:
        >>> local_paths_in_text('see https://huggingface.co/org/x and /usr/bin/time') == []
        True
        >>> local_paths_in_text('data_files: /tmp/tasks/toy.jsonl')
        ['/tmp/tasks/toy.jsonl']
    """
    found = []
    home = os.path.expanduser("~").rstrip("/\\")
    if len(home) > 1 and home + os.sep in text:
        found.append(home + os.sep)
    for m in _ABS_PATH.finditer(text):
        path = m.group(1)
        top = path.split("/")[1]
        if top and top not in _SYSTEM_DIRS and os.path.isdir("/" + top):
            found.append(path)
    if os.name == "nt":  # pragma: no cover - a drive path is this machine's only where drives exist
        found += [p for p in _WINDOWS_PATH.findall(text) if os.path.exists(p.split("\\")[0] + "\\")]
    return found


def _strings(value: Any) -> Iterator[str]:
    """Every string value of parsed JSON (not the keys: a tokenizer's vocabulary is keys)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def local_path_in_file(name: str, content: str | bytes) -> str | None:
    """The first local path (:func:`local_paths_in_text`) that a file to publish holds, or None.

    ``content`` is the file's bytes or its local path. JSON is read by its string values, a safetensors file by
    its header's metadata, any other file that is UTF-8 text (YAML, markdown, a template, ...) as text; other
    binary files carry no text to check.
    """
    if isinstance(content, bytes):
        data = content
    elif name.endswith(".safetensors"):
        with open(content, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            data = f.read(min(n, 100 * 1024 * 1024))
    else:
        if os.path.getsize(content) > _TEXT_LIMIT:
            return None
        with open(content, "rb") as f:
            data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if name.endswith((".json", ".safetensors")):
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
        if parsed is not None:
            hits = [p for s in _strings(parsed) for p in local_paths_in_text(s)]
            return hits[0] if hits else None
    hits = local_paths_in_text(text)
    return hits[0] if hits else None


def public_config_text(text: str) -> str:
    """The config with every local model folder named by its public form (name and content digest)."""
    try:
        data = load_yaml(text, "mergekit config")
    except ParameterError:
        return text
    pub = map_models(data, lambda ref: public_value(ref) if isinstance(ref, str) else ref)
    if pub == data:
        return text
    return dump_config(pub)


class _Dumper(yaml.SafeDumper):  # type: ignore[misc]  # PyYAML ships no stubs (types-PyYAML not installed)
    """mergekit's layout: lists of numbers (layer ranges, gradients) in flow style."""


_Dumper.add_representer(list, lambda d, v: d.represent_sequence(
    "tag:yaml.org,2002:seq", v, flow_style=all(isinstance(e, (int, float)) for e in v)))


def dump_config(data: Mapping[str, Any]) -> str:
    """A config as YAML, in the layout mergekit itself writes."""
    return cast(str, yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True))  # no stream: the text


def map_models(data: Any, fn: Callable[[str], str]) -> Any:
    """``data`` (a parsed config) with ``fn`` applied to every model reference."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    if isinstance(out.get("modules"), dict):  # each module is a config of its own shape
        out["modules"] = {k: map_models(v, fn) for k, v in out["modules"].items()}
    for key in ("base_model", "tokenizer_source"):
        if isinstance(out.get(key), str) and out[key] not in ("base", "union"):
            out[key] = fn(out[key])
    if isinstance(out.get("tokenizer"), dict):  # the tokenizer section's source and tokens' models
        out["tokenizer"] = _map_tokenizer_models(out["tokenizer"], fn)
    if isinstance(out.get("models"), list):
        out["models"] = [{**m, "model": fn(m["model"])} if isinstance(m, dict) and "model" in m else m
                         for m in out["models"]]
    if isinstance(out.get("slices"), list):
        out["slices"] = [{**s, "sources": [{**x, "model": fn(x["model"])} if isinstance(x, dict) and "model" in x
                                           else x for x in s.get("sources") or []]} if isinstance(s, dict) else s
                         for s in out["slices"]]
    return out


def _map_tokenizer_models(section: dict[str, Any], fn: Callable[[str], str]) -> dict[str, Any]:
    out = dict(section)
    if isinstance(out.get("source"), str) and out["source"] not in ("base", "union"):
        out["source"] = fn(out["source"])
    if isinstance(out.get("tokens"), dict):
        tokens = {}
        for tok, setting in out["tokens"].items():
            if isinstance(setting, dict):
                src = setting.get("source")
                if isinstance(src, str):
                    setting = {**setting, "source": fn(src)}
                elif isinstance(src, dict) and isinstance(src.get("model"), str):
                    setting = {**setting, "source": {**src, "model": fn(src["model"])}}
            tokens[tok] = setting
        out["tokens"] = tokens
    return out


def resign_state_json(text: str) -> str:
    """``state.json`` text whose fields were rewritten (local paths made public at push time), checksummed again."""
    d = json.loads(text)
    d.pop("checksum", None)
    d["checksum"] = json_digest(d)
    return json.dumps(d, indent=2)


def json_digest(d: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()
