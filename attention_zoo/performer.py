"""Performer: FAVOR+ attention (Choromanski et al. 2021), softmax approximated by random features.

    exp(q·k · s) = E_ω[φ(q̂) φ(k̂)],   φ(x) = exp(Ωx - |x|²/2) / sqrt(m),   x̂ = x · sqrt(s)
    Attention(Q, K, V) ≈ D⁻¹ φ(Q̂) (φ(K̂)ᵀ V),   D = diag(φ(Q̂) φ(K̂)ᵀ 1)

Ω [m, d] stacks ceil(m/d) orthogonal d x d blocks whose rows get chi(d)-distributed norms, so
each row is marginally N(0, I_d) and rows within a block are orthogonal (lower variance than
i.i.d. rows). One Ω per K/V head. The estimator's variance grows like exp(|q̂ + k̂|²): it is
accurate when q·k·s is moderate and needs many features when queries and keys have large norms.
`kernel="relu"` is generalized attention, φ(x) = relu(Ωx̂) + ε, which defines its own attention
rather than approximating softmax.

Ω is drawn once at construction from the `params` stream and stored (not trainable): it is
used whenever `deterministic=True`, so evaluation is reproducible. With `redraw=True`, every
training call (`deterministic=False`) draws a fresh Ω from the `dropout` stream.

Numerics (f32 whatever the input dtype): per query the max exponent is subtracted (a per-query
constant cancels in D⁻¹); per key the max exponent is carried as a log scale and
`kernelized.linear_attention` rescales keys by the max over the keys each query sees — real
keys only, and only the past when causal — so nothing overflows at bf16 or 16K tokens and
neither padding nor the future leaks in. The 1/sqrt(m) cancels in D⁻¹ and is omitted.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from attention_zoo import kernelized
from attention_zoo.base import ceil_div
from attention_zoo.registry import register

RELU_EPSILON = 1e-3   # keeps generalized-attention denominators positive


class RandomFeatures(nnx.Variable):
  """The fixed random projection Ω: model state, but not a parameter an optimizer trains."""


@functools.partial(jax.jit, static_argnums=(1, 2, 3))   # one compiled draw, not op by op
def orthogonal_gaussian(key, num_kv_heads: int, nb_features: int, head_dim: int):
  """[kvh, m, d]: stacked orthogonal blocks, rows rescaled to chi(d)-distributed norms."""
  num_blocks = ceil_div(nb_features, head_dim)
  block_shape = (num_kv_heads, num_blocks, head_dim, head_dim)
  norm_shape = (num_kv_heads, nb_features, head_dim)
  # One flat draw, split and reshaped: XLA:CPU compiles an N-d random.normal several times slower.
  flat = jax.random.normal(key, (math.prod(block_shape) + math.prod(norm_shape),))
  gaussian = flat[:math.prod(block_shape)].reshape(block_shape)
  q, r = jnp.linalg.qr(gaussian)
  # Fix the column signs so that Q is Haar-distributed, then use its columns as rows.
  q = q * jnp.sign(jnp.diagonal(r, axis1=-2, axis2=-1))[..., None, :]
  rows = jnp.swapaxes(q, -1, -2).reshape(num_kv_heads, num_blocks * head_dim, head_dim)
  norms = jnp.linalg.norm(flat[math.prod(block_shape):].reshape(norm_shape), axis=-1)   # chi(d)
  return rows[:, :nb_features] * norms[..., None]


@register("performer", exact=False, supports_causal=True, supports_cross=True,
          complexity="O(n·m)",
          paper="Choromanski et al. 2021, Rethinking Attention with Performers (arXiv:2009.14794)",
          can_decode=True, supports_dropout=False)
class PerformerAttention(kernelized.KernelizedAttention):
  OPTIONS = {"kernel": "softmax", "nb_features": 256, "redraw": True,
             **kernelized.KernelizedAttention.OPTIONS}
  TEST_OPTIONS = {"nb_features": 64, "chunk_size": 4}

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    kernel, nb_features, redraw = (self.options[k] for k in ("kernel", "nb_features", "redraw"))
    if kernel not in ("softmax", "relu"):
      raise ValueError(f"performer: kernel must be 'softmax' (FAVOR+) or 'relu' (generalized "
                       f"attention), got {kernel!r}")
    if not isinstance(nb_features, int) or nb_features <= 0:
      raise ValueError(f"performer: nb_features must be a positive int, got {nb_features!r}")
    if not isinstance(redraw, bool):
      raise ValueError(f"performer: redraw must be True or False, got {redraw!r}")
    self.features = RandomFeatures(self._draw(self.rngs.params()))   # [kvh, m, d]

  @property
  def nb_features(self) -> int:
    return self.options["nb_features"]

  def _draw(self, key):
    return orthogonal_gaussian(key, self.num_kv_heads, self.nb_features, self.head_dim)

  def projection(self, deterministic: bool):
    """Ω [kvh, m, d]: the stored one, or a fresh draw in training mode with redraw=True."""
    if self.options["redraw"] and not deterministic:
      return self._draw(self.rngs.dropout())
    return self.features[...]

  def feature_maps(self, q, k, *, deterministic: bool):
    omega = self.projection(deterministic)
    root_scale = self.scale ** 0.5
    q_proj = jnp.einsum("bnhgd,hmd->bnhgm", q * root_scale, omega)   # [b, n, kvh, g, m]
    k_proj = jnp.einsum("bnhd,hmd->bnhm", k * root_scale, omega)     # [b, n, kvh, m]
    if self.options["kernel"] == "relu":
      return (jax.nn.relu(q_proj) + RELU_EPSILON, jax.nn.relu(k_proj) + RELU_EPSILON,
              jnp.zeros(k_proj.shape[:-1], jnp.float32))
    # Per query, -|q̂|²/2 is a constant like the max: both cancel in D⁻¹.
    q_feat = jnp.exp(q_proj - jax.lax.stop_gradient(q_proj.max(axis=-1, keepdims=True)))
    k_exponent = k_proj - 0.5 * jnp.sum((k * root_scale) ** 2, axis=-1, keepdims=True)
    log_scale = jax.lax.stop_gradient(k_exponent.max(axis=-1))       # [b, n, kvh]
    return q_feat, jnp.exp(k_exponent - log_scale[..., None]), log_scale
