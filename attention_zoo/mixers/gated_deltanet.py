r"""Gated DeltaNet (Yang, Kautz, Hatamizadeh 2024, arXiv:2412.06464): the delta rule with a
data-dependent decay per head, Mamba2's gate.

    S_t = α_t (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ,     o_t = S_tᵀ (d_k^{-1/2} q_t)
    log α_t = -exp(A_log) · softplus(w_aᵀ x_t + dt_bias)                 (per head)

The layer as flash-linear-attention defines it (fla/layers/gated_deltanet.py): everything of
DeltaNet's (`attention_zoo.deltanet`: q, k, v projections through a kernel-4 causal conv and
SiLU, L2-normalised q and k, β = σ(w_βᵀ x)), plus the decay gate with A ~ U(0, 16) and
dt_bias = softplus⁻¹(dt), dt log-uniform in [1e-3, 0.1] (`parts.DecayGate`; unlike
Mamba2, v is not scaled by Δ: β carries the write strength), and by default the output gate:
RMSNorm per head times SiLU(W_g x), then the output projection. d_v = expand_v · d_k (2).

Where ours differs: fla fixes head_dim = 256 (6 heads, about 6·d² parameters per layer with
num_heads · head_dim = 0.75·d), too large for a small model; here d_k = qkv_dim / num_heads
(qkv_dim defaults to emb_dim). fla's GVA (more value heads than q/k heads) is not built;
num_kv_heads < num_heads shares k, v between query heads (GQA) with the gates per query head.
The rest as DeltaNet's "where ours differs".
"""
from __future__ import annotations

from attention_zoo import ops
from attention_zoo.contract import register_mixer
from attention_zoo.mixers import parts
from attention_zoo.mixers.deltanet import DELTA_OPTIONS, DeltaRuleLayer
from attention_zoo.options import Bool, Float


@register_mixer("gated_deltanet", complexity="O(n·C·d + n·d²)",
                paper="Yang, Kautz, Hatamizadeh 2024, Gated Delta Networks: Improving Mamba2 "
                      "with Delta Rule (arXiv:2412.06464)",
                supports_segment_ids=True, supports_context_parallel=True)
class GatedDeltaNet(DeltaRuleLayer):
  OPTIONS = {**DELTA_OPTIONS, "expand_v": Float(2.0, above=0), "use_gate": Bool(True)}
  # Chunks of 8 at the suite's length 20: several chunks and a partial last one.
  TEST_OPTIONS = dict(chunk_size=8)

  def __init__(self, *, rngs, **kwargs):
    super().__init__(rngs=rngs, **kwargs)       # q, k, v, β; the output gate SiLU(W_g x)
    self.decay_proj = parts.linear(self.emb_dim, self.num_heads, dtype=self.dtype, rngs=rngs)
    self.decay = parts.DecayGate(self.num_heads, a_range=(0.0, 16.0), rngs=rngs)

  def forward(self, x, mask, state, segment_ids=None):
    q, k, v, beta = self.delta_inputs(x, mask, state, segment_ids)
    _, g = self.decay(self.decay_proj(x))                                        # [b, n, h]
    o, state = parts.recurrence(ops.chunk_gated_delta_rule, ops.recurrent_gated_delta_rule,
                                q, k, v, g, beta, mask=mask, state=state,
                                chunk_size=self.options["chunk_size"], segment_ids=segment_ids)
    return parts.gated_output(self, x, o), state
