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

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from experiments.common.errors import HarnessError

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
    raise HarnessError(f"unknown schedule factor(s) {', '.join(map(repr, unknown))} in "
                       f"schedule.factors={factors!r}; factors: {', '.join(FACTORS)}")
  if "linear_warmup" in names and warmup_steps <= 0:
    raise HarnessError("schedule.warmup_steps must be positive for linear_warmup, "
                       f"got {warmup_steps}")
  if "cosine_decay" in names and steps_per_cycle <= 0:
    raise HarnessError("schedule.steps_per_cycle must be positive for cosine_decay, "
                       f"got {steps_per_cycle}")
  if "one_cycle" in names:
    check_one_cycle(warmup_steps, steps_per_cycle)
    if div_factor <= 0 or final_div_factor <= 0:
      raise HarnessError(f"schedule.div_factor ({div_factor}) and schedule.final_div_factor "
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
    raise HarnessError(
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
    raise HarnessError(f"schedule.cycle_b1 follows the one_cycle factor, which "
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
    raise HarnessError(f"unknown optimizer.name {optimizer.name!r}; choose one of "
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


def steps_per_cycle(config) -> int:
  """config.schedule.steps_per_cycle; 0 = num_train_steps."""
  return config.schedule.steps_per_cycle or config.num_train_steps


def from_config(config):
  """(optax optimizer, learning-rate schedule) of config.optimizer and config.schedule."""
  s = config.schedule
  schedule = learning_rate_schedule(s.factors, base_learning_rate=s.base_learning_rate,
                                    warmup_steps=s.warmup_steps,
                                    steps_per_cycle=steps_per_cycle(config),
                                    div_factor=s.div_factor,
                                    final_div_factor=s.final_div_factor)
  b1 = b1_schedule({**s, "steps_per_cycle": steps_per_cycle(config)}) if s.cycle_b1 else \
      config.optimizer.b1
  return make_optimizer(config.optimizer, schedule, b1=b1), schedule
