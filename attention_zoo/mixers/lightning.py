r"""Lightning Attention, TransNormerLLM's token mixer (Qin et al. 2023, arXiv:2307.14995;
Lightning Attention-2, Qin et al. 2024, arXiv:2401.04658): linear attention with a fixed decay
per head, which is not learned and not data dependent.

    S_t = λ_h S_{t-1} + k_t v_tᵀ,   o_t = S_tᵀ q_t,   y_t = W_o (RMSNorm(o_t) ⊙ σ(W_g x_t))
    q_t, k_t, v_t = SiLU(W_qkv x_t),   λ_h = exp(-s_h · (1 - depth + 1e-5)),
    s_h = 2^{-8(h+1)/H}   (h = 0..H-1; ALiBi's slopes, `positions.alibi_slopes`)

Every head forgets at its own fixed rate: at depth 0 (the first layer) λ runs from
exp(-2^{-8/H}) (0.61 with 8 heads: a memory of a few tokens) to exp(-2^{-8}) ≈ 0.996 (a
few hundred), and the rates slow towards the last layer (depth 1: λ ≈ 1, no decay).

The layer as its authors run it at scale (MiniMax-Text-01's lightning attention layer, with
the lightning-attention kernels' `_build_slope_tensor`, then slope · (1 - l/(L-1) + 1e-5) for
layer l of L): one projection to q | k | v with SiLU on all three (TransNormerLLM's swish), no
biases; scale 1; the output RMS-normalised over the whole hidden vector (all heads at once, a
scale per channel) times σ(W_g x), then projected back. Chunkwise by
`attention_zoo.ops.chunk_simple_gla` with the constant log-decay -s_h (1 - depth + 1e-5).

Where ours differs: a zoo mixer does not know its layer, so depth = l/(L-1) is the option
`depth` (default 0, the first layer's), the same in every block. flash-linear-attention's
chunk_lightning_attn uses λ_h = exp(-(8h/H)(1 - l/L)) with h from 0 (its head 0 never decays);
the authors' code, followed here, uses the ALiBi slopes above. TransNormerLLM's own layer also
rotates q and k (LRPE) and normalises with SimpleRMSNorm (no scale): not built, as in
MiniMax's layer. A masked token neither decays the state nor writes to it. Head dimensions
come from the model's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from attention_zoo import norms, ops, positions
from attention_zoo.contract import Mixer, register_mixer
from attention_zoo.mixers import parts
from attention_zoo.options import Float, Int


@register_mixer("lightning", complexity="O(n·C·d + n·d²)",
                paper="Qin et al. 2024, Lightning Attention-2 (arXiv:2401.04658); TransNormerLLM "
                      "(arXiv:2307.14995)",
                supports_segment_ids=True, supports_context_parallel=True)
class Lightning(Mixer):
  OPTIONS = {"depth": Float(0.0, minimum=0, maximum=1), "chunk_size": Int(64, minimum=1),
             "norm_eps": Float(1e-5, above=0)}
  # Chunks of 8 at the suite's length 20: several chunks and a partial last one.
  TEST_OPTIONS = dict(chunk_size=8)
  state_size = classmethod(parts.key_value_state_size)

  def __init__(self, *, rngs, **kwargs):
    super().__init__(rngs=rngs, **kwargs)
    h, kvh, d, emb, dtype = (self.num_heads, self.num_kv_heads, self.head_dim, self.emb_dim,
                             self.dtype)
    self.qkv = parts.linear(emb, (h + 2 * kvh) * d, dtype=dtype, rngs=rngs)   # q | k | v
    self.gate_proj = parts.linear(emb, h * d, dtype=dtype, rngs=rngs)
    self.norm = norms.GatedRMSNorm(h * d, eps=self.options["norm_eps"], activation="sigmoid")
    self.out = parts.linear(h * d, emb, dtype=dtype, rngs=rngs)
    # fixed: log λ_h = -s_h (1 - depth + 1e-5)
    self.log_decay = -positions.alibi_slopes(h) * (1.0 - self.options["depth"] + 1e-5)

  def forward(self, x, mask, state, segment_ids=None):
    b, n, _ = x.shape
    h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
    q, k, v = jnp.split(jax.nn.silu(self.qkv(x)), [h * d, (h + kvh) * d], axis=-1)
    q = q.reshape(b, n, h, d)                                                  # [b, n, h, d]
    k = parts.repeat_kv(k.reshape(b, n, kvh, d), h)                            # [b, n, h, d]
    v = parts.repeat_kv(v.reshape(b, n, kvh, d), h)                            # [b, n, h, d]
    g = jnp.broadcast_to(jnp.asarray(self.log_decay, jnp.float32), (b, n, h))
    o, state = parts.recurrence(ops.chunk_simple_gla, ops.recurrent_simple_gla, q, k, v, g,
                                mask=mask, state=state, chunk_size=self.options["chunk_size"],
                                scale=1.0, segment_ids=segment_ids)
    y = self.norm(o.reshape(b, n, h * d), self.gate_proj(x))                  # [b, n, h·d]
    return self.out(y.astype(self.dtype)), state

  def empty_state(self, batch_size, max_len, dtype):
    return jnp.zeros((batch_size, self.num_heads, self.head_dim, self.head_dim), jnp.float32)
