r"""The delta rule (DeltaNet) and the gated delta rule (Gated DeltaNet): each token replaces
the value stored under its key by a beta-weighted step instead of adding to it.

    S̃_t = exp(g_t) S_{t-1}
    S_t = S̃_t + beta_t k_t (v_t - S̃_tᵀ k_t)ᵀ  = (I - beta_t k_t k_tᵀ) S̃_t + beta_t k_t v_tᵀ
    o_t = S_tᵀ (scale · q_t)

DeltaNet (Schlag et al. 2021; chunkwise: Yang et al. 2024, arXiv:2406.06484) has g = 0; Gated
DeltaNet (Yang, Kautz, Hatamizadeh, arXiv:2412.06464) a scalar log-decay g [B, T, H] per head
and token. beta [B, T, H] in [0, 1]; with beta = 1 and a unit key the value under k_t becomes
exactly v_t. The ops do not normalise k (the layers L2-normalise it; unnormalised keys make
I - beta k kᵀ expanding). q, k [B, T, H, K], v [B, T, H, V]; scale None = K^-1/2;
initial_state [B, H, K, V] or None (zeros); mask bool [B, T] or None: a False token leaves the
state untouched and outputs 0. Returns (o [B, T, H, V] in v's dtype, final state [B, H, K, V]
float32). The chunk (WY) form and the numerics are described in attention_zoo/ops/engine.py;
`recurrent_*` is the token-by-token scan (the decode path: T = 1 with the carried state).
"""
from __future__ import annotations

from attention_zoo.ops.engine import DEFAULT_CHUNK_SIZE, run


def chunk_delta_rule(q, k, v, beta, *, scale=None, initial_state=None, mask=None,
                     chunk_size=DEFAULT_CHUNK_SIZE):
  """The delta rule, chunkwise parallel."""
  return run("chunk_delta_rule", q, k, v, None, beta, per_channel_gate=False, scale=scale,
             initial_state=initial_state, mask=mask, chunk_size=chunk_size)


def recurrent_delta_rule(q, k, v, beta, *, scale=None, initial_state=None, mask=None):
  """The delta rule, token by token."""
  return run("recurrent_delta_rule", q, k, v, None, beta, per_channel_gate=False, scale=scale,
             initial_state=initial_state, mask=mask, chunk_size=None)


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, mask=None,
                           chunk_size=DEFAULT_CHUNK_SIZE):
  """The gated delta rule, chunkwise parallel."""
  return run("chunk_gated_delta_rule", q, k, v, g, beta, per_channel_gate=False, scale=scale,
             initial_state=initial_state, mask=mask, chunk_size=chunk_size)


def recurrent_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, mask=None):
  """The gated delta rule, token by token."""
  return run("recurrent_gated_delta_rule", q, k, v, g, beta, per_channel_gate=False,
             scale=scale, initial_state=initial_state, mask=mask, chunk_size=None)
