"""hubsoup: model soups from the Hugging Face Hub.

Merge fine-tunes of one base model (Hub repo IDs or local folders) with the methods
of the model-merging literature, streaming tensor by tensor, and get a standard
``save_pretrained`` checkpoint with a model card that says how it was made.

Example:
    >>> import hubsoup
    >>> result = hubsoup.merge(["org/ft-a", "org/ft-b"], method="ties",
    ...                        base="org/base", out="./soup")        # doctest: +SKIP
    >>> print(result)                                                 # doctest: +SKIP
"""

__version__ = "0.1.0"

from hubsoup.errors import HubsoupError  # noqa: E402
from hubsoup.api import MergeResult, merge  # noqa: E402

__all__ = ["merge", "MergeResult", "HubsoupError", "__version__"]
