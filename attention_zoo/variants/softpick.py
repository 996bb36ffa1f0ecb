r"""Softpick attention (Zuhri et al. 2025, "Softpick: No Attention Sink, No Massive Activations
with Rectified Softmax", arXiv:2504.20966): softmax replaced by a rectified function whose
weights need not sum to 1, so a head can attend to nothing instead of to a sink token.

    z_ij = q_i·k_j · scale,   w_ij = ReLU(e^{z_ij} − 1) / (Σ_l |e^{z_il} − 1| + ε),
    out_i = Σ_j w_ij v_j

over the keys query i sees (all, or j <= i causally). Tiled with a running shift and a running
denominator, as the online softmax (attention_zoo.ops.key_scan), so memory is linear.

Conventions, read from the authors' code (github.com/zaydzuhri/softpick-attention):
- a masked key contributes 0 to both sums, as their `torch.where(x.isfinite(), |·|, 0)` and
  their flash kernel's causal masking do; padding is a key mask here, so appended or changed
  padding changes nothing;
- ε (option eps, default 1e-6 as their flash kernel's hard-coded constant; their naive
  reference uses 1e-8) is added in the units of the definition, e^z − 1. Their stable form adds
  it after dividing by e^m (m the row's max score), i.e. ε·e^m in these units; the two differ
  only when the denominator is near ε, where the output is near 0 either way;
- the shift is c = max(0, m) rather than m, so e^{−c} <= 1 also for rows whose scores are all
  very negative (their e^{−m} overflows f32 below m = −88); the weights are the same;
- a row that sees no key gives 0 (the numerator is 0), with finite gradients.
No attention dropout (the weights are never formed as an array).
"""
from __future__ import annotations

from attention_zoo.contract import Attention, register
from attention_zoo.ops import key_scan
from attention_zoo.options import Float, Int


@register("softpick", exact=False, supports_causal=True, supports_cross=True,
          complexity="O(n²) time, O(n) memory",
          paper="Zuhri et al. 2025, Softpick: No Attention Sink, No Massive Activations with "
                "Rectified Softmax (arXiv:2504.20966)",
          can_decode=True, supports_dropout=False)
class SoftpickAttention(Attention):
  OPTIONS = {"eps": Float(key_scan.SOFTPICK_EPS, above=0),
             "block_q": Int(key_scan.DEFAULT_BLOCK, minimum=1),
             "block_k": Int(key_scan.DEFAULT_BLOCK, minimum=1)}
  # Tiles smaller than the suite's lengths: the running shift and denominator cross key blocks.
  TEST_OPTIONS = dict(block_q=8, block_k=4)
  WHY_NO_DROPOUT = "its tiled scan never forms the attention weights as an array to drop"

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic):
    del q_mask, deterministic   # the base zeroes masked query rows; no dropout
    return key_scan.softpick_attention(
        q, k, v, scale=self.scale, kv_mask=kv_mask, causal=self.causal, eps=self.options["eps"],
        block_q=self.options["block_q"], block_k=self.options["block_k"])
