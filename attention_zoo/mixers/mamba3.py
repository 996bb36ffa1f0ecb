r"""Mamba-3 (Lahoti, Li, Chen, Wang, Bick, Kolter, Dao & Gu 2026, arXiv:2603.15569): Mamba2's
scalar-decay SSM with the exponential-trapezoidal discretisation, a complex-valued state
realised as a data-dependent rotary embedding of B and C, and the MIMO form (rank r).

Per head, with P channels of x and N of the state (h_t [N, P]), for token t:

    Δ_t = softplus(w_Δᵀ u_t + dt_bias),   A_t = -max(softplus(w_Aᵀ u_t), a_floor)
    α_t = exp(Δ_t A_t),   λ_t = σ(w_λᵀ u_t),   γ_t = λ_t Δ_t,   β_t = (1 - λ_t) Δ_t α_t
    φ_t = φ_{t-1} + π tanh(w_θᵀ u_t) Δ_t                     one angle per rotated pair of N
    B̃_t = R(φ_t) (RMSNorm(B_t) + b_B),   C̃_t = R(φ_t) (RMSNorm(C_t) + b_C)
    h_t = α_t h_{t-1} + β_t Σ_j B̃_{t-1,j} x_{t-1,j}ᵀ + γ_t Σ_j B̃_{t,j} x_{t,j}ᵀ
    y_{t,i} = h_tᵀ C̃_{t,i} + D x_{t,i}

R(φ) rotates the channel pairs (2m, 2m+1), m < M = ⌊N · rope_fraction / 2⌋, by φ_m and leaves
the others: the complex diagonal transition α_t e^{iΔ_t θ_t} of the paper, moved onto B and C
("the RoPE trick": h stays real). SISO (mimo_rank 1): one (B, C, x) per token, the output
y ⊙ SiLU(z). MIMO (rank r): r of each, B_{t,j}, C_{t,j} projected, x_{t,j} = x_t ⊙ w^x_j, and
out_t = Σ_i w^o_i ⊙ (y_{t,i} ⊙ SiLU(z_t ⊙ w^z_i)) (per head; w^x, w^o init 1/r, w^z init 1).
The state stays N x P per head; r multiplies the work, not the state.

On the existing scalar-decay op (`ops.chunk_simple_gla`, no new kernel). The β term of token s
reaches h_t (t > s) with the same decay as γ_s's, Π_{u=s+1..t} α_u, so

    y_{t,i} = Σ_{s<=t} Π_{s<u<=t} α_u  (C̃_{t,i} · B̃_{s,j}) w_s x_{s,j}   (summed over j)
              + Σ_j (C̃_{t,i} · B̃_{t,j}) x_{t,j} (γ_t - w_t [j <= i])
    w_s = γ_s + (1 - λ_{s'}) Δ_{s'}      s' the next real token of s's sequence (none: w_s = γ_s)

The first line is scalar-gated linear attention over the sequence flattened to (token, rank)
pairs, keys B̃, queries C̃, values w_s x, the decay on each token's first pair only; the
second puts the token's own block right (the op saw its causal lower triangle with w_t, the
recurrence has the whole r x r block with γ_t; at r = 1 it subtracts the look-ahead weight).
Decoding carries (h, B̃ and x of the last real token, φ); a call adds the pending
(1 - λ_t) Δ_t Σ_j B̃_{t-1,j} x_{t-1,j}ᵀ of its first real token t to h before the op, which
multiplies it by α_t: the β_t term. A masked token leaves all four untouched (no angle, no
write, and the next real token's β term reaches back past it). Packed sequences: the look-ahead
weight stops at a segment's end; the angles run on across segments, which moves no output (C̃_t ·
B̃_s reads only φ_t - φ_s inside a segment). Memory linear in T (the chunk op's).

The layer as the authors' Mamba3 (state-spaces/mamba, mamba_ssm/modules/mamba3.py, read to
learn the conventions): one input projection to [z | x | B | C | Δ | A | λ | θ] (d_inner =
expand · d, B and C r · N per group), no short convolution, B and C RMS-normalised over N (one
learned scale per channel, eps 1e-5) before a bias per head and rank (init 1), θ one angle per
rotated pair shared by the heads (each head's own Δ scales it), rope_fraction 0.5, D per head
(init 1), dt_bias as Mamba2's (dt log-uniform in [1e-3, 0.1]), a_floor 1e-4, no output norm
(their is_outproj_norm=False default).

Where ours differs: the head dimension P = expand · head_dim (theirs fixed at 64, heads
derived); their ngroups is num_kv_heads (default: num_heads groups); the angles are not
wrapped mod 2π (R reads only cos and sin, and an unwrapped sum makes a prefill's state equal
token-by-token decoding's to rounding), and their running sum is one float32 cumsum over the
sequence, so a relative angle φ_t - φ_s carries about 1e-7 |φ_t| rad of rounding (3e-4 rad at
|φ| = 2,500; their kernel wraps the carried sum per chunk); MIMO rotates the same adjacent
pairs as SISO (their MIMO kernel pairs channel m with m + N/4, a fixed permutation of the
learned B and C channels); chunks of 64 count (token, rank) pairs (theirs recommend 64 / r
tokens for MIMO). No context-parallel form: the angle sum and the look-ahead weight cross the
shards, which the chunk engine's dispatch does not carry.
"""
from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from attention_zoo import norms, ops
from attention_zoo.contract import Mixer, register_mixer
from attention_zoo.mixers import parts
from attention_zoo.options import Float, Int


def num_angles(d_state: int, rope_fraction: float) -> int:
  """M, the rotated channel pairs of N: ⌊N · rope_fraction⌋ rounded down to even, halved."""
  return int(d_state * rope_fraction) // 2


def rotate_pairs(v, phi):
  """R(φ) v: channel pairs (2m, 2m+1), m < M, rotated by φ_m, the rest as they are.
  v [b, n, r, h, N], phi [b, n, h, M] -> [b, n, r, h, N] float32."""
  pairs = phi.shape[-1]
  v = v.astype(jnp.float32)
  first, second = v[..., :2 * pairs:2], v[..., 1:2 * pairs:2]                   # [b, n, r, h, M]
  cos, sin = jnp.cos(phi)[:, :, None], jnp.sin(phi)[:, :, None]
  rotated = jnp.stack([first * cos - second * sin, first * sin + second * cos], axis=-1)
  return jnp.concatenate([rotated.reshape(first.shape[:-1] + (2 * pairs,)),
                          v[..., 2 * pairs:]], axis=-1)


def next_real_value(values, mask, segment_ids):
  """For each token s, values at the next real token after s in s's segment, 0 if there is
  none. values [b, n, h], mask bool [b, n], segment_ids [b, n] or None -> [b, n, h]."""
  n = mask.shape[1]
  real_index = jnp.where(mask, jnp.arange(n), n)                                # n: masked
  after = jnp.concatenate([real_index[:, 1:], jnp.full_like(real_index[:, :1], n)], axis=1)
  following = jax.lax.cummin(after, axis=1, reverse=True)                       # [b, n]
  found = following < n
  index = jnp.minimum(following, n - 1)
  if segment_ids is not None:
    found &= jnp.take_along_axis(segment_ids, index, axis=1) == segment_ids
  picked = jnp.take_along_axis(values, index[..., None], axis=1)
  return jnp.where(found[..., None], picked, 0.0)


@register_mixer("mamba3", complexity="O(n·r·C·(N + P) + n·r·N·P)",
                paper="Lahoti et al. 2026, Mamba-3: Improved Sequence Modeling using State "
                      "Space Principles (arXiv:2603.15569)",
                supports_segment_ids=True)
class Mamba3(Mixer):
  OPTIONS = {"expand": Int(2, minimum=1), "d_state": Int(128, minimum=2),
             "rope_fraction": Float(0.5, above=0, maximum=1), "mimo_rank": Int(1, minimum=1),
             "chunk_size": Int(64, minimum=1, optional=True), "a_floor": Float(1e-4, above=0)}
  # Chunks of 8 (token, rank) pairs at the suite's length 20: several, a partial last one.
  TEST_OPTIONS = dict(chunk_size=8, d_state=8)

  @classmethod
  def state_size(cls, *, num_heads, head_dim, options, **dims) -> int:
    n, p, r = options["d_state"], options["expand"] * head_dim, options["mimo_rank"]
    return num_heads * (n * p + r * (n + p) + num_angles(n, options["rope_fraction"]))

  def __init__(self, *, rngs, **kwargs):
    super().__init__(rngs=rngs, **kwargs)
    h, groups, dtype = self.num_heads, self.num_kv_heads, self.dtype
    self.p = self.options["expand"] * self.head_dim           # P, channels per head
    self.n = self.options["d_state"]                          # N, the state per channel
    self.rank = self.options["mimo_rank"]
    self.angles = num_angles(self.n, self.options["rope_fraction"])
    if self.angles < 1:
      raise self.option_error("rope_fraction", f"a value leaving at least one rotated pair of "
                                               f"d_state {self.n} channels")
    self.d_inner = h * self.p
    self.bc_width = self.rank * groups * self.n
    # z | x | B | C | Δ | A | λ | θ
    self.in_proj = parts.linear(self.emb_dim, 2 * self.d_inner + 2 * self.bc_width + 3 * h
                                + self.angles, dtype=dtype, rngs=rngs)
    self.dt_bias = nnx.Param(parts.dt_bias_init(rngs.params(), (h,)), weight_decay=False)
    self.b_norm = norms.GatedRMSNorm(self.n)
    self.c_norm = norms.GatedRMSNorm(self.n)
    self.b_bias = nnx.Param(jnp.ones((self.rank, h, self.n)))
    self.c_bias = nnx.Param(jnp.ones((self.rank, h, self.n)))
    self.D = nnx.Param(jnp.ones((h,)), weight_decay=False)   # the authors': no decay
    if self.rank > 1:      # MIMO: x up to r values, z to r gates, the r outputs down to one
      self.mimo_x = nnx.Param(jnp.full((self.rank, h, self.p), 1 / self.rank))
      self.mimo_z = nnx.Param(jnp.ones((self.rank, h, self.p)))
      self.mimo_out = nnx.Param(jnp.full((self.rank, h, self.p), 1 / self.rank))
    self.out = parts.linear(self.d_inner, self.emb_dim, dtype=dtype, rngs=rngs)

  def forward(self, x, mask, state, segment_ids=None):
    b, n, _ = x.shape
    h, groups, p, d_state, r = self.num_heads, self.num_kv_heads, self.p, self.n, self.rank
    widths = (self.d_inner, self.d_inner, self.bc_width, self.bc_width, h, h, h)
    z, xs, B, C, dt, a, trap, theta = jnp.split(self.in_proj(x), list(itertools.accumulate(widths)),
                                                axis=-1)
    delta = jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias[...])          # Δ [b, n, h]
    rate = jnp.maximum(jax.nn.softplus(a.astype(jnp.float32)), self.options["a_floor"])
    lam = jax.nn.sigmoid(trap.astype(jnp.float32))                               # λ [b, n, h]
    increment = (math.pi * jnp.tanh(theta.astype(jnp.float32))[:, :, None, :]
                 * delta[..., None])                                             # [b, n, h, M]
    phi = jnp.cumsum(jnp.where(mask[:, :, None, None], increment, 0.0), axis=1)
    if state is not None:
      phi = phi + state["angle"][:, None]

    def rotated(proj, norm, bias):                                               # [b, n, r, h, N]
      heads = parts.repeat_kv(norm(proj.reshape(b, n, r, groups, d_state)), h)
      return rotate_pairs(heads + bias[...], phi)
    keys, queries = rotated(B, self.b_norm, self.b_bias), rotated(C, self.c_norm, self.c_bias)
    xs = xs.reshape(b, n, 1, h, p).astype(jnp.float32)
    values = xs * self.mimo_x[...] if r > 1 else xs                             # [b, n, r, h, P]

    gamma = lam * delta
    ahead = (1 - lam) * delta             # what a token's β term weighs its predecessor by / α
    weight = gamma + next_real_value(ahead, mask, segment_ids)                   # w [b, n, h]
    initial = None
    if state is not None:                 # the pending β term of this call's first real token
      first = jnp.argmax(mask, axis=1)
      pending = jnp.take_along_axis(ahead, first[:, None, None], axis=1)[:, 0]
      pending = jnp.where(jnp.any(mask, axis=1)[:, None], pending, 0.0)          # [b, h]
      initial = state["h"] + pending[..., None, None] * jnp.einsum(
          "brhk,brhv->bhkv", state["key"], state["value"])

    # (token, rank) pairs as one sequence: the decay on each token's first pair only
    flat = lambda a: a.reshape(b, n * r, *a.shape[3:])
    log_decay = jnp.zeros((b, n, r, h)).at[:, :, 0].set(delta * -rate)
    repeat = lambda a: None if a is None else jnp.repeat(a, r, axis=1)
    o, final = parts.recurrence(
        ops.chunk_simple_gla, ops.recurrent_simple_gla, flat(queries).astype(self.dtype),
        flat(keys).astype(self.dtype), flat(values * weight[:, :, None, :, None]),
        flat(log_decay), mask=repeat(mask), state=initial,
        chunk_size=self.options["chunk_size"], scale=1.0, segment_ids=repeat(segment_ids))
    o = o.reshape(b, n, r, h, p).astype(jnp.float32)
    # the token's own r x r block: γ_t on every pair, not w_t on the lower triangle
    scores = jnp.einsum("bnihk,bnjhk->bnhij", queries, keys)
    own = gamma[..., None, None] - weight[..., None, None] * jnp.tril(jnp.ones((r, r)))
    y = o + jnp.einsum("bnhij,bnjhv->bnihv", scores * own, values)
    y = y + self.D[...][:, None] * values                                       # [b, n, r, h, P]
    z = z.reshape(b, n, 1, h, p).astype(jnp.float32)
    if r > 1:
      y = jnp.sum(self.mimo_out[...] * y * jax.nn.silu(z * self.mimo_z[...]), axis=2)
    else:
      y = y[:, :, 0] * jax.nn.silu(z[:, :, 0])                                   # [b, n, h, P]
    y = self.out(y.reshape(b, n, self.d_inner).astype(self.dtype))
    if state is None:
      return y, None
    last = (n - 1 - jnp.argmax(mask[:, ::-1], axis=1))[:, None, None, None, None]
    seen = jnp.any(mask, axis=1)[:, None, None, None]
    carry = lambda a, old: jnp.where(seen, jnp.take_along_axis(a, last, axis=1)[:, 0], old)
    return y, {"h": final, "key": carry(keys, state["key"]),
               "value": carry(values, state["value"]), "angle": phi[:, -1]}

  def empty_state(self, batch_size, max_len, dtype):
    h, r = self.num_heads, self.rank
    return {"h": jnp.zeros((batch_size, h, self.n, self.p), jnp.float32),
            "key": jnp.zeros((batch_size, r, h, self.n), jnp.float32),
            "value": jnp.zeros((batch_size, r, h, self.p), jnp.float32),
            "angle": jnp.zeros((batch_size, h, self.angles), jnp.float32)}
