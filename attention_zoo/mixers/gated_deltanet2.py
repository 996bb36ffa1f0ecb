r"""Gated DeltaNet-2 (Hatamizadeh, Choi, Kautz 2026, arXiv:2605.22791): KDA with the scalar β
split into a channel-wise erase gate on the key axis and a channel-wise write gate on the value
axis.

    S_t = (I - k_t (b_t ⊙ k_t)ᵀ) Diag(α_t) S_{t-1} + k_t (w_t ⊙ v_t)ᵀ,   o_t = S_tᵀ (d_k^{-1/2} q_t)
    b_t = σ(W_b x_t) [d_k],  w_t = σ(W_w x_t) [d_v],  log α_t = KDA's per key channel

The decayed state is read with b_t ⊙ k_t (which key channels are read and erased) and the
read is removed along k_t; w_t selects the value channels written. b = w = β·1 is KDA, and with
one decay per head Gated DeltaNet. With allow_neg_eigval b = 2σ(·) (the authors' option): the
transition's eigenvalue along k is 1 - Σ_d b_d k_d², in (-1, 1) for a unit key.

The layer as the authors' code defines it (NVlabs/GatedDeltaNet-2, lit_gpt/gdn2.py, read in a
public fork; the paper's text was reachable only as summaries, whose update matches the code's
docstring): KDA's q, k, v (`attention_zoo.kda`: projections through a kernel-4 causal conv and
SiLU, L2-normalised q and k) and its low-rank per-channel decay (A ~ U(1, 16) per head, dt_bias
per key channel); W_b [d, h·d_k] and W_w [d, h·d_v] full projections without bias; the output
RMS-normalised per head times SiLU(W_up W_down x + b) (a low-rank gate of rank d_v, SiLU where
KDA has a sigmoid), then the output projection; d_v = d_k. Chunkwise by
`attention_zoo.ops.chunk_gated_delta_rule2` (the delta engine's WY form with the read keys
b ⊙ k), decoded token by token.

Where ours differs: the authors initialise every projection Xavier-uniform with gain 2^-2.5
(ours: the projections' default, as the other delta mixers); their head_dim is 128 (here
d_k = qkv_dim / num_heads); their GVA (more value heads than q/k heads) is not built;
num_kv_heads < num_heads shares k, v between query heads (GQA) with b, w and the decay per
query head. The rest as DeltaNet's "where ours differs".
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from attention_zoo import ops
from attention_zoo.contract import register_mixer
from attention_zoo.mixers import parts
from attention_zoo.mixers.kda import KimiDeltaAttention


@register_mixer("gated_deltanet2", complexity="O(n·C·d + n·d²)",
                paper="Hatamizadeh, Choi, Kautz 2026, Gated DeltaNet-2: Decoupling Erase and "
                      "Write in Linear Attention (arXiv:2605.22791)",
                supports_segment_ids=True, supports_context_parallel=True)
class GatedDeltaNet2(KimiDeltaAttention):
  # Chunks of 8 at the suite's length 20: several chunks and a partial last one.
  TEST_OPTIONS = dict(chunk_size=8)

  def __init__(self, *, rngs, **kwargs):
    # KDA's q, k, v, decay and low-rank output gate (with SiLU); β per key channel (the erase
    # gate b) and the write gate w
    super().__init__(rngs=rngs, gate_activation="silu", channel_gates=True, **kwargs)

  def forward(self, x, mask, state, segment_ids=None):
    b, n, _ = x.shape
    q, k, v, erase = self.delta_inputs(x, mask, state, segment_ids)       # erase [b, n, h, dk]
    write = jax.nn.sigmoid(self.write_proj(x).astype(jnp.float32)).reshape(
        b, n, self.num_heads, self.d_v)                                          # [b, n, h, dv]
    o, state = parts.recurrence(ops.chunk_gated_delta_rule2, ops.recurrent_gated_delta_rule2,
                                q, k, v, self.channel_decay(x), erase, write, mask=mask,
                                state=state, chunk_size=self.options["chunk_size"],
                                segment_ids=segment_ids)
    return parts.gated_output(self, x, o), state
