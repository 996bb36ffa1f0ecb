"""Sliding-window attention: each query sees the keys within w positions of it.

    A(i) = { j : |i' - j| <= w }   (causal: i' - w <= j <= i'),
    out_i = Σ_{j ∈ A(i)} softmax_j(q_i·k_j / sqrt(d)) v_j

with i' = i + (kv_len - q_len) the bottom-right aligned query position. Computed by blocks of
B = w queries against their own and neighbouring key blocks (3 blocks, causal 2), so time and
memory are O(n·w). The causal pattern depends only on j - i, so one-token decoding against the
base class's right-aligned KV cache is exact.
"""
from __future__ import annotations

import numpy as np

from attention_zoo import blockwise, reference
from attention_zoo.base import Attention, ceil_div
from attention_zoo.options import Int
from attention_zoo.registry import register


@register("sliding_window", exact=True, supports_causal=True, supports_cross=True,
          complexity="O(n·w)",
          paper="Beltagy et al. 2020, Longformer: The Long-Document Transformer "
                "(arXiv:2004.05150), "
                "sliding window without global tokens",
          can_decode=True, supports_alibi=True)
class SlidingWindowAttention(Attention):
  OPTIONS = {"window": Int(128, minimum=0)}

  @classmethod
  def state_size(cls, *, num_kv_heads, head_dim, seq_len, options, **dims) -> int:
    return 2 * min(options["window"], seq_len) * num_kv_heads * head_dim

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.window = self.options["window"]

  def pattern(self, q_len: int, kv_len: int):
    q_pos, k_pos = blockwise.aligned_positions(q_len, kv_len)
    allowed = np.abs(q_pos - k_pos) <= self.window
    if self.causal:
      allowed &= reference.causal_allowed(q_pos, k_pos, 0, 0)
    return allowed[None]

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic, alibi_slopes=None):
    # Blocks of w queries (fewer when the sequence is shorter) reach w positions on each side
    # with ceil(w / B) neighbouring key blocks.
    block = max(1, min(self.window, max(q.shape[1], k.shape[1])))
    reach = ceil_div(self.window, block)
    offsets = tuple(range(-reach, 1 if self.causal else reach + 1))
    return blockwise.blockwise_attention(
        q, k, v, blockwise.Frame.aligned(q.shape[1], k.shape[1], block),
        [blockwise.Neighbours(offsets, blockwise.Band(self.window))], kv_mask=kv_mask,
        causal=self.causal, scale=self.scale, alibi_slopes=alibi_slopes,
        dropout_rate=self.dropout_rate,
        dropout_rng=self.dropout_rng(deterministic))
