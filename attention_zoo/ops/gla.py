r"""Gated linear attention: the additive rule with a data-dependent decay (no normalisation).

    S_t = Diag(exp g_t) S_{t-1} + k_t v_tᵀ,    o_t = S_tᵀ (scale · q_t)

`*_simple_gla`: one scalar log-decay per head and token, g [B, T, H] (Mamba2's SSD; RetNet is a
constant g; g = 0 is plain causal linear attention, o = tril(Q Kᵀ) V). `*_gla`: one per key
channel, g [B, T, H, K] (GLA, Yang et al. 2023, arXiv:2312.06635). q, k [B, T, H, K],
v [B, T, H, V]; scale None = K^-1/2; initial_state [B, H, K, V] or None (zeros); mask bool
[B, T] or None: a False token leaves the state untouched and outputs 0; segment_ids int [B, T]
or None: packed sequences, each run of equal ids processed as if alone, from a zero state
(initial_state is the first run's). Returns (o [B, T, H, V] in v's dtype, final state
[B, H, K, V] float32: the last run's). The chunk form and the numerics are described in
attention_zoo/ops/engine.py; `recurrent_*` is the token-by-token scan (the decode path: T = 1
with the carried state). `with_negative_eigenvalues(op)` is an op with the transition
2 exp(g) - 1 in (-1, 1] (Mamba's and Mamba2's allow_neg_eigval).
"""
from __future__ import annotations

import jax.numpy as jnp

from attention_zoo.ops.engine import DEFAULT_CHUNK_SIZE, run


def chunk_simple_gla(q, k, v, g, *, scale=None, initial_state=None, mask=None, segment_ids=None,
                     chunk_size=DEFAULT_CHUNK_SIZE):
  """Scalar-gated linear attention, chunkwise parallel."""
  return run("chunk_simple_gla", q, k, v, g, None, per_channel_gate=False, scale=scale,
             initial_state=initial_state, mask=mask, segment_ids=segment_ids,
             chunk_size=chunk_size)


def recurrent_simple_gla(q, k, v, g, *, scale=None, initial_state=None, mask=None,
                         segment_ids=None):
  """Scalar-gated linear attention, token by token."""
  return run("recurrent_simple_gla", q, k, v, g, None, per_channel_gate=False, scale=scale,
             initial_state=initial_state, mask=mask, segment_ids=segment_ids, chunk_size=None)


def chunk_gla(q, k, v, g, *, scale=None, initial_state=None, mask=None, segment_ids=None,
              chunk_size=DEFAULT_CHUNK_SIZE):
  """Per-key-channel gated linear attention, chunkwise parallel."""
  return run("chunk_gla", q, k, v, g, None, per_channel_gate=True, scale=scale,
             initial_state=initial_state, mask=mask, segment_ids=segment_ids,
             chunk_size=chunk_size)


def recurrent_gla(q, k, v, g, *, scale=None, initial_state=None, mask=None, segment_ids=None):
  """Per-key-channel gated linear attention, token by token."""
  return run("recurrent_gla", q, k, v, g, None, per_channel_gate=True, scale=scale,
             initial_state=initial_state, mask=mask, segment_ids=segment_ids, chunk_size=None)


def with_negative_eigenvalues(gla_op):
  """One of this module's ops with its transition extended from exp g_t in (0, 1] to
  a_t = 2 exp(g_t) - 1 in (-1, 1] (Grazzi et al. 2025, arXiv:2411.12537, Mamba's form):

      S_t = Diag(a_t) S_{t-1} + k_t v_tᵀ,    o_t = S_tᵀ (scale · q_t)

  with the same arguments (g the log-decay, scalar [B, T, H] or per key channel [B, T, H, K]).
  A negative transition is no log-decay, so its sign is carried apart: with σ_t the running
  product of sign(a_s), s <= t (per head or key channel; masked tokens count +1), the state
  S̃_t = Diag(σ_t) S_t follows the log-decay recurrence with g' = log|a_t| and keys σ_t ⊙ k_t,
  reads it with σ_t ⊙ q_t, and S_T = Diag(σ_T) S̃_T. This is exact (σ² = 1) in both the chunk
  and the token form, across packed sequences (a reset zeroes S and S̃ alike) and from an
  initial state (σ_0 = 1). |a_t| is floored at the dtype's smallest normal number, so that
  log|a_t| is finite where a_t = 0 (g = -log 2)."""
  def op(q, k, v, g, *, mask=None, **kwargs):
    g = g.astype(jnp.promote_types(g.dtype, jnp.float32))
    a = 1 + 2 * jnp.expm1(g)                            # 2 e^g - 1, exact near 1
    near_one = a > 0.5                                  # log1p keeps log a's digits there
    log_magnitude = jnp.where(
        near_one, jnp.log1p(jnp.where(near_one, 2 * jnp.expm1(g), 0.0)),
        jnp.log(jnp.maximum(jnp.abs(a), jnp.finfo(a.dtype).tiny)))
    sign = jnp.where(a < 0, -1.0, 1.0).astype(a.dtype)
    if mask is not None:
      sign = jnp.where(mask.reshape(mask.shape + (1,) * (sign.ndim - 2)), sign, 1.0)
    running = jnp.cumprod(sign, axis=1)                 # σ_t [B, T, H] or [B, T, H, K]
    per_key = running if running.ndim == 4 else running[..., None]
    o, state = gla_op((q * per_key).astype(q.dtype), (k * per_key).astype(k.dtype), v,
                      log_magnitude, mask=mask, **kwargs)
    final = per_key[:, -1]                              # σ_T [B, H, K]
    return o, state * final[..., None]
  return op
