"""Performer: FAVOR+ attention (Choromanski et al. 2021), softmax approximated by random features.

    exp(q·k · s) = E_ω[φ(q̂) φ(k̂)],   φ(x) = exp(Ωx - |x|²/2) / sqrt(m),   x̂ = x · sqrt(s)
    Attention(Q, K, V) ≈ D⁻¹ φ(Q̂) (φ(K̂)ᵀ V),   D = diag(φ(Q̂) φ(K̂)ᵀ 1)

Ω [m, d] stacks ceil(m/d) orthogonal d x d blocks whose rows get chi(d)-distributed norms, so
each row is marginally N(0, I_d) and rows within a block are orthogonal (lower variance than
i.i.d. rows). One Ω per K/V head. The estimator's variance grows like exp(|q̂ + k̂|²): it is
accurate when q·k·s is moderate and needs many features when queries and keys have large norms.
`kernel="relu"` is generalized attention, φ(x) = relu(Ωx̂) + ε, which defines its own attention
rather than approximating softmax. With `features="deterministic"` (relu only) there is no
random projection: φ(x) = relu(x̂) + ε on the m = d coordinates of the head. That is what
LRA's released code ran by default (its "generalized" attention, deterministic features,
ε = 1e-3); it applied no d^(-1/4) normaliser there, i.e. scale=1.0 here.

Random features: Ω is drawn once at construction from the `params` stream and stored (not
trainable): it is used whenever `deterministic=True`, so evaluation is reproducible. With
`redraw=True`, every training call (`deterministic=False`) draws a fresh Ω from the `dropout`
stream.

Numerics (f32 whatever the input dtype): the feature maps return log φ and
`ops.kernelized.linear_attention` stabilises each feature by its own max over the keys a query
sees (real keys only, and only the past when causal), then each query by its own max, so
nothing overflows or underflows to an all-zero row at large input norms, in bf16 or at 16K
tokens, and neither padding nor the future leaks in. The 1/sqrt(m) cancels in D⁻¹ and is
omitted.

`stabiliser="performer_pytorch"` recreates performer-pytorch 0.15's softmax_kernel (what the
Nyströmformer LRA code ran): φ(x) = exp(Ωx̂ - |x̂|²/2 - c) + 1e-4, with c each query's own max of
Ωq̂ over its features but, for the keys, one max of Ωk̂ over every key, head, feature and row of
the batch. The 1e-4 floor does not cancel: a feature far below that max weighs 1e-4 whatever
its key, so attention flattens as the spread of Ωk̂ grows, and a row's output depends on the
other rows of the batch. The max over all keys makes it non-causal.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from attention_zoo.contract import register
from attention_zoo.ops.blocks import ceil_div
from attention_zoo.options import Bool, Choice, Int
from attention_zoo.variants import kernelized

RELU_EPSILON = 1e-3   # keeps generalized-attention denominators positive
PERFORMER_PYTORCH_EPSILON = 1e-4   # performer-pytorch's softmax_kernel floor


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
          can_decode=True, supports_dropout=False, supports_context_parallel=True)
class PerformerAttention(kernelized.KernelizedAttention):
  # kernel: "softmax" (FAVOR+) or "relu" (generalized attention); features: "random" (a
  # random projection Ω) or "deterministic" (none: the head_dim coordinates, relu only).
  # stabiliser: "per_feature" (the log-space sums of kernelized) or "performer_pytorch" (its
  # softmax_kernel: a floor of 1e-4 under features stabilised by one max over all keys).
  OPTIONS = {"kernel": Choice("softmax", ("softmax", "relu")),
             "features": Choice("random", ("random", "deterministic")),
             "nb_features": Int(256, minimum=1), "redraw": Bool(True),
             "stabiliser": Choice("per_feature", ("per_feature", "performer_pytorch")),
             **kernelized.KernelizedAttention.OPTIONS}
  TEST_OPTIONS = dict(nb_features=64, chunk_size=4)

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    features = self.options["features"]
    if features == "deterministic":
      if self.options["kernel"] != "relu":
        raise self.option_error("features", "'random' with kernel='softmax' (the softmax kernel "
                                            "is estimated from random projections; "
                                            "deterministic features need kernel='relu')")
      given = sorted({"nb_features", "redraw"} & set(kwargs))
      if given:
        raise self.option_error(given[0], f"no {given[0]} with features='deterministic' (no "
                                          f"random projection, so {given[0]} cannot apply: the "
                                          f"features are the head_dim coordinates)")
    if self.options["stabiliser"] == "performer_pytorch":
      if self.options["kernel"] != "softmax":
        raise self.option_error("stabiliser", "'per_feature' with kernel='relu' (performer_pytorch "
                                              "stabilises the softmax kernel's exponentials)")
      if self.causal:
        raise self.option_error("stabiliser", "'per_feature' when causal (performer_pytorch takes "
                                              "one max over every key, future ones included)")
    self.features = (RandomFeatures(self._draw(self.rngs.params())) if features == "random"
                     else None)                                      # Ω [kvh, m, d]

  @classmethod
  def feature_count(cls, head_dim: int, options: dict) -> int:
    return head_dim if options["features"] == "deterministic" else options["nb_features"]

  def _draw(self, key):
    return orthogonal_gaussian(key, self.num_kv_heads, self.nb_features, self.head_dim)

  def projection(self, deterministic: bool):
    """Ω [kvh, m, d]: the stored one, or a fresh draw in training mode with redraw=True."""
    if self.options["redraw"] and not deterministic:
      return self._draw(self.rngs.dropout())
    return self.features[...]

  def feature_maps(self, q, k, *, deterministic: bool, kv_mask=None):
    """log φ: Ωx̂ - |x̂|²/2 (softmax; the query's |q̂|²/2 is a per-query constant, dropped) or
    log(relu(Ωx̂) + ε) (relu); deterministic features: x̂ in place of Ωx̂. The performer_pytorch
    stabiliser: see the module docstring."""
    root_scale = self.scale ** 0.5
    q, k = q * root_scale, k * root_scale
    q_proj, k_proj = q, k
    if self.features is not None:
      omega = self.projection(deterministic)
      q_proj = jnp.einsum("bnhgd,hmd->bnhgm", q, omega)              # [b, n, kvh, g, m]
      k_proj = jnp.einsum("bnhd,hmd->bnhm", k, omega)                # [b, n, kvh, m]
    if self.options["kernel"] == "relu":
      log_phi = lambda x: jnp.log(jax.nn.relu(x) + RELU_EPSILON)
      return log_phi(q_proj), log_phi(k_proj)
    half_norm = lambda x: 0.5 * jnp.sum(x ** 2, axis=-1, keepdims=True)
    if self.options["stabiliser"] == "per_feature":
      return q_proj, k_proj - half_norm(k)
    # log(exp(x - c) + ε); the maxima are not constants here, so their gradients flow (as torch's)
    floor = math.log(PERFORMER_PYTORCH_EPSILON)
    key_max = jnp.max(k_proj if kv_mask is None
                      else jnp.where(kv_mask[:, :, None, None], k_proj, -jnp.inf))
    query_max = jnp.max(q_proj, axis=-1, keepdims=True)
    return (jnp.logaddexp(q_proj - half_norm(q) - query_max, floor),
            jnp.logaddexp(k_proj - half_norm(k) - key_max, floor))
