"""Local attention: softmax inside non-overlapping contiguous blocks (the LRA "local" baseline).

    A(i) = { j : ⌊i'/B⌋ = ⌊j/B⌋ },   out_i = Σ_{j ∈ A(i)} softmax_j(q_i·k_j / sqrt(d)) v_j

with i' = i + (kv_len - q_len) the bottom-right aligned query position (causal: also j <= i').
Blocks are contiguous positions [mB, (m+1)B), not the strided groups of the LRA reference
code. A mask function (variants/masked.py) with tiles of B: self-attention visits only the
diagonal tiles (full ones: no mask is evaluated), so time and memory are O(n·B).
"""
from __future__ import annotations

from attention_zoo.contract import register
from attention_zoo.ops import softmax
from attention_zoo.options import Int
from attention_zoo.variants.masked import MaskAttention


@register("local", exact=True, supports_causal=True, supports_cross=True, complexity="O(n·b)",
          paper="Parmar et al. 2018, Image Transformer (arXiv:1802.05751); "
                "as the LRA baseline in Tay et al. 2021 (arXiv:2011.04006)",
          supports_alibi=True, supports_softcap=True, supports_segment_ids=True,
          supports_context_parallel=True, supports_sinks=True)
class LocalAttention(MaskAttention):
  OPTIONS = {"block_size": Int(50, minimum=1)}
  TEST_OPTIONS = dict(block_size=6)

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.block_size = self.options["block_size"]

  def mask_mod(self, q_len: int, kv_len: int):
    """(b, h, q, kv) -> whether query q sees key kv (the engine's mask function)."""
    block, offset = self.block_size, kv_len - q_len

    def allowed(b, h, q, kv):
      keep = (q + offset) // block == kv // block
      return keep & softmax.causal_allowed(q, kv, q_len, kv_len) if self.causal else keep
    return allowed

  def engine_options(self) -> dict:
    return dict(block_q=self.block_size, block_k=self.block_size)    # the diagonal tiles
