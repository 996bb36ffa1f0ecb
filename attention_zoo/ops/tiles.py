"""FlashAttention's tile maths: the online softmax over key blocks and its backward, shared by
the block-mask engine (flex.py) and the Pallas flash kernels (flash/).

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
as in flex.py, which also stacks the query heads sharing a K/V head as rows).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from attention_zoo.ops.softmax import MASK_VALUE

LOG2E = math.log2(math.e)


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
