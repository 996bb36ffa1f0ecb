r"""Gated DeltaProduct (Siems et al. 2025, arXiv:2502.10297): n_h delta-rule steps per token,
so that each token's transition is a product of n_h generalised Householder matrices (of rank
up to n_h rather than 1), after Gated DeltaNet's decay.

    S_{t,0} = α_t S_{t-1}
    S_{t,j} = (I - β_{t,j} k_{t,j} k_{t,j}ᵀ) S_{t,j-1} + β_{t,j} k_{t,j} v_{t,j}ᵀ,   j = 1..n_h
    S_t = S_{t,n_h},     o_t = S_tᵀ (d_k^{-1/2} q_t)

The layer as flash-linear-attention defines it (fla/layers/gated_deltaproduct.py): Gated
DeltaNet's (`attention_zoo.gated_deltanet`: its decay gate, output gate and d_v = 2·d_k) with
k, v and β projected n_h times per token (`num_householder`, default 2), all through the
kernel-4 conv and SiLU, each k_{t,j} L2-normalised; one q per token, read after its last step.
Chunkwise by `attention_zoo.ops.chunk_gated_delta_product` (n_h·T steps, `chunk_size` counts
steps), decoded token by token.

Where ours differs: allow_neg_eigval defaults to False (fla's layer: True), as on the other
delta mixers; fla's use_forget_gate=False (no decay) is not built. The rest as Gated DeltaNet's
"where ours differs".
"""
from __future__ import annotations

from attention_zoo import ops
from attention_zoo.contract import register_mixer
from attention_zoo.mixers import parts
from attention_zoo.mixers.deltanet import DeltaRuleLayer
from attention_zoo.mixers.gated_deltanet import GatedDeltaNet
from attention_zoo.options import Int


@register_mixer("gated_deltaproduct", complexity="O(n·n_h·(C·d + d²))",
                paper="Siems et al. 2025, DeltaProduct: Improving State-Tracking in Linear RNNs "
                      "via Householder Products (arXiv:2502.10297)",
                supports_segment_ids=True, supports_context_parallel=True)
class GatedDeltaProduct(DeltaRuleLayer):
  OPTIONS = {"num_householder": Int(2, minimum=1), **GatedDeltaNet.OPTIONS}
  # Chunks of 7 steps at the suite's length 20 (40 steps): several, some splitting a token's
  # two steps, and a partial last one.
  TEST_OPTIONS = dict(chunk_size=7)

  def __init__(self, *, rngs, **kwargs):
    # n_h (k, v, β) per token (the option, validated by the base before it is used); the
    # output gate SiLU(W_g x)
    steps = kwargs.get("num_householder", self.OPTIONS["num_householder"].default)
    super().__init__(rngs=rngs, steps=steps, **kwargs)
    self.decay_proj = parts.linear(self.emb_dim, self.num_heads, dtype=self.dtype, rngs=rngs)
    self.decay = parts.DecayGate(self.num_heads, a_range=(0.0, 16.0), rngs=rngs)

  def forward(self, x, mask, state, segment_ids=None):
    q, k, v, beta = self.delta_inputs(x, mask, state, segment_ids)     # k, v, β: n_h steps
    _, g = self.decay(self.decay_proj(x))                                        # [b, n, h]
    o, state = parts.recurrence(ops.chunk_gated_delta_product,
                                ops.recurrent_gated_delta_product, q, k, v, g, beta, mask=mask,
                                state=state, chunk_size=self.options["chunk_size"],
                                segment_ids=segment_ids)
    return parts.gated_output(self, x, o), state
