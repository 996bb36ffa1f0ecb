"""FlashAttention in plain JAX: the same tiles and online softmax as the Pallas kernels, as loops.

Forward: `lax.map` over query blocks, and inside each a `fori_loop` over the key blocks that block
may see (causal: a dynamic bound, so fully masked tiles are skipped). Backward (custom_vjp,
recomputing P from the saved log-sum-exp): a loop over key blocks, each accumulating its dK, dV
over the query blocks that see it and adding its share into dQ. Memory in both directions is
O(len · block) plus the inputs and outputs. Portable (any backend), and the default on CPU.

The tile math is attention_zoo.flash.common's, applied to all heads at once: a query block holds
the `group` query heads that share a K/V head stacked as rows, [b, kvh, group · block_q, d], so
each product is one matmul per K/V head (GQA/MQA never copy K/V) and no array has a size-1
axis that would make XLA copy tiles between layouts. dK and dV are accumulated transposed
([d, block_k]: dKᵀ = Qᵀ dS, dVᵀ = dOᵀ P), so the [rows, block_k] tiles P and dS are never
transposed.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from attention_zoo import reference
from attention_zoo.flash import common

# Picked on the 2-core CPU at 4K tokens (batch 1, 4 heads, head_dim 64, f32, forward+backward):
# 512 x 512 reached 0.81 of the f32 matmul rate (experiments/flops.py), against 0.78 for
# 512 x 256 and 1024 x 256, 0.70-0.72 for 256 x 512, 1024 x 512 and 512 x 1024, 0.5 for 256 x 256.
DEFAULT_BLOCKS = dict(block_q=512, block_k=512)


def _to_blocks(x, block: int):
  """[b, kvh, g, len, c] -> [len / block, b, kvh, g · block, c]: one query block per index."""
  b, kvh, g, length, c = x.shape
  x = x.reshape(b, kvh, g, length // block, block, c)
  return jnp.moveaxis(x, 3, 0).reshape(length // block, b, kvh, g * block, c)


def _from_blocks(x, group: int):
  """Inverse of _to_blocks: [n, b, kvh, g · block, c] -> [b, kvh, g, n · block, c]."""
  n, b, kvh, rows, c = x.shape
  x = jnp.moveaxis(x.reshape(n, b, kvh, group, rows // group, c), 0, 3)
  return x.reshape(b, kvh, group, n * (rows // group), c)


def _row_slopes(slopes, block: int):
  """slopes [kvh, g] -> [kvh, g · block, 1]: each stacked row's head's ALiBi slope."""
  return jnp.repeat(slopes, block, axis=1)[..., None]


def _keys(x, j, block: int, axis: int = 2):
  """Key block j of x along its key axis (k, v [b, kvh, kv_len, d]; kv_valid: axis 3)."""
  return jax.lax.dynamic_slice_in_dim(x, j * block, block, axis=axis)


@dataclasses.dataclass(frozen=True)
class Kernels:
  """Forward and backward loops for one static configuration (hashable).

  Layout: q, out [b, kvh, g, q_len, d]; k, v [b, kvh, kv_len, d]; kv_valid [b, 1, 1, kv_len];
  slopes [kvh, g]; lse [b, kvh, g, q_len, 1].
  """
  fwd: common.Geometry
  bwd: common.Geometry

  def forward(self, q, k, v, kv_valid, slopes):
    geo = self.fwd
    bq, bk, group = geo.block_q, geo.block_k, q.shape[2]
    num_kv_blocks = k.shape[2] // bk
    slopes = _row_slopes(slopes, bq)
    init = jax.tree.map(lambda x: jnp.broadcast_to(x, q.shape[:2] + x.shape),
                        common.softmax_init(group * bq, q.shape[-1]))

    def query_block(args):
      i, q_i = args                                                          # q_i [b, kvh, g·bq, d]

      def key_block(j, state):
        kv_valid_j = _keys(kv_valid, j, bk, axis=3)
        scores = common.tile_scores(q_i, _keys(k, j, bk), i * bq, j * bk, kv_valid_j, slopes,
                                    geo)                                     # [b, kvh, g·bq, bk]
        return common.softmax_update(state, scores, _keys(v, j, bk))

      state = jax.lax.fori_loop(0, common.kv_blocks_seen(i, geo, num_kv_blocks), key_block, init)
      out, lse = common.softmax_finish(state)
      return out.astype(q.dtype), lse

    num_q_blocks = q.shape[3] // bq
    out, lse = jax.lax.map(query_block, (jnp.arange(num_q_blocks), _to_blocks(q, bq)))
    return _from_blocks(out, group), _from_blocks(lse, group)

  def backward(self, q, k, v, kv_valid, slopes, out, lse, d_out):
    geo = self.bwd
    bq, bk, group = geo.block_q, geo.block_k, q.shape[2]
    slopes = _row_slopes(slopes, bq)
    d_out = d_out.astype(q.dtype)
    delta = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1, keepdims=True)
    # [num q blocks, b, kvh, g·bq, d or 1]
    q, d_out, lse, delta = (_to_blocks(x, bq) for x in (q, d_out, lse, delta))

    def key_block(j, grads):
      dq, dk, dv = grads
      k_j, v_j, kv_valid_j = _keys(k, j, bk), _keys(v, j, bk), _keys(kv_valid, j, bk, axis=3)

      def query_block(i, carry):
        dq, dk_t, dv_t = carry
        q_i, do_i = q[i], d_out[i]                                           # [b, kvh, g·bq, d]
        scores = common.tile_scores(q_i, k_j, i * bq, j * bk, kv_valid_j, slopes, geo)
        # p, ds [b, kvh, g·bq, bk]
        p, ds = common.tile_probs_and_dscores(scores, lse[i], delta[i], do_i, v_j)
        dv_t += common.dot_tn(do_i, p.astype(do_i.dtype))                   # [b, kvh, d, bk]
        dk_t += common.dot_tn(q_i, ds.astype(q_i.dtype))
        dq_i = common.dot_nn(ds.astype(k_j.dtype), k_j)                      # [b, kvh, g·bq, d]
        return dq.at[i].add(dq_i), dk_t, dv_t

      zeros = jnp.zeros((*k_j.shape[:2], k_j.shape[3], bk), jnp.float32)      # [b, kvh, d, bk]
      first = common.first_q_block_seeing(j, geo)
      dq, dk_t, dv_t = jax.lax.fori_loop(first, q.shape[0], query_block, (dq, zeros, zeros))
      put = lambda full, block_t: jax.lax.dynamic_update_slice_in_dim(
          full, jnp.swapaxes(block_t, 2, 3).astype(full.dtype), j * bk, axis=2)
      return dq, put(dk, dk_t * geo.scale), put(dv, dv_t)

    grads = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, k.dtype),
             jnp.zeros(v.shape, v.dtype))
    dq, dk, dv = jax.lax.fori_loop(0, k.shape[2] // bk, key_block, grads)
    return (_from_blocks(dq, group) * geo.scale).astype(q.dtype), dk, dv


def flash_attention(q, k, v, kv_mask, alibi_slopes=None, *, causal: bool, scale: float,
                    block_q=None, block_k=None, block_q_bwd=None, block_k_bwd=None):
  """Exact softmax attention. q [b, q_len, h, d]; k, v [b, kv_len, kvh, d];
  kv_mask bool [b, kv_len]; alibi_slopes f32 [h] or None. Returns [b, q_len, h, d] in q's dtype.

  The backward blocks default to the forward ones; lengths are padded to a multiple of both.
  """
  b, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  block_q = DEFAULT_BLOCKS["block_q"] if block_q is None else block_q
  block_k = DEFAULT_BLOCKS["block_k"] if block_k is None else block_k
  asked = dict(block_q=block_q, block_k=block_k, block_q_bwd=block_q_bwd or block_q,
               block_k_bwd=block_k_bwd or block_k)
  blocks = {}
  for name, value in asked.items():
    if value <= 0:
      raise ValueError(f"flash (chunked): {name} must be positive, got {value}")
    # short inputs: one block
    blocks[name] = min(value, kv_len if name.startswith("block_k") else q_len)
  q, k, v, kv_valid, slopes = common.pad_inputs(
      q, k, v, kv_mask, alibi_slopes, head_dim=head_dim,
      q_multiple=math.lcm(blocks["block_q"], blocks["block_q_bwd"]),
      kv_multiple=math.lcm(blocks["block_k"], blocks["block_k_bwd"]))
  geometry = functools.partial(common.Geometry, q_len=q_len, kv_len=kv_len, causal=bool(causal),
                               scale=float(scale), use_alibi=alibi_slopes is not None)
  kernels = Kernels(fwd=geometry(block_q=blocks["block_q"], block_k=blocks["block_k"]),
                    bwd=geometry(block_q=blocks["block_q_bwd"], block_k=blocks["block_k_bwd"]))
  q_grouped = jnp.moveaxis(reference.group_heads(q, num_kv_heads), 1, 3)    # [b, kvh, g, q, d]
  heads_major = lambda x: jnp.swapaxes(x, 1, 2)              # [b, kv, kvh, d] -> [b, kvh, kv, d]
  out = common.attention_with_vjp(kernels, q_grouped, heads_major(k), heads_major(v),
                                  kv_valid[:, None], slopes.reshape(num_kv_heads, -1))
  # out [b, kvh, g, q, d]
  return jnp.moveaxis(out, 3, 1).reshape(b, -1, num_heads, head_dim)[:, :q_len]
