"""Generate the mergekit reference fixtures of tests/methods/test_mergekit_methods.py (run once, by hand).

Runs mergekit's own merge-method kernels (mergekit 0.1.5, installed in a separate venv that
hubsoup never imports) on small seeded tensors and saves inputs and outputs:

    benchmarks/.work/mergekit-venv/bin/python tests/tools/make_mergekit_method_fixtures.py

Writes tests/fixtures/mergekit_methods/CASE.safetensors (tensors ``base``, ``m0``.., ``out``;
the case's method and parameters in the metadata) and gradients.json (mergekit's
``evaluate_setting`` over the layers for several layer counts and settings). ``--only NAME``
(repeatable) writes only those cases (gradients.json is then left as it is).

Random methods' cases whose name ends in ``_masked_<dtype>`` also keep the masks mergekit drew
(``mask0``, .. for the inputs that drew one, in order: ``torch.bernoulli`` is watched while mergekit
runs): given those masks, the rest of mergekit's computation is deterministic, and hubsoup's must
be it bit for bit.

Registry snapshot: ``--registry`` writes tests/fixtures/mergekit_methods/registry.json, every merge
method mergekit 0.1.5 registers (name, parameters and defaults, input contract), read from
``mergekit.merge_methods.registry`` itself.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from safetensors.torch import save_file

from mergekit.config import ConditionalParameter, evaluate_setting
from mergekit.merge_methods import registry
from mergekit.merge_methods.base import TensorGroup

OUT = os.path.join(os.path.dirname(__file__), "..", "fixtures", "mergekit_methods")


def models(seed: int, n: int, shape=(6, 5), spread=1.0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g)
    return base, [base + spread * torch.randn(shape, generator=g) for _ in range(n)]


ONLY: set[str] | None = None
"""``--only``: the cases to write (None: all)."""


class _Draws:
    """``torch.bernoulli`` watched while mergekit runs (DARE's and DELLA's masks): every mask it draws, in order."""

    def __enter__(self):
        self.masks, self._orig = [], torch.bernoulli

        def draw(*args, **kwargs):
            m = self._orig(*args, **kwargs)
            self.masks.append(m.clone())
            return m

        torch.bernoulli = draw
        return self

    def __exit__(self, *exc):
        torch.bernoulli = self._orig


def case(name, method, base, ms, params, *, with_base=True, hubsoup=None):
    """mergekit's output for one tensor; ``hubsoup`` = the hubsoup method + params that should match."""
    if ONLY is not None and name not in ONLY:
        return
    tensors = ([base] if with_base else []) + ms
    group = TensorGroup.from_tensors(tensors, base_index=0 if with_base else None, name="model.layers.0.mlp.weight")
    with _Draws() as draws:
        (out,) = registry.get(method)((group,), parameters=params)
    data = {"base": base.contiguous(), "out": out.contiguous()}
    data.update({f"m{i}": m.contiguous() for i, m in enumerate(ms)})
    if "_masked_" in name:  # the masks mergekit drew, one per input with density < 1, in input order
        assert draws.masks, name
        data.update({f"mask{i}": m.reshape(base.shape).to(torch.bool).contiguous() for i, m in enumerate(draws.masks)})
    meta = {"mergekit_method": method, "mergekit_params": json.dumps(params), "with_base": json.dumps(with_base),
            "hubsoup": json.dumps(hubsoup)}
    save_file(data, os.path.join(OUT, f"{name}.safetensors"), metadata=meta)


def sparse_models(seed: int, n: int, shape=(16, 12), keep=0.35, spread=0.02):
    """A base and n fine-tunes that each change a random part of the entries (RL updates are sparse: RAM's
    setting), some of them by less than RAM's epsilon 1e-5 (unchanged, as far as RAM counts)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g)
    out = []
    for _ in range(n):
        changed = torch.rand(shape, generator=g) < keep
        tiny = torch.rand(shape, generator=g) < 0.05
        delta = spread * torch.randn(shape, generator=g) * changed + 4e-6 * torch.randn(shape, generator=g) * tiny
        out.append(base + delta)
    return base, out


def last_methods():
    """mergekit 0.1.5's methods added in issue 49 (nearswap, ram, ramplus_tl), arcee_fusion in its dtype, and the
    generalized task arithmetic (task_arithmetic, dare_*, della*) computed in half precision with lambda,
    rescale and normalize, as community configs use them."""
    halves = ((torch.bfloat16, "bf16"), (torch.float16, "fp16"))
    torch.manual_seed(49)  # mergekit's masks come from the global generator: the same with --only or without

    def cd(dt):
        return {"compute_dtype": str(dt).split(".")[-1]}

    bn, msn = models(8, 1, shape=(16, 12), spread=0.02)
    case("nearswap", "nearswap", bn, msn, {"t": 0.01}, hubsoup={"method": "nearswap", "params": {"t": 0.01}})
    for dt, tag in halves:
        case(f"nearswap_{tag}", "nearswap", bn.to(dt), [m.to(dt) for m in msn], {"t": 0.004},
             hubsoup={"method": "nearswap", "params": {"t": 0.004, **cd(dt)}})

    br, msr = sparse_models(10, 3)
    case("ram", "ram", br, msr, {}, hubsoup={"method": "ram", "params": {}})
    case("ram_epsilon", "ram", br, msr, {"epsilon": 1e-3}, hubsoup={"method": "ram", "params": {"epsilon": 1e-3}})
    case("ramplus_tl", "ramplus_tl", br, msr, {}, hubsoup={"method": "ramplus_tl", "params": {}})
    case("ramplus_tl_strong", "ramplus_tl", br, msr, {"r": 0.5, "alpha": 1.0, "epsilon": 1e-4},
         hubsoup={"method": "ramplus_tl", "params": {"r": 0.5, "alpha": 1.0, "epsilon": 1e-4}})
    for dt, tag in halves:
        hb, hms = br.to(dt), [m.to(dt) for m in msr]
        case(f"ram_{tag}", "ram", hb, hms, {}, hubsoup={"method": "ram", "params": cd(dt)})
        # float32 out of half inputs: mergekit's scale λ is a float32 tensor and promotes the result
        case(f"ramplus_tl_{tag}", "ramplus_tl", hb, hms, {"r": 0.5, "alpha": 1.0},
             hubsoup={"method": "ramplus_tl", "params": {"r": 0.5, "alpha": 1.0, **cd(dt)}})

    ba, msa = models(9, 1, shape=(24, 16), spread=0.05)
    case("arcee_fusion", "arcee_fusion", ba, msa, {}, hubsoup={"method": "arcee_fusion", "params": {}})
    for dt, tag in halves:  # float32 out of half inputs (mergekit's mask is float32)
        case(f"arcee_fusion_{tag}", "arcee_fusion", ba.to(dt), [m.to(dt) for m in msa], {},
             hubsoup={"method": "arcee_fusion", "params": cd(dt)})

    # generalized task arithmetic in half precision: community-style weights, lambda, rescale, normalize
    bg, msg = models(11, 3, shape=(16, 12), spread=0.02)
    w = [0.3, 0.55, 0.9]
    for dt, tag in halves:
        hb, hms = bg.to(dt), [m.to(dt) for m in msg]
        case(f"task_arithmetic_lambda_{tag}", "task_arithmetic", hb, hms, {"weight": w, "lambda": 0.7},
             hubsoup={"method": "task_arithmetic", "params": {"weights": w, "scale": 0.7, **cd(dt)}})
        case(f"task_arithmetic_normalized_{tag}", "task_arithmetic", hb, hms,
             {"weight": w, "normalize": True, "lambda": 1.2},
             hubsoup={"method": "task_arithmetic", "params": {"weights": w, "scale": 1.2, "normalize": True, **cd(dt)}})
        dense = {"densities": [1.0] * 3, "convention": "mergekit", **cd(dt)}
        case(f"dare_linear_dense_{tag}", "dare_linear", hb, hms, {"weight": w, "lambda": 0.85},
             hubsoup={"method": "dare", "params": {"weights": w, "scale": 0.85, "then": "sum", **dense}})
        case(f"dare_ties_dense_{tag}", "dare_ties", hb, hms, {"weight": w, "lambda": 1.3, "rescale": True},
             hubsoup={"method": "dare", "params": {"weights": w, "scale": 1.3, "then": "ties", "merge": "sum",
                                                   "rescale": True, **dense}})
        dens = [0.5, 0.3, 0.7]
        case(f"dare_ties_masked_{tag}", "dare_ties", hb, hms,
             {"weight": w, "density": dens, "lambda": 0.9, "rescale": True, "normalize": True},
             hubsoup={"method": "dare", "params": {"weights": w, "densities": dens, "scale": 0.9, "then": "ties",
                                                   "merge": "mean", "rescale": True, "convention": "mergekit",
                                                   **cd(dt)}})
        case(f"dare_linear_masked_{tag}", "dare_linear", hb, hms[:2],
             {"weight": w[:2], "density": 0.4, "normalize": True, "lambda": 1.1},
             hubsoup={"method": "dare", "params": {"weights": w[:2], "densities": [0.4, 0.4], "scale": 1.1,
                                                   "then": "sum", "normalize": True, "convention": "mergekit",
                                                   **cd(dt)}})
        case(f"della_linear_masked_{tag}", "della_linear", hb, hms,
             {"weight": w, "density": 0.5, "epsilon": 0.2, "lambda": 1.1},
             hubsoup={"method": "della_linear", "params": {"weights": w, "density": 0.5, "epsilon": 0.2,
                                                           "scale": 1.1, **cd(dt)}})
        case(f"della_masked_{tag}", "della", hb, hms[:2], {"weight": w[:2], "density": 0.6, "epsilon": 0.3},
             hubsoup={"method": "della", "params": {"weights": w[:2], "density": 0.6, "epsilon": 0.3, **cd(dt)}})


def registry_snapshot() -> dict:
    """Every merge method mergekit registers: its name, parameters (default, or none when required), input
    contract; what tests/methods/test_mergekit_methods.py holds hubsoup's method table to."""
    from importlib.metadata import version

    methods = {}
    for m in registry.registered_methods():
        spec = m.spec
        params = {}
        for p in spec.parameters:
            default = None if p.required else p.default
            params[p.name] = {"scope": str(p.scope.value), "required": bool(p.required),
                              "default": default if isinstance(default, (bool, int, float, str, type(None)))
                              else repr(default)}
        c = spec.contract
        methods[spec.name] = {"parameters": params, "base": str(c.base.value), "min_inputs": c.min_inputs,
                              "max_inputs": c.max_inputs}
    return {"mergekit": version("mergekit"), "methods": dict(sorted(methods.items()))}


def main(argv=None):
    global ONLY
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", action="append", help="write only these cases (repeatable)")
    ap.add_argument("--registry", action="store_true", help="write only registry.json, mergekit's method registry")
    args = ap.parse_args(argv)
    os.makedirs(OUT, exist_ok=True)
    if args.registry:
        with open(os.path.join(OUT, "registry.json"), "w", encoding="utf-8") as f:
            json.dump(registry_snapshot(), f, indent=1, sort_keys=True)
            f.write("\n")
        return
    ONLY = set(args.only) if args.only else None
    b, ms = models(0, 3)
    w = [0.5, 0.3, 0.9]
    case("linear_normalized", "linear", b, ms, {"weight": w, "normalize": True}, with_base=False,
         hubsoup={"method": "linear", "params": {"weights": w, "combine": "models"}})
    case("linear_sum", "linear", b, ms, {"weight": w, "normalize": False}, with_base=False,
         hubsoup={"method": "linear", "params": {"weights": w, "normalize": False, "combine": "models"}})
    case("task_arithmetic", "task_arithmetic", b, ms, {"weight": w, "lambda": 0.8}, hubsoup={
        "method": "task_arithmetic", "params": {"weights": w, "scale": 0.8}})
    case("task_arithmetic_normalized", "task_arithmetic", b, ms, {"weight": w, "normalize": True}, hubsoup={
        "method": "task_arithmetic", "params": {"weights": w, "scale": 1.0, "normalize": True}})
    for norm in (True, False):
        case(f"ties_weighted_{'mean' if norm else 'sum'}", "ties", b, ms,
             {"weight": w, "density": [0.5, 0.3, 0.7], "normalize": norm, "lambda": 1.1},
             hubsoup={"method": "ties", "params": {"weights": w, "densities": [0.5, 0.3, 0.7], "convention": "mergekit",
                                                   "scope": "tensor", "merge": "mean" if norm else "sum",
                                                   "scale": 1.1}})
    case("ties_rescale", "ties", b, ms, {"weight": w, "density": 0.4, "rescale": True}, hubsoup={
        "method": "ties", "params": {"weights": w, "density": 0.4, "convention": "mergekit", "rescale": True}})
    b1, ms1 = models(1, 2, shape=(10,))
    case("ties_tiny_density", "ties", b1, ms1, {"weight": [1.0, 1.0], "density": 0.05}, hubsoup={
        "method": "ties", "params": {"density": 0.05, "convention": "mergekit", "scope": "tensor"}})
    case("breadcrumbs", "breadcrumbs", b, ms, {"weight": w, "density": 0.6, "gamma": 0.1}, hubsoup={
        "method": "breadcrumbs", "params": {"weights": w, "density": 0.6, "gamma": 0.1}})
    case("breadcrumbs_ties", "breadcrumbs_ties", b, ms, {"weight": w, "density": 0.6, "gamma": 0.1,
                                                         "normalize": True}, hubsoup={
        "method": "breadcrumbs_ties", "params": {"weights": w, "density": 0.6, "gamma": 0.1, "normalize": True}})
    b4, ms4 = models(4, 3, shape=(8, 6), spread=0.3)
    case("model_stock", "model_stock", b4, ms4, {}, hubsoup={"method": "model_stock", "params": {}})
    case("model_stock_filter_wise", "model_stock", b4, ms4, {"filter_wise": True},
         hubsoup={"method": "model_stock", "params": {"filter_wise": True}})
    b2, ms2 = models(2, 1)
    case("slerp", "slerp", b2, ms2, {"t": 0.3}, hubsoup={"method": "slerp", "params": {"t": 0.3}})
    b3, ms3 = models(3, 2)
    for flat, row in ((True, False), (False, False), (False, True)):
        tag = "flat" if flat else ("rowwise" if row else "rows")
        p = {"weight": [0.3, 0.7], "nuslerp_flatten": flat, "nuslerp_row_wise": row}
        hp = {"weights": [0.3, 0.7], "nuslerp_flatten": flat, "nuslerp_row_wise": row}
        case(f"nuslerp_base_{tag}", "nuslerp", b3, ms3, p, hubsoup={"method": "nuslerp", "params": hp})
        case(f"nuslerp_nobase_{tag}", "nuslerp", b3, ms3, p, with_base=False,
             hubsoup={"method": "nuslerp", "params": {**hp, "use_base": False}})
    case("multislerp_base", "multislerp", b, ms, {"weight": w}, hubsoup={"method": "multislerp",
                                                                       "params": {"weights": w}})
    case("multislerp_nobase", "multislerp", b, ms, {"weight": w}, with_base=False,
         hubsoup={"method": "multislerp", "params": {"weights": w, "use_base": False}})
    case("karcher", "karcher", b, ms, {}, with_base=False, hubsoup={"method": "karcher", "params": {}})
    case("karcher_iter", "karcher", b, ms, {"max_iter": 3, "tol": 1e-7}, with_base=False,
         hubsoup={"method": "karcher", "params": {"max_iter": 3, "tol": 1e-7}})
    for k in (1.0, 0.5):
        case(f"sce_{k}", "sce", b, ms, {"select_topk": k}, hubsoup={"method": "sce", "params": {"select_topk": k}})
    case("passthrough", "passthrough", b, ms[:1], {"scale": [0.5]}, with_base=False,
         hubsoup={"method": "passthrough", "params": {"weight_scale": 0.5}})

    # half precision: mergekit casts the inputs to its config's dtype and computes every step in it (hubsoup:
    # compute_dtype); fine-tune-sized task vectors, so that rounding τ = θ − θ₀ there matters
    bh, msh = models(6, 3, shape=(16, 12), spread=0.02)
    for dt, tag in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        hb, hms = bh.to(dt), [m.to(dt) for m in msh]
        cd = {"compute_dtype": str(dt).split(".")[-1]}
        for flat, row in ((True, False), (False, False), (False, True)):
            kind = "flat" if flat else ("rowwise" if row else "rows")
            p = {"weight": [0.4, 0.6], "nuslerp_flatten": flat, "nuslerp_row_wise": row}
            hp = {"weights": [0.4, 0.6], "nuslerp_flatten": flat, "nuslerp_row_wise": row, **cd}
            case(f"nuslerp_base_{kind}_{tag}", "nuslerp", hb, hms[:2], p, hubsoup={"method": "nuslerp", "params": hp})
            case(f"nuslerp_nobase_{kind}_{tag}", "nuslerp", hb, hms[:2], p, with_base=False,
                 hubsoup={"method": "nuslerp", "params": {**hp, "use_base": False}})
        case(f"multislerp_base_{tag}", "multislerp", hb, hms, {"weight": w},
             hubsoup={"method": "multislerp", "params": {"weights": w, **cd}})
        case(f"multislerp_nobase_{tag}", "multislerp", hb, hms, {"weight": w}, with_base=False,
             hubsoup={"method": "multislerp", "params": {"weights": w, "use_base": False, **cd}})
        case(f"karcher_{tag}", "karcher", hb, hms, {}, with_base=False,
             hubsoup={"method": "karcher", "params": cd})
        # a real config's settings (tol 1e-10, 1200 steps) on inputs far apart: in half precision the iteration
        # ends in a cycle (here of 60 steps in bf16, 24 in fp16) instead of converging
        lb, lms = models(7, 3, shape=(32, 16), spread=0.3)
        case(f"karcher_long_{tag}", "karcher", lb.to(dt), [m.to(dt) for m in lms], {"max_iter": 1200, "tol": 1e-10},
             with_base=False, hubsoup={"method": "karcher", "params": {"max_iter": 1200, "tol": 1e-10, **cd}})
    # random methods: one large tensor each, for distribution statistics (kept fraction, L1 rescale)
    torch.manual_seed(0)
    bl, msl = models(5, 2, shape=(64, 64))
    case("dare_linear_stats", "dare_linear", bl, msl, {"weight": [1.0, 1.0], "density": 0.3}, hubsoup={
        "method": "dare", "params": {"p": 0.7, "then": "sum", "convention": "mergekit"}})
    case("dare_ties_stats", "dare_ties", bl, msl, {"weight": [1.0, 1.0], "density": 0.3}, hubsoup={
        "method": "dare", "params": {"p": 0.7, "then": "ties", "merge": "sum", "convention": "mergekit"}})
    case("della_linear_stats", "della_linear", bl, msl[:1], {"weight": [1.0], "density": 0.4, "epsilon": 0.3,
                                                              "rescale": False},
         hubsoup={"method": "della_linear", "params": {"density": 0.4, "epsilon": 0.3, "rescale": False}})

    last_methods()
    if ONLY is not None:
        return

    # gradients and filters, evaluated as mergekit's planner does for every layer
    settings = {
        "five": [0, 0.5, 0.3, 0.7, 1],
        "two": [0.2, 0.9],
        "three": [1.0, 0.0, 1.0],
        "filters": [{"filter": "self_attn", "value": [0, 0.5, 0.3, 0.7, 1]},
                    {"filter": "mlp", "value": [1, 0.5, 0.7, 0.3, 0]}, {"value": 0.5}],
    }
    names = ["model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.mlp.up_proj.weight",
             "model.layers.{i}.input_layernorm.weight"]
    grads = []
    for key, setting in settings.items():
        st = [ConditionalParameter(**e) for e in setting] if isinstance(setting[0], dict) else setting
        for n_layers in (1, 2, 3, 4, 7, 12):
            for i in range(n_layers):
                t = i / (n_layers - 1) if n_layers > 1 else 1
                for pattern in names:
                    name = pattern.format(i=i)
                    v = evaluate_setting(name, st, t, validate=float)
                    grads.append({"setting": key, "n_layers": n_layers, "layer": i, "name": name, "value": v})
        for name in ("model.embed_tokens.weight", "lm_head.weight"):  # outside the layers: t = 0
            grads.append({"setting": key, "n_layers": None, "layer": None, "name": name,
                          "value": evaluate_setting(name, st, 0, validate=float)})
    with open(os.path.join(OUT, "gradients.json"), "w") as f:
        json.dump({"settings": settings, "values": grads}, f, indent=0)


if __name__ == "__main__":
    main()
