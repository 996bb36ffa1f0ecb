r"""The delta rule family: each token replaces the value stored under its key by a beta-weighted
step instead of adding to it.

    S̃_t = Diag(exp g_t) S_{t-1}
    S_t = S̃_t + beta_t k_t (v_t - S̃_tᵀ k_t)ᵀ  = (I - beta_t k_t k_tᵀ) S̃_t + beta_t k_t v_tᵀ
    o_t = S_tᵀ (scale · q_t)

- `*_delta_rule`: DeltaNet (Schlag et al. 2021; chunkwise: Yang et al. 2024, arXiv:2406.06484),
  g = 0.
- `*_gated_delta_rule`: Gated DeltaNet (Yang, Kautz, Hatamizadeh, arXiv:2412.06464), a scalar
  log-decay g [B, T, H] per head and token.
- `*_kda`: Kimi Delta Attention (arXiv:2510.26692), one log-decay per key channel,
  g [B, T, H, K].
- `*_gated_delta_rule2`: Gated DeltaNet-2 (Hatamizadeh, Choi, Kautz, arXiv:2605.22791), KDA's
  per-channel decay g [B, T, H, K] with beta split into a per-key-channel erase gate
  b [B, T, H, K] and a per-value-channel write gate w [B, T, H, V]:
      S_t = (I - k_t (b_t ⊙ k_t)ᵀ) S̃_t + k_t (w_t ⊙ v_t)ᵀ
  (the read S̃_tᵀ (b_t ⊙ k_t) is what is erased along k_t). b = w = beta·1 is KDA; b in (0, 2)
  gives the eigenvalue 1 - Σ_d b_d k_d² down to -1 (unit k).
- `*_gated_delta_product`: Gated DeltaProduct (Siems et al., arXiv:2502.10297), n delta steps
  per token: k [B, T, n, H, K], v [B, T, n, H, V], beta [B, T, n, H], g [B, T, H] (None: no
  decay). Per token S <- exp(g_t) S once, then for j < n the delta step with (k_tj, v_tj,
  beta_tj); o_t reads S after the last step. It runs as n·T steps of the gated delta rule whose
  decay applies at each token's first step and whose output is read at its last; `chunk_size`
  counts those steps (n per token).

beta [B, T, H]: in [0, 1] the transition I - beta k kᵀ (unit k) is a contraction, beta = 1 with
a unit key makes the value under k_t exactly v_t; the ops do not clip it, so beta in (0, 2)
(negative eigenvalues, `allow_neg_eigval`) works too. The ops do not normalise k (the layers
L2-normalise it; unnormalised keys make I - beta k kᵀ expanding). q, k [B, T, H, K],
v [B, T, H, V]; scale None = K^-1/2; initial_state [B, H, K, V] or None (zeros); mask bool
[B, T] or None: a False token leaves the state untouched and outputs 0; segment_ids int [B, T]
or None: packed sequences, each run of equal ids processed as if alone, from a zero state
(initial_state is the first run's). Returns (o [B, T, H, V] in v's dtype, final state
[B, H, K, V] float32: the last run's). The chunk (WY) form and the numerics are described in
attention_zoo/ops/engine.py; `recurrent_*` is the token-by-token scan (the decode path: T = 1
with the carried state).
"""
from __future__ import annotations

import jax.numpy as jnp

from attention_zoo.ops.engine import DEFAULT_CHUNK_SIZE, check_shapes, run


def chunk_delta_rule(q, k, v, beta, *, scale=None, initial_state=None, mask=None,
                     segment_ids=None, chunk_size=DEFAULT_CHUNK_SIZE):
  """The delta rule, chunkwise parallel."""
  return run("chunk_delta_rule", q, k, v, None, beta, per_channel_gate=False, scale=scale,
             initial_state=initial_state, mask=mask, segment_ids=segment_ids,
             chunk_size=chunk_size)


def recurrent_delta_rule(q, k, v, beta, *, scale=None, initial_state=None, mask=None,
                         segment_ids=None):
  """The delta rule, token by token."""
  return run("recurrent_delta_rule", q, k, v, None, beta, per_channel_gate=False, scale=scale,
             initial_state=initial_state, mask=mask, segment_ids=segment_ids, chunk_size=None)


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, mask=None,
                           segment_ids=None, chunk_size=DEFAULT_CHUNK_SIZE):
  """The gated delta rule, chunkwise parallel."""
  return run("chunk_gated_delta_rule", q, k, v, g, beta, per_channel_gate=False, scale=scale,
             initial_state=initial_state, mask=mask, segment_ids=segment_ids,
             chunk_size=chunk_size)


def recurrent_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, mask=None,
                               segment_ids=None):
  """The gated delta rule, token by token."""
  return run("recurrent_gated_delta_rule", q, k, v, g, beta, per_channel_gate=False,
             scale=scale, initial_state=initial_state, mask=mask, segment_ids=segment_ids,
             chunk_size=None)


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, mask=None, segment_ids=None,
              chunk_size=DEFAULT_CHUNK_SIZE):
  """Kimi Delta Attention (per-key-channel gated delta rule), chunkwise parallel."""
  return run("chunk_kda", q, k, v, g, beta, per_channel_gate=True, scale=scale,
             initial_state=initial_state, mask=mask, segment_ids=segment_ids,
             chunk_size=chunk_size)


def recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None, mask=None,
                  segment_ids=None):
  """Kimi Delta Attention, token by token."""
  return run("recurrent_kda", q, k, v, g, beta, per_channel_gate=True, scale=scale,
             initial_state=initial_state, mask=mask, segment_ids=segment_ids, chunk_size=None)


def _gated_delta_rule2(name, q, k, v, g, b, w, *, scale, initial_state, mask, segment_ids,
                       chunk_size):
  """The gated delta rule with b as the erase gate and w folded into v (engine.run)."""
  check_shapes(name, {"b": (b, q.shape), "w": (w, v.shape)})
  return run(name, q, k, v, g, None, per_channel_gate=True, scale=scale,
             initial_state=initial_state, mask=mask, segment_ids=segment_ids,
             chunk_size=chunk_size, erase=b, write=w)


def chunk_gated_delta_rule2(q, k, v, g, b, w, *, scale=None, initial_state=None, mask=None,
                            segment_ids=None, chunk_size=DEFAULT_CHUNK_SIZE):
  """Gated DeltaNet-2 (erase gate b per key channel, write gate w per value channel),
  chunkwise parallel."""
  return _gated_delta_rule2("chunk_gated_delta_rule2", q, k, v, g, b, w, scale=scale,
                            initial_state=initial_state, mask=mask, segment_ids=segment_ids,
                            chunk_size=chunk_size)


def recurrent_gated_delta_rule2(q, k, v, g, b, w, *, scale=None, initial_state=None, mask=None,
                                segment_ids=None):
  """Gated DeltaNet-2, token by token."""
  return _gated_delta_rule2("recurrent_gated_delta_rule2", q, k, v, g, b, w, scale=scale,
                            initial_state=initial_state, mask=mask, segment_ids=segment_ids,
                            chunk_size=None)


def _gated_delta_product(name, q, k, v, g, beta, *, scale, initial_state, mask, segment_ids,
                         chunk_size):
  """Checks the per-step shapes, then runs the n·T interleaved steps (module docstring)."""
  if q.ndim != 4 or k.ndim != 5 or k.shape[:2] + k.shape[3:] != q.shape:
    raise ValueError(f"{name}: q must be [B, T, H, K] and k [B, T, n, H, K] (n steps per "
                     f"token), got {q.shape} and {k.shape}")
  B, T, n, H, K = k.shape
  if v.ndim != 5 or v.shape[:4] != (B, T, n, H):
    raise ValueError(f"{name}: v must be [B, T, n, H, V] = ({B}, {T}, {n}, {H}, V) like k, got "
                     f"{v.shape}")
  check_shapes(name, {"g": (g, (B, T, H)), "beta": (beta, (B, T, n, H)),
                      "mask": (mask, (B, T)), "segment_ids": (segment_ids, (B, T))})
  as_steps = lambda x: x.reshape(B, T * n, *x.shape[3:])     # [B, T, n, ...] -> [B, T·n, ...]
  per_step = lambda x: None if x is None else jnp.repeat(x, n, axis=1)  # [B, T] -> [B, T·n]
  q_last = jnp.pad(q[:, :, None], [(0, 0), (0, 0), (n - 1, 0), (0, 0), (0, 0)])  # [B,T,n,H,K]
  g_first = None if g is None else jnp.pad(g[:, :, None], [(0, 0), (0, 0), (0, n - 1), (0, 0)])
  first_steps = jnp.broadcast_to(jnp.arange(n) == 0, (B, T, n)).reshape(B, T * n)
  o, state = run(name, as_steps(q_last), as_steps(k), as_steps(v),
                 None if g is None else as_steps(g_first), as_steps(beta),
                 per_channel_gate=False, scale=scale, initial_state=initial_state,
                 mask=per_step(mask), segment_ids=per_step(segment_ids), chunk_size=chunk_size,
                 gated_tokens=first_steps)
  return o[:, n - 1::n], state                               # [B, T, H, V]


def chunk_gated_delta_product(q, k, v, g, beta, *, scale=None, initial_state=None, mask=None,
                              segment_ids=None, chunk_size=DEFAULT_CHUNK_SIZE):
  """Gated DeltaProduct, chunkwise parallel (chunk_size in steps, n per token)."""
  return _gated_delta_product("chunk_gated_delta_product", q, k, v, g, beta, scale=scale,
                              initial_state=initial_state, mask=mask, segment_ids=segment_ids,
                              chunk_size=chunk_size)


def recurrent_gated_delta_product(q, k, v, g, beta, *, scale=None, initial_state=None,
                                  mask=None, segment_ids=None):
  """Gated DeltaProduct, token by token."""
  return _gated_delta_product("recurrent_gated_delta_product", q, k, v, g, beta, scale=scale,
                              initial_state=initial_state, mask=mask, segment_ids=segment_ids,
                              chunk_size=None)
