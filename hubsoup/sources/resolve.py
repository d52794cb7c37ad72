"""Turn an input spec (``org/name@rev`` or a folder) into a :class:`Checkpoint`.

Hub inputs are pinned: the revision is resolved to a commit SHA once, and every
file is then downloaded at that SHA, so a push to the repo during a merge cannot
mix two versions. Metadata (config, card, index) is fetched first; weights only
when the engine opens them, after the inputs were checked against the base.
"""

from __future__ import annotations

import json
import os
import re

from hubsoup.errors import InputError
from hubsoup.sources.checkpoint import Checkpoint, InputRef

METADATA_FILES = [
    "config.json",
    "adapter_config.json",
    "README.md",
    "generation_config.json",
    "*.safetensors.index.json",
    "*.bin.index.json",
]
TOKENIZER_FILES = [
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab*",
    "merges.txt",
    "*.model",
    "chat_template*",
    "preprocessor_config.json",
]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def parse_spec(spec: str) -> tuple[str, str | None]:
    """Split ``org/name@revision`` into ``(repo_id, revision)``.

    >>> parse_spec("org/model@v1.0")
    ('org/model', 'v1.0')
    >>> parse_spec("org/model")
    ('org/model', None)
    """
    if "@" in spec:
        repo_id, rev = spec.rsplit("@", 1)
        return repo_id, rev or None
    return spec, None



def open_input(spec: str, *, allow_pickle: bool = False, token: str | bool | None = None,
               with_tokenizer: bool = False) -> Checkpoint:
    """Open an input given as a local folder or a Hub repo ID (``org/name[@revision]``).

    Example:
        >>> ckpt = open_input("./my-finetune")            # doctest: +SKIP
        >>> ckpt = open_input("org/model@main")           # doctest: +SKIP
        >>> ckpt.ref.sha                                  # doctest: +SKIP
        '3f1c...'
    """
    expanded = os.path.expanduser(spec)
    if os.path.isdir(expanded):
        return _local(spec, expanded, allow_pickle)
    if os.path.exists(expanded):
        raise InputError(f"input '{spec}': is a file; give the folder that holds config.json and the weights")
    repo_id, revision = parse_spec(spec)
    if spec.startswith((".", "/", "~")) or repo_id.count("/") > 1 or not _REPO_ID.match(repo_id):
        raise InputError(f"input '{spec}': no such local folder, and not a valid Hub repo ID (org/name[@revision])")
    return _hub(spec, repo_id, revision, allow_pickle, token, with_tokenizer)


def _local(spec: str, folder: str, allow_pickle: bool) -> Checkpoint:
    kind = "lora" if os.path.isfile(os.path.join(folder, "adapter_config.json")) else "full"
    if kind == "full" and not os.path.isfile(os.path.join(folder, "config.json")):
        raise InputError(f"input '{spec}': no config.json in {folder}; is this a model folder?")
    ref = InputRef(spec=spec, path=os.path.abspath(folder), kind=kind)
    return Checkpoint(ref=ref, folder=folder, allow_pickle=allow_pickle)


def _hub(spec, repo_id, revision, allow_pickle, token, with_tokenizer) -> Checkpoint:
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    def fail(e: Exception) -> InputError:
        if isinstance(e, GatedRepoError):
            return InputError(f"input '{spec}': the repo is gated; accept its terms on the Hub and log in (hf auth login or HF_TOKEN)")
        if isinstance(e, RevisionNotFoundError):
            return InputError(f"input '{spec}': revision '{revision}' not found in {repo_id}")
        if isinstance(e, RepositoryNotFoundError):
            return InputError(
                f"input '{spec}': repo {repo_id} not found on {constants.ENDPOINT} "
                "(or it is private and no valid token was given: log in with `hf auth login` or set HF_TOKEN)"
            )
        if isinstance(e, LocalEntryNotFoundError) or constants.HF_HUB_OFFLINE:
            return InputError(
                f"input '{spec}': not a local folder, and {repo_id}"
                f"{'@' + revision if revision else ''} is not in the local Hub cache while offline "
                "(HF_HUB_OFFLINE=1)"
            )
        if isinstance(e, HfHubHTTPError):
            return InputError(f"input '{spec}': Hub request failed: {e}")
        return InputError(f"input '{spec}': cannot reach the Hub ({type(e).__name__}: {e})")

    try:
        if constants.HF_HUB_OFFLINE:
            # offline: whatever the cache holds for that revision, pinned to its snapshot sha
            folder = snapshot_download(repo_id, revision=revision, token=token, local_files_only=True)
            sha = os.path.basename(folder.rstrip("/"))
        else:
            sha = HfApi().model_info(repo_id, revision=revision, token=token).sha
            patterns = METADATA_FILES + (TOKENIZER_FILES if with_tokenizer else [])
            folder = snapshot_download(repo_id, revision=sha, token=token, allow_patterns=patterns)
    except Exception as e:  # noqa: BLE001 - mapped to one clear line
        raise fail(e) from e

    kind = "lora" if os.path.isfile(os.path.join(folder, "adapter_config.json")) else "full"
    ref = InputRef(spec=spec, repo_id=repo_id, revision=revision, sha=sha, path=folder, kind=kind)

    def fetch_weights() -> None:
        if constants.HF_HUB_OFFLINE:
            return
        index = os.path.join(folder, "model.safetensors.index.json")
        try:
            if os.path.isfile(index):
                # exactly the shards the index names (repos often carry other *.safetensors too)
                with open(index, encoding="utf-8") as f:
                    patterns = sorted(set(json.load(f).get("weight_map", {}).values()))
            elif kind == "lora":
                patterns = ["adapter_model.safetensors"] + (["adapter_model.bin"] if allow_pickle else [])
            else:
                files = HfApi().list_repo_files(repo_id, revision=sha, token=token)
                if "model.safetensors" in files:
                    patterns = ["model.safetensors"]
                elif any(f.endswith(".safetensors") and "/" not in f for f in files):
                    patterns = ["*.safetensors"]
                else:  # pickle only: fetched only when the user allows loading it
                    patterns = ["pytorch_model*.bin"] if allow_pickle else []
            if patterns:
                snapshot_download(repo_id, revision=sha, token=token, allow_patterns=patterns)
        except Exception as e:  # noqa: BLE001
            raise fail(e) from e

    return Checkpoint(ref=ref, folder=folder, fetch_weights=fetch_weights, allow_pickle=allow_pickle)
