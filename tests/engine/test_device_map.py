"""Device maps: blocks spread over several devices (here: several CPU workers) give the same bytes as no map.

Every method family is merged with and without a map spreading its blocks over three CPU
workers (``cpu``, ``cpu:1``, ``cpu:2``: one thread each, merging concurrently); the outputs
must be identical byte for byte. A map given as a JSON file works the same; a block that
fits on no device is refused before any output folder exists.
"""

from __future__ import annotations

import json
import os

import pytest
from method_helpers import state  # noqa: E402  (tests/ is on sys.path)

import hubsoup
from hubsoup import continual
from hubsoup.cli import main as cli_main
from hubsoup.engine.placement import place
from hubsoup.errors import PlacementError
from hubsoup.options import parse_max_memory
from hubsoup.plan import Plan
from hubsoup.sources import open_input
from hubsoup.testing import make_base, make_finetune

MAP = {"model.embed_tokens": "cpu:1", "model.layers.0": "cpu:2", "model.layers.1": "cpu:1", "": "cpu"}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("dmap")
    base = make_base("llama", str(root / "base"))
    return base, [make_finetune(base, str(root / f"ft{i}"), seed=i) for i in (1, 2, 3)]


def files(folder):
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors") or f == "adapter_config.json":
            with open(os.path.join(folder, f), "rb") as fh:
                out[f] = fh.read()
    return out


@pytest.mark.parametrize("method,params,kw", [
    ("task_arithmetic", {}, {}),
    ("ties", {"density": 0.3}, {}),                       # statistics passes (model-wide threshold)
    ("dare", {"p": 0.5}, {}),                             # seeded randomness
    ("sftm", {}, {}),                                     # SVDs
    ("lines", {"base_method": "ties"}, {}),               # a modifier with its own statistics pass
    ("ties", {}, {"output_format": "lora", "rank": 4}),   # the LoRA-output sink
])
def test_map_over_several_cpu_workers_is_bit_identical(zoo, tmp_path, method, params, kw):
    base, fts = zoo
    plain = hubsoup.merge(fts, method, base=base, out=str(tmp_path / "plain"), params=params, quiet=True, **kw)
    mapped = hubsoup.merge(fts, method, base=base, out=str(tmp_path / "mapped"), params=params, quiet=True,
                           device_map=MAP, **kw)
    assert mapped.recipe.hash == plain.recipe.hash  # where it ran is not what it is
    assert files(mapped.path) == files(plain.path)
    workers = {b.worker for b in mapped.plan.blocks}
    assert workers == {"cpu", "cpu:1", "cpu:2"}


def test_map_file_and_continual_add(zoo, tmp_path):
    base, fts = zoo
    path = tmp_path / "map.json"
    path.write_text(json.dumps(MAP))
    for name, dm in (("plain", None), ("mapped", str(path))):
        continual.init(fts[:2], base=base, out=str(tmp_path / name), quiet=True, device_map=dm)
        continual.add(str(tmp_path / name), [fts[2]], quiet=True, device_map=dm)
    assert state(str(tmp_path / "mapped")) .keys() == state(str(tmp_path / "plain")).keys()
    assert files(str(tmp_path / "mapped")) == files(str(tmp_path / "plain"))


def test_continual_places_through_the_one_entry(zoo, tmp_path, monkeypatch):
    """Continual merging places its blocks through ``place_blocks`` like merge and ``hubsoup plan``: the
    method's declared workspace counts (continual's own placement ignored it), and its refusal is theirs."""
    from hubsoup.methods.opcm import Opcm

    base, fts = zoo
    ok = continual.init(fts[:2], base=base, out=str(tmp_path / "ok"), quiet=True, max_memory={"cpu": "1GiB"})
    assert {b.device for b in ok.plan.blocks} == {"cpu"}
    monkeypatch.setattr(Opcm, "workspace_bytes", lambda self, shape, n, params, name="": 2**31)
    with pytest.raises(PlacementError, match="max_memory"):
        continual.init(fts[:2], base=base, out=str(tmp_path / "big"), quiet=True, max_memory={"cpu": "1GiB"})
    assert not os.path.exists(tmp_path / "big")


def test_auto_map_uses_accelerate_and_refuses_a_block_that_fits_nowhere(zoo, tmp_path, capsys):
    base, fts = zoo
    plan = Plan.of(open_input(base), "cpu")
    placement = place(plan, 3, device_map="auto", max_memory={"cpu": "1GiB"})
    assert set(placement.devices) == {"cpu"} and all(b.device == "cpu" for b in plan.blocks)
    assert parse_max_memory("0=70GiB,cpu=64GiB") == {0: 70 * 2**30, "cpu": 64 * 2**30}
    with pytest.raises(PlacementError, match="fits on no device"):
        place(plan, 3, device_map="auto", max_memory={"cpu": "10KB"})
    out = tmp_path / "o"
    rc = cli_main(["merge", *fts, "--base", base, "--method", "ties", "--device-map", "auto", "--max-memory",
                   "cpu=10KB", "--out", str(out), "-q"])
    err = capsys.readouterr().err
    assert rc == 2 and "fits on no device" in err and "Traceback" not in err
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".o.")]


def test_plan_command_prints_the_placement(zoo, capsys):
    base, fts = zoo
    rc = cli_main(["plan", *fts, "--base", base, "--method", "ties", "--device-map", json.dumps(MAP)])
    out = capsys.readouterr().out
    assert rc == 0 and "3 device(s)" in out and "predicted peak" in out
    for worker in ("cpu:1", "cpu:2"):
        assert worker in out
    with pytest.raises(SystemExit):
        cli_main(["plan", *fts, "--method", "ties", "--device-map"])
    rc = cli_main(["plan", *fts, "--base", base, "--method", "ties", "--device-map", "nonsense"])
    assert rc == 2 and "not one of auto" in capsys.readouterr().err


def test_planner_and_merge_resolve_a_tensors_parameters_alike(zoo, tmp_path, monkeypatch):
    """Per-layer schedules have one owner (``lowrank.tensor_params``): the planner's workspace of each tensor is
    asked with the numbers the merge then uses for it, never with the schedule itself."""
    from hubsoup.api import parse_method
    from hubsoup.engine.placement import place_blocks
    from hubsoup.engine import lowrank
    from hubsoup.methods.ties import Ties
    from hubsoup.options import MergeOptions
    from hubsoup.sources.compat import open_models

    base, fts = zoo
    planned, merged = {}, {}
    monkeypatch.setattr(Ties, "workspace_bytes",
                        lambda self, shape, n, params, name="": planned.setdefault(name, params.density) and 0)
    real = lowrank.tensor_params

    def spy(params, block, entry):
        p = real(params, block, entry)
        merged[entry.name] = p.density
        return p

    monkeypatch.setattr(lowrank, "tensor_params", spy)
    ckpt, sources = open_models(fts, base=base, headers_only=True)
    m, p = parse_method("ties", {"density": [0.1, 0.9], "scope": "tensor"})  # a gradient over the layers
    place_blocks(Plan.of(ckpt), m, p, sources, MergeOptions())
    assert planned and all(isinstance(v, float) for v in planned.values())
    assert len({round(v, 6) for v in planned.values()}) >= 2  # the layers' own densities
    hubsoup.merge(fts, "ties", base=base, out=str(tmp_path / "o"), params={"density": [0.1, 0.9], "scope": "tensor"}, quiet=True)
    assert {k: merged[k] for k in planned} == planned
