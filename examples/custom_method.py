"""A merge method in one file: the element-wise median of the task vectors.

Import this file (or put it in ``hubsoup/methods/``, where every public module is
imported automatically) and the method is available by name, with typed parameters,
a recipe hash, a model card and the CLI's ``--param`` parsing, for full fine-tunes and
LoRA adapters alike:

    >>> import hubsoup, custom_method                                   # doctest: +SKIP
    >>> hubsoup.merge(["ft-a", "ft-b", "ft-c"], method="median", base="base",
    ...               out="soup", scale=0.8)                            # doctest: +SKIP

Run it as a script to see the method merge three tiny fine-tunes, one of them an
outlier, and compare with the plain average (no network):

    python examples/custom_method.py [--out DIR]

The method is one function: ``@method`` reads its parameters (``scale``: a float, default 1,
with its help and range) from the signature and registers it. The engine hands it the inputs'
task vectors stacked as one float32 ``(N, *shape)`` tensor (``deltas``; the method may
overwrite it; ``base`` and ``ctx`` too, where the function declares them) and adds the
returned merged task vector to the base. Nothing here reads a file or knows about devices,
shards or output formats. A method that needs whole-model statistics passes, ``prepare`` or a
low-rank path is a :class:`hubsoup.methods.Method` class instead (see ARCHITECTURE.md).
"""

from __future__ import annotations

import torch

from hubsoup.methods import method, param


@method("median", paper="(an example method: the coordinate-wise median, a classic robust aggregate)",
        search_grid={"scale": [0.5, 0.75, 1.0, 1.25]},  # what `--search scale` tries
        elementwise=True)  # entry by entry: full fine-tunes may be merged in cache-sized pieces
def median(deltas: torch.Tensor, *,
           scale: float = param(1.0, "λ: scale of the median task vector", range=(None, None))) -> torch.Tensor:
    """Element-wise median of the task vectors, scaled: robust to one outlying fine-tune.

    ``scale`` is the method's global λ: LiNeS (``--method lines --param base_method=median``) replaces it by
    its depth factor.
    """
    # torch.median picks the lower middle for an even N; the mean of the two middles is symmetric
    n = deltas.shape[0]
    s = deltas.sort(dim=0).values
    mid = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
    return mid.mul_(scale)


def main(argv: list[str] | None = None) -> int:
    """Merge two similar fine-tunes and one outlier with ``median`` and with the plain average."""
    import argparse
    import atexit
    import os
    import shutil
    import tempfile

    from safetensors.torch import load_file

    import hubsoup
    from hubsoup.testing import make_base, make_finetune

    parser = argparse.ArgumentParser(description="The example 'median' method on three tiny fine-tunes.")
    parser.add_argument("--out", help="folder for everything this example writes (default: a temporary folder, removed at exit)")
    out = parser.parse_args(argv).out
    root = out or tempfile.mkdtemp(prefix="hubsoup-example-median-")
    os.makedirs(root, exist_ok=True)
    if not out:  # a temporary folder, removed at exit (--out DIR keeps everything)
        atexit.register(shutil.rmtree, root, True)
    # torch makes its compile cache in TMPDIR when torch._dynamo is first imported: here, under root
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(root, ".torch-cache"))
    base = make_base("llama", os.path.join(root, "base"))
    fts = [make_finetune(base, os.path.join(root, f"ft-{i}"), seed=i, scale=s)
           for i, s in ((1, 0.02), (2, 0.02), (3, 0.5))]  # ft-3 moved 25 times further: an outlier
    median = hubsoup.merge(fts, "median", base=base, out=os.path.join(root, "median"), quiet=True, overwrite=True)
    mean = hubsoup.merge(fts, "linear", base=base, out=os.path.join(root, "average"), quiet=True, overwrite=True)
    print(median)

    def shift(folder: str) -> float:  # ‖θ − θ_0‖ over the whole model
        got = load_file(os.path.join(folder, "model.safetensors"))
        b = load_file(os.path.join(base, "model.safetensors"))
        return sum(float((got[k].float() - b[k].float()).norm()) ** 2 for k in b) ** 0.5

    print(f"distance from the base: median {shift(median.path):.3f}, average {shift(mean.path):.3f}, "
          f"fine-tunes {', '.join(f'{shift(f):.3f}' for f in fts)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
