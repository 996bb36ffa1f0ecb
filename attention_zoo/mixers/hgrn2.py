r"""HGRN2 (Qin et al. 2024, HGRN2: Gated Linear RNNs with State Expansion, arXiv:2404.07904):
GLA whose key is the complement of its forget gate, so a channel writes exactly what it
forgets (the input gate tied to the forget gate, as in HGRN).

    f_t = γ + (1 - γ) σ(W_f x_t)           forget gate per key channel, γ its lower bound
    S_t = Diag(f_t) S_{t-1} + (1 - f_t) v_tᵀ,     o_t = S_tᵀ (d_k^{-1/2} q_t)      S_t [d_k, d_v]
    q_t = SiLU(W_q x_t),  v_t = W_i x_t,   y_t = W_o RMSNorm(o_t)  (over all heads at once)

The layer as flash-linear-attention defines it (fla/layers/hgrn2.py): q, f and i linear
projections without bias (d_k = expand_ratio, 128, per head; d_v = hidden / heads); the
log-gate g = log f_t, the key k = 1 - exp(g); the per-channel-gated op (fla's chunk_gla, here
`attention_zoo.ops.chunk_gla`) with its default scale d_k^{-1/2}; the output RMS-normalised
over the whole hidden vector (one norm across the heads, with a scale per channel, no output
gate), then projected back.

Where ours differs: head dimensions come from the model's (d_k = expand_k · qkv_dim / heads,
d_v = qkv_dim / heads); q, f, v share one projection. The paper's lower bound is learned per
layer at the model level (fla's HGRN2Model: a [layers, hidden] table, softmax over the layers,
cumulative, so layer 0 has γ = 0 and γ rises with depth); a zoo mixer does not know its depth,
so γ is the fixed option `lower_bound` (default 0: the first layer's, the gate σ(W_f x)
itself), the same in every block. fla's optional short convolutions (without activation, off
by default) are not built. num_kv_heads < num_heads shares f (hence k and the decay) and v
between query heads (GQA), as the GLA mixer does.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from attention_zoo import norms, ops
from attention_zoo.contract import Mixer, register_mixer
from attention_zoo.mixers import parts
from attention_zoo.options import Float, Int


@register_mixer("hgrn2", complexity="O(n·C·d + n·d²)",
                paper="Qin et al. 2024, HGRN2: Gated Linear RNNs with State Expansion "
                      "(arXiv:2404.07904)",
                supports_segment_ids=True, supports_context_parallel=True)
class HGRN2(Mixer):
  OPTIONS = {"expand_k": Float(1.0, above=0), "lower_bound": Float(0.0, minimum=0, below=1),
             "chunk_size": Int(64, minimum=1), "norm_eps": Float(1e-5, above=0)}
  # Chunks of 8 at the suite's length 20: several chunks and a partial last one.
  TEST_OPTIONS = dict(chunk_size=8, lower_bound=0.5)
  state_size = classmethod(parts.key_value_state_size)

  def __init__(self, *, rngs, **kwargs):
    super().__init__(rngs=rngs, **kwargs)
    self.d_k, self.d_v = parts.checked_dims(self)
    h, kvh = self.num_heads, self.num_kv_heads
    self.qfv = parts.linear(self.emb_dim, h * self.d_k + kvh * (self.d_k + self.d_v),
                            dtype=self.dtype, rngs=rngs)                 # q | f | v
    self.norm = norms.GatedRMSNorm(h * self.d_v, eps=self.options["norm_eps"])
    self.out = parts.linear(h * self.d_v, self.emb_dim, dtype=self.dtype, rngs=rngs)

  def forward(self, x, mask, state, segment_ids=None):
    b, n, _ = x.shape
    h, kvh, d_k, d_v = self.num_heads, self.num_kv_heads, self.d_k, self.d_v
    q, f, v = jnp.split(self.qfv(x), [h * d_k, (h + kvh) * d_k], axis=-1)
    q = jax.nn.silu(q).reshape(b, n, h, d_k)                                   # [b, n, h, dk]
    g = jax.nn.log_sigmoid(f.astype(jnp.float32))                              # log σ(W_f x)
    bound = self.options["lower_bound"]
    if bound > 0:                  # log(γ + (1 - γ) σ): the gate never falls below γ
      g = jnp.logaddexp(jnp.log(bound), jnp.log1p(-bound) + g)
    g = parts.repeat_kv(g.reshape(b, n, kvh, d_k), h)                          # [b, n, h, dk]
    k = -jnp.expm1(g)                                                          # 1 - f
    v = parts.repeat_kv(v.reshape(b, n, kvh, d_v), h)                          # [b, n, h, dv]
    o, state = parts.recurrence(ops.chunk_gla, ops.recurrent_gla, q, k, v, g, mask=mask,
                                state=state, chunk_size=self.options["chunk_size"],
                                segment_ids=segment_ids)
    y = self.norm(o.reshape(b, n, h * d_v))                                    # [b, n, h·dv]
    return self.out(y.astype(self.dtype)), state

  def empty_state(self, batch_size, max_len, dtype):
    return jnp.zeros((batch_size, self.num_heads, self.d_k, self.d_v), jnp.float32)
