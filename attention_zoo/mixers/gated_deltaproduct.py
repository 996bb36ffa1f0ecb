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
from attention_zoo.mixers import gated_deltanet
from attention_zoo.options import Int


@register_mixer("gated_deltaproduct", complexity="O(n·n_h·(C·d + d²))",
                paper="Siems et al. 2025, DeltaProduct: Improving State-Tracking in Linear RNNs "
                      "via Householder Products (arXiv:2502.10297)",
                supports_segment_ids=True, supports_context_parallel=True)
class GatedDeltaProduct(gated_deltanet.GatedDeltaNet):
  OPTIONS = {"num_householder": Int(2, minimum=1), **gated_deltanet.GatedDeltaNet.OPTIONS}
  # Chunks of 7 steps at the suite's length 20 (40 steps): several, some splitting a token's
  # two steps, and a partial last one.
  TEST_OPTIONS = dict(chunk_size=7)
  CHUNK_OP = staticmethod(ops.chunk_gated_delta_product)
  STEP_OP = staticmethod(ops.recurrent_gated_delta_product)
  STEP_AXIS = True
