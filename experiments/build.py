"""The build step: from a config (configs/, plain values) to the run it describes, the one place
where presets are resolved and the model and its optimizer are made, for the trainer, the
benchmark and the fidelity table alike. The trainer calls `resolve`, then `model`, `optimizer`
and experiments/data.py's `load_splits` (the data at the resolved model.max_len).

A config leaves None what depends on the attention variant (configs/lra/common.py): `resolve`
fills it in for the variant the config finally names, from the same tables the config file
holds. So `--config.model.attention=local` gives local's settings, an option set in
`model.attention_options` wins over the preset's, and token-counted options follow a
shortened `model.max_len`.

The optimiser is Adam or AdamW after optional gradient clipping, with LRA's learning-rate
schedules, which LRA writes as a product of factors (`create_learning_rate_scheduler` in the
reference code), e.g. "constant * linear_warmup * rsqrt_decay":
  constant                base_learning_rate
  linear_warmup           min(1, step / warmup_steps)
  rsqrt_decay             1 / sqrt(max(step, warmup_steps))
  rsqrt_normalized_decay  sqrt(warmup_steps) / sqrt(max(step, warmup_steps))
  cosine_decay            0.5 * (1 + cos(pi * (progress % 1))), progress =
                          max(0, (step - warmup_steps) / steps_per_cycle)
  one_cycle               PyTorch's OneCycleLR (two phases, linear anneal) as a factor of its
                          max_lr: 1 / div_factor at update 0, rising linearly to 1 at update
                          warmup_steps - 1, then falling linearly to 1 / (div_factor *
                          final_div_factor) at update steps_per_cycle - 1
`step` counts from 1 for the first update (the reference's step 0 would give rate 0); one_cycle
counts updates from 0, as PyTorch's scheduler does. With schedule.cycle_b1, Adam's β1 follows
OneCycleLR's momentum cycle instead of optimizer.b1: max_b1 at update 0, min_b1 at update
warmup_steps - 1, max_b1 again at update steps_per_cycle - 1 (PyTorch's cycle_momentum, which
overwrites the betas' β1).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

import attention_zoo as az
import lra
from attention_zoo.models import (BottleneckLM, Classifier, DecoderLM, DualEncoderClassifier,
                                  TransformerConfig)
from configs.lra import common
from experiments import cli

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
  released = cli.task_module(task).RELEASED
  own = released.get(variant, {} if variant in common.LRA_VARIANTS else released.get("full", {}))
  return {**released["shared"], **common.RELEASED_QUIRKS,
          **common.RELEASED_ATTENTION.get(variant, {}), **own}


def preset_values(task: str, variant: str, preset: str) -> dict:
  """The preset's values for `variant`, in dotted config fields, before length scaling: every
  value under `paper` (the released one, or its PAPER_CHANGES), `light` and `light_fair` (the
  task's LIGHT, and under light_fair its LIGHT_FIXES), the attention settings under `fair` and
  `tiny` (the rest does not depend on the variant), and a diagnostic's own
  ATTENTION_SETTINGS."""
  module = cli.task_module(task)
  if hasattr(module, "ATTENTION_SETTINGS"):
    return dict(module.ATTENTION_SETTINGS.get(variant, {}))
  if preset in common.LIGHT_PRESETS:
    return common.light_values(module.LIGHT, module.LIGHT_FIXES, variant, preset)
  extra = common.EXTRA_ATTENTION.get(variant, {})
  if preset == "paper":
    changes = getattr(module, "PAPER_CHANGES", {}).get(variant, {})
    return {**released_values(task, variant), **extra,
            **{field: value for field, (value, _) in changes.items()}}
  # LRA's task-specific block sizes (64 on the pixel tasks) are kept.
  task_blocks = {field: value for field, value in module.RELEASED.get(variant, {}).items()
                 if field.startswith(OPTIONS) and field[len(OPTIONS):] in LENGTH_OPTIONS}
  return {**common.FAIR_ATTENTION.get(variant, {}), **extra, **task_blocks}


# -- resolving a config -------------------------------------------------------------------------

def resolve(config) -> ml_collections.ConfigDict:
  """A copy of `config` with every value the run uses: each None the preset has a value for,
  the variant's options (the preset's, scaled to model.max_len, under those the config sets),
  and the "0 = follow another field" defaults. Unknown names -> HarnessError."""
  if config.preset not in common.PRESETS:
    raise cli.HarnessError(f"unknown preset {config.preset!r}; presets: "
                           f"{', '.join(common.PRESETS)}")
  cli.check_attention(config.model.attention)
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
  options = scale_length_options(options, model.max_len / lra.task_spec(config.task).max_len)
  head_dim = (model.qkv_dim or model.emb_dim) // model.num_heads
  computed = {common.SQRT_HEAD_DIM: math.sqrt(head_dim), common.INVERSE_HEAD_DIM: 1 / head_dim}
  if options.get("scale") in computed:
    options["scale"] = computed[options["scale"]]
  explicit = {k: v for k, v in config.model.attention_options.items() if v is not None}
  for name in explicit:
    if name not in spec.options:
      raise cli.HarnessError(
          f"model.attention_options.{name}: {config.model.attention} has no option {name!r}"
          f"{cli.did_you_mean(name, spec.options)}; its options: "
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
  default = cli.task_config(config.task, config.model.attention, config.preset)
  ours, theirs = _flatten(config.to_dict()), _flatten(default.to_dict())
  return {field: value for field, value in ours.items()
          if field not in theirs or theirs[field] != value}


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
  """A causal DecoderLM for a token task (the diagnostics; a BottleneckLM when the task reads
  every position from the last one, MAD's compression), else a classifier (a dual encoder for
  Retrieval)."""
  spec = lra.task_spec(task)
  if spec.objective == "next_token":
    return BottleneckLM if spec.readout == "last_position" else DecoderLM
  return DualEncoderClassifier if spec.dual else Classifier


def model(config, rngs: nnx.Rngs) -> tuple[nnx.Module, TransformerConfig]:
  """The task's model (see model_class) and its resolved TransformerConfig."""
  resolved = model_config(config)
  return model_class(config.task)(resolved, rngs=rngs), resolved


def optimizer(config):
  """(optax optimizer, learning-rate schedule) of config.optimizer and config.schedule."""
  s = config.schedule
  schedule = learning_rate_schedule(s.factors, base_learning_rate=s.base_learning_rate,
                                    warmup_steps=s.warmup_steps,
                                    steps_per_cycle=s.steps_per_cycle,
                                    div_factor=s.div_factor,
                                    final_div_factor=s.final_div_factor)
  b1 = b1_schedule(s) if s.cycle_b1 else config.optimizer.b1
  return make_optimizer(config.optimizer, schedule, b1=b1), schedule


def describe(model: TransformerConfig) -> dict:
  """The resolved model as plain JSON values (for results.json)."""
  return dataclasses.asdict(model)


# -- the optimiser ------------------------------------------------------------------------------

FACTORS = ("constant", "linear_warmup", "rsqrt_decay", "rsqrt_normalized_decay", "cosine_decay",
           "one_cycle")
OPTIMIZERS = ("adam", "adamw")


def learning_rate_schedule(factors: str, *, base_learning_rate: float, warmup_steps: int,
                           steps_per_cycle: int, div_factor: float = 25.0,
                           final_div_factor: float = 1e4):
  """An optax schedule: update index (0-based) -> learning rate."""
  names = [name.strip() for name in factors.split("*")]
  unknown = [n for n in names if n not in FACTORS]
  if unknown:
    raise cli.HarnessError(f"unknown schedule factor(s) {', '.join(map(repr, unknown))} in "
                       f"schedule.factors={factors!r}; factors: {', '.join(FACTORS)}")
  if "linear_warmup" in names and warmup_steps <= 0:
    raise cli.HarnessError("schedule.warmup_steps must be positive for linear_warmup, "
                       f"got {warmup_steps}")
  if "cosine_decay" in names and steps_per_cycle <= 0:
    raise cli.HarnessError("schedule.steps_per_cycle must be positive for cosine_decay, "
                       f"got {steps_per_cycle}")
  if "one_cycle" in names:
    check_one_cycle(warmup_steps, steps_per_cycle)
    if div_factor <= 0 or final_div_factor <= 0:
      raise cli.HarnessError(f"schedule.div_factor ({div_factor}) and schedule.final_div_factor "
                             f"({final_div_factor}) must be positive for one_cycle")

  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1
    rate = jnp.ones((), jnp.float32)
    for name in names:
      if name == "constant":
        rate *= base_learning_rate
      elif name == "linear_warmup":
        rate *= jnp.minimum(1.0, step / warmup_steps)
      elif name == "rsqrt_decay":
        rate /= jnp.sqrt(jnp.maximum(step, warmup_steps))
      elif name == "rsqrt_normalized_decay":
        rate *= jnp.sqrt(warmup_steps) / jnp.sqrt(jnp.maximum(step, warmup_steps))
      elif name == "cosine_decay":
        progress = jnp.maximum(0.0, (step - warmup_steps) / steps_per_cycle)
        rate *= 0.5 * (1.0 + jnp.cos(jnp.pi * (progress % 1.0)))
      else:  # one_cycle
        rate *= one_cycle(count, 1.0 / div_factor, 1.0, 1.0 / (div_factor * final_div_factor),
                          warmup_steps=warmup_steps, total_steps=steps_per_cycle)
    return rate

  return schedule


def check_one_cycle(warmup_steps: int, total_steps: int) -> None:
  if warmup_steps < 2 or total_steps <= warmup_steps:
    raise cli.HarnessError(
        f"one_cycle needs 2 <= schedule.warmup_steps < schedule.steps_per_cycle (its phases end "
        f"at updates warmup_steps - 1 and steps_per_cycle - 1); got {warmup_steps} and "
        f"{total_steps}")


def one_cycle(count, start: float, peak: float, end: float, *, warmup_steps: int,
              total_steps: int):
  """PyTorch OneCycleLR's two linear phases at update `count` (0-based): start -> peak over
  updates 0 .. warmup_steps - 1, then peak -> end over warmup_steps - 1 .. total_steps - 1
  (held at `end` after)."""
  count = jnp.asarray(count, jnp.float32)
  turn, last = warmup_steps - 1, total_steps - 1
  rising = start + (peak - start) * count / turn
  # measured from the end, so that a tiny `end` keeps its digits in float32
  falling = end + (peak - end) * jnp.maximum(last - count, 0.0) / (last - turn)
  return jnp.where(count <= turn, rising, falling)


def b1_schedule(schedule_config):
  """Adam's β1 by update under schedule.cycle_b1 (PyTorch OneCycleLR's cycle_momentum): max_b1
  -> min_b1 while the learning rate rises, back to max_b1 while it falls."""
  s = dict(schedule_config)
  if "one_cycle" not in [name.strip() for name in s["factors"].split("*")]:
    raise cli.HarnessError(f"schedule.cycle_b1 follows the one_cycle factor, which "
                           f"schedule.factors={s['factors']!r} lacks")
  check_one_cycle(s["warmup_steps"], s["steps_per_cycle"])
  return lambda count: one_cycle(count, s["max_b1"], s["min_b1"], s["max_b1"],
                                 warmup_steps=s["warmup_steps"], total_steps=s["steps_per_cycle"])


def decayed(params):
  """False for the parameters created with `weight_decay=False` metadata (the recurrent mixers'
  decay-rate parameters, which their authors exclude from weight decay), True for the rest; a
  prefix of the params tree, as optax's masks may be."""
  return jax.tree.map(lambda p: getattr(p, "weight_decay", True) is not False, params,
                      is_leaf=lambda p: isinstance(p, nnx.Variable))


def make_optimizer(optimizer, schedule, *, b1=None) -> optax.GradientTransformation:
  """Adam (L2 weight decay added to the gradient) or AdamW (decoupled decay, as LRA's
  flax.optim.Adam), after optional global-norm gradient clipping. Decay applies to every
  parameter, as in LRA, except those marked `weight_decay=False` (see `decayed`). `b1`: Adam's
  β1, a number or a function of the update index (default optimizer.b1)."""
  if optimizer.name not in OPTIMIZERS:
    raise cli.HarnessError(f"unknown optimizer.name {optimizer.name!r}; choose one of "
                       f"{', '.join(OPTIMIZERS)}")
  clip = [optax.clip_by_global_norm(optimizer.grad_clip_norm)] if optimizer.grad_clip_norm else []
  b1 = optimizer.b1 if b1 is None else b1
  # optax.adam / adamw as their chains, so that β1 may follow a schedule
  scale_by_adam = optax.inject_hyperparams(optax.scale_by_adam) if callable(b1) else \
      optax.scale_by_adam
  adam = [scale_by_adam(b1=b1, b2=optimizer.b2, eps=optimizer.eps)]
  if optimizer.name == "adamw":
    main = optax.chain(*adam, optax.add_decayed_weights(optimizer.weight_decay, decayed),
                       optax.scale_by_learning_rate(schedule))
  else:
    decay = ([optax.masked(optax.add_decayed_weights(optimizer.weight_decay), decayed)]
             if optimizer.weight_decay else [])
    main = optax.chain(*decay, optax.chain(*adam, optax.scale_by_learning_rate(schedule)))
  return optax.chain(*clip, main)
