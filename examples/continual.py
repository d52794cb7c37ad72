"""Continual merging with OPCM: start a soup from two models, add a third one later.

``hubsoup.continual.init`` merges fine-tunes in order with OPCM (orthogonal projection-
based continual merging) and saves its state beside the merged weights, in
``<soup>/continual_state/`` (the accumulated update S, the task-vector norms, λ, the base's
checksums). ``hubsoup.continual.add`` later adds new models reading only that state, the
base and the new models: the earlier fine-tunes may be gone (this script deletes them).
The soup grown one model at a time equals the one-shot ``--method opcm`` merge of all
three, which the script checks.

Everything is built here (a tiny Llama base and three fine-tunes); no network.

Run:
    python examples/continual.py [--out DIR]

CLI equivalent:
    hubsoup continual init FT_A FT_B --base BASE --out soup
    hubsoup continual add soup FT_C
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import tempfile

import torch
from safetensors.torch import load_file

import hubsoup
from hubsoup.testing import make_base, make_finetune


def show(soup: str) -> None:
    state = hubsoup.continual.load_state(soup)
    models = ", ".join(os.path.basename(m.get("spec", "?")) for m in state.models)
    print(f"  state: {state.count} models ({models}), lambda={state.lam:.4f}, "
          f"||S||={state.s_norm:.4f}, task-vector norms {', '.join(f'{n:.3f}' for n in state.task_norms)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Continual merging (OPCM): add a model to a soup later.")
    parser.add_argument("--out", help="folder for everything this example writes (default: a temporary folder, removed at exit)")
    args = parser.parse_args(argv)
    root = args.out or tempfile.mkdtemp(prefix="hubsoup-example-continual-")
    os.makedirs(root, exist_ok=True)
    if not args.out:  # a temporary folder, removed at exit (--out DIR keeps everything)
        atexit.register(shutil.rmtree, root, True)
    # torch makes its compile cache in TMPDIR when torch._dynamo is first imported: here, under root
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(root, ".torch-cache"))

    base = make_base("llama", os.path.join(root, "base"))
    ft_a, ft_b, ft_c = (make_finetune(base, os.path.join(root, f"ft-{x}"), seed=i) for i, x in enumerate("abc", 1))
    soup = os.path.join(root, "soup")

    res = hubsoup.continual.init([ft_a, ft_b], base=base, out=soup, quiet=True, overwrite=True)
    print(f"init: {res.path}")
    show(soup)

    # months later: the first fine-tunes are gone, a new one arrives
    one_shot = hubsoup.merge([ft_a, ft_b, ft_c], "opcm", base=base, out=os.path.join(root, "one-shot"),
                             quiet=True, overwrite=True)  # for the check below only
    shutil.rmtree(ft_a)
    shutil.rmtree(ft_b)
    res = hubsoup.continual.add(soup, [ft_c], quiet=True)
    print(f"add {os.path.basename(ft_c)}: {res.path} (in place)")
    show(soup)

    grown, direct = load_file(os.path.join(soup, "model.safetensors")), load_file(
        os.path.join(one_shot.path, "model.safetensors"))
    same = all(torch.equal(grown[k], direct[k]) for k in direct)
    print(f"equals the one-shot OPCM merge of all three: {same}")
    print(f"state files: {', '.join(sorted(os.listdir(os.path.join(soup, 'continual_state'))))}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
