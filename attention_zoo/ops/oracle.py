"""The oracle every exact variant is tested against: plain dense softmax attention in f32.

    Attention(Q, K, V) = softmax(Q Kᵀ · scale + bias, over the allowed keys) V

Written independently of the numerics the variants share (softmax.py): K/V heads are repeated,
not grouped, and the backward is autodiff's. A query row that may see no key gives zeros.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def dense_attention(q, k, v, allowed, *, scale=None, bias=None, sinks=None):
  """The oracle: plain f32 softmax attention over `allowed` (bool, broadcastable to [b, h, q, k]).
  sinks: None, or a sink logit per head [h] that joins every row's denominator (attention
  sinks: e^{s_h} + Σ_k e^{x_k}) with no value.

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
  if sinks is not None:
    total = total + jnp.exp(jnp.asarray(sinks, jnp.float32)[:, None, None] - row_max)
  weights = weights / jnp.where(total > 0, total, 1.0)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, v, precision=HIGHEST)  # [b, q, h, d]
