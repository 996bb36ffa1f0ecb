r"""Mamba2's SSD layer (Dao & Gu 2024, arXiv:2405.21060): a state space model whose scalar,
data-dependent decay per head makes it gated linear attention with q = C, k = B, v = Δ·x.

    h_t = exp(Δ_t A_h) h_{t-1} + B_t (Δ_t x_t)ᵀ,    y_t = h_tᵀ C_t + D_h x_t      h_t [N, P]
    Δ_t = softplus(w_Δᵀ x_t + dt_bias),   A_h = -exp(A_log_h)

The layer as its authors define it (mamba_ssm Mamba2, fla/layers/mamba2.py): one input
projection to [z | x | B | C | Δ] (d_inner = expand · d = 2d, P = head dim, N = d_state = 128;
B and C shared by the heads of a group); a kernel-4 causal conv (with bias) and SiLU over
[x, B, C] (Δ is not convolved); A ~ U(1, 16), dt_bias = softplus⁻¹(dt) with dt log-uniform in
[1e-3, 0.1] (`parts.DecayGate`), so at init α = exp(ΔA) lies in about [0.2, 0.999]; a
D skip per head (init 1); y ⊙ SiLU(z) RMS-normalised over each group's d_inner / groups
channels with one scale per channel (the gate before the norm, unlike GLA's), then the output
projection. Scale 1.
Chunkwise by `attention_zoo.ops.chunk_simple_gla` (chunks of 256, the authors').

allow_neg_eigval replaces the transition exp(Δ_t A_h) by 2 exp(Δ_t A_h) - 1 in (-1, 1], the
modification Grazzi et al. 2025 (arXiv:2411.12537) make to Mamba, applied to the scalar decay
per head: the op carries the sign apart (`attention_zoo.ops.with_negative_eigenvalues`), exact
in the chunk and token forms and in decoding.

Where ours differs: the head dimension P = expand · qkv_dim / num_heads follows the model's
(the authors fix P = 64 and derive the head count); the authors' n_groups is num_kv_heads
(their default, one group, is num_kv_heads=1; ours defaults to num_heads groups); Δ is not
clamped (the authors' dt_limit defaults to (0, inf)); D is per head (D_has_hdim=False).
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from attention_zoo import norms, ops
from attention_zoo.contract import Mixer, register_mixer
from attention_zoo.convolution import ShortConv
from attention_zoo.mixers import parts
from attention_zoo.options import Bool, Float, Int


@register_mixer("mamba2", complexity="O(n·C·(N + P) + n·N·P)",
                paper="Dao & Gu 2024, Transformers are SSMs: Generalized Models and Efficient "
                      "Algorithms Through Structured State Space Duality (arXiv:2405.21060)",
                supports_segment_ids=True, supports_context_parallel=True)
class Mamba2(Mixer):
  OPTIONS = {"expand": Int(2, minimum=1), "d_state": Int(128, minimum=1),
             "conv_size": Int(4, minimum=1), "chunk_size": Int(256, minimum=1),
             "norm_eps": Float(1e-5, above=0), "allow_neg_eigval": Bool(False)}
  # Chunks of 8 at the suite's length 20: several chunks and a partial last one.
  TEST_OPTIONS = dict(chunk_size=8, d_state=8)

  @classmethod
  def state_size(cls, *, num_heads, head_dim, options, **dims) -> int:
    return num_heads * options["d_state"] * options["expand"] * head_dim

  def __init__(self, *, rngs, **kwargs):
    super().__init__(rngs=rngs, **kwargs)
    h, groups, dtype = self.num_heads, self.num_kv_heads, self.dtype
    self.p = self.options["expand"] * self.head_dim          # P, channels per head
    self.n = self.options["d_state"]                          # N, the state per channel
    self.d_inner = h * self.p
    conv_channels = self.d_inner + 2 * groups * self.n        # x | B | C
    self.in_proj = parts.linear(self.emb_dim, self.d_inner + conv_channels + h, dtype=dtype,
                                rngs=rngs)                    # z | x | B | C | Δ
    self.conv = ShortConv(conv_channels, self.options["conv_size"], dtype=dtype, rngs=rngs)
    self.decay = parts.DecayGate(h, a_range=(1.0, 16.0), rngs=rngs)
    self.D = nnx.Param(jnp.ones((h,)), weight_decay=False)   # the authors': no decay
    # one scale per channel, RMS over each group's channels (RMSNormGated(d_inner, group_size))
    self.norm = norms.GatedRMSNorm(self.d_inner, group_size=self.d_inner // groups,
                                   eps=self.options["norm_eps"], norm_before_gate=False)
    self.out = parts.linear(self.d_inner, self.emb_dim, dtype=dtype, rngs=rngs)

  def forward(self, x, mask, state, segment_ids=None):
    b, n, _ = x.shape
    h, groups, p, d_state = self.num_heads, self.num_kv_heads, self.p, self.n
    z, xbc, dt = jnp.split(self.in_proj(x), [self.d_inner, 2 * self.d_inner + 2 * groups * d_state],
                           axis=-1)
    xbc = parts.short_conv(self.conv, xbc, mask, decode=state is not None,
                           segment_ids=segment_ids)
    xs, B, C = jnp.split(xbc, [self.d_inner, self.d_inner + groups * d_state], axis=-1)
    xs = xs.reshape(b, n, h, p)                                                  # [b, n, h, P]
    B = parts.repeat_kv(B.reshape(b, n, groups, d_state), h)                     # [b, n, h, N]
    C = parts.repeat_kv(C.reshape(b, n, groups, d_state), h)                     # [b, n, h, N]
    delta, g = self.decay(dt)                                                    # [b, n, h]
    v = xs.astype(jnp.float32) * delta[..., None]                                # [b, n, h, P]
    chunk_op, step_op = ops.chunk_simple_gla, ops.recurrent_simple_gla
    if self.options["allow_neg_eigval"]:      # transitions 2 exp(Δ A) - 1 in (-1, 1]
      chunk_op, step_op = map(ops.with_negative_eigenvalues, (chunk_op, step_op))
    y, state = parts.recurrence(chunk_op, step_op, C, B, v, g, mask=mask, state=state,
                                chunk_size=self.options["chunk_size"], scale=1.0,
                                segment_ids=segment_ids)
    y = y + self.D[...][:, None] * xs.astype(jnp.float32)                        # [b, n, h, P]
    y = self.norm(y.reshape(b, n, self.d_inner), z)                              # [b, n, h·P]
    return self.out(y.astype(self.dtype)), state

  def empty_state(self, batch_size, max_len, dtype):
    return jnp.zeros((batch_size, self.num_heads, self.n, self.p), jnp.float32)
