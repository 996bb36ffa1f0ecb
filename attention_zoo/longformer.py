"""Longformer attention (Beltagy et al. 2020): a dilated sliding window plus global tokens.

    window(i) = { j : |i - j| <= w·δ and (i - j) mod δ = 0 }        (δ = dilation)
    A(i) = window(i) ∪ { j < g } ∪ { all j if i < g }                 (causal: ∩ { j <= i })
    out_i = Σ_{j ∈ A(i)} softmax_j(q_i·k_j / sqrt(d)) v_j

The first g positions (g = num_global_tokens, e.g. a CLS token) attend to every key and are
attended by every query. Non-global rows take one softmax over [global keys ∪ window keys],
the window part never counting a global key twice; global rows are a separate O(g·n) pass.
The window is computed by blocks: positions are regrouped by residue mod δ, where the dilated
window is a plain band, so time and memory are O(n·(w + g)). LRA's "window 512" is w = 256.
Self-attention only (global tokens are positions of one sequence).
"""
from __future__ import annotations

import numpy as np

from attention_zoo import blockwise, reference
from attention_zoo.base import Attention, ceil_div
from attention_zoo.registry import register


@register("longformer", exact=True, supports_causal=True, supports_cross=False, complexity="O(n·(w + g))",
          paper="Beltagy et al. 2020, Longformer: The Long-Document Transformer (arXiv:2004.05150)",
          supports_alibi=True)
class LongformerAttention(Attention):
  OPTIONS = {"window": 256, "dilation": 1, "num_global_tokens": 1}
  TEST_OPTIONS = {"window": 2, "dilation": 2, "num_global_tokens": 2}

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.window = blockwise.check_int("longformer", "window", self.options["window"], 0)
    self.dilation = blockwise.check_int("longformer", "dilation", self.options["dilation"], 1)
    self.num_global = blockwise.check_int("longformer", "num_global_tokens", self.options["num_global_tokens"], 0)

  def pattern(self, q_len: int, kv_len: int):
    if q_len != kv_len:
      raise ValueError(f"longformer is self-attention only: q_len ({q_len}) != kv_len ({kv_len})")
    i, j = blockwise.aligned_positions(q_len, kv_len)
    window = (np.abs(i - j) <= self.window * self.dilation) & ((i - j) % self.dilation == 0)
    allowed = window | (j < self.num_global) | (i < self.num_global)
    if self.causal:
      allowed &= reference.causal_allowed(i, j, 0, 0)
    return allowed[None]

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic, alibi_slopes=None):
    length, window, dilation, num_global = q.shape[1], self.window, self.dilation, self.num_global
    # Each residue class mod δ holds ceil(n/δ) positions; blocks of w of them reach w on each side.
    block = max(1, min(window, ceil_div(length, dilation)))
    reach = ceil_div(window, block)
    offsets = tuple(range(-reach, 1 if self.causal else reach + 1))

    # global keys are left to the global segment, so none counts twice
    in_window = blockwise.Band(window * dilation, stride=dilation, first_key=num_global)
    global_tokens = np.arange(min(num_global, length))
    return blockwise.blockwise_attention(
        q, k, v, blockwise.Frame.interleaved(length, block, dilation),
        [blockwise.Neighbours(offsets, in_window), blockwise.SharedKeys(global_tokens)],
        kv_mask=kv_mask, causal=self.causal, scale=self.scale, alibi_slopes=alibi_slopes,
        dropout_rate=self.dropout_rate, dropout_rng=self.dropout_rng(deterministic),
        global_rows=None if self.causal else global_tokens)   # causal global rows see only global keys
