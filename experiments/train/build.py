"""The build step: from a config (configs/, plain values) to the run it describes, the one place
where presets are resolved and the model is made, for the trainer, the benchmark and the
fidelity table alike. The trainer calls `resolve`, then `model`, experiments/train/optimizer.py's
`from_config` and experiments/train/data.py's `load_splits` (the data at the resolved
model.max_len).

A config leaves None what depends on the attention variant (configs/lra/common.py): `resolve`
fills it in for the variant the config finally names, from the values its task's config file
declares (`VALUES`, configs/task_values.py) and the presets' tables. So
`--config.model.attention=local` gives local's settings, an option set in
`model.attention_options` wins over the preset's, and token-counted options follow a
shortened `model.max_len`.
"""
from __future__ import annotations

import dataclasses
import math

import ml_collections
from flax import nnx

import attention_zoo as az
from attention_zoo.models import (BottleneckLM, Classifier, DecoderLM, DualEncoderClassifier,
                                  TransformerConfig)
from configs.lra import common
from experiments.common import tasks
from experiments.common.errors import HarnessError, did_you_mean
from experiments.common.task_configs import task_config, task_values
from experiments.common.variant_names import check_attention

OPTIONS = "model.attention_options."
# Attention options measured in tokens, with the smallest value a shortened sequence scales them
# to: a block or window then covers the same fraction of the sequence as at the task's length.
LENGTH_OPTIONS = {"block_size": 4, "window": 4, "chunk_len": 4, "chunk_size": 4,
                  "query_chunk": 4, "num_summary": 1}


# -- the presets' values for one variant -------------------------------------------------------

def released_values(task: str, variant: str) -> dict:
  """What the released LRA code ran for (task, variant), in dotted config fields: the task's
  base config, the quirks of every released encoder, the variant's attention settings, then
  what the variant's file changes. A variant without a released file takes the Transformer's."""
  released = task_values(task).released
  own = released.get(variant, {} if variant in common.LRA_VARIANTS else released.get("full", {}))
  return {**released["shared"], **common.RELEASED_QUIRKS,
          **common.RELEASED_ATTENTION.get(variant, {}), **own}


def preset_values(task: str, variant: str, preset: str) -> dict:
  """The preset's values for `variant`, in dotted config fields, before length scaling: every
  value under `paper` (the released one, or its paper change), `light` and `light_fair` (the
  task's light values, and under light_fair its light fixes), the attention settings under
  `fair` and `tiny` (the rest does not depend on the variant), and a diagnostic's own
  attention settings."""
  values = task_values(task)
  if not values.is_lra:
    return dict(values.attention_settings.get(variant, {}))
  if preset in common.LIGHT_PRESETS:
    return common.light_values(values.light, values.light_fixes, variant, preset)
  extra = common.EXTRA_ATTENTION.get(variant, {})
  if preset == "paper":
    changes = values.paper_changes.get(variant, {})
    return {**released_values(task, variant), **extra,
            **{field: value for field, (value, _) in changes.items()}}
  # LRA's task-specific block sizes (64 on the pixel tasks) are kept.
  task_blocks = {field: value for field, value in values.released.get(variant, {}).items()
                 if field.startswith(OPTIONS) and field[len(OPTIONS):] in LENGTH_OPTIONS}
  return {**common.FAIR_ATTENTION.get(variant, {}), **extra, **task_blocks}


# -- resolving a config -------------------------------------------------------------------------

def resolve(config) -> ml_collections.ConfigDict:
  """A copy of `config` with every value the run uses: each None the preset has a value for,
  the variant's options (the preset's, scaled to model.max_len, under those the config sets),
  and the "0 = follow another field" defaults. Unknown names -> HarnessError."""
  if config.preset not in common.PRESETS:
    raise HarnessError(f"unknown preset {config.preset!r}"
                       f"{did_you_mean(config.preset, common.PRESETS)}; presets: "
                       f"{', '.join(common.PRESETS)}")
  check_attention(config.model.attention)
  resolved = ml_collections.ConfigDict(config.to_dict())
  attention, task = config.model.attention, config.task
  values = preset_values(task, attention, config.preset)
  for field, value in values.items():
    node, name = common.parent_and_name(resolved, field)
    if not field.startswith(OPTIONS) and node.get(name) is None:
      node[name] = value
  model = resolved.model
  model.attention_ignores_padding = bool(model.attention_ignores_padding)
  model.share_attention_across_layers = bool(model.share_attention_across_layers)
  spec = az.spec(attention)
  if not spec.supports_dropout:
    model.attention_dropout_rate = 0.0   # the variant forms no attention weights to drop
  model.attention_options = _options(config, values, spec, resolved.model)
  resolved.eval_batch_size = resolved.eval_batch_size or resolved.batch_size
  resolved.checkpoint_every = resolved.checkpoint_every or resolved.eval_every
  resolved.schedule.steps_per_cycle = (resolved.schedule.steps_per_cycle
                                       or resolved.num_train_steps)
  return resolved


def _options(config, values: dict, spec, model) -> dict:
  """The variant's options: the preset's, token-counted ones scaled when model.max_len is
  shorter than the task's, a sqrt(head_dim) scale made a number, then those the config sets
  (taken as they are; a name the variant does not have -> HarnessError)."""
  options = {field[len(OPTIONS):]: value for field, value in values.items()
             if field.startswith(OPTIONS)}
  options = scale_length_options(options, model.max_len / tasks.task_spec(config.task).max_len)
  head_dim = (model.qkv_dim or model.emb_dim) // model.num_heads
  computed = {common.SQRT_HEAD_DIM: math.sqrt(head_dim), common.INVERSE_HEAD_DIM: 1 / head_dim}
  if options.get("scale") in computed:
    options["scale"] = computed[options["scale"]]
  explicit = {k: v for k, v in config.model.attention_options.items() if v is not None}
  for name in explicit:
    if name not in spec.options:
      raise HarnessError(
          f"model.attention_options.{name}: {config.model.attention} has no option {name!r}"
          f"{did_you_mean(name, spec.options)}; its options: "
          f"{', '.join(sorted(spec.options))}")
  return {**options, **explicit}


def scale_length_options(options: dict, ratio: float) -> dict:
  """Token-counted options times `ratio` (rounded, at least LENGTH_OPTIONS' minimum)."""
  if ratio >= 1:
    return dict(options)
  scaled = dict(options)
  for name, minimum in LENGTH_OPTIONS.items():
    value = options.get(name)
    if isinstance(value, int) and not isinstance(value, bool):
      scaled[name] = max(minimum, round(value * ratio))
  return scaled


def overrides(config) -> dict:
  """Where `config` departs from its config file's get_config("<attention>,<preset>"), in
  dotted fields: the user's changes, for results.json."""
  default = task_config(config.task, config.model.attention, config.preset)
  ours, theirs = fields(config), fields(default)
  return {field: value for field, value in ours.items()
          if field not in theirs or theirs[field] != value}


def fields(config) -> dict:
  """Every value of a config, by dotted field ("model.emb_dim": 64)."""
  return _flatten(config.to_dict())


def _flatten(tree: dict, prefix: str = "") -> dict:
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(_flatten(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


# -- the model ---------------------------------------------------------------------------------

def model_config(config) -> TransformerConfig:
  """The TransformerConfig of `config.model`, resolved (see `resolve`)."""
  model = resolve(config).model.to_dict()
  return TransformerConfig(**model)


def model_class(task: str) -> type:
  """A causal DecoderLM for a token task (the synthetic tasks; a BottleneckLM when the task
  reads every position from the last one, MAD's compression), else a classifier (a dual encoder
  for Retrieval)."""
  spec = tasks.task_spec(task)
  if spec.objective == "next_token":
    return BottleneckLM if spec.readout == "last_position" else DecoderLM
  return DualEncoderClassifier if spec.dual else Classifier


def model(config, rngs: nnx.Rngs) -> tuple[nnx.Module, TransformerConfig]:
  """The task's model (see model_class) and its resolved TransformerConfig."""
  resolved = model_config(config)
  return model_class(config.task)(resolved, rngs=rngs), resolved


def describe(model: TransformerConfig) -> dict:
  """The resolved model as plain JSON values (for results.json)."""
  return dataclasses.asdict(model)
