r"""mLSTM, the matrix-memory cell of xLSTM (Beck et al. 2024, arXiv:2405.04517), in its
pre-up-projection block.

    x_m, z = W_up x                                          (d_inner = expand · d each)
    x_c = SiLU(conv(x_m))                                    causal depthwise, kernel 4
    q_t = W_q x_c,  k_t = W_k x_c / sqrt(d_h),  v_t = W_v x_m                per head [d_h]
    ĩ_t, f̃_t = W_i [q_t; k_t; v_t] + b_i,  W_f [..] + b_f                   per head, scalar
    C_t = f_t C_{t-1} + i_t v_t k_tᵀ,   n_t = f_t n_{t-1} + i_t k_t,   i_t = exp(ĩ_t),
    f_t = σ(f̃_t),   h̃_t = C_t q_t / max(|n_tᵀ q_t|, 1)
    out_t = W_down ((norm(h̃_t) + s ⊙ x_c,t) ⊙ SiLU(z_t))                   s a learned skip

with the running-max stabiliser m_t = max(log f_t + m_{t-1}, ĩ_t) (`attention_zoo.ops.mlstm`:
`chunk_mlstm`, the chunkwise form, for training and prefill; `recurrent_mlstm` for decoding and
chunk_size None). The state per head: C̃ [d_h, d_h], ñ [d_h] and m. Fwd+bwd of the layer at
T = 2048, emb 128, 2 heads on the shared 2-core CPU: chunks of 64 0.22 s, the token form 2.4 s
(2026-12-07).

The block as its authors define it (NX-AI/xlstm, mLSTMLayer): up-projection factor 2; the conv
with a bias; i and f read the concatenated q, k, v, with zero weights, the input gate's bias
~ N(0, 0.1²) and the forget gate's biases linspace(3, 6) over the heads (f ≈ 0.95-0.998 at init,
a long memory); the skip s initialised to ones.

Where ours differs: W_q, W_k, W_v are dense (the authors': block-diagonal, blocks of 4
channels); the per-head norm is an RMSNorm (xLSTM 7B's; the paper's block: a LayerNorm per
head, no bias); projections bias-free; no eps in the cell's denominator (see ops/mlstm.py);
only the sigmoid forget gate (the paper's exponential one is not an option). num_kv_heads must
equal num_heads.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from attention_zoo import ops
from attention_zoo.contract import Mixer, register_mixer
from attention_zoo.convolution import ShortConv
from attention_zoo.mixers import parts
from attention_zoo.norms import GatedRMSNorm
from attention_zoo.options import Float, Int


@register_mixer("mlstm", complexity="O(n·C·d + n·d²)",
                paper="Beck et al. 2024, xLSTM: Extended Long Short-Term Memory "
                      "(arXiv:2405.04517)",
                supports_segment_ids=True)
class MLSTM(Mixer):
  OPTIONS = {"expand": Int(2, minimum=1), "conv_size": Int(4, minimum=1),
             "chunk_size": Int(64, minimum=1, optional=True), "norm_eps": Float(1e-5, above=0)}
  # Chunks of 8 at the suite's length 20: several chunks and a partial last one.
  TEST_OPTIONS = dict(chunk_size=8)
  WHY_NO_GQA = "mLSTM's q, k and v come from one up-projection per head (no key/value heads)"

  @classmethod
  def state_size(cls, *, num_heads, head_dim, options, **dims) -> int:
    d = options["expand"] * head_dim
    return num_heads * (d * d + d + 1)                                 # C̃ [d, d], ñ [d], m

  def __init__(self, *, rngs, **kwargs):
    super().__init__(rngs=rngs, **kwargs)
    h, dtype = self.num_heads, self.dtype
    self.d = self.options["expand"] * self.head_dim                    # per head
    d_inner = h * self.d
    self.up_proj = parts.linear(self.emb_dim, 2 * d_inner, dtype=dtype, rngs=rngs)   # x_m | z
    self.conv = ShortConv(d_inner, self.options["conv_size"], dtype=dtype, rngs=rngs)
    self.q_proj, self.k_proj, self.v_proj = (
        parts.linear(d_inner, d_inner, dtype=dtype, rngs=rngs) for _ in range(3))
    # ĩ | f̃ from [q; k; v]: zero weights, the authors' biases
    self.gate_proj = nnx.Linear(
        3 * d_inner, 2 * h, dtype=dtype, rngs=rngs, kernel_init=nnx.initializers.zeros,
        bias_init=lambda key, shape, dtype: jnp.concatenate(
            [0.1 * jax.random.normal(key, (h,), dtype), jnp.linspace(3.0, 6.0, h, dtype=dtype)]))
    self.norm = GatedRMSNorm(self.d, eps=self.options["norm_eps"])
    self.skip = nnx.Param(jnp.ones((d_inner,)))
    self.down_proj = parts.linear(d_inner, self.emb_dim, dtype=dtype, rngs=rngs)

  def forward(self, x, mask, state, segment_ids=None):
    b, n, _ = x.shape
    h, d = self.num_heads, self.d
    x_m, z = jnp.split(self.up_proj(x), 2, axis=-1)                             # [b, n, h·d]
    x_c = parts.short_conv(self.conv, x_m, mask, decode=state is not None,
                           segment_ids=segment_ids)                             # [b, n, h·d]
    q, k, v = self.q_proj(x_c), self.k_proj(x_c), self.v_proj(x_m)              # [b, n, h·d]
    gates = self.gate_proj(jnp.concatenate([q, k, v], -1)).astype(jnp.float32)  # [b, n, 2h]
    log_i, f = jnp.split(gates, 2, axis=-1)                                     # [b, n, h]
    heads = lambda a: a.reshape(b, n, h, d)                                     # [b, n, h, d]
    o, state = parts.recurrence(ops.chunk_mlstm, ops.recurrent_mlstm, heads(q), heads(k),
                                heads(v), log_i, jax.nn.log_sigmoid(f), mask=mask, state=state,
                                chunk_size=self.options["chunk_size"], segment_ids=segment_ids)
    y = self.norm(o).reshape(b, n, h * d) + self.skip[...] * x_c.astype(jnp.float32)
    y = y * jax.nn.silu(z.astype(jnp.float32))
    return self.down_proj(y.astype(self.dtype)), state

  def empty_state(self, batch_size, max_len, dtype):
    h, d = self.num_heads, self.d
    return tuple(jnp.zeros(shape, jnp.float32)                        # (S̃, ñ, m), m_0 = 0
                 for shape in ((batch_size, h, d, d), (batch_size, h, d), (batch_size, h)))
