"""Exemplar features for data-aware methods (LOT Merging): load exemplars, run each expert, keep statistics.

For every task k the fine-tuned expert θ_k (= θ_0 + τ_k, materialised tensor by tensor
from the task-vector source, so full fine-tunes and LoRA adapters both work) is run in
eval mode, without gradients, on that task's own exemplars. Forward hooks on every
parametrised op reduce the op's input to the statistics its closed-form merge needs,
as soon as it is produced; no activation is ever kept:

========================  =====================================================  ===========
op (module)               statistic per task k                                   kind
========================  =====================================================  ===========
Linear, GPT-2 Conv1D      Gram G_k = XᵀX of the input rows (float64)              ``linear``
Conv2d (im2col rows)      Gram of the unfolded patches, d_in = C·kh·kw            ``linear``
LayerNorm / RMSNorm γ     s_k = Σ_x x̂², x̂ the normalised input                    ``scale``
token Embedding           token counts (the Gram of one-hot inputs is diagonal)   ``lookup``
biases, norm β, position  n_k = number of rows (tokens) seen                      ``add``
embeddings, other params
========================  =====================================================  ===========

Modules that receive the very same input tensor (q/k/v, gate/up) share one Gram.
Padding positions are excluded (``attention_mask``) wherever an op's rows are token
positions. Ops no exemplar reaches get no statistics and keep θ_0.

Memory and streaming: statistics are kept per op, never activations. The hooked ops
are split, in forward order, into chunks whose float64 Grams fit ``gram_budget_gb``;
each chunk gets its own forward passes over the exemplars (only its ops hooked), and
at the end of a chunk the statistics are written to a scratch safetensors file per task
and freed. Peak memory while capturing: one float32 copy of the model + one chunk's
Grams + one batch's activations. Disk: every task's statistics (T·Σ d_in²·8 bytes).
When merging, one Gram at a time is read back from disk per linear weight.

Experts larger than one device: given a ``device_map`` or ``max_memory`` (the merge's options),
each expert is built empty and dispatched by accelerate's big-model inference, the modules that
fit no device offloaded to disk in a folder inside the output's temporary folder
(:mod:`hubsoup.exemplars.dispatch`); the statistics are the same, bit for bit on the CPU.
"""

from hubsoup.exemplars.capture import FeatureStore, OpStat, capture, load_skeleton, plan_ops
from hubsoup.exemplars.data import Batch, load_exemplar_rows, make_batches, match_tasks, parse_exemplar_specs

__all__ = ["FeatureStore", "OpStat", "capture", "load_skeleton", "plan_ops", "Batch", "load_exemplar_rows",
           "make_batches", "match_tasks", "parse_exemplar_specs"]
