"""The FlashAttention tile math shared by the Pallas kernels (GPU and TPU) and attention_zoo.flex.

One tile is a block of `block_q` queries against a block of `block_k` keys. Scores are kept in
base-2 units (s₂ = log2(e) · s) so the kernels use `exp2`, and the row statistics are [rows, 1]
columns (2-D, as the TPU lowering wants). With m the running row maximum and ℓ the running sum:

    m' = max(m, rowmax(S₂))      P = exp2(S₂ - m')      ℓ' = exp2(m - m')·ℓ + rowsum(P)
    acc' = exp2(m - m')·acc + P V                      out = acc / ℓ,  lse₂ = m + log2(ℓ)

Backward (FlashAttention-2, Dao 2023, Alg. 2), with Δ = rowsum(dO ∘ O):

    P = exp2(S₂ - lse₂)   dV = Pᵀ dO   dP = dO Vᵀ   dS = P ∘ (dP - Δ)
    dQ = dS K·scale       dK = dSᵀ Q·scale

With soft-capping (Gemma 2) the score is c · tanh(Q Kᵀ · scale / c), and dS is multiplied by
its derivative 1 - tanh² before dQ and dK, recomputed in the tile like the scores.

Disallowed entries hold the finite MASK_VALUE, so exp2 of them minus any row statistic is 0; a
row that has seen no key yet (m' = MASK_VALUE) subtracts 0 instead, so its P is 0 too (never
-inf arithmetic). Such a row gives ℓ = 0 -> out 0 and lse₂ = 0, and its backward tile is all
zeros: no NaN, no Inf.

The functions take one tile ([rows, d], as in the kernels) or a batch of tiles ([..., rows, d],
as in attention_zoo.flex, which also stacks the query heads sharing a K/V head as rows).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp

from attention_zoo import reference
from attention_zoo.base import ceil_div, pad_to_multiple

LOG2E = math.log2(math.e)
# Finite, so masked entries never make inf - inf; exp2(MASK_VALUE - m) underflows to 0.
MASK_VALUE = reference.MASK_VALUE


@dataclasses.dataclass(frozen=True)
class Geometry:
  """Static facts every tile needs (hashable: it is a static argument of the custom_vjp)."""
  q_len: int            # unpadded lengths: ALiBi distances use these
  kv_len: int
  scale: float
  use_alibi: bool
  block_q: int
  block_k: int
  # mask_mod closure-converted: mask(b, h, q, kv, *mask_consts) -> bool, evaluated in partial
  # tiles only; None: every visited tile is full.
  mask: Callable | None = None
  softcap: float | None = None  # c of c · tanh(s / c) on the scaled dot product; None: off
  use_segments: bool = False    # compare the query's and key's segment ids in every tile

  @property
  def offset(self) -> int:
    """Bottom-right alignment of query i with key i + offset (ALiBi's distance)."""
    return self.kv_len - self.q_len


def matmul_precision(dtype):
  """f32 inputs get true f32 products (the variant is exact); bf16/f16 use the native MXU/tensor
  cores."""
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _dot(a, b, a_contract: int, b_contract: int):
  """dot_general over a's and b's last two axes (leading axes are batch), in f32."""
  batch = tuple(range(a.ndim - 2))
  contract = ((a.ndim - 2 + a_contract,), (b.ndim - 2 + b_contract,))
  return jax.lax.dot_general(a, b, (contract, (batch, batch)), preferred_element_type=jnp.float32,
                             precision=matmul_precision(a.dtype))


def dot_nt(a, b):
  """a [..., m, d] · b [..., n, d]ᵀ -> [..., m, n] in f32."""
  return _dot(a, b, 1, 1)


def dot_nn(a, b):
  """a [..., m, n] · b [..., n, d] -> [..., m, d] in f32."""
  return _dot(a, b, 1, 0)


def dot_tn(a, b):
  """a [..., n, m]ᵀ · b [..., n, d] -> [..., m, d] in f32."""
  return _dot(a, b, 0, 0)


def tile_allowed(geo: Geometry, is_full, b, h, q_start, k_start, mask_consts):
  """mask_mod on one [block_q, block_k] tile (b, h scalars), or None when geo has no mask; a
  full tile (is_full nonzero: the block metadata says mask_mod is True on all of it) evaluates
  nothing."""
  if geo.mask is None:
    return None
  shape = (geo.block_q, geo.block_k)
  q = q_start + jax.lax.broadcasted_iota(jnp.int32, (geo.block_q, 1), 0)
  kv = k_start + jax.lax.broadcasted_iota(jnp.int32, (1, geo.block_k), 1)
  evaluate = lambda: jnp.broadcast_to(geo.mask(b, h, q, kv, *mask_consts), shape)
  return jax.lax.cond(is_full != 0, lambda: jnp.ones(shape, bool), evaluate)


def tile_scores(q, k, q_start, k_start, kv_valid, slope, geo: Geometry, allowed=None,
                segments=None):
  """Base-2 scores of one tile, MASK_VALUE where not allowed.

  q [bq, d], k [bk, d]; q_start, k_start: positions of the tile's first query / key; kv_valid
  int [1, bk] (0 for padding and padded-to-block keys); slope: the ALiBi slope (ignored unless
  geo.use_alibi); allowed: None or bool [bq, bk], tile_allowed's mask; segments: None or the
  tile's (query ids [bq, 1], key ids [1, bk]), read when geo.use_segments. Returns (s₂ [bq, bk]
  f32, the soft-cap's derivative 1 - tanh² [bq, bk], or None without geo.softcap).
  """
  if geo.softcap is None:
    scores, cap_grad = dot_nt(q, k) * (geo.scale * LOG2E), None            # [bq, bk]
  else:
    capped = jnp.tanh(dot_nt(q, k) * (geo.scale / geo.softcap))
    scores, cap_grad = capped * (geo.softcap * LOG2E), 1.0 - capped * capped
  allowed_here = jnp.broadcast_to(kv_valid, scores.shape) != 0            # [bq, bk]
  if allowed is not None:
    allowed_here = allowed_here & allowed
  if geo.use_segments:
    allowed_here = allowed_here & (segments[0] == segments[1])
  if geo.use_alibi:
    # reference.alibi_bias for one head: -slope · |i + offset - j|, here in base-2 units.
    q_pos = q_start + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 0)
    k_pos = k_start + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
    distance = jnp.abs(q_pos + geo.offset - k_pos).astype(jnp.float32)
    scores = scores - (slope * LOG2E) * distance
  return jnp.where(allowed_here, scores, MASK_VALUE), cap_grad


def softmax_init(block_q: int, head_dim: int):
  """(acc [bq, d], m [bq, 1], row_sum [bq, 1]) before the first key block."""
  return (jnp.zeros((block_q, head_dim), jnp.float32),
          jnp.full((block_q, 1), MASK_VALUE, jnp.float32),
          jnp.zeros((block_q, 1), jnp.float32))


def softmax_update(state, scores, v, kept=None):
  """One online-softmax step over a key block: state (acc, m, row_sum), scores [..., rows, bk],
  v [..., bk, d]; kept: None, or attention dropout's keep / (1 - rate) [..., rows, bk], which
  scales the weights that reach V (not the normaliser)."""
  acc, m, row_sum = state
  m_new = jnp.maximum(m, jnp.max(scores, axis=-1, keepdims=True))           # [..., rows, 1]
  m_used = jnp.where(m_new == MASK_VALUE, 0.0, m_new)                      # no key seen yet: P = 0
  p = jnp.exp2(scores - m_used)                                            # [..., rows, bk]
  rescale = jnp.exp2(m - m_used)                                           # [..., rows, 1]
  row_sum_new = rescale * row_sum + jnp.sum(p, axis=-1, keepdims=True)
  weights = p if kept is None else p * kept
  acc_new = rescale * acc + dot_nn(weights.astype(v.dtype), v)             # [..., rows, d]
  return acc_new, m_new, row_sum_new


def softmax_finish(state):
  """-> (out [..., rows, d] f32, lse₂ [..., rows, 1]); rows that saw no key give 0 and lse₂ = 0."""
  acc, m, row_sum = state
  seen = row_sum > 0
  out = acc / jnp.where(seen, row_sum, 1.0)
  lse = jnp.where(seen, m + jnp.log2(jnp.where(seen, row_sum, 1.0)), 0.0)
  return out, lse


def tile_probs_and_dscores(scores, lse, delta, do, v, kept=None, cap_grad=None):
  """Backward of one tile: P and dS (gradient w.r.t. the natural-unit scores before `scale`,
  and before the soft-cap when its derivative `cap_grad` is given, as tile_scores returns it).

  scores [..., rows, bk]; lse, delta [..., rows, 1]; do [..., rows, d]; v [..., bk, d]; kept as
  for softmax_update (Δ = rowsum(dO ∘ O) holds with dropout too).
  Returns p, ds [..., rows, bk] f32 (0 where not allowed: exp2(MASK_VALUE - lse₂) = 0); with
  `kept`, p is the dropped weights P ∘ kept (what dV needs).
  """
  p = jnp.exp2(scores - lse)                                               # [..., rows, bk]
  dp = dot_nt(do, v)                                                       # [..., rows, bk]
  if kept is None:
    ds = p * (dp - delta)
  else:
    p, ds = p * kept, p * (dp * kept - delta)
  return p, ds if cap_grad is None else ds * cap_grad


def cumsum_two_float(x, axis: int):
  """Inclusive cumulative sum of f32 `x` along `axis` as an unevaluated pair hi + lo of f32.

  A plain f32 cumsum of log forget gates reaches -1e4 at long lengths, where one ulp is 1e-3:
  c_i - c_j of two nearby tokens would keep only 3-4 digits. The pair carries the rounding error
  of every addition (Knuth's TwoSum in a parallel scan), so (hi_i - hi_j) + (lo_i - lo_j) is
  accurate to a few f32 ulps of c_i - c_j itself, at any length.
  """
  def add(a, b):
    total = a[0] + b[0]
    b_part = total - a[0]
    error = (a[0] - (total - b_part)) + (b[0] - b_part)                   # exact: a + b - total
    lo = a[1] + b[1] + error
    hi = total + lo                                                        # renormalise
    return hi, lo - (hi - total)

  x = x.astype(jnp.float32)
  return jax.lax.associative_scan(add, (x, jnp.zeros_like(x)), axis=axis)


def padded(length: int, block: int) -> int:
  return ceil_div(length, block) * block


def next_power_of_2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


# -- what every implementation shares around its kernels ---------------------------------------

def convert_mask(mask_mod, block_q: int, block_k: int):
  """mask_mod -> (mask(b, h, q, kv, *mask_consts) for one [block_q, block_k] tile, mask_consts):
  every array it closes over (traced or not) becomes an explicit kernel input, since a kernel may
  capture none; None -> (None, [])."""
  if mask_mod is None:
    return None, []
  closed = jax.make_jaxpr(mask_mod)(jnp.int32(0), jnp.int32(0),
                                    jnp.zeros((block_q, 1), jnp.int32),
                                    jnp.zeros((1, block_k), jnp.int32))
  mask = lambda b, h, q, kv, *consts: jax.core.eval_jaxpr(closed.jaxpr, consts, b, h, q, kv)[0]
  return mask, list(closed.consts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention_with_vjp(kernels, q, k, v, kv_valid, segments, slopes, metadata):
  """Runs `kernels.forward` and differentiates through `kernels.backward` (which recomputes P).

  kernels: a hashable object with forward(q, k, v, kv_valid, segments, slopes, metadata) ->
  (out, lse) and backward(q, k, v, kv_valid, segments, slopes, metadata, out, lse, d_out) ->
  (dq, dk, dv); segments: pad_inputs' (q ids, kv ids); metadata: the block lists and mask_mod's
  arrays the kernels read. Only (out, lse) are saved besides the inputs, so memory stays linear
  in length. ALiBi slopes are fixed constants (Press et al. 2022): they get no gradient; the int
  kv_valid mask, the segment ids and the metadata get none either.
  """
  return kernels.forward(q, k, v, kv_valid, segments, slopes, metadata)[0]


def _attention_fwd(kernels, q, k, v, kv_valid, segments, slopes, metadata):
  out, lse = kernels.forward(q, k, v, kv_valid, segments, slopes, metadata)
  return out, (q, k, v, kv_valid, segments, slopes, metadata, out, lse)


def _attention_bwd(kernels, residuals, d_out):
  dq, dk, dv = kernels.backward(*residuals, d_out)
  no_grad = lambda tree: jax.tree.map(lambda _: None, tree)
  return dq, dk, dv, None, no_grad(residuals[4]), None, no_grad(residuals[6])


attention_with_vjp.defvjp(_attention_fwd, _attention_bwd)


def pad_inputs(q, k, v, kv_mask, alibi_slopes, segment_ids=None, *, q_multiple: int,
               kv_multiple: int, head_dim: int):
  """Pads lengths to block multiples and head_dim to `head_dim` with zeros (exact: zero columns
  add nothing to Q Kᵀ and give zero output columns). Returns q, k, v, kv_valid int32
  [b, 1, kv_padded] (False for padding and padded positions), segments (query ids int32
  [b, q_padded, 1], key ids int32 [b, 1, kv_padded]; zeros if segment_ids is None) and slopes
  f32 [h] (zeros if None)."""
  q = pad_to_multiple(q, q_multiple, axis=1)
  k, v = (pad_to_multiple(x, kv_multiple, axis=1) for x in (k, v))
  if head_dim != q.shape[-1]:
    q, k, v = (pad_to_multiple(x, head_dim, axis=3) for x in (q, k, v))
  kv_valid = pad_to_multiple(kv_mask, kv_multiple, axis=1, value=False)
  kv_valid = kv_valid.astype(jnp.int32)[:, None, :]                        # [b, 1, kv_padded]
  num_heads = q.shape[2]
  slopes = (jnp.zeros((num_heads,), jnp.float32) if alibi_slopes is None
            else jnp.asarray(alibi_slopes, jnp.float32).reshape(num_heads))
  if segment_ids is None:
    segment_ids = (jnp.zeros(kv_mask.shape[:1] + q.shape[1:2], jnp.int32),
                   jnp.zeros(kv_mask.shape, jnp.int32))
  q_ids, kv_ids = (pad_to_multiple(jnp.asarray(ids, jnp.int32), multiple, axis=1)
                   for ids, multiple in zip(segment_ids, (q_multiple, kv_multiple)))
  return q, k, v, kv_valid, (q_ids[:, :, None], kv_ids[:, None, :]), slopes
