r"""Mamba (Gu & Dao 2023, arXiv:2312.00752): the selective state space block, whose step Δ, input
map B and output map C depend on the token, with one state of N numbers per channel.

    x_t, z_t = W_in u_t                                  (d_inner = expand · d channels each)
    x_t ← SiLU(conv(x)_t)                                (causal depthwise, kernel 4)
    Δ_t = softplus(W_Δ (W_x x_t)_{:R} + b_Δ),   B_t, C_t = (W_x x_t)_{R:R+N}, (W_x x_t)_{R+N:}
    h_t = exp(Δ_t A) ⊙ h_{t-1} + (Δ_t ⊙ x_t) B_tᵀ,      A = -exp(A_log)      h_t, A [d_inner, N]
    y_t = h_t C_t + D ⊙ x_t,    out_t = W_out (y_t ⊙ SiLU(z_t))

Channel c is gated linear attention with one value: q = C_t, k = B_t, v = Δ_tc x_tc and the
log-decay Δ_tc A_c [N], per key channel. Its decay varies along c and n both, so channels do not
share a head with a wider value: each of the d_inner channels is a head with K = N, V = 1 of
`attention_zoo.ops.chunk_gla` (the token form in decoding; the decode state is the conv's last 3
inputs and h). The chunk form forms a C x C product per channel, O(n·C·N·d_inner) work against
the selective scan's O(n·N·d_inner), in exchange for parallel work over the chunk. So the
default, chunk_size=None, is the selective scan itself, as its authors compute it: the token
form (`recurrent_gla`, a `lax.scan` over tokens; its backward keeps h per token, n·d_inner·N
floats, linear in n); chunk_size=C runs the chunk form (parallel within a chunk, for an
accelerator). On a shared 2-core CPU, fwd+bwd at T = 2048, d_inner 512, N 16, the op alone:
chunk 16 7.3 s, 32 16 s, 64 19 s, the token form 2.7 s; the layer (emb 256): chunk 16 15.9 s,
the token form 5.7 s, causal `full` 1.5 s.

The layer as its authors define it (mamba_ssm's Mamba, fla/layers/mamba.py): expand 2, N =
d_state 16, R = dt_rank = ⌈d / 16⌉; bias-free in, x and out projections; the conv with a bias;
W_Δ ~ U(±R^{-1/2}) and b_Δ = softplus⁻¹(dt), dt log-uniform in [1e-3, 0.1] floored at 1e-4
(`parts.dt_bias_init`); the S4D-real init A_cn = n + 1 and D = 1, both with
`weight_decay=False` (the authors'). Scale 1.

allow_neg_eigval (Grazzi et al. 2025, "Unlocking State-Tracking in Linear RNNs Through Negative
Eigenvalues", arXiv:2411.12537, as its authors' modified selective scan does) replaces the
transition exp(Δ_t A) by 2 exp(Δ_t A) - 1, extending its range from (0, 1] to (-1, 1], so that a
channel can flip sign from token to token (parity, modular counting); B, C, D and the write
Δ_t x_t B_t are unchanged. A negative transition is no log-decay: the op carries its sign apart
(`attention_zoo.ops.with_negative_eigenvalues`), exact in both forms and in decoding.

Where ours differs: d_inner = expand · num_heads · head_dim (expand · emb_dim unless head_dim is
given); heads play no other part and num_kv_heads none. A masked token enters the conv as zeros
and leaves h untouched (fla zeroes it before and after the conv).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from attention_zoo import ops
from attention_zoo.contract import Mixer, register_mixer
from attention_zoo.convolution import ShortConv
from attention_zoo.mixers import parts
from attention_zoo.options import Bool, Int


@register_mixer("mamba", complexity="O(n·N·d_inner)",
                paper="Gu & Dao 2023, Mamba: Linear-Time Sequence Modeling with Selective "
                      "State Spaces (arXiv:2312.00752)",
                supports_segment_ids=True, supports_context_parallel=True)
class Mamba(Mixer):
  OPTIONS = {"expand": Int(2, minimum=1), "d_state": Int(16, minimum=1),
             "dt_rank": Int(None, minimum=1, optional=True), "conv_size": Int(4, minimum=1),
             "chunk_size": Int(None, minimum=1, optional=True),
             "allow_neg_eigval": Bool(False)}
  # Chunks of 8 at the suite's length 20: several chunks and a partial last one.
  TEST_OPTIONS = dict(chunk_size=8, d_state=4)

  @classmethod
  def state_size(cls, *, num_heads, head_dim, options, **dims) -> int:
    return options["expand"] * num_heads * head_dim * options["d_state"]

  def __init__(self, *, rngs, **kwargs):
    super().__init__(rngs=rngs, **kwargs)
    dtype = self.dtype
    self.d_inner = self.options["expand"] * self.num_heads * self.head_dim
    self.n = self.options["d_state"]                              # N, the state per channel
    self.rank = self.options["dt_rank"] or math.ceil(self.emb_dim / 16)
    self.in_proj = parts.linear(self.emb_dim, 2 * self.d_inner, dtype=dtype, rngs=rngs)  # x | z
    self.conv = ShortConv(self.d_inner, self.options["conv_size"], dtype=dtype, rngs=rngs)
    self.x_proj = parts.linear(self.d_inner, self.rank + 2 * self.n, dtype=dtype,
                               rngs=rngs)                         # Δ (low rank) | B | C
    bound = self.rank ** -0.5
    self.dt_proj = nnx.Linear(
        self.rank, self.d_inner, dtype=dtype, rngs=rngs, bias_init=parts.dt_bias_init,
        kernel_init=lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound,
                                                                 bound))
    # S4D-real: A_cn = n + 1 in every channel; not decayed, as the authors train them
    self.A_log = nnx.Param(jnp.log(jnp.tile(jnp.arange(1.0, self.n + 1), (self.d_inner, 1))),
                           weight_decay=False)                                   # [d_inner, N]
    self.D = nnx.Param(jnp.ones((self.d_inner,)), weight_decay=False)
    self.out = parts.linear(self.d_inner, self.emb_dim, dtype=dtype, rngs=rngs)

  def forward(self, x, mask, state, segment_ids=None):
    xs, z = jnp.split(self.in_proj(x), 2, axis=-1)                               # [b, n, E]
    xs = parts.short_conv(self.conv, xs, mask, decode=state is not None, segment_ids=segment_ids)
    dt, B, C = jnp.split(self.x_proj(xs), [self.rank, self.rank + self.n], axis=-1)  # B, C [b,n,N]
    delta = jax.nn.softplus(self.dt_proj(dt).astype(jnp.float32))                # Δ [b, n, E]
    g = -delta[..., None] * jnp.exp(self.A_log[...])                             # [b, n, E, N]
    per_channel = lambda a: jnp.broadcast_to(a[:, :, None], g.shape)             # [b, n, E, N]
    v = (delta * xs.astype(jnp.float32))[..., None]                              # [b, n, E, 1]
    chunk_op, step_op = ops.chunk_gla, ops.recurrent_gla
    if self.options["allow_neg_eigval"]:      # transitions 2 exp(Δ A) - 1 in (-1, 1]
      chunk_op, step_op = map(ops.with_negative_eigenvalues, (chunk_op, step_op))
    y, state = parts.recurrence(chunk_op, step_op, per_channel(C), per_channel(B), v, g,
                                mask=mask, state=state,
                                chunk_size=self.options["chunk_size"], scale=1.0,
                                segment_ids=segment_ids)
    y = y[..., 0] + self.D[...] * xs.astype(jnp.float32)                         # [b, n, E]
    return self.out((y * jax.nn.silu(z.astype(jnp.float32))).astype(self.dtype)), state

  def empty_state(self, batch_size, max_len, dtype):
    return jnp.zeros((batch_size, self.d_inner, self.n, 1), jnp.float32)
