r"""PaTH attention (Yang et al. 2025, "PaTH Attention: Position Encoding via Accumulating
Householder Transformations", arXiv:2505.16381): causal softmax attention whose query-key
bilinear form is the product of the data-dependent Householder-like transforms between them.

    H_t = I − β_t w_t w_tᵀ        (w_t a unit vector, β_t in (0, 2); per K/V head)
    s_ij = scale · q_iᵀ H_i H_{i−1} ⋯ H_{j+1} k_j    (j <= i; j = i: q_iᵀ k_i)
    o_i = Σ_{j <= i} softmax_j(s_ij) v_j

With a forget gate (the paper's PaTH-FoX), s_ij + c_i − c_j, c_t = Σ_{l<=t} log f_l
per query head, as FoX (ops/forgetting_attention.py; the same float32-pair cumulative sum).

The product runs over the tokens after the key up to and including the query (the convention
of the paper and of flash-linear-attention's kernel and decoding: when token t arrives, every
key before it is multiplied by H_t). With w, β from the layer input; the op takes them given.

Blockwise algorithm (the paper's). Cut the sequence into blocks of C tokens. Inside a
block (positions 1..C, W [C, d] the rows w_t), the UT transform of the delta rule gives every
partial product at once: with T = (I + stril(diag(β) W Wᵀ))⁻¹ diag(β) (lower triangular; the
inverse is `engine.unit_lower_inverse`, the delta rule's chunk form's),

    H_i ⋯ H_{j+1} = I − Σ_{j < b <= a <= i} T_ab w_a w_bᵀ

(a contiguous diagonal sub-block of a triangular inverse is the inverse of the sub-block). So,
per block, all [C, C] or [C, d]:

    S_intra = Q Kᵀ − tril(Q Wᵀ) · T · stril(W Kᵀ)          (tril: a <= i; stril: b > j)
    Q̃ = Q − tril(Q Wᵀ) T W         rows q̃_iᵀ = q_iᵀ H_i ⋯ H_first     (query to block start)
    K̃ = K − (T stril(W Kᵀ))ᵀ W     rows k̃_j = H_last ⋯ H_{j+1} k_j    (key to block end)
    q̂ᵀ P = q̂ᵀ − (q̂ᵀ Wᵀ)(T W)     P = H_last ⋯ H_first, never formed

and for a key in an earlier block c, s_ij = scale · q̃_iᵀ P_{c_q−1} ⋯ P_{c+1} k̃_j. Each query
block runs the online softmax of FlashAttention (`tiles.softmax_update`) first over its own
block (S_intra, causal), then over the earlier key blocks from the nearest back, carrying q̂
(q̃, then q̂ ← q̂ P_c after each key block c). Key blocks after the query's are skipped
(`lax.cond`). Cost O(T² d) time like attention; memory O(T (C + d)): no [T, T] array. The
N(N − 1)/2 tile steps run one after another (query blocks by `lax.map`, key blocks by
`lax.scan`), each on one C x C tile per head: on an accelerator at long lengths that is likely
bound by per-step overhead rather than arithmetic (not measured here; processing the query
blocks in parallel would need a hand-written backward to keep memory linear).

Gradients: JAX differentiates the loops; each query block's pass is rematerialised
(`jax.checkpoint`), so the backward keeps one query block's tiles at a time and memory stays
linear in T (the blockwise form is checked against a float64 dense oracle, forward and
gradients, in tests/mixers/test_path.py). Everything is computed in float32 whatever the input
dtype (products of many transforms would lose precision in bf16).

GQA: the transforms belong to the K/V heads (w, β [B, T, KVH]); the query heads of a group share
them, as in flash-linear-attention. Padding (mask False): the token's transform is the identity
(β = 0), its key is not attended, its output is 0, so a left-padded sequence gives the
unpadded outputs. Packed sequences (segment_ids): pairs in different runs are masked; a pair in
one run multiplies only that run's transforms, so each run is attended as if alone.

Decoding (`path_decode_step`): the cache holds every key already transformed up to the newest
token, k̂_j = H_t ⋯ H_{j+1} k_j. When token t arrives every cached key is multiplied by H_t,
k̂ ← k̂ − β_t (k̂·w_t) w_t: O(S d) per step and K/V head, then the new key is appended as is and
the query attends densely over the cache (with the gate: FoX's step over the cache).

Where ours differs from flash-linear-attention (fla/ops/path_attn, Triton): a pure-JAX blockwise
form differentiated by JAX through rematerialised loops (fla: hand-written backward kernels
with their own block products); the passed block's transform applied as q̂ − (q̂ Wᵀ)(T W)
without forming it; any head_dim (fla: 16, 32 or 64); padding by mask and packing by segment
ids (fla: cu_seqlens); the gate's cumulative sum as a float32 pair (fla: one float32 sum).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from attention_zoo.ops import softmax, tiles
from attention_zoo.ops.blocks import ceil_div
from attention_zoo.ops.engine import unit_lower_inverse
from attention_zoo.ops.forgetting_attention import (check_causal_qkv, cumsum_two_float,
                                                     forgetting_attention_step)
from attention_zoo.ops.segments import segment_runs

DEFAULT_BLOCK_SIZE = 64


def _einsum(spec, *operands):
  """float32 einsum at full precision (the transforms' products are sensitive to rounding)."""
  return jnp.einsum(spec, *operands, precision=jax.lax.Precision.HIGHEST,
                    preferred_element_type=jnp.float32)


def _check(q, k, v, w, beta, mask, *, decode: bool, segment_ids=None, log_f=None):
  """ValueError naming the first argument whose shape does not fit q's (decode: k and v are the
  caches)."""
  batch, length, num_heads, num_kv_heads, head_dim = check_causal_qkv(q, k, v, decode=decode,
                                                                      name="PaTH")
  per_token = (batch,) if decode else (batch, length)
  if w.shape != per_token + (num_kv_heads, head_dim):
    raise ValueError(f"w must be {per_token + (num_kv_heads, head_dim)}, one unit vector per "
                     f"K/V head and token, got {w.shape}")
  if beta.shape != per_token + (num_kv_heads,):
    raise ValueError(f"beta must be {per_token + (num_kv_heads,)}, one per K/V head and token, "
                     f"got {beta.shape}")
  if mask is not None and mask.shape != per_token:
    raise ValueError(f"mask must be bool {per_token} or None, got {mask.shape}")
  if log_f is not None and log_f.shape != per_token + (num_heads,):
    raise ValueError(f"log_f must be {per_token + (num_heads,)}, one gate per query head, or "
                     f"None, got {log_f.shape}")
  if segment_ids is not None and (segment_ids.shape != per_token
                                  or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
    raise ValueError(f"segment_ids must be int {per_token} or None, got {segment_ids.dtype} "
                     f"{segment_ids.shape}")


def _blocks(x, num_blocks: int, block: int):
  """[B, T, KVH, ...] -> [N, B, KVH, C, ...], T padded with zeros to N·C."""
  pad = num_blocks * block - x.shape[1]
  x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  x = x.reshape(x.shape[0], num_blocks, block, *x.shape[2:])
  return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)


def path_attention(q, k, v, w, beta, *, log_f=None, scale: float | None = None, mask=None,
                   segment_ids=None, block_size: int = DEFAULT_BLOCK_SIZE):
  """PaTH attention, blockwise. q [B, T, H, D]; k, v [B, T, KVH, D] (H % KVH == 0); w
  [B, T, KVH, D], unit vectors (the op does not normalise them); beta [B, T, KVH] (the paper's
  range (0, 2); any value works); log_f [B, T, H] or None: PaTH-FoX's log forget gate per query
  head (<= 0), adding c_i − c_j, c = cumsum(log f), to the scores as FoX does; mask bool [B, T]
  or None (True = real token; a padded token's gate counts as f = 1); segment_ids int
  [B, T] or None (packed sequences: each run of equal ids attended as if alone); scale None for
  D^(-1/2); block_size C, tokens per block. Returns [B, T, H, D] in q's dtype, differentiable in
  q, k, v, w, beta and log_f.
  """
  _check(q, k, v, w, beta, mask, decode=False, segment_ids=segment_ids, log_f=log_f)
  if block_size < 1:
    raise ValueError(f"block_size must be a positive number of tokens, got {block_size}")
  B, T, H, D = q.shape
  KVH = k.shape[2]
  G = H // KVH
  scale = D ** -0.5 if scale is None else float(scale)
  mask = jnp.ones((B, T), bool) if mask is None else jnp.asarray(mask, bool)
  C = min(block_size, T)
  N = ceil_div(T, C)
  f32 = lambda x: x.astype(jnp.float32)
  beta = jnp.where(mask[..., None], f32(beta), 0.0)                        # H_t = I at padding
  qb = _blocks(f32(q).reshape(B, T, KVH, G, D), N, C)                      # [N, B, KVH, C, G, D]
  qb = jnp.swapaxes(qb, 3, 4)                                              # [N, B, KVH, G, C, D]
  kb, vb, wb = (_blocks(f32(x), N, C) for x in (k, v, w))                  # [N, B, KVH, C, D]
  betab = _blocks(beta, N, C)                                              # [N, B, KVH, C]
  key_mask = _blocks(mask[:, :, None], N, C)[:, :, 0]                      # [N, B, C]
  runs = jnp.zeros((B, T), jnp.int32) if segment_ids is None else segment_runs(segment_ids)
  runs = _blocks(runs[:, :, None], N, C)[:, :, 0]                          # [N, B, C]

  if log_f is not None:   # c = cumsum(log f) as a float32 pair hi + lo (FoX's precision)
    log_f = jnp.where(mask[..., None], f32(log_f), 0.0)                    # f = 1 at padding
    cum = tuple(jnp.swapaxes(_blocks(c.reshape(B, T, KVH, G), N, C), 3, 4)
                for c in cumsum_two_float(log_f, axis=1))                  # [N, B, KVH, G, C]

  def gate_bias(c_q, c_k):
    """c_i − c_j [B, KVH, G·C, C] of query block c_q's rows and key block c_k's keys."""
    if log_f is None:
      return 0.0
    difference = sum(c[c_q][..., :, None] - c[c_k][..., None, :] for c in cum)
    return difference.reshape(B, KVH, G * C, C)

  def same_run(c_q, c_k):
    """bool [B, 1, G·C, C]: query row (g, i) of block c_q and key j of block c_k in one run."""
    same = runs[c_q][:, :, None] == runs[c_k][:, None, :]                  # [B, C, C]
    return jnp.tile(same, (1, G, 1))[:, None]

  below = jnp.tril(jnp.ones((C, C), bool), -1)                             # b > j (strict)
  on_or_below = jnp.tril(jnp.ones((C, C), bool))                           # a <= i
  gram = _einsum("nzhad,nzhcd->nzhac", wb, wb)                             # [N, B, KVH, C, C]
  T_ut = unit_lower_inverse(jnp.where(below, betab[..., :, None] * gram, 0.0))
  T_ut = T_ut * betab[..., None, :]                                        # (I + L)⁻¹ diag(β)
  TW = _einsum("nzhab,nzhbd->nzhad", T_ut, wb)                             # T W [.., C, D]
  WK = jnp.where(below, _einsum("nzhbd,nzhjd->nzhbj", wb, kb), 0.0)        # stril(W Kᵀ)
  TWK = _einsum("nzhab,nzhbj->nzhaj", T_ut, WK)                            # T stril(W Kᵀ)
  QW = jnp.where(on_or_below, _einsum("nzhgid,nzhad->nzhgia", qb, wb), 0.0)  # tril(Q Wᵀ)
  intra = (_einsum("nzhgid,nzhjd->nzhgij", qb, kb)
           - _einsum("nzhgia,nzhaj->nzhgij", QW, TWK))                     # [N, B, KVH, G, C, C]
  q_start = qb - _einsum("nzhgia,nzhad->nzhgid", QW, TW)                   # Q̃ [N, B, KVH, G, C, D]
  k_end = kb - _einsum("nzhaj,nzhad->nzhjd", TWK, wb)                      # K̃ [N, B, KVH, C, D]

  rows = lambda x: x.reshape(*x.shape[:2], G * C, x.shape[-1])             # [B, KVH, G·C, ·]

  @jax.checkpoint
  def query_block(c_q, q_start_c, intra_c):
    """Output rows [B, KVH, G·C, D] of query block c_q."""
    allowed = (jnp.tile(on_or_below, (G, 1)) & key_mask[c_q][:, None, None, :]
               & same_run(c_q, c_q))                                       # [B, 1, G·C, C]
    scores = (rows(intra_c) * scale + gate_bias(c_q, c_q)) * tiles.LOG2E       # [B, KVH, G·C, C]
    scores = jnp.where(allowed, scores, softmax.MASK_VALUE)
    state = tiles.softmax_update(
        (jnp.zeros((B, KVH, G * C, D)), jnp.full((B, KVH, G * C, 1), softmax.MASK_VALUE),
         jnp.zeros((B, KVH, G * C, 1))), scores, vb[c_q])

    def earlier_block(carry, step):
      c_k = c_q - 1 - step

      def attend(carry):
        q_hat, state = carry
        scores = _einsum("bhrd,bhjd->bhrj", q_hat, k_end[c_k]) * scale     # [B, KVH, G·C, C]
        scores = (scores + gate_bias(c_q, c_k)) * tiles.LOG2E
        allowed = key_mask[c_k][:, None, None, :] & same_run(c_q, c_k)
        scores = jnp.where(allowed, scores, softmax.MASK_VALUE)
        state = tiles.softmax_update(state, scores, vb[c_k])
        q_hat = q_hat - _einsum("bhra,bhad->bhrd", _einsum("bhrd,bhad->bhra", q_hat, wb[c_k]),
                                TW[c_k])                                   # q̂ᵀ P_{c_k}
        return q_hat, state
      return jax.lax.cond(c_k >= 0, attend, lambda carry: carry, carry), None

    (_, state), _ = jax.lax.scan(earlier_block, (rows(q_start_c), state), jnp.arange(N - 1))
    return tiles.softmax_finish(state)[0]

  out = jax.lax.map(lambda xs: query_block(*xs), (jnp.arange(N), q_start, intra))
  out = out.reshape(N, B, KVH, G, C, D).transpose(1, 0, 4, 2, 3, 5).reshape(B, N * C, H, D)[:, :T]
  return jnp.where(mask[:, :, None, None], out, 0).astype(q.dtype)


def householder_update(keys, w, beta):
  """Every cached key multiplied by the new token's transform: k̂ − β (k̂·w) w. keys
  [B, S, KVH, D]; w [B, KVH, D]; beta [B, KVH] (0 leaves the keys as they are). O(S·D) per K/V
  head. Returns keys' shape and dtype."""
  projection = _einsum("bskd,bkd->bsk", keys.astype(jnp.float32), w.astype(jnp.float32))
  update = (beta.astype(jnp.float32)[:, None] * projection)[..., None] * w[:, None].astype(
      jnp.float32)
  return (keys - update).astype(keys.dtype)


def path_decode_step(q, k, v, w, beta, cache, *, log_f=None, scale: float | None = None,
                     mask=None):
  """One token of decoding. q [B, H, D]; k, v, w [B, KVH, D]; beta [B, KVH]; log_f [B, H] or
  None (PaTH-FoX's gate); mask bool [B] or None (False: a padded token, which transforms
  nothing, is not attended and outputs 0). cache: "key", "value" [B, S, KVH, D] (the keys
  transformed up to the previous token), "filled" bool [B, S], "index" (this token's slot, int
  scalar), and with log_f "log_f" [B, S, H]. Returns (out [B, H, D] in q's dtype, the cache with
  this token's transform applied to the cached keys, its key, value (and gate) written at
  index, and index + 1). The gated step is FoX's (`forgetting_attention_step`) over the
  transformed keys, as flash-linear-attention's decoding.
  """
  key_cache, value_cache = cache["key"], cache["value"]
  _check(q, key_cache, value_cache, w, beta, mask, decode=True, log_f=log_f)
  token_shape = key_cache.shape[:1] + key_cache.shape[2:]
  if k.shape != token_shape or v.shape != token_shape:
    raise ValueError(f"k and v of the new token must both be [B, KVH, D] = {token_shape}, got "
                     f"{k.shape} and {v.shape}")
  if (log_f is None) != ("log_f" not in cache):
    raise ValueError("pass log_f with a cache that has a \"log_f\" entry, and only then")
  mask = jnp.ones(q.shape[:1], bool) if mask is None else jnp.asarray(mask, bool)
  index = cache["index"]
  write = lambda buffer, new: jax.lax.dynamic_update_slice_in_dim(
      buffer, new[:, None].astype(buffer.dtype), index, axis=1)
  keys = householder_update(key_cache, w, jnp.where(mask[:, None], beta, 0.0))
  cache = {**cache, "key": write(keys, k), "value": write(value_cache, v),
           "filled": write(cache["filled"], mask), "index": index + 1}
  if log_f is None:
    out = softmax.masked_softmax_attention(q[:, None], cache["key"], cache["value"],
                                           kv_mask=cache["filled"], scale=scale)[:, 0]
  else:
    cache["log_f"] = write(cache["log_f"], log_f)
    out = forgetting_attention_step(q, cache["key"], cache["value"], cache["log_f"],
                                    cache["filled"], scale=scale)          # [B, H, D]
  return jnp.where(mask[:, None, None], out, 0).astype(q.dtype), cache
