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

import jax.numpy as jnp

from attention_zoo import ops
from attention_zoo.contract import Mixer, register_mixer
from attention_zoo.mixers import parts
from attention_zoo.mixers.gated_deltanet import GatedDeltaNet
from attention_zoo.options import Int


@register_mixer("gated_deltaproduct", complexity="O(n·n_h·(C·d + d²))",
                paper="Siems et al. 2025, DeltaProduct: Improving State-Tracking in Linear RNNs "
                      "via Householder Products (arXiv:2502.10297)",
                supports_segment_ids=True)
class GatedDeltaProduct(Mixer):
  OPTIONS = {"num_householder": Int(2, minimum=1), **GatedDeltaNet.OPTIONS}
  # Chunks of 7 steps at the suite's length 20 (40 steps): several, some splitting a token's
  # two steps, and a partial last one.
  TEST_OPTIONS = dict(chunk_size=7)
  state_size = classmethod(parts.key_value_state_size)

  def __init__(self, *, rngs, **kwargs):
    super().__init__(rngs=rngs, **kwargs)
    self.d_k, self.d_v = parts.checked_dims(self)
    h, kvh, d_k, d_v = self.num_heads, self.num_kv_heads, self.d_k, self.d_v
    emb, dtype, steps = self.emb_dim, self.dtype, self.options["num_householder"]
    self.qkv, self.conv = parts.qkv_projection(   # q | n_h k's | n_h v's
        emb, h * d_k + steps * kvh * (d_k + d_v), self.options, dtype=dtype, rngs=rngs)
    self.beta_proj = parts.linear(emb, steps * h, dtype=dtype, rngs=rngs)        # n_h w_β's
    self.gate_proj, self.norm, self.out = parts.gated_output_layers(
        emb, h, d_v, eps=self.options["norm_eps"], dtype=dtype, rngs=rngs,
        use_gate=self.options["use_gate"])                                       # W_g: SiLU
    self.decay_proj = parts.linear(emb, h, dtype=dtype, rngs=rngs)               # w_a
    self.decay = parts.DecayGate(h, a_range=(0.0, 16.0), rngs=rngs)             # A_log, dt_bias

  def forward(self, x, mask, state, segment_ids=None):
    q, k, v, beta = parts.delta_rule_inputs(self, x, mask, decode=state is not None,
                                            segment_ids=segment_ids,
                                            steps=self.options["num_householder"])
    _, g = self.decay(self.decay_proj(x))                                        # [b, n, h]
    o, state = parts.recurrence(ops.chunk_gated_delta_product,
                                ops.recurrent_gated_delta_product, q, k, v, g, beta, mask=mask,
                                state=state, chunk_size=self.options["chunk_size"],
                                segment_ids=segment_ids)
    return parts.gated_output(self, x, o), state

  def empty_state(self, batch_size, max_len, dtype):
    return jnp.zeros((batch_size, self.num_heads, self.d_k, self.d_v), jnp.float32)
