"""Dense softmax attention: the oracle every exact variant is tested against, and the shared
numerics (masked softmax, causal alignment, ALiBi bias) the variants build on.

    Attention(Q, K, V) = softmax(Q Kᵀ · scale + bias, over the allowed keys) V

Shapes: q [batch, q_len, num_heads, head_dim]; k, v [batch, kv_len, num_kv_heads, head_dim];
num_heads % num_kv_heads == 0. A query row that may see no key gives zeros, never NaN.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

HIGHEST = jax.lax.Precision.HIGHEST


def causal_allowed(q_positions, k_positions, q_len: int, kv_len: int):
  """Bottom-right causal rule: query i sees key j iff j <= i + (kv_len - q_len).

  Positions are indices into the q and kv sequences; any broadcastable shapes.
  """
  return k_positions <= q_positions + (kv_len - q_len)


def causal_pattern(q_len: int, kv_len: int, causal: bool):
  """`pattern()` of a variant that sees every key (or, causal, the bottom-right triangle):
  bool [1, q, k]."""
  allowed = np.ones((1, q_len, kv_len), bool)
  if causal:
    allowed &= causal_allowed(np.arange(q_len)[:, None], np.arange(kv_len)[None, :], q_len, kv_len)
  return allowed


def alibi_bias(slopes, q_positions, k_positions, q_len: int, kv_len: int):
  """ALiBi (Press et al. 2022): -slope_h · |i' - j|, i' the bottom-right aligned query position.

  slopes [h]; q_positions [..., q, 1]-like and k_positions [..., 1, k]-like index arrays.
  Returns f32 broadcast to [h, *position shape].
  """
  distance = jnp.abs(q_positions + (kv_len - q_len) - k_positions).astype(jnp.float32)
  slopes = jnp.asarray(slopes, jnp.float32).reshape((-1,) + (1,) * distance.ndim)
  return -slopes * distance


def masked_softmax(scores, allowed, axis=-1):
  """softmax over the allowed entries of `scores` (f32); rows with nothing allowed give 0."""
  scores = jnp.where(allowed, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
  row_max = jax.lax.stop_gradient(jnp.max(scores, axis=axis, keepdims=True))
  unnormalised = jnp.where(allowed, jnp.exp(scores - row_max), 0.0)
  total = jnp.sum(unnormalised, axis=axis, keepdims=True)
  return unnormalised / jnp.where(total > 0, total, 1.0)


def dense_attention(q, k, v, allowed, *, scale=None, bias=None):
  """The oracle: plain f32 softmax attention over `allowed` (bool, broadcastable to [b, h, q, k]).

  Written independently of the variants' helpers: K/V heads are repeated, not grouped.
  """
  num_heads, num_kv_heads = q.shape[2], k.shape[2]
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  k = jnp.repeat(k, num_heads // num_kv_heads, axis=2)
  v = jnp.repeat(v, num_heads // num_kv_heads, axis=2)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=HIGHEST) * scale  # [b, h, q, k]
  if bias is not None:
    scores = scores + bias
  allowed = jnp.broadcast_to(allowed, scores.shape)
  scores = jnp.where(allowed, scores, -jnp.inf)
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  weights = jnp.where(allowed, jnp.exp(scores - row_max), 0.0)
  total = weights.sum(-1, keepdims=True)
  weights = weights / jnp.where(total > 0, total, 1.0)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, v, precision=HIGHEST)  # [b, q, h, d]


def group_heads(q, num_kv_heads: int):
  """[b, q, h, d] -> [b, q, num_kv_heads, group, d]: query heads grouped by the K/V head they
  share."""
  b, n, h, d = q.shape
  return q.reshape(b, n, num_kv_heads, h // num_kv_heads, d)


def masked_softmax_attention(q, k, v, *, q_mask=None, kv_mask=None, causal=False, scale=None,
                             bias=None, dropout_rate=0.0, dropout_rng=None):
  """The plain dense path (O(n²) memory), GQA without copying K/V per head.

  bias: optional f32, broadcastable to [b, h, q, k]. Masks: bool [b, len], True = real token.
  Dropout on the attention weights when `dropout_rng` is given.
  """
  b, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  scale = head_dim ** -0.5 if scale is None else scale
  group = num_heads // num_kv_heads
  scores = jnp.einsum("bqhgd,bkhd->bhgqk", group_heads(q, num_kv_heads), k,
                      preferred_element_type=jnp.float32) * scale  # [b, kvh, g, q, k]
  if bias is not None:
    bias = jnp.broadcast_to(bias, (b, num_heads, q_len, kv_len))
    scores = scores + bias.reshape(b, num_kv_heads, group, q_len, kv_len)
  allowed = jnp.ones((b, 1, 1, q_len, kv_len), bool)
  if kv_mask is not None:
    allowed &= kv_mask[:, None, None, None, :]
  if q_mask is not None:
    allowed &= q_mask[:, None, None, :, None]
  if causal:
    allowed &= causal_allowed(jnp.arange(q_len)[:, None], jnp.arange(kv_len)[None, :], q_len,
                              kv_len)
  weights = masked_softmax(scores, allowed)
  if dropout_rng is not None and dropout_rate > 0:
    weights = dropout(weights, dropout_rate, dropout_rng)
  out = jnp.einsum("bhgqk,bkhd->bqhgd", weights.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)  # [b, q, kvh, g, d]
  return out.reshape(b, q_len, num_heads, head_dim).astype(q.dtype)


def dropout(weights, rate: float, rng):
  """Inverted dropout on attention weights."""
  keep = jax.random.bernoulli(rng, 1.0 - rate, weights.shape)
  return jnp.where(keep, weights / (1.0 - rate), 0.0).astype(weights.dtype)
