r"""DeltaNet (Schlag et al. 2021; parallelised by Yang et al. 2024, arXiv:2406.06484).

Each token replaces the value stored under its key instead of adding to it (the delta rule):

    S_t = S_{t-1} + β_t k_t (v_t - S_{t-1}ᵀ k_t)ᵀ = (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ
    o_t = S_tᵀ (d_k^{-1/2} q_t)                                   S_t [d_k, d_v] per head

The layer as flash-linear-attention defines it (fla/layers/delta_net.py): q, k, v linear
projections, each through a causal depthwise convolution (kernel 4) and SiLU; q and k
L2-normalised (so I - β k kᵀ has eigenvalues 1 - β and 1: stable, and with β = 1 an exact
overwrite); β_t = σ(w_βᵀ x_t) per head (with allow_neg_eigval 2σ(·) in (0, 2), so the
eigenvalue 1 - β reaches down to -1: Grazzi et al. 2024, arXiv:2411.12537); the output per head
RMS-normalised (with use_gate, gated by SiLU(W_g x)), then projected back. Computed by the
chunkwise WY form (`attention_zoo.ops.chunk_delta_rule`), decoded token by token.

Where ours differs: head dimensions come from the model's (d_k = expand_k · qkv_dim / heads,
d_v = expand_v · qkv_dim / heads; fla: expand · hidden / heads, the same with qkv_dim = emb_dim);
q, k and v share one projection and one depthwise convolution over their concatenated channels
(equal to three, as the convolution is per channel); the convolution has a bias (fla's none);
num_kv_heads < num_heads shares k, v between query heads (GQA), β stays per query head.
"""
from __future__ import annotations

import jax.numpy as jnp

from attention_zoo import ops
from attention_zoo.contract import Mixer, register_mixer
from attention_zoo.mixers import parts
from attention_zoo.options import Bool, Float, Int

# The options of the delta-rule mixers (gated_deltanet, kda, gated_deltaproduct add to them).
DELTA_OPTIONS = {"expand_v": Float(1.0, above=0), "use_gate": Bool(False),
                 "use_short_conv": Bool(True), "conv_size": Int(4, minimum=1),
                 "allow_neg_eigval": Bool(False), "chunk_size": Int(64, minimum=1),
                 "norm_eps": Float(1e-5, above=0)}


class DeltaRuleLayer(Mixer):
  """What the delta mixers share, unregistered: q, k, v (one projection, the short conv) and β
  (`parts.delta_rule_inputs`), and the output norm, gate and projection (`parts.gated_output`).
  Each registered subclass adds its own decay, if any, in its own __init__ and calls its own op
  in its forward. Constructor arguments (given by the subclass, not options): steps, the (k, v,
  β) per token (Gated DeltaProduct's n_h); gate_activation, SiLU or sigmoid; low_rank_gate, the
  output gate as W_up W_down x + b of rank d_v (KDA's) instead of W_g x; channel_gates, β per
  key channel (the erase gate, beta_proj to h·d_k) and a write gate per value channel
  (write_proj to h·d_v) in place of the scalar β (Gated DeltaNet-2's)."""
  state_size = classmethod(parts.key_value_state_size)

  def __init__(self, *, rngs, steps: int = 1, gate_activation: str = "silu",
               low_rank_gate: bool = False, channel_gates: bool = False, **kwargs):
    super().__init__(rngs=rngs, **kwargs)
    self.d_k, self.d_v = parts.checked_dims(self)
    self.steps = steps
    h, kvh, d_k, d_v = self.num_heads, self.num_kv_heads, self.d_k, self.d_v
    emb, dtype = self.emb_dim, self.dtype
    self.qkv, self.conv = parts.qkv_projection(   # q | k's | v's
        emb, h * d_k + steps * kvh * (d_k + d_v), self.options, dtype=dtype, rngs=rngs)
    self.channel_gates = channel_gates
    # w_β per step, or the erase gate's W_b per key channel
    self.beta_proj = parts.linear(emb, steps * h * (d_k if channel_gates else 1), dtype=dtype,
                                  rngs=rngs)
    self.write_proj = (parts.linear(emb, h * d_v, dtype=dtype, rngs=rngs) if channel_gates
                       else None)                                                # W_w
    self.gate_proj, self.norm, self.out = parts.gated_output_layers(
        emb, h, d_v, eps=self.options["norm_eps"], dtype=dtype, rngs=rngs,
        use_gate=self.options["use_gate"], gate_rank=d_v if low_rank_gate else None,
        activation=gate_activation)

  def delta_inputs(self, x, mask, state, segment_ids):
    """q, k, v, β (`parts.delta_rule_inputs`; with steps > 1 a step axis after n; with
    channel_gates β per key channel)."""
    return parts.delta_rule_inputs(self, x, mask, decode=state is not None,
                                   segment_ids=segment_ids,
                                   steps=self.steps if self.steps > 1 else None,
                                   beta_per_key_channel=self.channel_gates)

  def empty_state(self, batch_size, max_len, dtype):
    return jnp.zeros((batch_size, self.num_heads, self.d_k, self.d_v), jnp.float32)


@register_mixer("deltanet", complexity="O(n·C·d + n·d²)",
                paper="Yang et al. 2024, Parallelizing Linear Transformers with the Delta Rule "
                      "over Sequence Length (arXiv:2406.06484); Schlag et al. 2021",
                supports_segment_ids=True, supports_context_parallel=True)
class DeltaNet(DeltaRuleLayer):
  OPTIONS = {"expand_k": Float(1.0, above=0), **DELTA_OPTIONS}
  # Chunks of 8 at the suite's length 20: several chunks and a partial last one.
  TEST_OPTIONS = dict(chunk_size=8)

  def forward(self, x, mask, state, segment_ids=None):
    q, k, v, beta = self.delta_inputs(x, mask, state, segment_ids)
    o, state = parts.recurrence(ops.chunk_delta_rule, ops.recurrent_delta_rule, q, k, v, beta,
                                mask=mask, state=state, chunk_size=self.options["chunk_size"],
                                segment_ids=segment_ids)
    return parts.gated_output(self, x, o), state
