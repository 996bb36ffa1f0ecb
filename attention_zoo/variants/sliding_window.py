"""Sliding-window attention: each query sees the keys within w positions of it.

    A(i) = { j : |i' - j| <= w }   (causal: i' - w <= j <= i'),
    out_i = Σ_{j ∈ A(i)} softmax_j(q_i·k_j / sqrt(d)) v_j

with i' = i + (kv_len - q_len) the bottom-right aligned query position. A mask function on
`attention_zoo.flex`: tiles of 128 x 128 visit only the key blocks within w of a query block,
so time and memory are O(n·w). The causal pattern depends only on j - i, so one-token
decoding against the base class's right-aligned KV cache is exact.
"""
from __future__ import annotations

from attention_zoo import flex
from attention_zoo.contract import Attention, register
from attention_zoo.ops import softmax
from attention_zoo.options import Int


@register("sliding_window", exact=True, supports_causal=True, supports_cross=True,
          complexity="O(n·w)",
          paper="Beltagy et al. 2020, Longformer: The Long-Document Transformer "
                "(arXiv:2004.05150), "
                "sliding window without global tokens",
          can_decode=True, supports_alibi=True, supports_softcap=True, supports_segment_ids=True,
          supports_context_parallel=True)
class SlidingWindowAttention(Attention):
  OPTIONS = {"window": Int(128, minimum=0)}
  TEST_OPTIONS = dict(window=3)

  @classmethod
  def state_size(cls, *, num_kv_heads, head_dim, seq_len, options, **dims) -> int:
    return 2 * min(options["window"], seq_len) * num_kv_heads * head_dim

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.window = self.options["window"]

  def mask_mod(self, q_len: int, kv_len: int):
    """(b, h, q, kv) -> whether query q sees key kv (flex's mask function)."""
    return softmax.window_allowed(self.window, q_len, kv_len, self.causal)

  def pattern(self, q_len: int, kv_len: int):
    return flex.dense_mask(self.mask_mod(q_len, kv_len), None, q_len, kv_len)

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic, alibi_slopes=None,
             segment_ids=None):
    return flex.attend(self, q, k, v, self.mask_mod(q.shape[1], k.shape[1]), kv_mask=kv_mask,
                       deterministic=deterministic, alibi_slopes=alibi_slopes,
                       segment_ids=segment_ids)
