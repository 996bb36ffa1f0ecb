"""FlashAttention in plain JAX: the same tiles and online softmax as the Pallas kernels, as loops.

Forward: `lax.map` over query blocks, and inside each a `fori_loop` over the key blocks that block
may see (causal: a dynamic bound, so fully masked tiles are skipped). The tile math is
attention_zoo.flash.common's, vmapped over (batch, kv head, query head of the group), so GQA/MQA
never copies K/V per query head. Backward (custom_vjp, recomputing P from the saved log-sum-exp):
a loop over key blocks, each accumulating its dK, dV over the query blocks that see it and adding
its share into dQ. Memory in both directions is O(len · block) plus the inputs and outputs.
Portable (any backend), and the default on CPU.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from attention_zoo import reference
from attention_zoo.flash import common

# Picked on the 2-core CPU at 4K tokens (batch 1, 8 heads, head_dim 64, f32, forward+backward):
# 512 x 512 was at least as fast as 256 x 512, 1024 x 512, 512 x 1024 and 4096 x 256.
DEFAULT_BLOCKS = dict(block_q=512, block_k=512)


def _over_heads(fn, group_axes, kv_head_axes, batch_axes):
  """Maps a one-tile function of common.py over [batch, kv heads, group] (vmap, innermost first)."""
  return jax.vmap(jax.vmap(jax.vmap(fn, in_axes=group_axes), in_axes=kv_head_axes), in_axes=batch_axes)


def _tile_functions(geo):
  """common.py's tile math for q [b, kvh, g, bq, d], k/v [b, kvh, bk, d], kv_valid [b, 1, bk],
  slopes [kvh, g] (K/V are shared by the group's query heads: in_axes None over g)."""
  scores = _over_heads(functools.partial(common.tile_scores, geo=geo),
                       (0, None, None, None, None, 0), (0, 0, None, None, None, 0), (0, 0, None, None, 0, None))
  update = _over_heads(common.softmax_update, (0, 0, 0, None), 0, 0)
  finish = _over_heads(common.softmax_finish, 0, 0, 0)
  grads = _over_heads(common.tile_probs_and_dscores, (0, 0, 0, 0, 0, None), 0, 0)
  return scores, update, finish, grads


def _rows(x, start, size, axis):
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


@dataclasses.dataclass(frozen=True)
class Kernels:
  """Forward and backward loops for one static configuration (hashable).

  Layout: q, out [b, kvh, g, q_len, d]; k, v [b, kvh, kv_len, d]; kv_valid [b, 1, kv_len];
  slopes [kvh, g]; lse [b, kvh, g, q_len, 1].
  """
  fwd: common.Geometry
  bwd: common.Geometry

  def forward(self, q, k, v, kv_valid, slopes):
    geo = self.fwd
    bq, bk = geo.block_q, geo.block_k
    num_kv_blocks = k.shape[2] // bk
    tile_scores, softmax_update, softmax_finish, _ = _tile_functions(geo)
    init = jax.tree.map(lambda x: jnp.broadcast_to(x, q.shape[:3] + x.shape),
                        common.softmax_init(bq, q.shape[-1]))

    def query_block(i):
      q_i = _rows(q, i * bq, bq, axis=3)                                     # [b, kvh, g, bq, d]

      def key_block(j, state):
        scores, allowed = tile_scores(q_i, _rows(k, j * bk, bk, 2), i * bq, j * bk,
                                      _rows(kv_valid, j * bk, bk, 2), slopes)  # [b, kvh, g, bq, bk]
        return softmax_update(state, scores, allowed, _rows(v, j * bk, bk, 2))

      state = jax.lax.fori_loop(0, common.kv_blocks_seen(i, geo, num_kv_blocks), key_block, init)
      out, lse = softmax_finish(state)
      return out.astype(q.dtype), lse

    out, lse = jax.lax.map(query_block, jnp.arange(q.shape[3] // bq))       # [nq, b, kvh, g, bq, ...]
    merge = lambda x: jnp.moveaxis(x, 0, 3).reshape(q.shape[:3] + (-1, x.shape[-1]))
    return merge(out), merge(lse)

  def backward(self, q, k, v, kv_valid, slopes, out, lse, d_out):
    geo = self.bwd
    bq, bk = geo.block_q, geo.block_k
    num_q_blocks = q.shape[3] // bq
    tile_scores, _, _, probs_and_dscores = _tile_functions(geo)
    d_out = d_out.astype(q.dtype)
    delta = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1, keepdims=True)  # [b, kvh, g, q, 1]

    def key_block(j, grads):
      dq, dk, dv = grads
      k_j, v_j = _rows(k, j * bk, bk, 2), _rows(v, j * bk, bk, 2)           # [b, kvh, bk, d]
      kv_valid_j = _rows(kv_valid, j * bk, bk, 2)

      def query_block(i, carry):
        dq, dk_j, dv_j = carry
        q_i, do_i = _rows(q, i * bq, bq, 3), _rows(d_out, i * bq, bq, 3)  # [b, kvh, g, bq, d]
        scores, allowed = tile_scores(q_i, k_j, i * bq, j * bk, kv_valid_j, slopes)
        p, ds = probs_and_dscores(scores, allowed, _rows(lse, i * bq, bq, 3), _rows(delta, i * bq, bq, 3),
                                  do_i, v_j)                                 # [b, kvh, g, bq, bk]
        dv_j += jnp.einsum("bhgqk,bhgqd->bhkd", p.astype(do_i.dtype), do_i, preferred_element_type=jnp.float32)
        dk_j += jnp.einsum("bhgqk,bhgqd->bhkd", ds.astype(q_i.dtype), q_i, preferred_element_type=jnp.float32)
        dq_i = jnp.einsum("bhgqk,bhkd->bhgqd", ds.astype(k_j.dtype), k_j, preferred_element_type=jnp.float32)
        return jax.lax.dynamic_update_slice_in_dim(dq, _rows(dq, i * bq, bq, 3) + dq_i, i * bq, axis=3), dk_j, dv_j

      zeros = jnp.zeros(k_j.shape, jnp.float32)
      dq, dk_j, dv_j = jax.lax.fori_loop(common.first_q_block_seeing(j, geo), num_q_blocks, query_block,
                                         (dq, zeros, zeros))
      put = lambda full, block: jax.lax.dynamic_update_slice_in_dim(full, block.astype(full.dtype), j * bk, axis=2)
      return dq, put(dk, dk_j * geo.scale), put(dv, dv_j)

    grads = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, k.dtype), jnp.zeros(v.shape, v.dtype))
    dq, dk, dv = jax.lax.fori_loop(0, k.shape[2] // bk, key_block, grads)
    return (dq * geo.scale).astype(q.dtype), dk, dv


def flash_attention(q, k, v, kv_mask, alibi_slopes=None, *, causal: bool, scale: float,
                    block_q=None, block_k=None, block_q_bwd=None, block_k_bwd=None):
  """Exact softmax attention. q [b, q_len, h, d]; k, v [b, kv_len, kvh, d]; kv_mask bool [b, kv_len];
  alibi_slopes f32 [h] or None. Returns [b, q_len, h, d] in q's dtype.

  The backward blocks default to the forward ones; lengths are padded to a multiple of both.
  """
  b, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  block_q = DEFAULT_BLOCKS["block_q"] if block_q is None else block_q
  block_k = DEFAULT_BLOCKS["block_k"] if block_k is None else block_k
  asked = dict(block_q=block_q, block_k=block_k, block_q_bwd=block_q_bwd or block_q, block_k_bwd=block_k_bwd or block_k)
  blocks = {}
  for name, value in asked.items():
    if value <= 0:
      raise ValueError(f"flash (chunked): {name} must be positive, got {value}")
    blocks[name] = min(value, kv_len if name.startswith("block_k") else q_len)   # short inputs: one block
  q, k, v, kv_valid, slopes = common.pad_inputs(
      q, k, v, kv_mask, alibi_slopes, head_dim=head_dim,
      q_multiple=math.lcm(blocks["block_q"], blocks["block_q_bwd"]),
      kv_multiple=math.lcm(blocks["block_k"], blocks["block_k_bwd"]))
  geometry = functools.partial(common.Geometry, q_len=q_len, kv_len=kv_len, causal=bool(causal),
                               scale=float(scale), use_alibi=alibi_slopes is not None)
  kernels = Kernels(fwd=geometry(block_q=blocks["block_q"], block_k=blocks["block_k"]),
                    bwd=geometry(block_q=blocks["block_q_bwd"], block_k=blocks["block_k_bwd"]))
  q_grouped = jnp.moveaxis(reference.group_heads(q, num_kv_heads), 1, 3)    # [b, kvh, g, q, d]
  heads_major = lambda x: jnp.swapaxes(x, 1, 2)                             # [b, kv, kvh, d] -> [b, kvh, kv, d]
  out = common.attention_with_vjp(kernels, q_grouped, heads_major(k), heads_major(v), kv_valid,
                                  slopes.reshape(num_kv_heads, -1))         # [b, kvh, g, q, d]
  return jnp.moveaxis(out, 3, 1).reshape(b, -1, num_heads, head_dim)[:, :q_len]
