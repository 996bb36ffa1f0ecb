r"""Forgetting Attention, the token mixer of the Forgetting Transformer (FoX; Lin et al. 2025,
"Forgetting Transformer: Softmax Attention with a Forget Gate", arXiv:2503.02130).

Causal softmax attention whose scores decay with a data-dependent forget gate, one per head:

    f_t = σ(w_fᵀ x_t + b_f),     c_t = Σ_{l <= t} log f_l,
    o_i = Σ_{j <= i} softmax_j(s · q_iᵀ k_j + c_i − c_j) v_j,     s = D^(-1/2) by default,

c_i − c_j = Σ_{j < l <= i} log f_l <= 0 down-weights key j by the product of the gates since it.
With f = 1 (log f = 0) this is plain causal softmax attention.

Engine: `attention_zoo.ops.flex.flex_attention` with flash's causal block mask
(`flash.chunked.block_mask`) and the gate as a score_mod adding cᵢ − cⱼ to each tile's scores, so
everything else (query-block map, key-block loop that skips the tiles above the diagonal, online
softmax, GQA with K/V never copied per query head, backward recomputing P from the log-sum-exp)
is the engine's; a separate op would repeat its loops. The engine's backward differentiates the
score_mod per tile, so c gets the column sums of dS (the gradient of −cⱼ; the rows of dS sum to
0 since cᵢ is constant along the softmax), and autodiff of the cumulative sum turns d c into
d log f. No [T, T] array is formed: memory is O(T · block) in both directions, f32 accumulation
for bf16/f16 inputs.

Precision: c is a float32 pair hi + lo from a compensated scan (`cumsum_two_float`),
and each tile forms (hi_i − hi_j) + (lo_i − lo_j). A plain f32 cumsum reaches -1e4 at long
lengths (one ulp = 1e-3 in every logit); a tile-local reference still cancels inside the
diagonal tiles (an error of one ulp of the tile's partial sums, up to block · |log f|); the
pair keeps c_i − c_j to a few ulps of itself at any length and in any tile. Measured at T = 2048
with log f uniform in [-2, -0.01] (c reaches about -2000), default tiles, against a float64
oracle (tests/ops/test_fox_op.py's long-sequence case): max output error 7.4e-7 with the pair,
1.2e-4 with a plain f32 cumsum.

Padding (mask False): a padded token is never attended, its output is 0, and its log f counts
as 0 (f = 1), so it does not decay the tokens around it: a left-padded sequence gives the same
outputs as the unpadded one.

Packed sequences (segment_ids): each run of equal ids is attended as if alone, through the
engine's segment block mask (`flex.with_segments`, on the runs: equal ids in separate runs are
separate sequences); c_i − c_j of a pair in one run sums only that run's gates.

Decoding: `forgetting_attention_step` evaluates the newest query densely against a cache of
(k, v, log f); see its docstring.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from attention_zoo.ops import flex, softmax, tiles
from attention_zoo.ops.flash import chunked
from attention_zoo.ops.segments import segment_runs


def check_causal_qkv(q, k, v, *, decode: bool, name: str):
  """ValueError naming the first of q, k, v whose shape does not fit causal self-attention
  (decode: q one token, k and v the caches) -> (batch, length, num_heads, num_kv_heads,
  head_dim). `name`: the op, for the messages."""
  if q.ndim != (3 if decode else 4):
    raise ValueError(f"q must be {'[B, H, D]' if decode else '[B, T, H, D]'}, got shape "
                     f"{q.shape}")
  batch, num_heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
  if k.ndim != 4 or k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim:
    raise ValueError(f"{'the caches' if decode else 'k and v'} must both be [B, T, KVH, D] with "
                     f"B={batch}, D={head_dim}; got {k.shape} and {v.shape}")
  length, num_kv_heads = k.shape[1], k.shape[2]
  if num_heads % num_kv_heads:
    raise ValueError(f"the {num_heads} query heads must be a multiple of the {num_kv_heads} "
                     "K/V heads")
  if not decode and q.shape[1] != length:
    raise ValueError(f"q and k must have the same length ({name} is causal self-attention), got "
                     f"{q.shape[1]} and {length}")
  return batch, length, num_heads, num_kv_heads, head_dim


def _check(q, k, v, log_f, mask, *, decode: bool, segment_ids=None):
  """ValueError naming the first argument whose shape does not fit q's."""
  batch, length, num_heads, _, _ = check_causal_qkv(q, k, v, decode=decode, name="FoX")
  if log_f.shape != (batch, length, num_heads):
    raise ValueError(f"log_f must be [B, T, H] = {(batch, length, num_heads)}, one gate per "
                     f"query head, got {log_f.shape}")
  if mask is not None and mask.shape != (batch, length):
    raise ValueError(f"mask must be bool [B, T] = {(batch, length)} or None, got {mask.shape}")
  if segment_ids is not None and (segment_ids.shape != (batch, length)
                                  or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
    raise ValueError(f"segment_ids must be int [B, T] = {(batch, length)} or None, got "
                     f"{segment_ids.dtype} {segment_ids.shape}")


def cumsum_two_float(x, axis: int):
  """Inclusive cumulative sum of f32 `x` along `axis` as an unevaluated pair hi + lo of f32.

  A plain f32 cumsum of log forget gates reaches -1e4 at long lengths, where one ulp is 1e-3:
  c_i - c_j of two nearby tokens would keep only 3-4 digits. The pair carries the rounding error
  of every addition (Knuth's TwoSum in a parallel scan), so (hi_i - hi_j) + (lo_i - lo_j) is
  accurate to a few f32 ulps of c_i - c_j itself, at any length.
  """
  x = x.astype(jnp.float32)
  return jax.lax.associative_scan(add_two_float, (x, jnp.zeros_like(x)), axis=axis)


def add_two_float(a, b):
  """(hi, lo) + (hi, lo) as a pair, the rounding error of hi + hi kept (Knuth's TwoSum)."""
  total = a[0] + b[0]
  b_part = total - a[0]
  error = (a[0] - (total - b_part)) + (b[0] - b_part)                     # exact: a + b - total
  lo = a[1] + b[1] + error
  hi = total + lo                                                          # renormalise
  return hi, lo - (hi - total)


def forgetting_attention(q, k, v, log_f, *, scale: float | None = None, mask=None,
                         segment_ids=None, block_size: int | None = None):
  """FoX attention. q [B, T, H, D]; k, v [B, T, KVH, D] (H % KVH == 0); log_f [B, T, H], the
  log forget gate (<= 0, e.g. jax.nn.log_sigmoid of the gate logits); mask bool [B, T] or None
  (True = real token); segment_ids int [B, T] or None (packed sequences: each run of equal ids
  attended as if alone). scale: None for D^(-1/2). block_size: queries and keys per tile,
  forward and backward (None: the flash chunked default). Returns [B, T, H, D] in q's dtype;
  differentiable in q, k, v and log_f.
  """
  _check(q, k, v, log_f, mask, decode=False, segment_ids=segment_ids)
  batch, length, _, head_dim = q.shape
  mask = jnp.ones((batch, length), bool) if mask is None else jnp.asarray(mask, bool)
  log_f = jnp.where(mask[..., None], log_f.astype(jnp.float32), 0.0)       # f = 1 at padding
  block_mask = chunked.block_mask(length, length, causal=True, block_q=block_size,
                                  block_k=block_size)
  if segment_ids is not None:
    runs = segment_runs(segment_ids)                                       # [B, T]
    block_mask = flex.with_segments(block_mask, runs, runs)
  out = flex.flex_attention(
      q, k, v, block_mask=block_mask, score_mod=_forget_gate_bias(log_f, k.shape[2]),
      scale=scale, kv_mask=mask)
  return jnp.where(mask[:, :, None, None], out, 0).astype(q.dtype)


def _forget_gate_bias(log_f, num_kv_heads: int):
  """flex score_mod adding cᵢ − cⱼ, c = cumsum(log f) [b, t, h] as the pair hi + lo, to a tile.

  Written for flex's tile index arrays (b = every batch row [B, 1, 1, 1], h the query head of
  each row [1, kvh, rows, 1], q [1, 1, rows, 1], kv one block's keys [1, 1, 1, bk]): cᵢ is a
  gather of one value per row; cⱼ, which varies along both axes of the tile, is gathered per
  (kv head, query head in its group, key) and spread over the rows of each head by a one-hot
  product (exact at HIGHEST precision), never by a gather of a whole tile. Indices past the
  length (the engine's padding, masked anyway) are clipped.
  """
  num_heads = log_f.shape[2]
  # (hi, lo), each [b, h, t]
  cum = tuple(jnp.moveaxis(c, 1, 2) for c in cumsum_two_float(log_f, axis=1))

  def score_mod(score, b, h, q, kv):
    return score + gate_difference(cum, cum, num_heads // num_kv_heads, b, h, q, kv)
  return score_mod


def gate_difference(query_cum, key_cum, group: int, b, h, q, kv):
  """cᵢ − cⱼ [B, kvh, rows, bk] of a tile from the pairs (hi, lo) of cumulative log forgets at
  the queries and at the keys, each [b, h, t] (the same array on one device; the ring's shard
  and the key block it holds under context parallelism)."""
  def differences(c_query, c_key):
    at_query = c_query[b, h, jnp.minimum(q, c_query.shape[2] - 1)]       # [B, kvh, rows, 1]
    batch, num_heads, length = c_key.shape
    per_group = c_key.reshape(batch, num_heads // group, group, length)
    at_key = jnp.take(per_group, kv[0, 0, 0], axis=3, mode="clip")          # [b, kvh, g, bk]
    if group > 1:
      # [1, kvh, rows, g]
      head_in_group = jax.nn.one_hot(h[..., 0] % group, group, dtype=jnp.float32)
      at_key = jnp.einsum("xkrg,bkgc->bkrc", head_in_group, at_key,
                          precision=jax.lax.Precision.HIGHEST)             # [b, kvh, rows, bk]
    return at_query - at_key

  return (differences(query_cum[0], key_cum[0]) + differences(query_cum[1], key_cum[1]))


def forgetting_attention_step(q, k_cache, v_cache, log_f_cache, kv_mask, *,
                              scale: float | None = None):
  """One decoding step: the newest token's query against the cache, a dense [S] evaluation.

  q [B, H, D]; k_cache, v_cache [B, S, KVH, D]; log_f_cache [B, S, H]: each cached token's
  log f, the newest token's included (the layer writes k, v and log f of the new token before
  the call); kv_mask bool [B, S]: True at the cached tokens up to the newest, False at padding
  and at slots not written yet. The logit of cached token j is s · qᵀ k_j + c_t − c_j with
  c_t − c_j = Σ_{l > j} log f_l over the real cached tokens, a reverse cumsum of terms <= 0
  (no cancellation, no running cumsum to keep). Returns [B, H, D] in q's dtype; equals
  `forgetting_attention`'s output at the newest position.
  """
  _check(q, k_cache, v_cache, log_f_cache, kv_mask, decode=True)
  batch, num_heads, head_dim = q.shape
  num_kv_heads = k_cache.shape[2]
  scale = head_dim ** -0.5 if scale is None else float(scale)
  log_f = jnp.where(kv_mask[..., None], log_f_cache.astype(jnp.float32), 0.0)    # [b, s, h]
  suffix = jax.lax.cumsum(log_f, axis=1, reverse=True)                   # Σ_{l >= j} log f_l
  decay = jnp.pad(suffix[:, 1:], ((0, 0), (0, 1), (0, 0)))                # Σ_{l > j}  [b, s, h]
  q_grouped = softmax.group_heads(q[:, None], num_kv_heads)[:, 0]       # [b, kvh, g, d]
  precision = tiles.matmul_precision(q.dtype)
  scores = jnp.einsum("bkgd,bskd->bkgs", q_grouped, k_cache, precision=precision,
                      preferred_element_type=jnp.float32) * scale          # [b, kvh, g, s]
  scores = scores + jnp.moveaxis(decay, 1, 2).reshape(scores.shape)
  weights = softmax.masked_softmax(scores, kv_mask[:, None, None, :])   # [b, kvh, g, s]
  out = jnp.einsum("bkgs,bskd->bkgd", weights.astype(v_cache.dtype), v_cache,
                   precision=precision, preferred_element_type=jnp.float32)  # [b, kvh, g, d]
  return out.reshape(batch, num_heads, head_dim).astype(q.dtype)
