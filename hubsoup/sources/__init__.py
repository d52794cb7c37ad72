"""Where weights come from: local folders and Hub repos (pinned to a commit SHA).

A source knows nothing about merging. It answers three questions about a model:
its configuration (``config.json``, card metadata), which tensors it has with
their shapes and dtypes (read from file headers only), and *give me tensor
``name``* — read lazily, one tensor at a time, from safetensors shards.
"""

from hubsoup.sources.checkpoint import Checkpoint, InputRef
from hubsoup.sources.resolve import open_input

__all__ = ["Checkpoint", "InputRef", "open_input"]
