"""The softmax numerics the variants share: the causal rule, the ALiBi bias, the masked softmax,
query heads grouped by their K/V head, attention dropout, and the plain dense path
`masked_softmax_attention` (the oracle the variants are tested against is `oracle.py`'s).

    Attention(Q, K, V) = softmax(Q Kᵀ · scale + bias, over the allowed keys) V

Shapes: q [batch, q_len, num_heads, head_dim]; k, v [batch, kv_len, num_kv_heads, head_dim];
num_heads % num_kv_heads == 0. A query row that may see no key gives zeros, never NaN.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from attention_zoo.ops.autodiff import autodiff_modes

def causal_allowed(q_positions, k_positions, q_len: int, kv_len: int):
  """Bottom-right causal rule: query i sees key j iff j <= i + (kv_len - q_len).

  Positions are indices into the q and kv sequences; any broadcastable shapes.
  """
  return k_positions <= q_positions + (kv_len - q_len)


def window_allowed(window: int, q_len: int, kv_len: int, causal: bool):
  """The sliding window as a flex mask function (b, h, q, kv) -> bool: query i sees key j iff
  |i + (kv_len - q_len) - j| <= window (queries aligned to the end of the keys), and with
  `causal` only j <= i + (kv_len - q_len) too (`sliding_window`, NSA's window, Based's)."""
  offset = kv_len - q_len

  def allowed(b, h, q, kv):
    keep = jnp.abs(q + offset - kv) <= window
    return keep & causal_allowed(q, kv, q_len, kv_len) if causal else keep
  return allowed


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


def group_heads(q, num_kv_heads: int):
  """[b, q, h, d] -> [b, q, num_kv_heads, group, d]: query heads grouped by the K/V head they
  share."""
  b, n, h, d = q.shape
  return q.reshape(b, n, num_kv_heads, h // num_kv_heads, d)


# Finite, so a fully masked row never makes inf - inf; exp(MASK_VALUE - m) underflows to 0.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def apply_sinks(out, lse, sinks):
  """Attention sinks (gpt-oss; StreamingLLM's learned sink) on a finished softmax: a logit s_h
  per head joins each row's denominator, p_ij = e^{x_ij} / (e^{s_h} + Σ_k e^{x_ik}), taking mass
  but adding no value. With lse = log Σ_k e^{x_ik}, every weight is the sink-free one times
  e^lse / (e^lse + e^s) = sigmoid(lse - s): exact, and O(1) extra memory for a tiled softmax.

  out [b, q, h, dv]; lse f32 [b, q, h], natural units (any value where a row sees no key: its
  out is 0); sinks f32 [h] (-inf: no sink). Differentiable in all three."""
  keep = jax.nn.sigmoid(lse - jnp.asarray(sinks, jnp.float32))             # [b, q, h]
  return (out.astype(jnp.float32) * keep[..., None]).astype(out.dtype)


def masked_softmax_attention(q, k, v, *, q_mask=None, kv_mask=None, causal=False, scale=None,
                             alibi_slopes=None, dropout_rate=0.0, dropout_rng=None, softcap=None,
                             segment_ids=None, sinks=None):
  """The plain dense path (O(n²) memory), GQA without copying K/V per head.

      S = cap(Q Kᵀ · scale) + B (MASK_VALUE where not allowed),   P = exp(S - rowmax(S)),
      out = (P ∘ keep / (1 - rate)) V / rowsum(P)

  Masks: bool [b, len], True = real token; masked query rows and rows that see no key give 0.
  alibi_slopes: optional f32 [h] (ALiBi, Press et al. 2022), fixed constants with no gradient.
  softcap: None, or c for cap(s) = c · tanh(s / c) (Gemma 2); identity when None.
  segment_ids: None, or (int [b, q_len], int [b, kv_len]): a query sees only keys of its segment.
  sinks: None, or f32 [h], a sink logit per head in every row's denominator (`apply_sinks`).
  Dropout (`keep` ~ Bernoulli(1 - rate)) on the attention weights when `dropout_rng` is given.

  The backward is written by hand (a custom VJP: FlashAttention-2's Alg. 2 in one tile), with
  ℓ = rowsum(P) and dS = (P ∘ keep / (1 - rate)) ∘ (dO/ℓ · Vᵀ) - P ∘ rowsum(dO/ℓ ∘ out).
  It saves only P besides the inputs, and each product is laid out so that no [q, k] array is
  ever transposed. The log-sum-exp (for sinks) is a second output: its cotangent d_lse adds
  P/ℓ · d_lse to dS, i.e. Δ - d_lse/ℓ in place of Δ. The query heads sharing a K/V head are
  stacked as rows ([b, kvh, g·q, d]), so every product is one matmul per kv head. Under
  forward-mode differentiation (jax.jvp, jacfwd; see autodiff.py) the forward runs as plain
  JAX, which JAX differentiates itself.
  """
  b, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  q_rows = jnp.moveaxis(group_heads(q, num_kv_heads), 1, 3)                 # [b, kvh, g, q, d]
  q_rows = q_rows.reshape(b, num_kv_heads, group * q_len, head_dim)         # [b, kvh, g·q, d]
  k_heads, v_heads = (jnp.swapaxes(x, 1, 2) for x in (k, v))                # [b, kvh, kv, d]
  kv_mask = jnp.ones((b, kv_len), bool) if kv_mask is None else kv_mask
  slopes = None
  if alibi_slopes is not None:
    slopes = jnp.asarray(alibi_slopes, jnp.float32).reshape(num_kv_heads, group)
  if dropout_rng is None or dropout_rate == 0:
    dropout_rate, dropout_rng = 0.0, None
  geo = _DenseGeometry(q_len=q_len, kv_len=kv_len, causal=bool(causal),
                       scale=head_dim ** -0.5 if scale is None else float(scale),
                       dropout_rate=float(dropout_rate),
                       softcap=None if softcap is None else float(softcap),
                       uses_lse=sinks is not None)
  if segment_ids is not None:   # [b, 1, g·q, kv]: row m is query m mod q_len
    q_ids, kv_ids = segment_ids
    kv_mask = (kv_mask[:, None, None, :]
               & (jnp.tile(q_ids, (1, group))[:, None, :, None] == kv_ids[:, None, None, :]))
  if autodiff_modes()[:1] == ("forward",):   # the same forward, plain: JAX differentiates it
    slopes = None if slopes is None else jax.lax.stop_gradient(slopes)
    out, lse = _dense_forward(geo, q_rows, k_heads, v_heads, kv_mask, slopes, dropout_rng)[0]
  else:
    out, lse = _dense_attention(geo, q_rows, k_heads, v_heads, kv_mask, slopes, dropout_rng)
  in_sequence = lambda x: jnp.moveaxis(x.reshape(b, num_kv_heads, group, q_len, -1), 3, 1)
  out = in_sequence(out).reshape(b, q_len, num_heads, head_dim)
  if sinks is not None:
    out = apply_sinks(out, in_sequence(lse).reshape(b, q_len, num_heads), sinks)
  if q_mask is not None:
    out = jnp.where(q_mask[:, :, None, None], out, 0.0)
  return out.astype(q.dtype)


@dataclasses.dataclass(frozen=True)
class _DenseGeometry:
  """The static facts of one dense call (hashable: a static argument of the custom VJP)."""
  q_len: int
  kv_len: int
  causal: bool
  scale: float
  dropout_rate: float
  softcap: float | None = None
  uses_lse: bool = False   # the log-sum-exp output is used (sinks): its cotangent enters Δ


def _dense_probs(geo, q_rows, k, kv_mask, slopes):
  """-> P [b, kvh, g·q, kv] f32 (0 where not allowed), ℓ = rowsum(P) [b, kvh, g·q, 1]
  (1 for rows that see no key: their P is all 0), the soft-cap's derivative 1 - tanh²
  [b, kvh, g·q, kv] (None without a cap) and the max P was taken from [b, kvh, g·q, 1] (0 for
  rows that see no key), so log ℓ plus it is the log-sum-exp. kv_mask: [b, kv], or
  [b, 1, g·q, kv] with segments."""
  scores = jnp.einsum("bhmd,bhkd->bhmk", q_rows, k,
                      preferred_element_type=jnp.float32) * geo.scale       # [b, kvh, g·q, kv]
  cap_grad = None
  if geo.softcap is not None:
    capped = jnp.tanh(scores / geo.softcap)
    scores, cap_grad = geo.softcap * capped, 1.0 - capped * capped
  k_pos = jnp.arange(geo.kv_len)[None, :]                                   # [1, kv]
  if slopes is not None:   # [kvh·g, q, kv] -> [kvh, g·q, kv]
    scores = scores + alibi_bias(slopes.reshape(-1), jnp.arange(geo.q_len)[:, None], k_pos,
                                 geo.q_len, geo.kv_len).reshape(scores.shape[1:])
  allowed = kv_mask[:, None, None, :] if kv_mask.ndim == 2 else kv_mask   # [b, 1, 1|g·q, kv]
  if geo.causal:
    q_pos = jnp.arange(q_rows.shape[2])[:, None] % geo.q_len               # [g·q, 1]
    allowed = allowed & causal_allowed(q_pos, k_pos, geo.q_len, geo.kv_len)  # [b, 1, g·q, kv]
  scores = jnp.where(allowed, scores, MASK_VALUE)
  # A constant to the derivatives (the result does not depend on it): a differentiated max would
  # divide by its count of ties, 0/0 when XLA rounds the max and the scores apart (forward mode).
  row_max = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))  # [b, kvh, g·q, 1]
  # A row that sees no key has row_max = MASK_VALUE; subtracting 0 there makes its P all 0.
  row_max = jnp.where(row_max == MASK_VALUE, 0.0, row_max)
  probs = jnp.exp(scores - row_max)
  total = jnp.sum(probs, axis=-1, keepdims=True)
  return probs, jnp.where(total > 0, total, 1.0), cap_grad, row_max


def _kept(geo, probs, dropout_rng):
  """P ∘ keep / (1 - rate): the same mask forward and backward (drawn from the same key)."""
  return probs if dropout_rng is None else dropout(probs, geo.dropout_rate, dropout_rng)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dense_attention(geo, q_rows, k, v, kv_mask, slopes, dropout_rng):
  """q_rows [b, kvh, g·q, d]; k, v [b, kvh, kv, d] -> (out [b, kvh, g·q, d] f32, the rows'
  log-sum-exp [b, kvh, g·q, 1] f32, 0 for a row that sees no key)."""
  return _dense_forward(geo, q_rows, k, v, kv_mask, slopes, dropout_rng)[0]


def _dense_forward(geo, q_rows, k, v, kv_mask, slopes, dropout_rng):
  probs, total, cap_grad, row_max = _dense_probs(geo, q_rows, k, kv_mask, slopes)
  kept = _kept(geo, probs, dropout_rng).astype(v.dtype)
  out = jnp.einsum("bhmk,bhkd->bhmd", kept, v, preferred_element_type=jnp.float32) / total
  lse = row_max + jnp.log(total)
  return (out, lse), (q_rows, k, v, kv_mask, slopes, dropout_rng, probs, total, cap_grad, out)


def _dense_backward(geo, residuals, cotangents):
  q_rows, k, v, kv_mask, slopes, dropout_rng, probs, total, cap_grad, out = residuals
  d_out, d_lse = cotangents
  dtype = v.dtype
  f32 = dict(preferred_element_type=jnp.float32)
  d_out = d_out / total                                                     # dO/ℓ [b, kvh, g·q, d]
  delta = jnp.sum(d_out * out, axis=-1, keepdims=True)                      # [b, kvh, g·q, 1]
  if geo.uses_lse:   # static, so a call without sinks compiles as before (no d_lse term)
    delta = delta - d_lse / total
  kept = _kept(geo, probs, dropout_rng)
  d_out = d_out.astype(dtype)
  # dVᵀ and dKᵀ [b, kvh, d, kv]: the [q, k] operand is read as laid out, the small results swapped.
  d_v = jnp.einsum("bhmd,bhmk->bhdk", d_out, kept.astype(dtype), **f32)
  d_kept = jnp.einsum("bhmd,bhkd->bhmk", d_out, v, **f32)                   # [b, kvh, g·q, kv]
  d_scores = kept * d_kept - probs * delta                                  # [b, kvh, g·q, kv]
  if cap_grad is not None:   # through s -> c · tanh(s / c)
    d_scores = d_scores * cap_grad
  d_scores = d_scores.astype(dtype)
  d_q = jnp.einsum("bhmk,bhkd->bhmd", d_scores, k, **f32) * geo.scale       # [b, kvh, g·q, d]
  d_k = jnp.einsum("bhmd,bhmk->bhdk", q_rows, d_scores, **f32) * geo.scale
  as_kv = lambda x, like: jnp.swapaxes(x, 2, 3).astype(like.dtype)          # -> [b, kvh, kv, d]
  return d_q.astype(q_rows.dtype), as_kv(d_k, k), as_kv(d_v, v), None, None, None


_dense_attention.defvjp(_dense_forward, _dense_backward)


def dropout(weights, rate: float, rng):
  """Inverted dropout on attention weights."""
  keep = keep_mask(rng, weights.shape, rate)
  return jnp.where(keep, weights / (1.0 - rate), 0.0).astype(weights.dtype)


def _mix32(x):
  """A bijective avalanche of uint32 words (the "lowbias32" xorshift-multiply finaliser)."""
  x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
  x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def keep_mask(rng, shape, rate: float):
  """bool `shape`, each entry True with probability 1 - rate (to 2^-32), independently across
  entries and keys for dropout's purposes: a counter-based hash of (key, row, column). Drawing
  one threefry bit per entry of a [b, h, q, k] weight array cost ~20x more than the attention
  itself on CPU (5 s against 0.25 s for 8 x 2 x 2048² entries): here a key costs one threefry
  call for two words, then each entry one multiply-xorshift round over its row's word and its
  column index. Rows are every axis but the last."""
  shape = tuple(shape)
  k0, k1 = jax.random.bits(rng, (2,), jnp.uint32)
  row_shape = (*shape[:-1], 1)
  row = jnp.zeros(row_shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(len(shape) - 1)):   # the row's flat index
    row = row + jax.lax.broadcasted_iota(jnp.uint32, row_shape, axis) * jnp.uint32(stride)
    stride *= shape[axis]
  row_word = _mix32(row * jnp.uint32(0x9E3779B9) ^ k0)                       # [..., 1]
  column = jax.lax.broadcasted_iota(jnp.uint32, (1,) * len(row_shape[:-1]) + tuple(shape[-1:]),
                                    len(shape) - 1)
  bits = _mix32(row_word ^ (column * jnp.uint32(0x85EBCA6B)) ^ k1)           # shape
  return bits >= jnp.uint32(min(round(rate * 2.0 ** 32), 2 ** 32 - 1))
