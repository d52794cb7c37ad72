"""mergekit YAML configs, read with mergekit's semantics (and written back from hubsoup recipes).

The package's modules, one concern each: :mod:`~hubsoup.formats.mergekit.config` (keys, model references, parameter
maps), :mod:`~hubsoup.formats.mergekit.methods` (the methods table), :mod:`~hubsoup.formats.mergekit.read` (a config
as the merge it means), :mod:`~hubsoup.formats.mergekit.layout` (the output it lays out: slices, config, tokenizer),
:mod:`~hubsoup.formats.mergekit.export` (a recipe written as a config), :mod:`~hubsoup.formats.mergekit.vocab`
(merged vocabularies) and :mod:`~hubsoup.formats.mergekit.modules` (``modules:`` configs). This package's names are
their public face.

Thousands of model cards carry a mergekit config. :func:`read_config` turns one into the
hubsoup merge it means and :func:`hubsoup.workflows.rerun.run_config` runs it (``hubsoup run CONFIG.yml`` and
:func:`hubsoup.run_recipe` detect such a file by its ``merge_method`` key):

* ``merge_method`` picks the hubsoup method *with mergekit's convention* (:data:`METHODS`:
  e.g. ``ties`` → hubsoup ``ties`` with ``convention=mergekit, scope=tensor``; ``lambda`` →
  ``scale``; per-model ``weight``/``density``/``gamma``/``epsilon`` → the per-input tuples
  ``weights``/``densities``/``gammas``/``epsilons``). A hubsoup method that mergekit lacks
  (``sftm``, ``lines``, ``opcm``, ``lot``, ...) is used as is, its ``parameters`` in hubsoup's names.
* Parameters follow mergekit's precedence (a model's, then its slice's, then the top-level
  ``parameters``); gradients and ``filter`` entries become per-tensor schedules
  (:mod:`hubsoup.methods._schedule`), resolved by the engine with mergekit's ``t``.
* ``slices`` (frankenmerges, per-slice merges) become a *layout*: the output's tensors are
  renumbered source layers (:class:`hubsoup.plan.TensorSource`), streamed by the one engine;
  the output config gets the new layer count.
* ``dtype`` / ``out_dtype`` set the output dtype; a method that mergekit computes in its ``dtype`` (else
  the inputs' own) does so here too (its ``compute_dtype``), and where mergekit's kernel returns float32
  whatever it computes in (arcee_fusion, ramplus_tl: :attr:`MkMethod.result_dtype`), a config without
  ``out_dtype`` stores float32 under a ``config.json`` naming its ``dtype``, as mergekit's does;
  ``chat_template`` may be a Jinja template, one of mergekit's names or ``auto``
  (:mod:`hubsoup.formats.chat_template`).
* ``tokenizer_source`` (``base``, ``union``, a model) and the ``tokenizer`` section (``source``,
  ``tokens``, ``pad_to_multiple_of``) give the output mergekit's merged vocabulary: every input's
  embedding and head rows re-indexed to it as the engine streams them
  (:mod:`hubsoup.formats.mergekit.vocab`).
* Keys and parameters mergekit drops without a word (its config classes ignore unknown keys,
  a method reads only the parameters it declares) are dropped too, each named in one warning
  and on the card (:attr:`MergekitMerge.ignored`); numbers written as strings are numbers.
* A stream of configs (mergekit-multi's stages) is run by :mod:`hubsoup.formats.stages`.
* ``modules:`` of a multimodal model (each module its own models, slices and parameters) is run module
  by module by :mod:`hubsoup.formats.mergekit.modules`; a lone ``default`` module reads as the plain config.

Where hubsoup differs: a per-model ``filter`` matches the *output* tensor's name (mergekit: the
input's, which differs only in the layer number within a slice); slices that merge must all take
the same models.

Model references are resolved as mergekit does: a folder that exists (relative to the working
folder) is local, anything else a Hub repo ``org/name[@revision]``; ``base+adapter`` (a LoRA
on the base model) is the adapter as an input, and ``model+adapter`` anywhere else (base_model
included) is the model with the adapter applied tensor by tensor (:mod:`hubsoup.sources.adapted`).

Example:
    >>> from hubsoup.formats.mergekit import read_config
    >>> m = read_config('''
    ... merge_method: ties
    ... base_model: org/base
    ... models:
    ...   - model: org/ft-a
    ...     parameters: {weight: 1.0, density: 0.5}
    ... ''', resolve=False)
    >>> m.method, m.params["convention"], m.params["weights"], m.params["densities"]
    ('ties', 'mergekit', [1.0], [0.5])
"""


from hubsoup.formats.mergekit.config import CONFIG_FILE, Slice, Source, check_hub_only, is_mergekit_config, load_text
from hubsoup.formats.mergekit.export import EXPORTS, export_config
from hubsoup.formats.mergekit.layout import MergekitLayout
from hubsoup.formats.mergekit.methods import METHODS, REQUIRED, MkMethod, MkParam
from hubsoup.formats.mergekit.read import MergekitMerge, read_config

__all__ = ["read_config", "MergekitMerge", "MergekitLayout", "export_config", "EXPORTS", "METHODS", "MkMethod", "MkParam",
           "REQUIRED", "Source", "Slice", "CONFIG_FILE", "is_mergekit_config", "load_text", "check_hub_only"]
