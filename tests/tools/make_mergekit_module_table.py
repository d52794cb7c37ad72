"""Write ``hubsoup/formats/mergekit/modules.json``: the tensors mergekit 0.1.5 lists for each module of its modular architectures.

mergekit merges a modular model (``_data/architectures/*.json`` of ``kind: modular``: Mistral3,
Gemma3, Llama4, Qwen2/2.5/3-VL, T5, Whisper) module by module, and plans exactly the tensors each
module's definition lists (``pre_weights``, ``layer_templates``, ``post_weights``, each name under the
module's ``weight_prefix``): a checkpoint tensor the list lacks is not written, an optional one only
when some input stores it, a tied one read from its tie source (``tied_names``) where a model does
not store it. hubsoup reads this table (:mod:`hubsoup.formats.mergekit.modules`); it never imports
mergekit. The table is data taken from the installed mergekit, nothing else: regenerate it when
mergekit's definitions change::

    python tests/tools/make_mergekit_module_table.py \\
        --mergekit-data benchmarks/.work/mergekit-venv/lib/python3.11/site-packages/mergekit/_data/architectures
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TABLE = os.path.join(HERE, "hubsoup", "formats", "mergekit", "modules.json")
MERGEKIT_VERSION = "0.1.5"


def _weight(w: dict, part: str, prefix: str) -> dict:
    """One weight as mergekit's ``_prefix_weight`` names it (prefix on its name, aliases and tie sources)."""
    out: dict = {"name": prefix + w["name"], "part": part}
    if w.get("vocabulary_axis") is not None:
        out["vocabulary_axis"] = w["vocabulary_axis"]
    if w.get("optional"):
        out["optional"] = True
    for key in ("aliases", "tied_names"):
        if w.get(key):
            out[key] = [prefix + n for n in w[key]]
    return out


def table(data_dir: str) -> dict:
    archs: dict = {}
    for fn in sorted(glob.glob(os.path.join(data_dir, "*.json"))):
        with open(fn, encoding="utf-8") as f:
            d = json.load(f)
        if d.get("kind") != "modular":
            continue
        mods = {}
        for name, md in d["modules"].items():
            a, prefix = md["architecture"], md.get("weight_prefix") or ""
            weights = [_weight(w, "pre", prefix) for w in a.get("pre_weights") or []]
            weights += [_weight(w, "layer", prefix) for w in (a.get("layer_templates") or {}).get("weights") or []]
            weights += [_weight(w, "post", prefix) for w in a.get("post_weights") or []]
            mods[name] = {"weight_prefix": md.get("weight_prefix"), "num_layers_config_key": a.get("num_layers_config_key"),
                          "override_num_layers": a.get("override_num_layers"), "weights": weights}
        for arch in d["architectures"]:
            archs[arch] = {"file": os.path.basename(fn), "vocab_size_config_key": d.get("vocab_size_config_key"),
                           "modules": mods}
    return {"mergekit": MERGEKIT_VERSION, "architectures": archs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mergekit-data", required=True, help="mergekit's _data/architectures folder")
    args = ap.parse_args(argv)
    out = table(args.mergekit_data)
    with open(TABLE, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {len(out['architectures'])} architectures to {TABLE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
