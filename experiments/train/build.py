"""The build step: from a config (configs/, the whole run as its task file's get_config made
it) to the model it describes, for the trainer, the benchmark and the fidelity table alike.
`check` is the one check step (the trainer's check_run and the dry run call it once); then
`model`, experiments/train/optimizer.py's `from_config` and experiments/train/data.py's
`load_splits` build from the checked config.

The check changes a config in one case only, and says so: model.max_len set after get_config
(the command line, --override, a sweep). The token-counted options that get_config scaled for
the preset's length (configs/presets.py, config.made) are then scaled again for the new length,
unless the option itself was set to another value; an option set to exactly the preset's value
at its old length is taken to be the preset's. Each such change is returned as a note (the dry
run prints it).
"""
from __future__ import annotations

import dataclasses
import math

import ml_collections
from flax import nnx

import attention_zoo as az
from attention_zoo.models import (BottleneckLM, Classifier, DecoderLM, DualEncoderClassifier,
                                  TransformerConfig)
from configs import presets
from configs.lra import common
from experiments.common import tasks
from experiments.common.errors import HarnessError, did_you_mean
from experiments.common.variant_names import check_attention

OPTIONS = presets.OPTIONS


# -- the one check step --------------------------------------------------------------------------

def check(config) -> tuple[ml_collections.ConfigDict, list[str]]:
  """A copy of `config` as the run uses it, and notes on what the check changed (see the module
  docstring). HarnessError for a variant the settings were not made for, an unknown variant,
  an option the variant does not have, or a causal-only variant in an encoder."""
  check_attention(config.model.attention)
  made = config.made
  if config.model.attention != made.variant:
    raise HarnessError(
        f"config.model.attention={config.model.attention} but the config holds "
        f"{made.variant}'s settings: name the variant in the config argument "
        f"(--config=<task file>:{config.model.attention},{config.preset}), not as an override")
  checked = ml_collections.ConfigDict(config.to_dict())
  notes = _follow_max_len(checked)
  spec = az.spec(config.model.attention)
  if checked.model.attention_dropout_rate and not spec.supports_dropout:
    notes.append(f"model.attention_dropout_rate={checked.model.attention_dropout_rate} is not "
                 f"used: {config.model.attention} forms no attention weights to drop")
  for name in checked.model.attention_options:
    if name not in spec.options:
      raise HarnessError(
          f"model.attention_options.{name}: {config.model.attention} has no option {name!r}"
          f"{did_you_mean(name, spec.options)}; its options: {', '.join(sorted(spec.options))}")
  encoder = model_class(config.task) not in (DecoderLM, BottleneckLM)
  if encoder and not spec.supports_bidirectional:
    raise HarnessError(
        f"{config.model.attention} is causal only, and {config.task}'s model is an encoder "
        f"({model_class(config.task).__name__}); run it on a causal task (the synthetic ones) "
        f"or use a variant with a bidirectional form")
  return checked, notes


def _follow_max_len(config) -> list[str]:
  """Scales the preset's token-counted options again when model.max_len is no longer the one
  get_config scaled them for; notes naming each change."""
  made, options = config.made, config.model.attention_options
  if config.model.max_len == made.scaled_for:
    return []
  stale = presets.scale_length_options(dict(made.declared), made.scaled_for / made.task_len)
  fresh = presets.scale_length_options(dict(made.declared),
                                       config.model.max_len / made.task_len)
  notes = []
  for name, value in fresh.items():
    if options.get(name) == stale[name] and value != stale[name]:
      options[name] = value
      notes.append(f"{OPTIONS}{name}: {stale[name]} -> {value} (the variant's settings, scaled "
                   f"to model.max_len={config.model.max_len})")
  made.scaled_for = config.model.max_len
  return notes


def sources(config, baseline) -> dict[str, str]:
  """Where each field of `config` that get_config or the user set came from: the layer of
  get_config (config.made.sources: task, preset, variant settings), or "command line" for a
  value that departs from `baseline` (the config file's get_config for the same argument)."""
  found = {field: source for source, names in config.made.sources.items() for field in names}
  found.update(dict.fromkeys(overrides(config, baseline), presets.COMMAND_LINE))
  return found


def source_lines(config, baseline) -> list[str]:
  """A dry run's account of the config: for each source (task, preset, variant settings,
  command line), the fields it set and their values, one line each."""
  values = fields(config)
  by_source: dict[str, list[str]] = {}
  for field, source in sources(config, baseline).items():
    by_source.setdefault(source, []).append(f"{field}={values.get(field)!r}")
  return [f"  {source}: {', '.join(sorted(items))}" for source, items in by_source.items()]


def overrides(config, baseline) -> dict:
  """Where `config` departs from `baseline` (its config file's get_config for the same
  argument), in dotted fields: the user's changes, for results.json. None: not known."""
  if baseline is None:
    return {}
  ours, theirs = fields(config), fields(baseline)
  return {field: value for field, value in ours.items()
          if not field.startswith("made.") and (field not in theirs or theirs[field] != value)}


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
  """The TransformerConfig of a checked config's model (see `check`): an attention scale given
  by formula (configs/lra/common.py SQRT_HEAD_DIM, INVERSE_HEAD_DIM) made a number, and no
  attention dropout for a variant that forms no attention weights (`check` notes it; the
  config keeps the rate its preset gives, as the released configs set it)."""
  model = config.model.to_dict()
  head_dim = (model["qkv_dim"] or model["emb_dim"]) // model["num_heads"]
  computed = {common.SQRT_HEAD_DIM: math.sqrt(head_dim), common.INVERSE_HEAD_DIM: 1 / head_dim}
  options = dict(model["attention_options"])
  if options.get("scale") in computed:
    options["scale"] = computed[options["scale"]]
  model["attention_options"] = options
  if not az.spec(model["attention"]).supports_dropout:
    model["attention_dropout_rate"] = 0.0
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
