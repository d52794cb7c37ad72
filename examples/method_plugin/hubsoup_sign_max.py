"""An example of a merge method in a package of its own (hubsoup finds it through the ``hubsoup.methods``
entry-point group; see this folder's ``pyproject.toml``).

τ = mean(sign(τᵢ)) · max|τᵢ| · scale, entry by entry: the inputs' agreement on a direction times the largest move.

Example:
    >>> import torch
    >>> from hubsoup.testing import merge_tensors
    >>> taus = [torch.tensor([1.0, -2.0, 0.5]), torch.tensor([3.0, 1.0, -0.5])]
    >>> merge_tensors("sign_max", taus).tolist()
    [3.0, 0.0, 0.0]
"""

from __future__ import annotations

from dataclasses import dataclass

from hubsoup.methods import Method, param, register


@dataclass
class SignMaxParams:
    scale: float = param(1.0, "λ: scale of the merged task vector", range=(None, None))


@register
class SignMax(Method):
    name = "sign_max"
    summary = "Mean of the task vectors' signs times their largest magnitude, entry by entry."
    Params = SignMaxParams
    scale_param = "scale"
    elementwise = True  # entry by entry: the engine may merge full fine-tunes in pieces
    workspace_copies = 1  # |τ| and the signs, one tensor at a time

    def merge(self, base, deltas, params, ctx):
        biggest = deltas.abs().amax(dim=0)
        return deltas.sign_().mean(dim=0).mul_(biggest).mul_(params.scale)
