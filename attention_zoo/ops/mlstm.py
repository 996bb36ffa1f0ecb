r"""The mLSTM cell of xLSTM (Beck et al. 2024, arXiv:2405.04517): a matrix memory with an
exponential input gate, a normaliser state and the running-max stabiliser.

    S_t = f_t S_{t-1} + i_t k_t v_tᵀ,    n_t = f_t n_{t-1} + i_t k_t         S [K, V], n [K]
    o_t = S_tᵀ q_t / max(|n_tᵀ q_t|, 1)                                      (q scaled)
    i_t = exp(ĩ_t),   f_t = exp(log f_t)                                     per head, scalar

(the paper's C_t = v kᵀ is our S_tᵀ, as flash-linear-attention's layout). exp(ĩ) overflows, so
both forms carry the stabilised state S̃_t = e^{-m_t} S_t, ñ_t = e^{-m_t} n_t with

    m_t = max(log f_t + m_{t-1}, ĩ_t)       =  max_{j <= t} (ĩ_j + Σ_{j < s <= t} log f_s)
                                               (and m_0 + Σ_{s <= t} log f_s), m_0 = 0
    o_t = S̃_tᵀ q_t / max(|ñ_tᵀ q_t|, e^{-m_t})

which is o_t exactly for any m (numerator and both arms of the max scale by e^{-m}). So m is
a constant to the gradient (stop_gradient): every exponent below is <= 0 and no gradient
passes through a max.

`recurrent_mlstm` runs these token by token (the decode step). `chunk_mlstm` splits T into
chunks of C tokens (the xLSTM kernels' chunkwise form): with F_r = Σ_{s <= r} log f_s inside
the chunk and (S̃, ñ, m) entering it,

    D_ij = F_i - F_j + ĩ_j  (j <= i),    m_i = max(max_j D_ij, F_i + m)      the gate matrix
    o_i  = [e^{F_i + m - m_i} S̃ᵀ q_i + Σ_j e^{D_ij - m_i} (q_i·k_j) v_j]
           / max(|e^{F_i + m - m_i} ñ·q_i + Σ_j e^{D_ij - m_i} q_i·k_j|, e^{-m_i})

and the state leaving it, with a_j = F_C - F_j + ĩ_j and m' = max(F_C + m, max_j a_j):
S̃' = e^{F_C + m - m'} S̃ + Σ_j e^{a_j - m'} k_j v_jᵀ (ñ' likewise). m_i is the token form's
m_t, so both forms carry the same stabiliser. The chunk summaries Σ_j e^{a_j - max a} k_j v_jᵀ
are formed for all chunks at once; only the combination runs in a `lax.scan` (checkpointed:
the backward keeps the N boundary states, memory linear in T).

Masks and packed sequences as the other ops (attention_zoo/ops/gla.py): a masked token has
f = 1 and i = 0 and outputs 0; at a segment start the state is reset to (0, 0, m = 0). The
final state (S̃, ñ, m) is the last run's.

Where the reference kernels differ (NX-AI's mlstm_kernels, its parallel and chunkwise JAX
forms): they add eps = 1e-6 to the denominator (we do not: it is no part of the paper's
equation, and max(.., e^{-m}) already keeps it away from 0); they take the forget gate's
pre-activation and apply logsigmoid themselves (we take log f_t, so the exponential forget gate
of the paper is log f_t = f̃_t); their parallel form's stabiliser is the row max alone (no m_0):
the same o_t.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from attention_zoo.ops.engine import (DEFAULT_CHUNK_SIZE, _chunk_layout, _from_chunks, _segments,
                                      _to_chunks, check_sequence_args, check_shapes)
from attention_zoo.ops.segments import segment_starts

_einsum = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)


def _masked_exp(keep, exponent):
  """exp(exponent) where keep, else 0; the exponent masked before exp (no inf in the unused
  branch, whose gradient would be NaN)."""
  return jnp.exp(jnp.where(keep, exponent, -jnp.inf))


def _finite_or_zero(m):
  """A stabiliser with no term (-inf: nothing written and nothing carried) set to 0."""
  return jnp.where(jnp.isfinite(m), m, 0.0)


def _prepare(name, q, k, v, log_i, log_f, *, scale, initial_state, mask, segment_ids, chunk_size):
  """Validates the inputs -> (q scaled, k, v, log_i, log_f in the compute dtype, masked tokens
  neutral (f = 1, i = 0, q, k, v = 0), valid bool [B, T], (S̃, ñ, m), resets or None,
  the output dtype)."""
  if q.ndim != 4 or k.shape != q.shape:
    raise ValueError(f"{name}: q and k must both be [B, T, H, K], got {q.shape} and {k.shape}")
  B, T, H, K = q.shape
  if v.ndim != 4 or v.shape[:3] != (B, T, H):
    raise ValueError(f"{name}: v must be [B, T, H, V] = ({B}, {T}, {H}, V) like q, got {v.shape}")
  V = v.shape[-1]
  if initial_state is not None and (not isinstance(initial_state, (tuple, list))
                                    or len(initial_state) != 3):
    raise ValueError(f"{name}: initial_state must be the tuple (S [B, H, K, V], n [B, H, K], "
                     f"m [B, H]) or None")
  S0, n0, m0 = (None, None, None) if initial_state is None else initial_state
  check_shapes(name, {"log_i": (log_i, (B, T, H)), "log_f": (log_f, (B, T, H)),
                      "initial_state[0] (S)": (S0, (B, H, K, V)),
                      "initial_state[1] (n)": (n0, (B, H, K)),
                      "initial_state[2] (m)": (m0, (B, H)), "mask": (mask, (B, T)),
                      "segment_ids": (segment_ids, (B, T))})
  check_sequence_args(name, mask, segment_ids, chunk_size)
  out_dtype, dtype = v.dtype, jnp.promote_types(v.dtype, jnp.float32)
  valid = jnp.ones((B, T), bool) if mask is None else mask
  neutral = lambda x, fill: jnp.where(valid.reshape(B, T, *[1] * (x.ndim - 2)),
                                      x.astype(dtype), fill)
  scale = K ** -0.5 if scale is None else scale
  q, k, v = (neutral(x, 0.0) for x in (q, k, v))
  state = ((jnp.zeros((B, H, K, V), dtype), jnp.zeros((B, H, K), dtype), jnp.zeros((B, H), dtype))
           if initial_state is None else tuple(x.astype(dtype) for x in initial_state))
  resets = None if segment_ids is None else segment_starts(segment_ids)
  return (q * scale, k, v, neutral(log_i, 0.0), neutral(log_f, 0.0), valid, state, resets,
          out_dtype)


def recurrent_mlstm(q, k, v, log_i, log_f, *, scale=None, initial_state=None, mask=None,
                    segment_ids=None):
  """The mLSTM token by token. q, k [B, T, H, K], v [B, T, H, V]; log_i [B, T, H] the input
  gate's log ĩ (i = exp ĩ), log_f [B, T, H] the forget gate's log (logsigmoid(f̃) for the
  sigmoid gate); scale None = K^-1/2; initial_state (S̃ [B, H, K, V], ñ [B, H, K], m [B, H]) or
  None (zeros); mask bool [B, T]; segment_ids int [B, T]. -> (o [B, T, H, V] in v's dtype,
  (S̃, ñ, m) float32)."""
  q, k, v, log_i, log_f, valid, state, resets, out_dtype = _prepare(
      "recurrent_mlstm", q, k, v, log_i, log_f, scale=scale, initial_state=initial_state,
      mask=mask, segment_ids=segment_ids, chunk_size=None)
  resets = jnp.zeros_like(valid) if resets is None else resets

  def step(carry, inputs):
    S, n, m = carry                                          # [B, H, K, V], [B, H, K], [B, H]
    q_t, k_t, v_t, log_i_t, log_f_t, valid_t, reset_t = inputs
    S, n, m = (jnp.where(reset_t.reshape(-1, *[1] * (x.ndim - 1)), 0.0, x) for x in (S, n, m))
    real = valid_t[:, None]                                  # [B, 1]
    m_new = jax.lax.stop_gradient(jnp.where(real, jnp.maximum(log_f_t + m, log_i_t), m))
    forget = jnp.exp(jnp.where(real, log_f_t + m - m_new, 0.0))      # [B, H], 1 when masked
    write = _masked_exp(real, log_i_t - m_new)                         # [B, H], 0 when masked
    S = forget[..., None, None] * S + (write[..., None] * k_t)[..., None] * v_t[..., None, :]
    n = forget[..., None] * n + write[..., None] * k_t
    numerator = _einsum("bhk,bhkv->bhv", q_t, S)                       # [B, H, V]
    denominator = jnp.maximum(jnp.abs(jnp.sum(q_t * n, -1)), jnp.exp(-m_new))   # [B, H]
    return (S, n, m_new), numerator / denominator[..., None]

  time_major = lambda x: jnp.moveaxis(x, 1, 0)
  state, o = jax.lax.scan(step, state, tuple(map(time_major, (q, k, v, log_i, log_f, valid,
                                                              resets))))
  o = jnp.where(valid[..., None, None], jnp.moveaxis(o, 0, 1), 0.0)
  return o.astype(out_dtype), state


def chunk_mlstm(q, k, v, log_i, log_f, *, scale=None, initial_state=None, mask=None,
                segment_ids=None, chunk_size=DEFAULT_CHUNK_SIZE):
  """The mLSTM chunkwise parallel; arguments and result as `recurrent_mlstm`'s."""
  q, k, v, log_i, log_f, valid, (S0, n0, m0), resets, out_dtype = _prepare(
      "chunk_mlstm", q, k, v, log_i, log_f, scale=scale, initial_state=initial_state,
      mask=mask, segment_ids=segment_ids, chunk_size=chunk_size)
  B, T, H, _ = q.shape
  C, N = _chunk_layout(T, chunk_size)
  chunks = lambda x: _to_chunks(x, N, C)                     # [B, T, H, D] -> [n, b, h, C, D]
  q, k, v = map(chunks, (q, k, v))
  log_i, log_f = (chunks(x[..., None])[..., 0] for x in (log_i, log_f))      # [n, b, h, C]
  real = chunks(jnp.broadcast_to(valid[:, :, None, None], (B, T, 1, 1)))[..., 0]  # [n, b, 1, C]
  segments = _segments(resets, N, C)
  F = jnp.cumsum(log_f, axis=-1)                             # [n, b, h, C], F_r
  # Σ_{s > j} log f_s, summed directly (F_C - F_j would cancel for the last tokens)
  to_end = jnp.cumsum(log_f[..., ::-1], axis=-1)[..., ::-1] - log_f

  # the chunk summaries: a_j = F_C - F_j + ĩ_j over the tokens that reach the leaving state
  reaches_end = real if segments is None else real & segments.to_leaving[..., 0]
  a = jnp.where(reaches_end, to_end + log_i, -jnp.inf)                       # [n, b, h, C]
  m_local = jax.lax.stop_gradient(jnp.max(a, axis=-1))                       # [n, b, h]
  weights = _masked_exp(reaches_end, a - _finite_or_zero(m_local)[..., None])  # [n, b, h, C]
  S_local = _einsum("nbhc,nbhck,nbhcv->nbhkv", weights, k, v)                # [n, b, h, K, V]
  n_local = _einsum("nbhc,nbhck->nbhk", weights, k)                          # [n, b, h, K]
  through = (jnp.ones((N, B, 1), bool) if segments is None
             else segments.through[..., 0, 0])                               # [n, b, 1]

  @jax.checkpoint
  def step(carry, xs):
    S, n, m = carry
    F_C, m_loc, S_loc, n_loc, through_ = xs
    m_next = jnp.maximum(jnp.where(through_, F_C + m, -jnp.inf), m_loc)
    m_next = jax.lax.stop_gradient(_finite_or_zero(m_next))
    carried = _masked_exp(through_, F_C + m - m_next)                        # [b, h]
    written = _masked_exp(jnp.isfinite(m_loc), m_loc - m_next)               # [b, h]
    S_next = carried[..., None, None] * S + written[..., None, None] * S_loc
    n_next = carried[..., None] * n + written[..., None] * n_loc
    return (S_next, n_next, m_next), (S, n, m)

  final_state, (S_in, n_in, m_in) = jax.lax.scan(
      step, (S0, n0, m0), (F[..., -1], m_local, S_local, n_local, through))

  # the outputs, every chunk at once from the state entering it
  causal = jnp.tril(jnp.ones((C, C), bool))
  pairs = causal & real[..., None, :]                        # [n, b, 1, C, C]: j <= i, j real
  if segments is not None:
    pairs = pairs & segments.same
  D = jnp.where(pairs, F[..., :, None] - F[..., None, :] + log_i[..., None, :], -jnp.inf)
  reads_entering = (jnp.ones((1, 1, 1, 1), bool) if segments is None
                    else segments.from_entering[..., 0])   # [n, b, 1, C]
  inter = jnp.where(reads_entering, F + m_in[..., None], -jnp.inf)           # [n, b, h, C]
  m = jax.lax.stop_gradient(_finite_or_zero(jnp.maximum(jnp.max(D, -1), inter)))
  gate = _masked_exp(pairs, D - m[..., None])                                # [n, b, h, C, C]
  from_state = _masked_exp(reads_entering, inter - m)                        # [n, b, h, C]
  scores = _einsum("nbhik,nbhjk->nbhij", q, k) * gate                        # [n, b, h, C, C]
  numerator = (from_state[..., None] * _einsum("nbhck,nbhkv->nbhcv", q, S_in)
               + _einsum("nbhij,nbhjv->nbhiv", scores, v))                   # [n, b, h, C, V]
  normaliser = from_state * _einsum("nbhck,nbhk->nbhc", q, n_in) + scores.sum(-1)  # [n, b, h, C]
  o = numerator / jnp.maximum(jnp.abs(normaliser), jnp.exp(-m))[..., None]
  o = jnp.where(real[..., None], o, 0.0)
  return _from_chunks(o, T).astype(out_dtype), final_state
