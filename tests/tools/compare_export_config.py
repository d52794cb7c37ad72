"""Print, as JSON, ``export_config`` of every registered method under 14 parameter variants and 1 to 3 inputs (the
config, or the error). Run it with two trees and compare (issue 33: the table of exporters writes what the chain of
conditions wrote):

    PYTHONPATH=/work/main python tests/tools/compare_export_config.py > old.json
    PYTHONPATH=. python tests/tools/compare_export_config.py > new.json && cmp old.json new.json
"""
import json, itertools, sys
from hubsoup.recipe import Recipe
from hubsoup.sources import InputRef
from hubsoup.methods import get_method, available
from hubsoup.formats.mergekit import export_config
from hubsoup.errors import HubsoupError
out = {}
variants = [{}, {"convention": "mergekit"}, {"convention": "mergekit", "scope": "tensor"},
            {"convention": "mergekit", "scope": "tensor", "merge": "sum", "rescale": True},
            {"normalize": False}, {"normalize": False, "combine": "models"}, {"then": "sum", "convention": "mergekit"},
            {"then": "ties", "convention": "mergekit", "densities": [0.3, 0.5]}, {"use_base": False},
            {"weights": [0.3, 0.7]}, {"t": 0.3}, {"weight_scale": 2.0}, {"scale": 0.7}, {"gamma": 0.3}]
for name in sorted(available()):
    m = get_method(name)
    for i, v in enumerate(variants):
        for n in (1, 2, 3):
            key = f"{name}/{i}/{n}"
            try:
                p = m.parse({k: val for k, val in v.items() if k in {f for f in m.parse({}).__dataclass_fields__}})
                d = m.describe_params(p)
                r = Recipe(method=name, params=d, base=InputRef("org/base", "org/base", sha="1" * 40),
                           inputs=[InputRef(f"org/m{j}", f"org/m{j}", sha=str(j + 2) * 40) for j in range(n)],
                           dtype=None)
                out[key] = export_config(r, out_dtype="bfloat16")
            except HubsoupError as e:
                out[key] = f"ERR {type(e).__name__}: {e}"
            except Exception as e:
                out[key] = f"EXC {type(e).__name__}: {e}"
json.dump(out, sys.stdout, sort_keys=True)
