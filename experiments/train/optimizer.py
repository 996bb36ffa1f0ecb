"""The optimiser of a run (config.optimizer, config.schedule): Adam or AdamW after optional
gradient clipping, with LRA's learning-rate schedules, which LRA writes as a product of factors
(`create_learning_rate_scheduler` in the reference code), e.g.
"constant * linear_warmup * rsqrt_decay":
  constant                base_learning_rate
  linear_warmup           min(1, step / warmup_steps)
  rsqrt_decay             1 / sqrt(max(step, warmup_steps))
  rsqrt_normalized_decay  sqrt(warmup_steps) / sqrt(max(step, warmup_steps))
  cosine_decay            0.5 * (1 + cos(pi * (progress % 1))), progress =
                          max(0, (step - warmup_steps) / steps_per_cycle)
`step` counts from 1 for the first update (the reference's step 0 would give rate 0).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from experiments.common.errors import HarnessError

FACTORS = ("constant", "linear_warmup", "rsqrt_decay", "rsqrt_normalized_decay", "cosine_decay")
OPTIMIZERS = ("adam", "adamw")


def learning_rate_schedule(factors: str, *, base_learning_rate: float, warmup_steps: int,
                           steps_per_cycle: int):
  """An optax schedule: update index (0-based) -> learning rate."""
  names = [name.strip() for name in factors.split("*")]
  unknown = [n for n in names if n not in FACTORS]
  if unknown:
    raise HarnessError(f"unknown schedule factor(s) {', '.join(map(repr, unknown))} in "
                       f"schedule.factors={factors!r}; factors: {', '.join(FACTORS)}")
  if "linear_warmup" in names and warmup_steps <= 0:
    raise HarnessError("schedule.warmup_steps must be positive for linear_warmup, "
                       f"got {warmup_steps}")
  if "cosine_decay" in names and steps_per_cycle <= 0:
    raise HarnessError("schedule.steps_per_cycle must be positive for cosine_decay, "
                       f"got {steps_per_cycle}")

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
      else:  # cosine_decay
        progress = jnp.maximum(0.0, (step - warmup_steps) / steps_per_cycle)
        rate *= 0.5 * (1.0 + jnp.cos(jnp.pi * (progress % 1.0)))
    return rate

  return schedule


def decayed(params):
  """False for the parameters created with `weight_decay=False` metadata (the recurrent mixers'
  decay-rate parameters, which their authors exclude from weight decay), True for the rest; a
  prefix of the params tree, as optax's masks may be."""
  return jax.tree.map(lambda p: getattr(p, "weight_decay", True) is not False, params,
                      is_leaf=lambda p: isinstance(p, nnx.Variable))


def make_optimizer(optimizer, schedule) -> optax.GradientTransformation:
  """Adam (L2 weight decay added to the gradient) or AdamW (decoupled decay, as LRA's
  flax.optim.Adam), after optional global-norm gradient clipping. Decay applies to every
  parameter, as in LRA, except those marked `weight_decay=False` (see `decayed`)."""
  if optimizer.name not in OPTIMIZERS:
    raise HarnessError(f"unknown optimizer.name {optimizer.name!r}; choose one of "
                       f"{', '.join(OPTIMIZERS)}")
  clip = [optax.clip_by_global_norm(optimizer.grad_clip_norm)] if optimizer.grad_clip_norm else []
  adam = dict(b1=optimizer.b1, b2=optimizer.b2, eps=optimizer.eps)
  if optimizer.name == "adamw":
    main = optax.adamw(schedule, weight_decay=optimizer.weight_decay, mask=decayed, **adam)
  else:
    decay = ([optax.masked(optax.add_decayed_weights(optimizer.weight_decay), decayed)]
             if optimizer.weight_decay else [])
    main = optax.chain(*decay, optax.adam(schedule, **adam))
  return optax.chain(*clip, main)


def from_config(config):
  """(optax optimizer, learning-rate schedule) of config.optimizer and config.schedule."""
  s = config.schedule
  schedule = learning_rate_schedule(s.factors, base_learning_rate=s.base_learning_rate,
                                    warmup_steps=s.warmup_steps,
                                    steps_per_cycle=s.steps_per_cycle)
  return make_optimizer(config.optimizer, schedule), schedule
