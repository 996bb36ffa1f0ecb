"""Local attention: softmax inside non-overlapping contiguous blocks (the LRA "local" baseline).

    A(i) = { j : ⌊i'/B⌋ = ⌊j/B⌋ },   out_i = Σ_{j ∈ A(i)} softmax_j(q_i·k_j / sqrt(d)) v_j

with i' = i + (kv_len - q_len) the bottom-right aligned query position (causal: also j <= i').
Blocks are contiguous positions [mB, (m+1)B), not the strided groups of the LRA reference
code; a length that is not a multiple of B is padded inside and the padding masked.
Cost O(n·B) time and memory.
"""
from __future__ import annotations

from attention_zoo import blockwise, reference
from attention_zoo.base import Attention
from attention_zoo.options import Int
from attention_zoo.registry import register


@register("local", exact=True, supports_causal=True, supports_cross=True, complexity="O(n·b)",
          paper="Parmar et al. 2018, Image Transformer (arXiv:1802.05751); "
                "as the LRA baseline in Tay et al. 2021 (arXiv:2011.04006)",
          supports_alibi=True)
class LocalAttention(Attention):
  OPTIONS = {"block_size": Int(50, minimum=1)}

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.block_size = self.options["block_size"]

  def pattern(self, q_len: int, kv_len: int):
    q_pos, k_pos = blockwise.aligned_positions(q_len, kv_len)
    allowed = q_pos // self.block_size == k_pos // self.block_size
    if self.causal:
      allowed &= reference.causal_allowed(q_pos, k_pos, 0, 0)
    return allowed[None]

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic, alibi_slopes=None):
    frame = blockwise.Frame.aligned(q.shape[1], k.shape[1], self.block_size)
    return blockwise.blockwise_attention(
        q, k, v, frame, [blockwise.Neighbours((0,))], kv_mask=kv_mask, causal=self.causal,
        scale=self.scale, alibi_slopes=alibi_slopes, dropout_rate=self.dropout_rate,
        dropout_rng=self.dropout_rng(deterministic))
