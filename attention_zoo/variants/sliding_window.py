"""Sliding-window attention: each query sees the keys within w positions of it.

    A(i) = { j : |i' - j| <= w }   (causal: i' - w <= j <= i'),
    out_i = Σ_{j ∈ A(i)} softmax_j(q_i·k_j / sqrt(d)) v_j

with i' = i + (kv_len - q_len) the bottom-right aligned query position. A mask function
(variants/masked.py): tiles of 128 x 128 visit only the key blocks within w of a query block, so
time and memory are O(n·w). The causal pattern depends only on j - i, so one-token decoding
against the base class's right-aligned KV cache is exact.
"""
from __future__ import annotations

from attention_zoo.contract import register
from attention_zoo.ops import softmax
from attention_zoo.options import Int
from attention_zoo.variants.masked import MaskAttention


@register("sliding_window", exact=True, supports_causal=True, supports_cross=True,
          complexity="O(n·w)",
          paper="Beltagy et al. 2020, Longformer: The Long-Document Transformer "
                "(arXiv:2004.05150), "
                "sliding window without global tokens",
          can_decode=True, supports_alibi=True, supports_softcap=True, supports_segment_ids=True,
          supports_context_parallel=True, supports_sinks=True)
class SlidingWindowAttention(MaskAttention):
  OPTIONS = {"window": Int(128, minimum=0)}
  TEST_OPTIONS = dict(window=3)

  @classmethod
  def state_size(cls, *, num_kv_heads, head_dim, seq_len, options, **dims) -> int:
    return 2 * min(options["window"], seq_len) * num_kv_heads * head_dim

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.window = self.options["window"]

  def mask_mod(self, q_len: int, kv_len: int):
    """(b, h, q, kv) -> whether query q sees key kv (the engine's mask function)."""
    return softmax.window_allowed(self.window, q_len, kv_len, self.causal)
