"""Sparse Transformer, fixed pattern (Child et al. 2019): a query sees its own block of B
positions and the last c positions ("summaries") of every block.

    A(i) = { j : ⌊i'/B⌋ = ⌊j/B⌋ } ∪ { j : j mod B >= B - c }   (causal: ∩ { j <= i' })
    out_i = Σ_{j ∈ A(i)} softmax_j(q_i·k_j / sqrt(d)) v_j

with i' = i + (kv_len - q_len) the bottom-right aligned query position. Bidirectional for
encoders, causal (own block up to i', summaries of earlier blocks) for decoders; the LRA
reference code was causal even for classification and built a dense n x n mask.

Each query sees B + c·n/B keys, so time is O(n·(B + c·n/B)): with fixed B and c the summaries
make it quadratic, about c/B of full attention (Child et al. take B ~ sqrt(n)). Memory stays
O(n·B + n·c): query blocks go through a checkpointed `lax.map`, `query_chunk` rows at a time.
"""
from __future__ import annotations

import numpy as np

from attention_zoo import blockwise, reference
from attention_zoo.base import Attention, ceil_div
from attention_zoo.options import Int
from attention_zoo.registry import register


@register("sparse_transformer", exact=True, supports_causal=True, supports_cross=True,
          complexity="O(n·(b + c·n/b))",
          paper="Child et al. 2019, Generating Long Sequences with Sparse Transformers "
                "(arXiv:1904.10509)",
          supports_alibi=True)
class SparseTransformerAttention(Attention):
  # query_chunk: query rows per step of the loop over query blocks (bounds score memory).
  OPTIONS = {"block_size": Int(50, minimum=1), "num_summary": Int(10, minimum=1),
             "query_chunk": Int(512, minimum=1)}

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.block_size, self.num_summary, self.query_chunk = (
        self.options[k] for k in ("block_size", "num_summary", "query_chunk"))
    if self.num_summary > self.block_size:
      raise self.option_error("num_summary", f"an integer <= block_size ({self.block_size}) "
                                             f"(the summaries are the last positions of a block)")

  def pattern(self, q_len: int, kv_len: int):
    q_pos, k_pos = blockwise.aligned_positions(q_len, kv_len)
    block = self.block_size
    allowed = (q_pos // block == k_pos // block) | (k_pos % block >= block - self.num_summary)
    if self.causal:
      allowed &= reference.causal_allowed(q_pos, k_pos, 0, 0)
    return allowed[None]

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic, alibi_slopes=None):
    block = self.block_size
    summaries = np.flatnonzero(np.arange(k.shape[1]) % block >= block - self.num_summary)
    # The own block's summaries are in the first segment already.
    segments = [blockwise.Neighbours((0,)),
                blockwise.SharedKeys(summaries, blockwise.OtherBlock(block))]
    return blockwise.blockwise_attention(
        q, k, v, blockwise.Frame.aligned(q.shape[1], k.shape[1], block), segments,
        kv_mask=kv_mask, causal=self.causal, scale=self.scale, alibi_slopes=alibi_slopes,
        dropout_rate=self.dropout_rate, dropout_rng=self.dropout_rng(deterministic),
        query_blocks_per_step=ceil_div(self.query_chunk, block))
