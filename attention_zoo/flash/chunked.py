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

An optional per-token log forget gate (FoX, Lin et al. 2025: scores s·qᵢ·kⱼ + cᵢ - cⱼ with
c = cumsum(log f) along the sequence, see attention_zoo.ops.forgetting_attention) runs on the
same loops: each tile adds its block of cᵢ - cⱼ to the scores (common.tile_scores' bias), and
the backward also sums the columns of dS, the gradient of -cⱼ (the rows of dS sum to 0: cᵢ is
constant along the softmax). c is kept as a pair of f32 (common.cumsum_two_float) so cᵢ - cⱼ
stays accurate at any length.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from attention_zoo import reference
from attention_zoo.base import pad_to_multiple
from attention_zoo.flash import common

# Picked on the 2-core CPU at 4K tokens (batch 1, 4 heads, head_dim 64, f32, forward+backward):
# 512 x 512 reached 0.81 of the f32 matmul rate (experiments/measure.py), against 0.78 for
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


def _decay_bias(c_rows, c_heads, j, block: int):
  """cᵢ - cⱼ of key block j: c_rows (hi, lo) [b, kvh, g·bq, 1] of the query block's rows, c_heads
  (hi, lo) [b, kvh, g, len] of every head. Returns [b, kvh, g·bq, bk] f32."""
  rows_per_head = c_rows[0].shape[2] // c_heads[0].shape[2]
  # [b, kvh, g, bk] -> [b, kvh, g·bq, bk]: row r belongs to head r // bq
  key_part = lambda c: jnp.repeat(_keys(c, j, block, axis=3), rows_per_head, axis=2)
  return (c_rows[0] - key_part(c_heads[0])) + (c_rows[1] - key_part(c_heads[1]))


def _gate_rows(cum_gate, block: int):
  """c (hi, lo) [b, kvh, g, len] -> (hi, lo) [len / block, b, kvh, g · block, 1]; None stays."""
  if cum_gate is None:
    return None
  return tuple(_to_blocks(c[..., None], block) for c in cum_gate)


def _keys(x, j, block: int, axis: int = 2):
  """Key block j of x along its key axis (k, v [b, kvh, kv_len, d]; kv_valid: axis 3)."""
  return jax.lax.dynamic_slice_in_dim(x, j * block, block, axis=axis)


@dataclasses.dataclass(frozen=True)
class Kernels:
  """Forward and backward loops for one static configuration (hashable).

  Layout: q, out [b, kvh, g, q_len, d]; k, v [b, kvh, kv_len, d]; kv_valid [b, 1, 1, kv_len];
  slopes [kvh, g]; lse [b, kvh, g, q_len, 1]; cum_gate None or FoX's c as (hi, lo)
  [b, kvh, g, len] (causal, q_len == kv_len).
  """
  fwd: common.Geometry
  bwd: common.Geometry

  def forward(self, q, k, v, kv_valid, slopes, cum_gate=None):
    geo = self.fwd
    bq, bk, group = geo.block_q, geo.block_k, q.shape[2]
    num_kv_blocks = k.shape[2] // bk
    slopes = _row_slopes(slopes, bq)
    init = jax.tree.map(lambda x: jnp.broadcast_to(x, q.shape[:2] + x.shape),
                        common.softmax_init(group * bq, q.shape[-1]))

    def query_block(args):
      i, q_i, c_i = args                                                     # q_i [b, kvh, g·bq, d]

      def key_block(j, state):
        kv_valid_j = _keys(kv_valid, j, bk, axis=3)
        bias = None if cum_gate is None else _decay_bias(c_i, cum_gate, j, bk)
        scores = common.tile_scores(q_i, _keys(k, j, bk), i * bq, j * bk, kv_valid_j, slopes,
                                    geo, bias)                               # [b, kvh, g·bq, bk]
        return common.softmax_update(state, scores, _keys(v, j, bk))

      state = jax.lax.fori_loop(0, common.kv_blocks_seen(i, geo, num_kv_blocks), key_block, init)
      out, lse = common.softmax_finish(state)
      return out.astype(q.dtype), lse

    num_q_blocks = q.shape[3] // bq
    out, lse = jax.lax.map(query_block, (jnp.arange(num_q_blocks), _to_blocks(q, bq),
                                         _gate_rows(cum_gate, bq)))
    return _from_blocks(out, group), _from_blocks(lse, group)

  def backward(self, q, k, v, kv_valid, slopes, out, lse, d_out, cum_gate=None):
    """-> (dq, dk, dv), and with a cum_gate also the gradient of c [b, kvh, g, len] f32."""
    geo = self.bwd
    bq, bk, group = geo.block_q, geo.block_k, q.shape[2]
    slopes = _row_slopes(slopes, bq)
    d_out = d_out.astype(q.dtype)
    delta = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1, keepdims=True)
    # [num q blocks, b, kvh, g·bq, d or 1]
    q, d_out, lse, delta = (_to_blocks(x, bq) for x in (q, d_out, lse, delta))
    c_rows = _gate_rows(cum_gate, bq)

    def key_block(j, grads):
      dq, dk, dv, dc = grads
      k_j, v_j, kv_valid_j = _keys(k, j, bk), _keys(v, j, bk), _keys(kv_valid, j, bk, axis=3)

      def query_block(i, carry):
        dq, dk_t, dv_t, dc_j = carry
        q_i, do_i = q[i], d_out[i]                                           # [b, kvh, g·bq, d]
        bias = None if cum_gate is None else _decay_bias(
            jax.tree.map(lambda c: c[i], c_rows), cum_gate, j, bk)
        scores = common.tile_scores(q_i, k_j, i * bq, j * bk, kv_valid_j, slopes, geo, bias)
        # p, ds [b, kvh, g·bq, bk]
        p, ds = common.tile_probs_and_dscores(scores, lse[i], delta[i], do_i, v_j)
        dv_t += common.dot_tn(do_i, p.astype(do_i.dtype))                   # [b, kvh, d, bk]
        dk_t += common.dot_tn(q_i, ds.astype(q_i.dtype))
        dq_i = common.dot_nn(ds.astype(k_j.dtype), k_j)                      # [b, kvh, g·bq, d]
        if cum_gate is not None:   # d(-cⱼ) = column sums of dS, per head
          dc_j -= jnp.sum(ds.reshape(*ds.shape[:2], group, bq, bk), axis=3)  # [b, kvh, g, bk]
        return dq.at[i].add(dq_i), dk_t, dv_t, dc_j

      zeros = jnp.zeros((*k_j.shape[:2], k_j.shape[3], bk), jnp.float32)      # [b, kvh, d, bk]
      dc_zeros = None if dc is None else jnp.zeros((*k_j.shape[:2], group, bk), jnp.float32)
      first = common.first_q_block_seeing(j, geo)
      dq, dk_t, dv_t, dc_j = jax.lax.fori_loop(first, q.shape[0], query_block,
                                               (dq, zeros, zeros, dc_zeros))
      put = lambda full, block_t: jax.lax.dynamic_update_slice_in_dim(
          full, jnp.swapaxes(block_t, 2, 3).astype(full.dtype), j * bk, axis=2)
      if dc is not None:
        dc = jax.lax.dynamic_update_slice_in_dim(dc, dc_j, j * bk, axis=3)
      return dq, put(dk, dk_t * geo.scale), put(dv, dv_t), dc

    grads = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, k.dtype),
             jnp.zeros(v.shape, v.dtype),
             None if cum_gate is None else jnp.zeros(cum_gate[0].shape, jnp.float32))
    dq, dk, dv, dc = jax.lax.fori_loop(0, k.shape[2] // bk, key_block, grads)
    dq = (_from_blocks(dq, group) * geo.scale).astype(q.dtype)
    return (dq, dk, dv) if cum_gate is None else (dq, dk, dv, dc)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gated_attention_with_vjp(kernels, q, k, v, kv_valid, slopes, log_gate):
  """common.attention_with_vjp with FoX's log gate f32 [b, kvh, g, len], which gets a gradient:
  c = cumsum(log f), so d log fₗ = Σ_{t >= l} d cₜ (a reverse cumsum)."""
  return _gated_fwd(kernels, q, k, v, kv_valid, slopes, log_gate)[0]


def _gated_fwd(kernels, q, k, v, kv_valid, slopes, log_gate):
  cum_gate = common.cumsum_two_float(log_gate, axis=3)
  out, lse = kernels.forward(q, k, v, kv_valid, slopes, cum_gate)
  return out, (q, k, v, kv_valid, slopes, out, lse, cum_gate)


def _gated_bwd(kernels, residuals, d_out):
  *inputs, cum_gate = residuals
  dq, dk, dv, dc = kernels.backward(*inputs, d_out, cum_gate)
  d_log_gate = jax.lax.cumsum(dc, axis=3, reverse=True)
  return dq, dk, dv, None, None, d_log_gate


_gated_attention_with_vjp.defvjp(_gated_fwd, _gated_bwd)


def flash_attention(q, k, v, kv_mask, alibi_slopes=None, *, causal: bool, scale: float,
                    block_q=None, block_k=None, block_q_bwd=None, block_k_bwd=None,
                    log_gate=None):
  """Exact softmax attention. q [b, q_len, h, d]; k, v [b, kv_len, kvh, d];
  kv_mask bool [b, kv_len]; alibi_slopes f32 [h] or None. Returns [b, q_len, h, d] in q's dtype.

  The backward blocks default to the forward ones; lengths are padded to a multiple of both.
  log_gate: None, or FoX's log forget gate log fₜ <= 0 [b, len, h] (causal, q_len == kv_len
  only), adding cᵢ - cⱼ with c = cumsum(log f) to the scores; it gets a gradient.
  """
  b, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  if log_gate is not None and (not causal or q_len != kv_len or alibi_slopes is not None):
    raise ValueError("flash (chunked): log_gate needs causal=True, q_len == kv_len and no ALiBi; "
                     f"got causal={causal}, q_len={q_len}, kv_len={kv_len}, "
                     f"alibi={alibi_slopes is not None}")
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
  q_multiple = math.lcm(blocks["block_q"], blocks["block_q_bwd"])
  kv_multiple = math.lcm(blocks["block_k"], blocks["block_k_bwd"])
  if log_gate is not None:   # one padded length: c is indexed by query and key blocks alike
    q_multiple = kv_multiple = math.lcm(q_multiple, kv_multiple)
  q, k, v, kv_valid, slopes = common.pad_inputs(
      q, k, v, kv_mask, alibi_slopes, head_dim=head_dim, q_multiple=q_multiple,
      kv_multiple=kv_multiple)
  geometry = functools.partial(common.Geometry, q_len=q_len, kv_len=kv_len, causal=bool(causal),
                               scale=float(scale), use_alibi=alibi_slopes is not None)
  kernels = Kernels(fwd=geometry(block_q=blocks["block_q"], block_k=blocks["block_k"]),
                    bwd=geometry(block_q=blocks["block_q_bwd"], block_k=blocks["block_k_bwd"]))
  q_grouped = jnp.moveaxis(reference.group_heads(q, num_kv_heads), 1, 3)    # [b, kvh, g, q, d]
  heads_major = lambda x: jnp.swapaxes(x, 1, 2)              # [b, kv, kvh, d] -> [b, kvh, kv, d]
  inputs = (q_grouped, heads_major(k), heads_major(v), kv_valid[:, None],
            slopes.reshape(num_kv_heads, -1))
  if log_gate is None:
    out = common.attention_with_vjp(kernels, *inputs)
  else:
    log_gate = pad_to_multiple(log_gate.astype(jnp.float32), q_multiple, axis=1)  # f = 1 past T
    gate_heads = jnp.moveaxis(reference.group_heads(log_gate[..., None], num_kv_heads), 1, 3)
    out = _gated_attention_with_vjp(kernels, *inputs, gate_heads[..., 0])   # [b, kvh, g, len]
  # out [b, kvh, g, q, d]
  return jnp.moveaxis(out, 3, 1).reshape(b, -1, num_heads, head_dim)[:, :q_len]
