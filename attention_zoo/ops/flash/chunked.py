"""FlashAttention in plain JAX: `attention_zoo.ops.flex.flex_attention` with no mask, or the causal
block mask.

Flash is not a second engine: the online softmax over tiles, the query-block map, the loop over
the key blocks a query block visits (causal: the tiles above the diagonal are empty, so never
visited; those on it are partial and evaluate the causal rule; those below are full and evaluate
no mask), GQA with K/V never copied per query head and the backward recomputing P from the
log-sum-exp, key block by key block, are flex's. Soft-capping and ALiBi are flex's
`score_function`, packed sequences flex's `with_segments` (tiles between documents skipped).
Memory in
both directions is O(len · block) plus the inputs and outputs. Portable (any backend), and the
default on CPU.

The backward runs on the forward's tiles: block_q_bwd / block_k_bwd, tile sizes of the Pallas
kernels' backward, must be None or equal to block_q / block_k here.
"""
from __future__ import annotations

from attention_zoo.ops import flex

# Picked on the 2-core CPU at 4K tokens (batch 1, 4 heads, head_dim 64, f32, forward+backward):
# 512 x 512 reached 0.81 of the f32 matmul rate (experiments/common/device.py), against 0.78 for
# 512 x 256 and 1024 x 256, 0.70-0.72 for 256 x 512, 1024 x 512 and 512 x 1024, 0.5 for 256 x 256.
DEFAULT_BLOCKS = dict(block_q=512, block_k=512)


def block_mask(q_len: int, kv_len: int, *, causal: bool, block_q: int | None = None,
               block_k: int | None = None) -> flex.BlockMask:
  """Flash's pattern as flex block metadata: every key, or the zoo's (bottom-right) causal rule;
  block sizes None: DEFAULT_BLOCKS."""
  blocks = dict(block_q=DEFAULT_BLOCKS["block_q"] if block_q is None else block_q,
                block_k=DEFAULT_BLOCKS["block_k"] if block_k is None else block_k)
  if causal:
    return flex.create_block_mask(flex.causal_mask(q_len, kv_len), None, None, q_len, kv_len,
                                  **blocks)
  return flex.full_block_mask(q_len, kv_len, **blocks)


def flash_attention(q, k, v, kv_mask, alibi_slopes=None, *, causal: bool, scale: float,
                    softcap=None, segment_ids=None, block_q=None, block_k=None, block_q_bwd=None,
                    block_k_bwd=None, sinks=None):
  """Exact softmax attention. q [b, q_len, h, d]; k, v [b, kv_len, kvh, d];
  kv_mask bool [b, kv_len]; alibi_slopes f32 [h] or None; softcap: None or the cap c of
  c · tanh(s / c); segment_ids None or (int [b, q_len], int [b, kv_len]); sinks None or a sink
  logit per head f32 [h] (softmax.apply_sinks). Returns
  [b, q_len, h, d] in q's dtype.
  """
  for name, backward, forward in (("block_q_bwd", block_q_bwd, block_q),
                                  ("block_k_bwd", block_k_bwd, block_k)):
    if backward is not None and backward != forward:
      raise ValueError(f"flash (chunked): {name} must be None or the forward's "
                       f"{name[:-4]}={forward} (the chunked backward runs on the forward's tiles), "
                       f"got {backward}")
  q_len, kv_len = q.shape[1], k.shape[1]
  mask = block_mask(q_len, kv_len, causal=causal, block_q=block_q, block_k=block_k)
  if segment_ids is not None:
    mask = flex.with_segments(mask, *segment_ids)
  score_mod = flex.score_function(softcap_value=softcap, alibi_slopes=alibi_slopes, q_len=q_len,
                                  kv_len=kv_len)
  return flex.flex_attention(q, k, v, block_mask=mask, score_mod=score_mod, scale=scale,
                             kv_mask=kv_mask, sinks=sinks)
