"""Writing a hubsoup recipe as a mergekit config (``hubsoup export-config``): one entry per method mergekit has
(:data:`EXPORTS`), instead of a chain of conditions on method names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from hubsoup.errors import ParameterError
from hubsoup.formats.mergekit.config import DTYPES
from hubsoup.formats.mergekit.methods import METHODS
from hubsoup.methods.task_arithmetic import default_scale
from hubsoup.public import dump_config

if TYPE_CHECKING:
    from hubsoup.recipe import Recipe

def _scale_of(p: dict[str, Any]) -> float:
    """The λ a recipe merged with (a DARE scale left at None resolves to mergekit's lambda, 1)."""
    return 1.0 if p.get("scale") is None else p["scale"]


@dataclass
class _Export:
    """One recipe on its way to a mergekit config: what each method's entry of :data:`EXPORTS` fills in."""

    method: str
    p: dict[str, Any]
    base: str | None
    inputs: list[str]
    cfg: dict[str, Any] = field(default_factory=dict)
    per: dict[str, list[Any]] = field(default_factory=dict)
    """Per-model parameters, one value per input."""

    @property
    def n(self) -> int:
        return len(self.inputs)

    def weights(self, default: float = 1.0) -> list[Any]:
        w = self.p.get("weights")
        return list(w) if w is not None else [default] * self.n

    def per_input(self, name: str, hub_tuple: str, hub_scalar: str | None) -> None:
        v = self.p.get(hub_tuple)
        if v is None and hub_scalar is not None:
            v = [self.p[hub_scalar]] * self.n
        if v is not None:
            self.per[name] = list(v)

    def fail(self, why: str) -> None:
        raise ParameterError(f"method '{self.method}'{why} has no mergekit equivalent; export-config cannot write it")


def _export_linear(x: _Export) -> None:
    p, cfg, per = x.p, x.cfg, x.per
    if p.get("normalize", True):
        cfg.update(merge_method="linear", parameters={"normalize": True})
        per["weight"] = x.weights()
        x.base = None
    elif p.get("combine") == "models":
        cfg.update(merge_method="linear", parameters={"normalize": False})
        per["weight"] = x.weights()
        x.base = None
    else:
        cfg.update(merge_method="task_arithmetic")
        per["weight"] = x.weights()


def _export_task_arithmetic(x: _Export) -> None:
    p = x.p
    lam = default_scale(x.n) if p.get("scale") is None else p["scale"]  # hubsoup's 1/N, written out
    x.cfg.update(merge_method="task_arithmetic", parameters={"lambda": lam,
                                                             "normalize": bool(p.get("normalize"))})
    x.per["weight"] = x.weights()


def _export_wise_ft(x: _Export) -> None:  # (1 − γ)θ₀ + γθ₁ = θ₀ + γτ: task arithmetic with weight γ
    x.cfg.update(merge_method="task_arithmetic", parameters={"lambda": 1.0, "normalize": False})
    x.per["weight"] = [x.p.get("gamma", 0.5)]


def _export_soup(x: _Export) -> None:
    x.cfg.update(merge_method="task_arithmetic", parameters={"lambda": _scale_of(x.p), "normalize": True})
    x.per["weight"] = [1.0] * x.n


def _export_ties(x: _Export) -> None:
    p = x.p
    if p.get("convention") != "mergekit" or p.get("scope") != "tensor":
        x.fail(" with convention=paper or scope=model (hubsoup's TIES; mergekit elects signs on weighted "
               "deltas, per tensor: use convention=mergekit scope=tensor)")
    x.cfg.update(merge_method="ties", parameters={"normalize": p.get("merge") == "mean",
                                                  "lambda": _scale_of(p), "rescale": bool(p.get("rescale"))})
    if p.get("merge") not in ("mean", "sum"):
        x.fail(f" with merge={p.get('merge')}")
    x.per["weight"] = x.weights()
    x.per_input("density", "densities", "density")


def _export_dare(x: _Export) -> None:
    p, cfg, per = x.p, x.cfg, x.per
    if p.get("convention") != "mergekit":
        x.fail(" with convention=paper (mergekit's DARE rescales to keep each tensor's L1 norm: use "
               "convention=mergekit)")
    then = p.get("then")
    if then not in ("ties", "sum"):
        x.fail(f" with then={then}")
    cfg["merge_method"] = "dare_ties" if then == "ties" else "dare_linear"
    params = {"lambda": _scale_of(p), "rescale": bool(p.get("rescale", True))}
    params["normalize"] = p.get("merge") == "mean" if then == "ties" else bool(p.get("normalize"))
    cfg["parameters"] = params
    per["weight"] = x.weights()
    if p.get("densities") is not None:
        per["density"] = list(p["densities"])
    else:
        per["density"] = [round(1.0 - float(p.get("p", 0.9)), 12)] * x.n


def _export_sparsified(x: _Export) -> None:  # breadcrumbs, breadcrumbs_ties, della, della_linear: mergekit's names
    p, method = x.p, x.method
    x.cfg.update(merge_method=method, parameters={"lambda": _scale_of(p), "normalize": bool(p.get("normalize")),
                                                  "rescale": bool(p.get("rescale"))})
    x.per["weight"] = x.weights()
    x.per_input("density", "densities", "density")
    if method.startswith("breadcrumbs"):
        x.per_input("gamma", "gammas", "gamma")
    else:
        x.per_input("epsilon", "epsilons", "epsilon")


def _export_named(*keys: str, use_base: bool = True) -> Callable[[_Export], None]:
    """A method mergekit has under the same name, whose ``keys`` are passed as they are."""
    def export(x: _Export) -> None:
        x.cfg.update(merge_method=x.method, parameters={k: x.p[k] for k in keys if k in x.p})
        if not use_base:
            x.base = None
    return export


def _export_interpolation(*keys: str) -> Callable[[_Export], None]:  # nuslerp, multislerp: weights, maybe a base
    def export(x: _Export) -> None:
        x.cfg.update(merge_method=x.method, parameters={k: x.p[k] for k in keys if k in x.p})
        x.per["weight"] = x.weights()
        if not x.p.get("use_base", True):
            x.base = None
    return export


def _export_slerp(x: _Export) -> None:
    x.cfg.update(merge_method="slerp", parameters={"t": x.p.get("t", 0.5)})
    if x.n == 2:  # hubsoup interpolates input 0 → input 1: mergekit's base_model is the t = 0 end
        x.base = x.inputs[0]
        x.inputs = x.inputs[1:]


def _export_passthrough(x: _Export) -> None:
    x.cfg.update(merge_method="passthrough")
    if x.p.get("weight_scale", 1.0) != 1.0:
        x.per["scale"] = [x.p["weight_scale"]]
    x.base = None


EXPORTS: dict[str, Callable[[_Export], None]] = {
    "linear": _export_linear,
    "task_arithmetic": _export_task_arithmetic,
    "wise_ft": _export_wise_ft,
    "soup": _export_soup,
    "ties": _export_ties,
    "dare": _export_dare,
    "breadcrumbs": _export_sparsified,
    "breadcrumbs_ties": _export_sparsified,
    "della": _export_sparsified,
    "della_linear": _export_sparsified,
    "model_stock": _export_named("filter_wise"),
    "sce": _export_named("select_topk"),
    "karcher": _export_named("max_iter", "tol", use_base=False),
    "nuslerp": _export_interpolation("nuslerp_flatten", "nuslerp_row_wise"),
    "multislerp": _export_interpolation("normalize_weights", "eps"),
    "slerp": _export_slerp,
    "passthrough": _export_passthrough,
    "arcee_fusion": _export_named(),
    "nearswap": _export_named("t"),
    "ram": _export_named("epsilon"),
    "ramplus_tl": _export_named("r", "alpha", "epsilon"),
}
"""How each hubsoup method is written as a mergekit config (``hubsoup export-config``): one entry per method
mergekit has, instead of a chain of conditions on method names; a method not here has no mergekit equivalent."""


def export_config(recipe: Recipe, out_dtype: str | None = None) -> str:
    """The mergekit config equivalent of a hubsoup :class:`~hubsoup.recipe.Recipe`.

    A recipe made from a mergekit config gives that config back. Otherwise the method and
    parameters are mapped onto mergekit's (see :data:`EXPORTS`); a method or option with no
    mergekit equivalent raises :class:`~hubsoup.errors.ParameterError` naming it. hubsoup
    computes in float32, and mergekit in its ``dtype``: the config says ``dtype: float32`` (the
    method's ``compute_dtype`` where the recipe sets one) and stores the output as hubsoup did with
    ``out_dtype`` (the recipe's dtype, else ``out_dtype``, the output's stored dtype, when the caller
    knows it).
    """
    if recipe.mergekit.get("config"):
        config: str = recipe.mergekit["config"]  # the config's YAML text (Recipe.mergekit)
        return config
    if recipe.options.get("shape_mismatch") not in (None, "error"):
        raise ParameterError("recipe option 'shape_mismatch' has no mergekit equivalent")
    method = recipe.method
    export = EXPORTS.get(method)
    if export is None:
        raise ParameterError(f"method '{method}' has no mergekit equivalent; export-config writes only methods "
                             f"mergekit has ({', '.join(sorted(METHODS))})")
    x = _Export(method, dict(recipe.params), recipe.base.pinned_spec, [i.pinned_spec for i in recipe.inputs])
    export(x)
    p, cfg, per, base, inputs = x.p, x.cfg, x.per, x.base, x.inputs  # p: main's tail reads compute_dtype from it
    if not cfg.get("parameters"):
        cfg.pop("parameters", None)
    models = []
    for i, ref in enumerate(inputs):
        entry: dict[str, Any] = {"model": ref}
        params = {k: v[i] for k, v in per.items() if i < len(v)}
        if params:
            entry["parameters"] = params
        models.append(entry)
    out: dict[str, Any] = {"merge_method": cfg["merge_method"]}
    if base is not None:
        out["base_model"] = base
    out["models"] = models
    if cfg.get("parameters"):
        out["parameters"] = cfg["parameters"]
    compute = p.get("compute_dtype") or "float32"  # mergekit computes in `dtype`: hubsoup's own arithmetic's
    if compute != "inputs":  # (none: mergekit computes in the inputs' dtype, as compute_dtype=inputs does)
        out["dtype"] = compute
    stored = recipe.dtype or out_dtype
    result = METHODS[out["merge_method"]].result_dtype if out["merge_method"] in METHODS else None
    if stored:
        stored = DTYPES.get(stored, stored)
        # mergekit stores in `dtype` (none: the inputs'), or what its kernel returns (result_dtype), unless
        # out_dtype says
        if stored != (result or out.get("dtype")):
            out["out_dtype"] = stored
    return "# mergekit config written by hubsoup export-config (recipe " + recipe.hash[:12] + ")\n" + dump_config(out)
