"""Where a merge goes: the output folder and the sinks the engine writes into.

* :mod:`hubsoup.output.folder` — :class:`OutputFolder` (lock, temporary folder, atomic rename,
  recovery after a crash), :func:`lock_output`, :func:`check_output`.
* :mod:`hubsoup.output.shards` — :class:`ShardedWriter`, sharded safetensors written in place.
* :mod:`hubsoup.output.checkpoint` — :class:`CheckpointSink`, a full ``save_pretrained`` checkpoint.
* :mod:`hubsoup.output.lora` — :class:`LoraSink`, the merged task vector as a PEFT adapter.
"""

from hubsoup.output.folder import OutputFolder, OutputLock, check_output, lock_output
from hubsoup.output.shards import INDEX_NAME, ShardedWriter

__all__ = ["OutputFolder", "OutputLock", "lock_output", "check_output", "ShardedWriter", "INDEX_NAME"]
