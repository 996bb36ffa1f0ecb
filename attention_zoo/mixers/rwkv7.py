r"""RWKV-7 "Goose" (Peng et al. 2025, arXiv:2503.14456): the time-mix layer, whose state evolves
by a diagonal-plus-rank-1 transition (a generalised delta rule with a decay and an in-context
learning rate per key channel).

    x^◇_t = x_t + μ_◇ ⊙ (x_{t-1} - x_t)                 ◇ ∈ {r, w, k, v, a, g} (token shift)
    r_t = W_r x^r_t,   k_t = W_k x^k_t,   v_t = W_v x^v_t
    w_t = exp(-e^{-1/2} σ(d_t)),   d_t = tanh(x^w_t W_w1) W_w2 + b_w          decay in (0.545, 1)
    a_t = σ(x^a_t W_a1 W_a2 + b_a)                                   in-context learning rate
    κ̂_t = (k_t ⊙ ξ) / ‖k_t ⊙ ξ‖ per head,   k̃_t = k_t ⊙ (1 + (a_t - 1) ⊙ α)
    S_t = (Diag(w_t) - (a_t ⊙ κ̂_t) κ̂_tᵀ) S_{t-1} + k̃_t v_tᵀ            S_t [d_k, d_v] per head
    p_t = GroupNorm(S_tᵀ r_t) + (Σ_i r_ti ρ_i k̃_ti) v_t                (per head; the bonus)
    o_t = (p_t ⊙ g_t) W_o,   g_t = σ(x^g_t W_g1) W_g2

The transition is `attention_zoo.ops.chunk_dplr_delta_rule` with q = r, k = k̃, g = log w,
a = -κ̂, b = κ̂ ⊙ a_t and scale 1 (chunkwise; the token form in decoding). The token shift is
static (μ learned per channel, as the paper's RWKV-7; RWKV-6's was data-dependent); a masked
token enters it as zeros, and decoding keeps the last input (`convolution.TokenShift`).

The layer as flash-linear-attention defines it (fla/layers/rwkv7.py, its first layer's
initialisation): bias-free r, k, v and output projections; the low-rank maps as above, of rank
max(32, round(2.5·√d·head_dim/64 / 32)·32) for w and a and max(32, round(5·√d / 32)·32) for
g (d = emb_dim; the options decay_low_rank_dim, a_low_rank_dim, gate_low_rank_dim); a
GroupNorm per head with eps = head_dim · norm_eps and a scale and bias per channel; μ_◇ =
1 - (i/d)^p with p 0.2 (r, g), 0.7 (k, v), 0.9 (w, a); ξ = 0.71 - 0.1·l, α = 1.02, ρ = -0.04,
b_w = -6 + 6·(l + 1/2) + 1/2 + 2.5·z and b_a = -0.19 + 0.3·z + 0.4·l over the key channels
(l linear from -1/2 to 1/2 over all of them, z = ζ|ζ| with ζ linear from -1 to 1 within each
head), so w_t = exp(-e^{-1/2} σ(b_w)) lies between about 0.56 and 0.9998 where the low-rank
term is 0. μ, ξ, α and ρ carry `weight_decay=False` (the authors decay only the matrices).

Where ours differs: the value residual of the full model (v_t = lerp(v_t, v_t of the first
layer, σ(low-rank(x^v_t))), which needs the first layer's values) is left out: a mixer sees only
its own input. The projections and low-rank factors start at the zoo's default initialisation
(fla: orthogonal, zero first low-rank factors, a zero output projection and a GroupNorm scale
((layer + 1)/layers)^0.7; here 1): a zero factor would leave its partner without gradient at
the first step. Head dimensions come from the model's (d_k = d_v = qkv_dim / num_heads; fla
fixes head_dim 64). num_kv_heads < num_heads shares k and v between query heads (GQA), with r,
w, a, g, ξ, α and ρ per query head.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from attention_zoo import norms, ops
from attention_zoo.contract import Mixer, register_mixer
from attention_zoo.convolution import TokenShift
from attention_zoo.mixers import parts
from attention_zoo.options import Float, Int

# the branches of the token shift, each with its own μ
BRANCHES = ("r", "w", "k", "v", "a", "g")
# μ_◇ = 1 - (i/d)^p at the first layer (fla's initialisation)
SHIFT_POWERS = {"r": 0.2, "w": 0.9, "k": 0.7, "v": 0.7, "a": 0.9, "g": 0.2}
# w = exp(-e^{-1/2} σ(d)): the log-decay lies in (-e^{-1/2}, 0)
DECAY_BOUND = math.exp(-0.5)


def fla_rank(emb_dim: int, multiplier: float, factor: float = 1.0) -> int:
  """fla's default low-rank width: max(32, round(multiplier·√emb_dim·factor / 32)·32)."""
  return max(32, int(round(multiplier * emb_dim ** 0.5 * factor / 32) * 32))


@register_mixer("rwkv7", complexity="O(n·C·d + n·d²)",
                paper="Peng et al. 2025, RWKV-7 \"Goose\" with Expressive Dynamic State "
                      "Evolution (arXiv:2503.14456)",
                supports_segment_ids=True, supports_context_parallel=True)
class RWKV7(Mixer):
  OPTIONS = {"decay_low_rank_dim": Int(None, minimum=1, optional=True),
             "a_low_rank_dim": Int(None, minimum=1, optional=True),
             "gate_low_rank_dim": Int(None, minimum=1, optional=True),
             "chunk_size": Int(64, minimum=1), "norm_eps": Float(1e-5, above=0)}
  # Chunks of 8 at the suite's length 20: several chunks and a partial last one; small ranks.
  TEST_OPTIONS = dict(chunk_size=8, decay_low_rank_dim=8, a_low_rank_dim=8, gate_low_rank_dim=8)
  state_size = classmethod(parts.key_value_state_size)

  def __init__(self, *, rngs, **kwargs):
    super().__init__(rngs=rngs, **kwargs)
    emb, h, kvh, d, dtype = (self.emb_dim, self.num_heads, self.num_kv_heads, self.head_dim,
                             self.dtype)
    self.d_k = self.d_v = d
    options = self.options
    ranks = {"w": options["decay_low_rank_dim"] or fla_rank(emb, 2.5, d / 64),
             "a": options["a_low_rank_dim"] or fla_rank(emb, 2.5, d / 64),
             "g": options["gate_low_rank_dim"] or fla_rank(emb, 5.0)}
    self.conv = TokenShift(emb)    # named conv: the base class prepares its decode cache
    depth = jnp.arange(emb) / emb                                                # i/d [emb]
    self.mu = nnx.Param(jnp.stack([1 - depth ** SHIFT_POWERS[name] for name in BRANCHES]),
                        weight_decay=False)                                      # [6, emb]
    self.r_proj = parts.linear(emb, h * d, dtype=dtype, rngs=rngs)
    self.k_proj = parts.linear(emb, kvh * d, dtype=dtype, rngs=rngs)
    self.v_proj = parts.linear(emb, kvh * d, dtype=dtype, rngs=rngs)
    self.w_lora = parts.low_rank(emb, ranks["w"], h * d, dtype=dtype, rngs=rngs, bias=True,
                                 activation=jnp.tanh)
    self.a_lora = parts.low_rank(emb, ranks["a"], h * d, dtype=dtype, rngs=rngs, bias=True)
    self.g_lora = parts.low_rank(emb, ranks["g"], h * d, dtype=dtype, rngs=rngs,
                                 activation=jax.nn.sigmoid)
    # fla's first-layer values over the h·d key channels: l linear, z = ζ|ζ| per head
    channel = jnp.arange(h * d)
    linear = channel / max(h * d - 1, 1) - 0.5
    zigzag = (channel % d - (d - 1) / 2) / max((d - 1) / 2, 1)
    zigzag = zigzag * jnp.abs(zigzag)
    self.w_lora.layers[-1].bias[...] = -6 + 6 * (linear + 0.5) + 0.5 + 2.5 * zigzag
    self.a_lora.layers[-1].bias[...] = -0.19 + 0.3 * zigzag + 0.4 * linear
    self.k_k = nnx.Param((0.71 - 0.1 * linear).reshape(h, d), weight_decay=False)   # ξ
    self.k_a = nnx.Param(jnp.full((h, d), 1.02), weight_decay=False)                # α
    self.r_k = nnx.Param(jnp.full((h, d), -0.04), weight_decay=False)               # ρ
    self.norm = nnx.GroupNorm(h * d, num_groups=h, epsilon=d * options["norm_eps"],
                              use_fast_variance=False, rngs=rngs)
    self.out = parts.linear(h * d, emb, dtype=dtype, rngs=rngs)

  def forward(self, x, mask, state, segment_ids=None):
    b, n, _ = x.shape
    h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
    x = jnp.where(mask[..., None], x, 0)                 # a masked token shifts in as zeros
    previous = self.conv(x, decode=state is not None, segment_ids=segment_ids)  # x_{t-1}
    mu = self.mu[...].astype(x.dtype)
    xr, xw, xk, xv, xa, xg = (x + mu[i] * (previous - x) for i in range(len(BRANCHES)))
    heads = lambda y, count: y.astype(jnp.float32).reshape(b, n, count, d)
    r = heads(self.r_proj(xr), h)                                                # [b, n, h, d]
    k = parts.repeat_kv(heads(self.k_proj(xk), kvh), h)                          # [b, n, h, d]
    v = parts.repeat_kv(heads(self.v_proj(xv), kvh), h)                          # [b, n, h, d]
    log_w = -DECAY_BOUND * jax.nn.sigmoid(heads(self.w_lora(xw), h))             # [b, n, h, d]
    a = jax.nn.sigmoid(heads(self.a_lora(xa), h))                                # [b, n, h, d]
    kappa = norms.l2_normalise(k * self.k_k[...])                                # κ̂ [b,n,h,d]
    k = k * (1 + (a - 1) * self.k_a[...])                                        # k̃ [b,n,h,d]
    o, state = parts.recurrence(ops.chunk_dplr_delta_rule, ops.recurrent_dplr_delta_rule, r,
                                k, v, -kappa, kappa * a, log_w, mask=mask, state=state,
                                chunk_size=self.options["chunk_size"], scale=1.0,
                                segment_ids=segment_ids)
    o = self.norm(o.astype(jnp.float32).reshape(b * n, h * d)).reshape(b, n, h, d)
    bonus = jnp.sum(r * self.r_k[...] * k, axis=-1, keepdims=True) * v           # [b, n, h, d]
    gate = self.g_lora(xg).astype(jnp.float32)                                   # [b, n, h·d]
    return self.out(((o + bonus).reshape(b, n, h * d) * gate).astype(self.dtype)), state

  def empty_state(self, batch_size, max_len, dtype):
    return jnp.zeros((batch_size, self.num_heads, self.d_k, self.d_v), jnp.float32)
