"""Position information: added to the embeddings (sinusoidal, learned), applied to q and k
inside attention (RoPE), or added to the attention scores (ALiBi); or none.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

KINDS = ("sinusoidal", "learned", "rope", "alibi", "none")


def check_kind(kind: str):
  if kind not in KINDS:
    raise ValueError(f"unknown position kind {kind!r}; choose one of {', '.join(KINDS)}")


def sinusoidal(positions, dim: int):
  """Vaswani et al. 2017: PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(...).

  -> [..., dim]"""
  inv_freq = 1.0 / (10000.0 ** (np.arange(0, dim, 2) / dim))
  angles = jnp.asarray(positions, jnp.float32)[..., None] * inv_freq  # [..., dim/2]
  table = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(*angles.shape[:-1], -1)
  return table[..., :dim]


class LearnedPositions(nnx.Module):
  """A trained table of max_len x dim position embeddings."""

  def __init__(self, max_len: int, dim: int, *, rngs: nnx.Rngs):
    self.max_len = max_len
    self.table = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (max_len, dim)))

  def __call__(self, positions):
    return self.table[...][positions]


def rope(x, positions, base: float = 10000.0):
  """Rotary embedding (Su et al. 2021) on the last axis, rotating pairs (x_i, x_{i+d/2}).

  x [b, n, h, d]; positions [b, n] or [n]. Scores q_m · k_n then depend only on m - n.
  """
  d = x.shape[-1]
  if d % 2:
    raise ValueError(f"RoPE needs an even head_dim, got {d}")
  inv_freq = 1.0 / (base ** (np.arange(0, d, 2) / d))                          # [d/2]
  compute = jnp.promote_types(x.dtype, jnp.float32)   # float32, float64 for float64 inputs
  angles = jnp.asarray(positions, compute)[..., None] * inv_freq                # [b?, n, d/2]
  angles = jnp.broadcast_to(angles, (x.shape[0], x.shape[1], d // 2))[:, :, None, :]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  x1, x2 = jnp.split(x.astype(compute), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def alibi_slopes(num_heads: int) -> np.ndarray:
  """ALiBi head slopes (Press et al. 2022): the geometric sequence 2^(-8i/n) for n a power of two;
  otherwise the slopes of the nearest lower power of two, then every other slope of the next one.
  """
  def power_of_two(n):
    start = 2.0 ** (-8.0 / n)
    return [start ** (i + 1) for i in range(n)]

  closest = 2 ** int(math.floor(math.log2(num_heads)))
  slopes = power_of_two(closest)
  if closest != num_heads:
    slopes += power_of_two(2 * closest)[0::2][: num_heads - closest]
  return np.asarray(slopes, np.float32)
