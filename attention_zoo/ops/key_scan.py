r"""Attention whose weights are not a softmax, computed tile by tile: a map over query blocks and,
inside it, a scan over key blocks that carries a few numbers per query row, so no [q_len,
kv_len] array is formed. Two weightings use it:

Stick-breaking (Tan et al. 2024, arXiv:2410.17980), causal only. With z_ij = scale · q_i·k_j and
β_ij = σ(z_ij), query i breaks its stick at the keys before it, nearest first:

    A_ij = β_ij ∏_{j<l<i} (1 − β_il)                                            (j < i)
    log A_ij = log σ(z_ij) − Σ_{j<l<i} softplus(z_il)

The key blocks are visited from the diagonal backwards, carrying per query row the log of the
stick left, Σ_{l visited} −softplus(z_il) <= 0; inside a block the keys to the right of j add
their −softplus through a reverse cumulative sum. Every term is <= 0, so exp never overflows and
nothing cancels. What is left of the stick after every key, 1 − Σ_j A_ij = ∏_j (1 − β_ij), is the
carry's exp at the end (`remainder`).

Softpick (Zuhri et al. 2025, arXiv:2504.20966), causal or not:

    w_ij = ReLU(e^{z_ij} − 1) / (Σ_l |e^{z_il} − 1| + ε)

evaluated with a running shift c = max(0, max_l z_il): e^{z−c} − e^{−c} in place of e^z − 1 and
ε e^{−c} in place of ε, which divides numerator and denominator by e^c (the same weights), and
keeps every exponential <= 1. The running denominator and output are rescaled by e^{c_old − c_new}
when c grows (FlashAttention's online softmax with |·| in the sum and ReLU in the weights).
e^{z−c} − e^{−c} is formed as −e^{z−c}·expm1(−z) for z > 0 and e^{−c}·expm1(z) otherwise, so no
digits cancel near z = 0 (where the plain difference keeps only the absolute precision of 1).

Both: q [B, Tq, H, D], k, v [B, Tk, KVH, D] with H a multiple of KVH (the query heads that share
a K/V head are stacked as rows of one tile, so K/V are never copied); kv_mask bool [B, Tk]: a
masked key takes no weight and (stick-breaking) breaks no stick, and softpick's denominator
leaves it out; causal alignment is bottom-right (query i sits at position i + Tk − Tq, as the
zoo's decode cache needs). Memory is O((Tq + Tk) · D + block_q · block_k) forward; the backward
is JAX's autodiff of the scans with each query block recomputed (jax.checkpoint), so it keeps one
query block's key-block residuals at a time: linear in the length as well. Scores, weights and
sums are f32; bf16/f16 inputs reach the matmuls as they are, with f32 accumulation.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from attention_zoo.ops import tiles
from attention_zoo.ops.blocks import ceil_div, pad_to_multiple

DEFAULT_BLOCK = 128


def _check(q, k, v, kv_mask):
  if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
    raise ValueError(f"q must be [B, Tq, H, D] and k, v both [B, Tk, KVH, D]; got {q.shape}, "
                     f"{k.shape}, {v.shape}")
  if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or q.shape[2] % k.shape[2]:
    raise ValueError(f"k, v {k.shape} must share q's batch and head_dim {q.shape}, and their "
                     f"heads must divide q's")
  if kv_mask is not None and kv_mask.shape != k.shape[:2]:
    raise ValueError(f"kv_mask must be bool [B, Tk] = {k.shape[:2]} or None, got "
                     f"{kv_mask.shape}")


def _scan_key_blocks(q, k, v, kv_mask, *, scale: float, block_q: int, block_k: int,
                     init: Callable, step: Callable, finish: Callable, reverse: bool,
                     causal: bool, include_diagonal: bool = True):
  """The shared loop: for each query block (lax.map, recomputed in the backward), carry =
  init(B, KVH, R, D) then carry = step(carry, tile) over the key blocks a causal query block
  can see (all of them when not causal; include_diagonal=False: keys strictly before the
  query), ascending or (`reverse`) from the last, then finish(carry) -> [B, KVH, R, C]. A tile
  is a dict: scores [B, KVH, R, bk] f32 (scaled), allowed [B, 1, R, bk] bool (real key, and
  causal), v [B, KVH, bk, D]; R = group · block_q rows (row g·block_q + r: query r of the g-th
  head sharing the K/V head). Returns [B, Tq, H, C] f32."""
  batch, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  block_q, block_k = min(block_q, q_len), min(block_k, kv_len)
  num_q, num_k = ceil_div(q_len, block_q), ceil_div(kv_len, block_k)
  offset = kv_len - q_len
  kv_mask = jnp.ones((batch, kv_len), bool) if kv_mask is None else kv_mask
  # [nq, B, KVH, G·bq, D]
  q_blocks = pad_to_multiple(q, block_q).reshape(batch, num_q, block_q, num_kv_heads, group,
                                                 head_dim)
  q_blocks = q_blocks.transpose(1, 0, 3, 4, 2, 5).reshape(num_q, batch, num_kv_heads,
                                                          group * block_q, head_dim)
  # [nk, B, KVH, bk, D], and [nk, B, 1, 1, bk] (the padding past kv_len False)
  to_blocks = lambda x: pad_to_multiple(x, block_k).reshape(
      batch, num_k, block_k, num_kv_heads, head_dim).transpose(1, 0, 3, 2, 4)
  k_blocks, v_blocks = to_blocks(k), to_blocks(v)
  valid = pad_to_multiple(kv_mask, block_k).reshape(batch, num_k, 1, 1, block_k)
  valid = valid.transpose(1, 0, 2, 3, 4)
  rows = group * block_q
  order = jnp.arange(num_k)[::-1] if reverse else jnp.arange(num_k)

  def query_block(qi, q_block):
    position = qi * block_q + jnp.arange(rows) % block_q + offset           # [R] aligned
    # the last key any row of this block may see: the key blocks after it are skipped
    last_key = qi * block_q + block_q - 1 + offset - (0 if include_diagonal else 1)

    def key_block(carry, kj):
      def visit(carry):
        scores = tiles.dot_nt(q_block, k_blocks[kj]) * scale             # [B, KVH, R, bk]
        key = kj * block_k + jnp.arange(block_k)                          # [bk]
        allowed = valid[kj]                                               # padding: False
        if causal:
          seen = (key[None, :] <= position[:, None]) if include_diagonal else (
              key[None, :] < position[:, None])
          allowed = allowed & seen                                        # [B, 1, R, bk]
        return step(carry, dict(scores=scores, allowed=allowed, v=v_blocks[kj]))
      if not causal:
        return visit(carry), None
      return jax.lax.cond(kj * block_k <= last_key, visit, lambda c: c, carry), None

    carry, _ = jax.lax.scan(key_block, init(batch, num_kv_heads, rows, head_dim), order)
    return finish(carry)                                                  # [B, KVH, R, C]

  out = jax.lax.map(jax.checkpoint(lambda args: query_block(*args)),
                    (jnp.arange(num_q), q_blocks))                          # [nq, B, KVH, R, C]
  out = out.reshape(num_q, batch, num_kv_heads, group, block_q, -1)
  out = out.transpose(1, 0, 4, 2, 3, 5).reshape(batch, num_q * block_q, num_heads, -1)
  return out[:, :q_len]


# -- stick-breaking ---------------------------------------------------------------------------

def stick_breaking_attention(q, k, v, *, scale: float | None = None, kv_mask=None,
                             attend_current: bool = False, block_q: int = DEFAULT_BLOCK,
                             block_k: int = DEFAULT_BLOCK, return_remainder: bool = False):
  """Σ_j A_ij v_j with A the stick-breaking weights (module docstring), causal, bottom-right
  aligned: query i (at position i' = i + Tk − Tq) breaks its stick at the keys j < i', or
  j <= i' with attend_current. scale: None for D^(-1/2). Returns [B, Tq, H, D] in q's dtype,
  and with return_remainder also the stick left, ∏_j (1 − β_ij) = 1 − Σ_j A_ij, f32
  [B, Tq, H]. A row that sees no key gives 0 and a remainder of 1."""
  _check(q, k, v, kv_mask)
  head_dim = q.shape[-1]
  scale = head_dim ** -0.5 if scale is None else float(scale)

  def init(batch, kv_heads, rows, dim):
    return (jnp.zeros((batch, kv_heads, rows, dim), jnp.float32),        # Σ A v
            jnp.zeros((batch, kv_heads, rows), jnp.float32))             # log of the stick left

  def step(carry, tile):
    acc, log_left = carry
    scores, allowed = tile["scores"], tile["allowed"]
    log_keep = jnp.where(allowed, -jax.nn.softplus(scores), 0.0)       # log(1 − β) [.., R, bk]
    # Σ over the keys of this block to the right of j (nearer the query), j itself excluded
    right = jax.lax.cumsum(log_keep, axis=3, reverse=True) - log_keep
    log_weight = jax.nn.log_sigmoid(scores) + right + log_left[..., None]
    weight = jnp.where(allowed, jnp.exp(jnp.minimum(log_weight, 0.0)), 0.0)
    acc = acc + tiles.dot_nn(weight.astype(tile["v"].dtype), tile["v"])
    return acc, log_left + jnp.sum(log_keep, axis=3)

  # the log of the stick left rides along as a last column: [B, Tq, H, D + 1]
  both = _scan_key_blocks(
      q, k, v, kv_mask, scale=scale, block_q=block_q, block_k=block_k, init=init, step=step,
      finish=lambda carry: jnp.concatenate([carry[0], carry[1][..., None]], axis=-1),
      reverse=True, causal=True, include_diagonal=attend_current)
  out = both[..., :head_dim].astype(q.dtype)
  return (out, jnp.exp(both[..., head_dim])) if return_remainder else out


# -- softpick ---------------------------------------------------------------------------------

SOFTPICK_EPS = 1e-6


def softpick_attention(q, k, v, *, scale: float | None = None, kv_mask=None, causal: bool = False,
                       eps: float = SOFTPICK_EPS, block_q: int = DEFAULT_BLOCK,
                       block_k: int = DEFAULT_BLOCK):
  """Σ_j w_ij v_j with w = softpick of the scaled scores over the keys each query sees (module
  docstring); causal: bottom-right aligned, key j <= i + Tk − Tq. eps: ε of the denominator, in
  the units of e^z − 1. scale: None for D^(-1/2). Returns [B, Tq, H, D] in q's dtype; a row
  that sees no key gives 0."""
  _check(q, k, v, kv_mask)
  scale = q.shape[-1] ** -0.5 if scale is None else float(scale)

  def init(batch, kv_heads, rows, dim):
    return (jnp.zeros((batch, kv_heads, rows, dim), jnp.float32),        # Σ ReLU(p) v
            jnp.zeros((batch, kv_heads, rows), jnp.float32),             # shift c >= 0
            jnp.zeros((batch, kv_heads, rows), jnp.float32))             # Σ |p|

  def step(carry, tile):
    acc, shift, total = carry
    allowed = tile["allowed"]
    scores = jnp.where(allowed, tile["scores"], 0.0)                   # masked: p = 0 below
    # the weights do not depend on c (it scales numerator and denominator alike)
    new_shift = jax.lax.stop_gradient(jnp.maximum(shift, jnp.max(scores, axis=3)))
    p = jnp.where(allowed, shifted_expm1(scores, new_shift[..., None]), 0.0)   # [.., R, bk]
    rescale = jnp.exp(shift - new_shift)                                  # [.., R]
    acc = rescale[..., None] * acc + tiles.dot_nn(
        jnp.maximum(p, 0.0).astype(tile["v"].dtype), tile["v"])
    return acc, new_shift, rescale * total + jnp.sum(jnp.abs(p), axis=3)

  def finish(carry):
    acc, shift, total = carry
    return acc / (total + eps * jnp.exp(-shift))[..., None]

  out = _scan_key_blocks(q, k, v, kv_mask, scale=scale, block_q=block_q, block_k=block_k,
                         init=init, step=step, finish=finish, reverse=False, causal=causal)
  return out.astype(q.dtype)


def shifted_expm1(z, shift):
  """e^{z − c} − e^{−c} = e^{−c}(e^z − 1) for z <= c, c >= 0, without cancellation near z = 0
  and with every exponential <= 1 (both branches safe where unused, so gradients stay finite)."""
  positive = z > 0
  z_pos, z_neg = jnp.where(positive, z, 0.0), jnp.where(positive, 0.0, z)
  return jnp.where(positive, -jnp.exp(z_pos - shift) * jnp.expm1(-z_pos),
                   jnp.exp(-shift) * jnp.expm1(z_neg))
