"""The store of per-tensor intermediates a method keeps between its statistics pass and its merge.

It lives in the method kit (:mod:`hubsoup.methods._kept`), below the engine, since
:class:`hubsoup.methods.PrepareContext` hands it out; re-exported here for the engine's callers.
"""

from hubsoup.methods._kept import KeptTensors  # noqa: F401
