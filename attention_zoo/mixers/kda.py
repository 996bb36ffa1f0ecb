r"""Kimi Delta Attention (Kimi Team 2025, Kimi Linear, arXiv:2510.26692): the gated delta rule
with one decay per key channel (Gated DeltaNet's gate made fine-grained, as GLA's is).

    S_t = (I - β_t k_t k_tᵀ) Diag(α_t) S_{t-1} + β_t k_t v_tᵀ,     o_t = S_tᵀ (d_k^{-1/2} q_t)
    log α_t = -exp(A_log) · softplus(W_up W_down x_t + dt_bias)          α_t [d_k] per head

The layer as flash-linear-attention defines it (fla/layers/kda.py, initialised as its model's
_init_weights does): DeltaNet's q, k, v (`attention_zoo.deltanet`: projections through a
kernel-4 causal conv and SiLU, L2-normalised q and k, β = σ(w_βᵀ x) per head); the decay from a
low-rank projection (W_down [d, d_v], W_up [d_v, h·d_k], no biases) with A ~ U(1, 16) per head
and dt_bias = softplus⁻¹(dt) per key channel, dt log-uniform in [1e-3, 0.1] (`parts.DecayGate`
with key_dim); the output per head RMS-normalised times σ(W_up W_down x + b) (a low-rank gate
of rank d_v, and a sigmoid where Gated DeltaNet has SiLU), then the output projection;
d_v = d_k (expand_v 1). Chunkwise by `attention_zoo.ops.chunk_kda`, decoded token by token.

Where ours differs: fla fixes head_dim = 128 (16 heads); here d_k = qkv_dim / num_heads. fla's
GVA (more value heads than q/k heads) is not built; num_kv_heads < num_heads shares k, v
between query heads (GQA) with the gates and β per query head. fla's later gate variants
(safe_gate, lower_bound: a bounded sigmoid decay) are not built. The rest as DeltaNet's "where
ours differs".
"""
from __future__ import annotations

from attention_zoo import ops
from attention_zoo.contract import register_mixer
from attention_zoo.mixers import parts
from attention_zoo.mixers.deltanet import DELTA_OPTIONS, DeltaRuleLayer
from attention_zoo.options import Bool


@register_mixer("kda", complexity="O(n·C·d + n·d²)",
                paper="Kimi Team 2025, Kimi Linear: An Expressive, Efficient Attention "
                      "Architecture (arXiv:2510.26692)",
                supports_segment_ids=True, supports_context_parallel=True)
class KimiDeltaAttention(DeltaRuleLayer):
  OPTIONS = {**DELTA_OPTIONS, "use_gate": Bool(True)}
  # Chunks of 8 at the suite's length 20: several chunks and a partial last one.
  TEST_OPTIONS = dict(chunk_size=8)

  def __init__(self, *, rngs, gate_activation: str = "sigmoid", **kwargs):
    # q, k, v, β; the output gate σ(W_up W_down x + b), low-rank of rank d_v (Gated
    # DeltaNet-2, a subclass, passes SiLU and its channel gates)
    super().__init__(rngs=rngs, gate_activation=gate_activation, low_rank_gate=True, **kwargs)
    h, d_k = self.num_heads, self.d_k
    # the decay per key channel: W_up W_down x (rank d_v), A per head, dt_bias per channel
    self.decay_proj = parts.low_rank(self.emb_dim, self.d_v, h * d_k, dtype=self.dtype,
                                     rngs=rngs)
    self.decay = parts.DecayGate(h, a_range=(1.0, 16.0), key_dim=d_k, rngs=rngs)

  def channel_decay(self, x):
    """x [b, n, emb] -> the log-decay g [b, n, h, d_k], float32."""
    b, n, _ = x.shape
    _, g = self.decay(self.decay_proj(x).reshape(b, n, self.num_heads, self.d_k))
    return g

  def forward(self, x, mask, state, segment_ids=None):
    q, k, v, beta = self.delta_inputs(x, mask, state, segment_ids)
    g = self.channel_decay(x)                                                    # [b, n, h, dk]
    o, state = parts.recurrence(ops.chunk_kda, ops.recurrent_kda, q, k, v, g, beta, mask=mask,
                                state=state, chunk_size=self.options["chunk_size"],
                                segment_ids=segment_ids)
    return parts.gated_output(self, x, o), state
