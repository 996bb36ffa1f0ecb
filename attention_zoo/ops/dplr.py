r"""The diagonal-plus-low-rank (DPLR) delta rule, RWKV-7's transition (Peng et al. 2025,
arXiv:2503.14456; flash-linear-attention's generalized_delta_rule/dplr):

    S_t = Diag(exp g_t) S_{t-1} + b_t (a_tᵀ S_{t-1}) + k_t v_tᵀ,      o_t = S_tᵀ (scale · q_t)

i.e. S_t = (Diag(exp g_t) + b_t a_tᵀ) S_{t-1} + k_t v_tᵀ. The rank-1 term reads the state
before the decay. q, k, a, b, g [B, T, H, K] (g the log-decay, <= 0), v [B, T, H, V]. RWKV-7
passes a = -κ̂, b = κ̂ ⊙ a_rwkv (κ̂ a unit key) and scale = 1. With a = -beta k̂, b = k̂, g = 0
and the write k = beta k̂ (or v scaled by beta) it is the delta rule; with a = -beta exp(g) ⊙ k̂
the gated delta rule (scalar g) or KDA (per-channel g). scale None = K^-1/2; initial_state
[B, H, K, V] or None (zeros); mask bool [B, T] or None: a False token leaves the state untouched
and outputs 0; segment_ids int [B, T] or None: packed sequences, each run of equal ids
processed as if alone, from a zero state (initial_state is the first run's). Returns
(o [B, T, H, V] in v's dtype, final state [B, H, K, V] float32: the last run's). The chunk form
(a WY representation with a and b) and the numerics are in attention_zoo/ops/engine.py;
`recurrent_dplr_delta_rule` is the token-by-token scan (the decode path).

Comba's transition (Hu et al. 2025, arXiv:2506.02475) is a scalar plus a rank 1, the delta
step reading the state before the decay:

    S_t = (α_t I - β_t k_t p_tᵀ) S_{t-1} + β_t k_t v_tᵀ,    o_t = S_tᵀ (scale · q_t)

with α_t = exp(g_t) one per head (g [B, T, H]), β_t [B, T, H] and p_t [B, T, H, K] the key the
state is read with (the layer's p = σ(λ) k: a feedback weaker than the write). `*_comba` is the
DPLR recurrence with a = p, b = -β k, the write key β k and the scalar gate (its chunk products
one matmul each, one triangular inverse per chunk). Comba's output correction (reading with
q - d·p) is the layer's: it only changes the query.
"""
from __future__ import annotations

import jax.numpy as jnp

from attention_zoo.ops.engine import DEFAULT_CHUNK_SIZE, check_shapes, run_dplr


def chunk_dplr_delta_rule(q, k, v, a, b, g, *, scale=None, initial_state=None, mask=None,
                          segment_ids=None, chunk_size=DEFAULT_CHUNK_SIZE):
  """The DPLR delta rule, chunkwise parallel."""
  return run_dplr("chunk_dplr_delta_rule", q, k, v, a, b, g, scale=scale,
                  initial_state=initial_state, mask=mask, segment_ids=segment_ids,
                  chunk_size=chunk_size)


def recurrent_dplr_delta_rule(q, k, v, a, b, g, *, scale=None, initial_state=None, mask=None,
                              segment_ids=None):
  """The DPLR delta rule, token by token."""
  return run_dplr("recurrent_dplr_delta_rule", q, k, v, a, b, g, scale=scale,
                  initial_state=initial_state, mask=mask, segment_ids=segment_ids,
                  chunk_size=None)


def _comba(name, q, k, v, p, g, beta, *, scale, initial_state, mask, segment_ids, chunk_size):
  """Comba as the DPLR recurrence with a scalar gate (module docstring); the products with β
  in float32 (float64 for float64 inputs), as the engine computes."""
  check_shapes(name, {"beta": (beta, q.shape[:3]), "g": (g, q.shape[:3])})
  dtype = jnp.promote_types(k.dtype, jnp.float32)
  write_key = beta.astype(dtype)[..., None] * k.astype(dtype)          # [B, T, H, K], β k
  return run_dplr(name, q, write_key, v, p, -write_key, g, scale=scale,
                  initial_state=initial_state, mask=mask, segment_ids=segment_ids,
                  chunk_size=chunk_size, per_channel_gate=False)


def chunk_comba(q, k, v, p, g, beta, *, scale=None, initial_state=None, mask=None,
                segment_ids=None, chunk_size=DEFAULT_CHUNK_SIZE):
  """Comba's scalar-plus-low-rank delta rule, chunkwise parallel."""
  return _comba("chunk_comba", q, k, v, p, g, beta, scale=scale, initial_state=initial_state,
                mask=mask, segment_ids=segment_ids, chunk_size=chunk_size)


def recurrent_comba(q, k, v, p, g, beta, *, scale=None, initial_state=None, mask=None,
                    segment_ids=None):
  """Comba's scalar-plus-low-rank delta rule, token by token."""
  return _comba("recurrent_comba", q, k, v, p, g, beta, scale=scale,
                initial_state=initial_state, mask=mask, segment_ids=segment_ids,
                chunk_size=None)
