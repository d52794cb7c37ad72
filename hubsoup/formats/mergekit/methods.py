"""mergekit 0.1.5's merge methods that hubsoup reproduces: the table from ``merge_method`` to a hubsoup method,
its options and how each of mergekit's parameters maps onto hubsoup's (:data:`METHODS`).

Example:
    >>> METHODS["ties"].hub, METHODS["ties"].fixed, METHODS["ties"].params["weight"].hub
    ('ties', {'convention': 'mergekit', 'scope': 'tensor'}, 'weights')
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

REQUIRED = object()


def _mean_or_sum(v: bool) -> str:
    return "mean" if v else "sum"


@dataclass(frozen=True)
class MkParam:
    """How one mergekit parameter maps onto hubsoup's."""

    hub: str | None
    """hubsoup's parameter (None: accepted and ignored, it does not change the result, e.g. int8_mask)."""
    per_input: bool = False
    default: Any = REQUIRED
    kind: type = float
    convert: Callable[[Any], Any] | None = None


@dataclass(frozen=True)
class MkMethod:
    """A mergekit merge method: the hubsoup method and options with its semantics."""

    hub: str
    params: dict[str, MkParam]
    fixed: dict[str, Any] = field(default_factory=dict)
    base: str = "required"
    """``required``, ``optional`` or ``none`` (mergekit's base policy)."""
    base_is_input: bool = False
    """mergekit merges base_model as one of the models (linear, karcher)."""
    use_base_flag: bool = False
    """hubsoup's ``use_base`` says whether base_model was given (nuslerp, multislerp)."""
    result_dtype: str | None = None
    """The dtype mergekit's kernel returns whatever it computes in (None: the compute dtype). ``float32`` for
    arcee_fusion (its mask) and ramplus_tl (its scale): float32 tensors that promote a half-precision result,
    which mergekit then stores when the config has no ``out_dtype``."""


def _gta(hub: str, fixed: dict[str, Any], normalize: bool, rescale: bool, *, normalize_as: str = "normalize",
         extra: dict[str, MkParam] | None = None, sparsify: bool = True) -> MkMethod:
    conv = _mean_or_sum if normalize_as == "merge" else None
    params = {"weight": MkParam("weights", True),
              "density": MkParam("densities" if sparsify else None, True, 1.0),
              "lambda": MkParam("scale", default=1.0),
              "normalize": MkParam(normalize_as, default=normalize, kind=bool, convert=conv),
              "rescale": MkParam("rescale" if sparsify else None, default=rescale, kind=bool),
              "int8_mask": MkParam(None, default=False, kind=bool)}
    params.update(extra or {})
    return MkMethod(hub, params, fixed)


_GAMMA = {"gamma": MkParam("gammas", True, 0.01)}

_EPSILON = {"epsilon": MkParam("epsilons", True, 0.15)}

_MK = {"convention": "mergekit"}

METHODS: dict[str, MkMethod] = {
    "linear": MkMethod("linear", {"weight": MkParam("weights", True), "normalize": MkParam("normalize", default=True, kind=bool)},
                       {"combine": "models"}, base="optional", base_is_input=True),
    "task_arithmetic": _gta("task_arithmetic", {}, False, False, sparsify=False),
    "ties": _gta("ties", {**_MK, "scope": "tensor"}, True, False, normalize_as="merge"),
    "dare_ties": _gta("dare", {**_MK, "then": "ties"}, False, True, normalize_as="merge"),
    "dare_linear": _gta("dare", {**_MK, "then": "sum"}, False, True),
    "breadcrumbs": _gta("breadcrumbs", {}, False, False, extra=_GAMMA),
    "breadcrumbs_ties": _gta("breadcrumbs_ties", {}, False, False, extra=_GAMMA),
    "della": _gta("della", {}, True, True, extra=_EPSILON),
    "della_linear": _gta("della_linear", {}, False, True, extra=_EPSILON),
    "model_stock": MkMethod("model_stock", {"filter_wise": MkParam("filter_wise", default=False, kind=bool)}),
    "slerp": MkMethod("slerp", {"t": MkParam("t")}),
    "nuslerp": MkMethod("nuslerp", {"weight": MkParam("weights", True),
                                    "nuslerp_flatten": MkParam("nuslerp_flatten", default=True, kind=bool),
                                    "nuslerp_row_wise": MkParam("nuslerp_row_wise", default=False, kind=bool)},
                        base="optional", use_base_flag=True),
    "multislerp": MkMethod("multislerp", {"weight": MkParam("weights", True),
                                          "normalize_weights": MkParam("normalize_weights", default=True, kind=bool),
                                          "eps": MkParam("eps", default=1e-8)},
                           base="optional", use_base_flag=True),
    "karcher": MkMethod("karcher", {"max_iter": MkParam("max_iter", default=10, kind=int),
                                    "tol": MkParam("tol", default=1e-5)}, base="optional", base_is_input=True),
    "sce": MkMethod("sce", {"select_topk": MkParam("select_topk", default=1.0),
                            "int8_mask": MkParam(None, default=False, kind=bool)}),
    "passthrough": MkMethod("passthrough", {"scale": MkParam("weight_scale", True, 1.0)}, base="none"),
    "arcee_fusion": MkMethod("arcee_fusion", {}, result_dtype="float32"),
    "nearswap": MkMethod("nearswap", {"t": MkParam("t")}),
    "ram": MkMethod("ram", {"epsilon": MkParam("epsilon", default=1e-5)}),
    "ramplus_tl": MkMethod("ramplus_tl", {"r": MkParam("r", default=0.1), "alpha": MkParam("alpha", default=0.2),
                                          "epsilon": MkParam("epsilon", default=1e-5)}, result_dtype="float32"),
}
"""mergekit 0.1.5's merge methods that hubsoup reproduces (``merge_method`` → method, parameters, options)."""
