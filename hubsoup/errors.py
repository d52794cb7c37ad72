"""Every exception hubsoup raises on purpose.

All derive from :class:`HubsoupError`, whose message is one line that names the
input, file or tensor at fault and says what to do. The CLI prints that line and
exits non-zero; ``--verbose`` adds the traceback.

Example:
    >>> import hubsoup
    >>> try:
    ...     hubsoup.merge(["./does-not-exist"], method="linear", base="./base", out="./x")
    ... except hubsoup.HubsoupError as e:
    ...     print(e)  # doctest: +SKIP
    input './does-not-exist': no such local folder and not a valid Hub repo ID
"""

from __future__ import annotations


class HubsoupError(Exception):
    """Base class of hubsoup's own errors."""


# --- INPUT ERRORS: reading models, adapters, states and data -----------------------------------

class InputError(HubsoupError):
    """An input (local folder or Hub repo) cannot be found, opened or read."""


class CorruptCheckpointError(InputError):
    """A weight file is truncated, corrupt or not a safetensors file."""


class PickleRefusedError(InputError):
    """Only pickle (``.bin``/``.pt``) weights exist and ``allow_pickle`` was not given."""


class UnsafePathError(InputError):
    """A checkpoint names a file outside its own folder (absolute path, ``..``, a link leading out)."""


class ContinualStateError(InputError):
    """A continual-merging state is missing, corrupt, or belongs to another base."""


class ExemplarError(InputError):
    """Exemplars for a data-aware method are missing, cannot be loaded, or cannot be tokenized."""


# --- COMPATIBILITY ERRORS: inputs against the base ---------------------------------------------

class BaseModelError(HubsoupError):
    """The base (pre-trained) model cannot be determined or disagrees with the inputs."""


class BaseNotNamedError(BaseModelError):
    """No base was given and an input's card names none (a method that needs no base may go on without)."""


class IncompatibleInputError(HubsoupError):
    """An input does not match the base: architecture, hidden size, tensors or shapes."""


class UnsupportedAdapterError(IncompatibleInputError):
    """A PEFT adapter of a type or with an option hubsoup cannot turn into task vectors."""


class NonFiniteTensorError(HubsoupError):
    """An input tensor holds NaN or infinity, or an output tensor would (the merge or its dtype overflowed)."""


# --- METHOD ERRORS: methods, parameters and options --------------------------------------------

class MethodError(HubsoupError):
    """Unknown method, or a method used with the wrong number of inputs."""


class ParameterError(MethodError):
    """Unknown parameter, unparsable value, or value out of range."""


class PlacementError(ParameterError):
    """A device map or max_memory cannot be read, or a block fits on no device."""


# --- OUTPUT ERRORS: writing and pushing -------------------------------------------------------

class OutputExistsError(HubsoupError):
    """The output folder exists and ``overwrite`` was not given."""


class OutputLockedError(HubsoupError):
    """Another run holds the output (or the continual soup): the message names it (pid, host, start, command)."""


class DiskFullError(HubsoupError):
    """The disk (or quota) filled up while writing the output; the temporary folder was removed."""


class DiskLimitError(HubsoupError):
    """The run's predicted peak local disk exceeds ``max_disk``: refused before any weight was downloaded; the
    message says what it needs, part by part."""


class OutputNotWritableError(HubsoupError):
    """The output's folder is on a read-only file system or not writable by this user."""


class PushError(HubsoupError):
    """Uploading to the Hub failed; the local output is intact."""


class PrivateInputsError(PushError):
    """A public push of a merge whose inputs are private or gated, refused before anything was sent.

    ``repo_id``: the public target; ``inputs``: ``(repo, why)`` of each such input (an app tells its visitor
    from these, without the command line's advice or the server's folder)."""

    def __init__(self, message: str, repo_id: str = "", inputs: "list[tuple[str, str]] | None" = None):
        super().__init__(message)
        self.repo_id = repo_id
        self.inputs = list(inputs or [])


class EvolveError(HubsoupError):
    """An evolutionary search could not give a model (every trial failed), or its storage holds another study."""


class StudyLockedError(EvolveError):
    """Another driver runs the same study (same storage and study name): the message names the storage and it."""


# --- RUN CONTROL ---------------------------------------------------------------------------------

class MergeCancelled(HubsoupError):
    """The run was cancelled (``cancel=`` set or returning True): no output, no temporary folder, nothing uploaded."""
