r"""Hawk, the recurrent block of Griffin with its Real-Gated Linear Recurrent Unit (RG-LRU) (De et
al. 2024, arXiv:2402.19427): a diagonal linear recurrence whose decay and input are gated by
the token.

    y_t = GeLU(W_y x_t)                                       gate branch          [D_rnn]
    u_t = conv(W_u x)_t                                        causal depthwise, kernel 4, no
                                                               activation          [D_rnn]
    r_t = σ(W_a u_t + b_a),   i_t = σ(W_x u_t + b_x)           recurrence and input gates
    log a_t = c · r_t ⊙ log σ(Λ),   c = 8                      a_t = σ(Λ)^{c r_t} in (0, 1)
    h_t = a_t ⊙ h_{t-1} + sqrt(1 - a_t²) ⊙ (i_t ⊙ u_t)
    out_t = W_out (y_t ⊙ h_t)

The RG-LRU is per channel: channel c of h is gated linear attention with one key and one
value, q = k = 1, v_t = sqrt(1 - a_t²) i_t u_t and the log-decay g_t = log a_t. So its D_rnn
channels are the heads (K = V = 1) of `attention_zoo.ops.recurrent_simple_gla`, the token
scan (O(n·D_rnn) work; its backward keeps h per token, linear memory), as the authors compute
the RG-LRU (a sequential linear scan); chunk_size=C runs `chunk_simple_gla`, the chunk engine's
scalar-decay path (within a chunk the C x C decays e^{G_i - G_j}, across chunks the carried h:
O(n·C·D_rnn) work, parallel over the chunk, for an accelerator). Fwd+bwd of the layer at
T = 2048, emb 128, 2 heads on the shared 2-core CPU: the token scan 0.105 s, chunks of 64
0.62 s (2026-12-07). Decoding is the token form from the carried h and the conv's last 3
inputs. sqrt(1 - a_t²) = sqrt(-expm1(2 log a_t)), exact for a_t near 1.

The block as the authors define it (google-deepmind/recurrentgemma, its RecurrentBlock and
RGLRU): D_rnn = 4/3 D in the paper's models (the option `expand`, per head); W_a and W_x are
block-diagonal, one [D_rnn/H, D_rnn/H] block per head, with zero biases; a = σ(Λ) initialised
with a² uniform in [0.9², 0.999²]; GeLU in its tanh form; W_y, W_u, W_out bias-free here.

Where ours differs: the reference does not scale the input of a document's first token by
sqrt(1 - a²) (its h_0 = i_0 ⊙ u_0); we follow the paper's equation for every token, the first
included. It bounds the backward of the square root (gradient at most 1000 where 1 - a² is
tiny); we do not (a_t < 1 strictly, as σ(Λ) < 1 and r_t > 0). Its projections have biases; ours
are bias-free as the other mixers'. Λ is excluded from weight decay (ours: decay would pull Λ to
0, a = 1/2 and a^c = 1/256, a memory of one token). num_kv_heads must equal num_heads.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from attention_zoo import ops
from attention_zoo.contract import Mixer, register_mixer
from attention_zoo.convolution import ShortConv
from attention_zoo.mixers import parts
from attention_zoo.options import Float, Int

# the paper's c: the exponent a^{c r_t} spans [a^c, 1] as r_t spans [1, 0]
GATE_EXPONENT = 8.0


def rnn_width_per_head(head_dim: int, options: dict) -> int:
  """The RG-LRU's channels per head: int(expand · head_dim)."""
  return int(options["expand"] * head_dim)


@register_mixer("hawk", complexity="O(n·d_rnn) (chunked: O(n·C·d_rnn))",
                paper="De et al. 2024, Griffin: Mixing Gated Linear Recurrences with Local "
                      "Attention for Efficient Language Models (arXiv:2402.19427)",
                supports_segment_ids=True)
class Hawk(Mixer):
  OPTIONS = {"expand": Float(4 / 3, above=0), "conv_size": Int(4, minimum=1),
             "chunk_size": Int(None, minimum=1, optional=True)}
  # Chunks of 8 at the suite's length 20: several chunks and a partial last one.
  TEST_OPTIONS = dict(chunk_size=8)
  WHY_NO_GQA = "the RG-LRU has no key/value heads to share (its heads are blocks of its gates)"

  @classmethod
  def state_size(cls, *, num_heads, head_dim, options, **dims) -> int:
    return num_heads * rnn_width_per_head(head_dim, options)                   # h [D_rnn]

  def __init__(self, *, rngs, **kwargs):
    super().__init__(rngs=rngs, **kwargs)
    h, dtype = self.num_heads, self.dtype
    self.width = rnn_width_per_head(self.head_dim, self.options)               # per head
    if self.width < 1:
      raise self.option_error("expand", f"a value giving at least 1 channel per head "
                                        f"(head_dim {self.head_dim})")
    d_rnn = h * self.width
    self.gate_branch = parts.linear(self.emb_dim, d_rnn, dtype=dtype, rngs=rngs)   # W_y
    self.in_proj = parts.linear(self.emb_dim, d_rnn, dtype=dtype, rngs=rngs)       # W_u
    self.conv = ShortConv(d_rnn, self.options["conv_size"], dtype=dtype, rngs=rngs)
    # W_a | W_x, block-diagonal: per head [width, 2·width], fan-in init as the reference's
    init = nnx.initializers.normal(self.width ** -0.5)
    self.gate_weight = nnx.Param(init(rngs.params(), (h, self.width, 2 * self.width)))
    self.gate_bias = nnx.Param(jnp.zeros((h, 2 * self.width)))
    # Λ with σ(Λ)² ~ U(0.9², 0.999²): a = σ(Λ) = sqrt of it, Λ = logit(a)
    a = jnp.sqrt(jax.random.uniform(rngs.params(), (d_rnn,), minval=0.9 ** 2,
                                    maxval=0.999 ** 2))
    self.Lambda = nnx.Param(jnp.log(a) - jnp.log1p(-a), weight_decay=False)
    self.out = parts.linear(d_rnn, self.emb_dim, dtype=dtype, rngs=rngs)

  def forward(self, x, mask, state, segment_ids=None):
    b, n, _ = x.shape
    h, width = self.num_heads, self.width
    y = jax.nn.gelu(self.gate_branch(x))                                          # [b, n, D]
    u = self.conv(jnp.where(mask[..., None], self.in_proj(x), 0), decode=state is not None,
                  segment_ids=segment_ids)                                        # [b, n, D]
    u = u.astype(jnp.float32)
    gates = jnp.einsum("bnhi,hio->bnho", u.reshape(b, n, h, width),
                       self.gate_weight[...]) + self.gate_bias[...]               # [b, n, h, 2w]
    r, i = jnp.split(jax.nn.sigmoid(gates), 2, axis=-1)                           # [b, n, h, w]
    r, i = r.reshape(b, n, h * width), i.reshape(b, n, h * width)                 # [b, n, D]
    log_a = GATE_EXPONENT * r * jax.nn.log_sigmoid(self.Lambda[...])              # [b, n, D]
    v = jnp.sqrt(-jnp.expm1(2 * log_a)) * i * u                                   # [b, n, D]
    ones = jnp.ones(v.shape + (1,), v.dtype)                                      # q = k = 1
    hidden, state = parts.recurrence(ops.chunk_simple_gla, ops.recurrent_simple_gla, ones, ones,
                                     v[..., None], log_a, mask=mask, state=state,
                                     chunk_size=self.options["chunk_size"], scale=1.0,
                                     segment_ids=segment_ids)                     # [b, n, D, 1]
    return self.out((y * hidden[..., 0]).astype(self.dtype)), state

  def empty_state(self, batch_size, max_len, dtype):
    return jnp.zeros((batch_size, self.num_heads * self.width, 1, 1), jnp.float32)
