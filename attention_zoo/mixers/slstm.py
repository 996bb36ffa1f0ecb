r"""sLSTM, the scalar-memory cell of xLSTM (Beck et al. 2024, arXiv:2405.04517): an LSTM with
exponential input gates, a normaliser state and recurrent connections inside each head.

    x̂ = SiLU(conv(x))                                      causal depthwise, kernel 4
    ĩ_t = W_i x̂_t + R_i h_{t-1} + b_i,   f̃_t = W_f x̂_t + R_f h_{t-1} + b_f      per channel
    z̃_t = W_z x_t + R_z h_{t-1} + b_z,   õ_t = W_o x_t + R_o h_{t-1} + b_o      [D]
    c_t = f_t c_{t-1} + i_t tanh(z̃_t),   n_t = f_t n_{t-1} + i_t,   h_t = σ(õ_t) ⊙ c_t / n_t
    i_t = exp(ĩ_t),  f_t = σ(f̃_t)
    out_t = W_out norm(h_t)                                  norm: per head

R_* are block-diagonal, one [d, d] block per head (h_{t-1} of a head feeds only its own gates),
D = num_heads · head_dim. The gates read h_{t-1}, so the recurrence is nonlinear in its state:
no chunkwise or associative form exists, and forward, training and decoding all run the token
scan (`lax.scan` over tokens, O(n·D·d) work, no parallelism over the sequence; its backward
keeps the state per token, linear memory). Stabilised as the paper's appendix does: with
m_t = max(log f_t + m_{t-1}, ĩ_t) the state holds c̃ = e^{-m} c, ñ = e^{-m} n, updated by
i' = exp(ĩ_t - m_t), f' = exp(log f_t + m_{t-1} - m_t) (exponents <= 0); h = σ(õ) c̃ / ñ is
unchanged, so m is a constant to the gradient. State per channel: c̃, ñ, m, h.

The layer as its authors define it (NX-AI/xlstm, sLSTMLayer): i and f read the convolved input
and z and o the input itself; a norm per head after the cell; the cell's initial state zeros.

Where ours differs: W_* are dense (the authors': block-diagonal per head); the per-head norm is
an RMSNorm (theirs: a LayerNorm); an output projection W_out closes the mixer (in the paper the
block's gated MLP follows the cell); R_* ~ N(0, 1/d) (theirs: per their init options); the
forget gate's biases linspace(3, 6) over the heads (theirs: a power law over the channels),
the others' 0; only the sigmoid forget gate (the paper's exponential one is not an option).
num_kv_heads must equal num_heads.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from attention_zoo.contract import Mixer, register_mixer
from attention_zoo.convolution import ShortConv
from attention_zoo.mixers import parts
from attention_zoo.norms import GatedRMSNorm
from attention_zoo.ops.segments import segment_starts
from attention_zoo.options import Float, Int

# the cell's state per channel, in the scan's carry: c̃, ñ, m, h
STATE_PARTS = 4


@register_mixer("slstm", complexity="O(n·D·d) (token scan only: nonlinear in its state)",
                paper="Beck et al. 2024, xLSTM: Extended Long Short-Term Memory "
                      "(arXiv:2405.04517)",
                supports_segment_ids=True)
class SLSTM(Mixer):
  OPTIONS = {"conv_size": Int(4, minimum=1), "norm_eps": Float(1e-5, above=0)}
  WHY_NO_GQA = "sLSTM's heads are blocks of its recurrent matrices (no key/value heads)"

  @classmethod
  def state_size(cls, *, num_heads, head_dim, **dims) -> int:
    return STATE_PARTS * num_heads * head_dim                          # c̃, ñ, m, h per channel

  def __init__(self, *, rngs, **kwargs):
    super().__init__(rngs=rngs, **kwargs)
    h, d, dtype = self.num_heads, self.head_dim, self.dtype
    width = h * d
    self.conv = ShortConv(self.emb_dim, self.options["conv_size"], dtype=dtype, rngs=rngs)
    self.input_gates = parts.linear(self.emb_dim, 2 * width, dtype=dtype, rngs=rngs)   # W_i | W_f
    self.cell_gates = parts.linear(self.emb_dim, 2 * width, dtype=dtype, rngs=rngs)    # W_z | W_o
    # R_i | R_f | R_z | R_o per head [d, 4d]
    self.recurrent = nnx.Param(nnx.initializers.normal(d ** -0.5)(rngs.params(), (h, d, 4 * d)))
    # b_i | b_f | b_z | b_o per head [4, d]: the forget gate's linspace(3, 6) over the heads
    forget = jnp.broadcast_to(jnp.linspace(3.0, 6.0, h)[:, None], (h, d))
    self.bias = nnx.Param(jnp.zeros((h, 4, d)).at[:, 1].set(forget))
    self.norm = GatedRMSNorm(d, eps=self.options["norm_eps"])
    self.out = parts.linear(width, self.emb_dim, dtype=dtype, rngs=rngs)

  def forward(self, x, mask, state, segment_ids=None):
    b, n, _ = x.shape
    h, d = self.num_heads, self.head_dim
    x_conv = parts.short_conv(self.conv, x, mask, decode=state is not None,
                              segment_ids=segment_ids)                          # [b, n, emb]
    inputs = jnp.concatenate([self.input_gates(x_conv), self.cell_gates(x)], -1)  # [b, n, 4D]
    # [b, n, 4, h, d] -> [b, n, h, 4, d]: W x + b for i, f, z, o
    inputs = inputs.reshape(b, n, 4, h, d).swapaxes(2, 3).astype(jnp.float32) + self.bias[...]
    resets = (jnp.zeros((b, n), bool) if segment_ids is None
              else segment_starts(segment_ids))                                 # [b, n]
    recurrent = self.recurrent[...]

    def step(carry, xs):
      inputs_t, real, reset = xs
      c, norm, m, h_prev = (jnp.where(reset[:, None, None], 0.0, a)
                            for a in carry)                                     # [b, h, d] each
      pre = inputs_t + jnp.einsum("bhd,hde->bhe", h_prev, recurrent).reshape(b, h, 4, d)
      log_i, f_pre, z_pre, o_pre = (pre[:, :, j] for j in range(4))             # [b, h, d]
      log_f = jax.nn.log_sigmoid(f_pre)
      m_new = jax.lax.stop_gradient(jnp.maximum(log_f + m, log_i))
      forget, write = jnp.exp(log_f + m - m_new), jnp.exp(log_i - m_new)
      c_new = forget * c + write * jnp.tanh(z_pre)
      norm_new = forget * norm + write
      h_new = jax.nn.sigmoid(o_pre) * c_new / norm_new
      keep = real[:, None, None]            # a masked token leaves the state as it was
      carry = tuple(jnp.where(keep, new, old) for new, old in
                    zip((c_new, norm_new, m_new, h_new), (c, norm, m, h_prev)))
      return carry, h_new

    time_major = lambda a: jnp.moveaxis(a, 1, 0)
    carry = self.empty_state(b, n, jnp.float32) if state is None else state
    carry, hidden = jax.lax.scan(step, tuple(carry), (time_major(inputs), time_major(mask),
                                                      time_major(resets)))
    hidden = jnp.moveaxis(hidden, 0, 1)                                         # [b, n, h, d]
    y = self.norm(hidden).reshape(b, n, h * d)
    return self.out(y.astype(self.dtype)), carry

  def empty_state(self, batch_size, max_len, dtype):
    shape = (batch_size, self.num_heads, self.head_dim)
    return tuple(jnp.zeros(shape, jnp.float32) for _ in range(STATE_PARTS))   # c̃, ñ, m, h
