"""Build the ``modules:`` fixtures of merged vocabularies, tied tensors and unlisted tensors, with mergekit's outputs.

The stand-ins are :mod:`make_mergekit_modules_fixtures`'s (Mistral3, T5, Whisper), changed so that
(:func:`build_models`, seeded, bit-identical on every run):

* ``mm-*`` carry tokenizers: ``mm-base`` and ``mm-ft-b`` the 32 words of
  :mod:`make_mergekit_vocab_fixtures`; ``mm-ft-a`` those and two added special tokens
  (``<|im_start|>`` 32, ``<|im_end|>`` 33), its embeddings and head resized to 34 rows
  (``text_config.vocab_size: 34``);
* ``t5-ft-a`` also stores ``encoder.embed_tokens.weight`` and ``decoder.embed_tokens.weight`` (its
  ``shared.weight`` plus a small offset each), ``t5-ft-b`` stores no ``lm_head.weight``, and every
  ``t5-*`` holds ``encoder.extra_scale``, under the encoder's prefix but not in mergekit's t5.json.

``tests/fixtures/mergekit_modules_extra/*.yml`` are the configs; for each, mergekit 0.1.5's output
tensors (``<name>.safetensors``) and, in ``manifest.json``, its ``config.json`` (vocabulary size at
its key, layer counts, dtype) and tokenizer files, or, for a config mergekit refuses, its error.
``tests/formats/test_mergekit_modules_extra.py`` compares hubsoup with them.

Regenerate from the repository root (``--only NAME``, repeatable: those configs only)::

    python tests/tools/make_mergekit_modules_extra_fixtures.py --mergekit benchmarks/.work/mergekit-venv/bin/mergekit-yaml
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_mergekit_modules_fixtures as base_fixtures  # noqa: E402
import make_mergekit_vocab_fixtures as vocab_fixtures  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(HERE, "fixtures", "mergekit_modules_extra")
MERGEKIT_VERSION = "0.1.5"
CHAT_TOKENS = [("<|im_start|>", True), ("<|im_end|>", True)]
TEXT_VOCAB = ("language_model.model.embed_tokens.weight", "language_model.lm_head.weight")


def build_models(root: str) -> dict[str, str]:
    """The stand-ins under ``root`` (see the module's docstring); returns name → digest of the tensors."""
    from safetensors.torch import load_file, save_file

    base_fixtures.build_models(root)
    out = {}
    for ref in base_fixtures.MODELS:
        folder = os.path.join(root, ref)
        path = os.path.join(folder, "model.safetensors")
        t = load_file(path)
        if ref.startswith("mm-"):
            vocab_fixtures.save_tokenizer(folder, vocab_fixtures.BASE_WORDS, CHAT_TOKENS if ref == "mm-ft-a" else [])
            if ref == "mm-ft-a":
                g = torch.Generator().manual_seed(99)
                for k in TEXT_VOCAB:
                    t[k] = torch.cat([t[k], (torch.randn(2, t[k].shape[1], generator=g) * 0.2).to(t[k].dtype)])
                with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
                    cfg = json.load(f)
                cfg["text_config"]["vocab_size"] = 34
                with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
                    json.dump(cfg, f, indent=2)
        if ref.startswith("t5-"):
            t["encoder.extra_scale"] = torch.ones(base_fixtures.HIDDEN, dtype=torch.bfloat16)
            if ref == "t5-ft-a":
                t["encoder.embed_tokens.weight"] = (t["shared.weight"].float() + 0.001).to(torch.bfloat16)
                t["decoder.embed_tokens.weight"] = (t["shared.weight"].float() - 0.002).to(torch.bfloat16)
            if ref == "t5-ft-b":
                del t["lm_head.weight"]
        save_file(t, path, metadata={"format": "pt"})
        out[ref] = base_fixtures.digest(t)
    return out


def config_names() -> list[str]:
    return sorted(fn[:-4] for fn in os.listdir(FIXTURES) if fn.endswith(".yml"))


def family_of(name: str) -> str:
    return "t5" if "t5" in name else "wh" if "whisper" in name else "mm"


def tokenizer_files(folder: str) -> dict:
    """The output's tokenizer files (``tokenizer_config.json`` without ``local_files_only``, which says how it ran)."""
    files = {}
    for fn in ("tokenizer.json", "tokenizer_config.json"):
        p = os.path.join(folder, fn)
        if os.path.isfile(p):
            with open(p, encoding="utf-8") as f:
                files[fn] = json.load(f)
    if "tokenizer_config.json" in files:
        files["tokenizer_config.json"].pop("local_files_only", None)
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mergekit", default="benchmarks/.work/mergekit-venv/bin/mergekit-yaml")
    ap.add_argument("--only", action="append", help="regenerate only these configs (repeatable)")
    args = ap.parse_args(argv)
    from safetensors import safe_open
    from safetensors.torch import save_file

    manifest: dict = {"mergekit": MERGEKIT_VERSION, "configs": {}}
    if args.only:
        with open(os.path.join(FIXTURES, "manifest.json"), encoding="utf-8") as f:
            manifest = json.load(f)
    with tempfile.TemporaryDirectory() as root:
        manifest["models"] = build_models(root)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONHASHSEED="0")
        for name in config_names():
            if args.only and name not in args.only:
                continue
            out = os.path.join(root, "_out", name)
            cmd = [os.path.abspath(args.mergekit), os.path.join(FIXTURES, f"{name}.yml"), out, "--random-seed", "0",
                   "--no-write-model-card", "--quiet"]
            proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
            if name.startswith("refused_"):
                if proc.returncode == 0:
                    raise SystemExit(f"mergekit ran {name}, which the fixture says it refuses")
                last = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1]
                manifest["configs"][name] = {"mergekit_error": last.strip()}
                print(f"mergekit: {name}: refused: {last.strip()}", file=sys.stderr)
                continue
            if proc.returncode != 0:
                print(proc.stderr[-2000:], file=sys.stderr)
                raise SystemExit(f"mergekit refused {name}")
            tensors = {}
            for fn in sorted(os.listdir(out)):
                if fn.endswith(".safetensors"):
                    with safe_open(os.path.join(out, fn), framework="pt") as h:
                        tensors.update({k: h.get_tensor(k) for k in h.keys()})
            save_file(tensors, os.path.join(FIXTURES, f"{name}.safetensors"), metadata={"mergekit": MERGEKIT_VERSION})
            with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
                cfg = json.load(f)
            fam = family_of(name)
            keys = list(base_fixtures.LAYER_KEYS[fam]) + (["text_config.vocab_size"] if fam == "mm" else ["vocab_size"])
            manifest["configs"][name] = {
                "config": {k: base_fixtures.layers(cfg, k) for k in keys},
                "dtype": cfg.get("dtype") or cfg.get("torch_dtype"),
                "tokenizer": tokenizer_files(out)}
            print(f"mergekit: {name}: {len(tensors)} tensors", file=sys.stderr)
    with open(os.path.join(FIXTURES, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True, ensure_ascii=False)
        f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
