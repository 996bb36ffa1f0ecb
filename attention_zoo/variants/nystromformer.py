"""Nyströmformer (Xiong et al. 2021): softmax attention through m landmarks, Nyström-style.

With landmarks Q̃, K̃ [m, d], the means of m contiguous segments of the queries and the keys,

    softmax(Q Kᵀ · s)  ≈  softmax(Q K̃ᵀ · s) · softmax(Q̃ K̃ᵀ · s)⁺ · softmax(Q̃ Kᵀ · s)
                               F [n, m]          A [m, m]              B [m, n]

and out = F (A⁺ (B V)): no n x n matrix is ever formed, O(n·m) memory and O(n·m·d) time.
A⁺ is the iterative Moore-Penrose pseudo-inverse the paper uses (`pinv_iterations` steps):

    Z₀ = Aᵀ / (‖A‖₁ ‖A‖∞),   Z ← ¼ Z (13 I − A Z (15 I − A Z (7 I − A Z)))

Few iterations also regularise: with m < n the exact A⁺ of an ill-conditioned A is worse. On
random inputs (n 64, m 16, head_dim 16) 20 iterations gave 2.5-4x the error to softmax
attention that the default 6 gave.

Padding. Landmarks are formed from the real tokens only: the c real tokens of a row, in order,
are split into m contiguous segments of ⌊c/m⌋ or ⌈c/m⌉ tokens (the paper's segment means when m
divides c, and any length works without padding). When c < m every real token is its own
landmark and the other landmarks are empty; empty landmarks are masked out of F, A and B (the
pseudo-inverse keeps the zero rows and columns of A at zero), and padded keys get no weight in
B. A padded row therefore gives exactly what the same row without its padding gives, holes
included (the convolution, when on, sees a hole as a zero value). With m >= c, Q̃ = Q and
K̃ = K, so F = A = B = S and S A⁺ S = S: exact up to the pseudo-inverse's accuracy.

The paper's LRA code formed landmarks otherwise, behind `landmarks="padded_segments"`: q and k
zeroed at padding, then the means of m equal segments of the padded length n (padding counted,
so a short row has landmarks of zeros), with F and A left unmasked and only B masking padded
keys. Its pseudo-inverse started from Z₀ = Aᵀ / (max ‖A‖₁ · max ‖A‖∞) with the maxima over
every matrix of the batch and every head (`pinv_init="batch_global"`), so an output depends on
the other rows of the batch.

`conv_kernel_size` > 0 adds the skip connection of the paper's code, a depthwise convolution of
V over the sequence (one filter per query head, shared across head_dim, padded values zeroed);
its LRA runs use 35. The default 0 (no convolution) keeps the variant a pure approximation of
softmax attention. The convolution ties query i to value i, hence self-attention only.
Attention dropout drops entries of F and B, the two attention-weight matrices; A is kept
whole because its pseudo-inverse would amplify the noise.
The sums over the sequence (landmarks, B V, the convolution) are ops/nystrom.py's, which also
runs them context-parallel.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from attention_zoo.contract import Attention, register
from attention_zoo.ops import nystrom, softmax
from attention_zoo.options import Choice, Int


@register("nystromformer", exact=False, supports_causal=False, supports_cross=False,
          complexity="O(n·m)",
          paper="Xiong et al. 2021, Nyströmformer: A Nyström-Based Algorithm for Approximating "
                "Self-Attention (arXiv:2102.03902)",
          supports_context_parallel=True)
class NystromformerAttention(Attention):
  OPTIONS = {"num_landmarks": Int(64, minimum=1), "pinv_iterations": Int(6, minimum=1),
             "conv_kernel_size": Int(0, minimum=0, where=(
                 "0 (no skip convolution) or odd (a window centred on each token; the paper's "
                 "LRA code uses 35)", lambda n: n == 0 or n % 2 == 1)),
             # "padded_segments", "batch_global": the paper's LRA code (module docstring)
             "landmarks": Choice("real_tokens", ("real_tokens", "padded_segments")),
             "pinv_init": Choice("per_matrix", ("per_matrix", "batch_global"))}
  # 6 landmarks at length 20: uneven segments; with padding some rows have fewer real tokens.
  TEST_OPTIONS = dict(num_landmarks=6, conv_kernel_size=5)
  WHY_NOT_CAUSAL = ("each landmark is the mean of a whole segment and every landmark query sees "
                    "every key, so each output depends on later tokens")

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    taps = self.options["conv_kernel_size"]
    # PyTorch's default Conv init, as in the paper's code: U(±1/sqrt(fan_in)).
    self.conv = None if taps == 0 else nnx.Param(jax.random.uniform(     # [taps, 1, h]
        self.rngs.params(), (taps, 1, self.num_heads), minval=-taps ** -0.5,
        maxval=taps ** -0.5))

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic):
    num_landmarks = self.options["num_landmarks"]
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    # Padded values zeroed: not even a NaN pad can reach B V.
    v = jnp.where(kv_mask[:, :, None, None], v.astype(jnp.float32), 0.0)
    equal_segments = self.options["landmarks"] == "padded_segments"
    if equal_segments:
      self._check_padded_segments(q.shape[1], num_landmarks)
      q = jnp.where(q_mask[:, :, None, None], q, 0.0)
      k = jnp.where(kv_mask[:, :, None, None], k, 0.0)
    # l indexes the query landmarks, m the key landmarks (as many of each: num_landmarks).
    grouped = softmax.group_heads(q, self.num_kv_heads)                    # [b, n, kvh, g, d]
    q_landmarks, q_landmark_real = nystrom.landmark_means(
        grouped, q_mask, num_landmarks, equal_segments=equal_segments)     # [b, l, kvh, g, d]
    k_landmarks, k_landmark_real = nystrom.landmark_means(
        k, kv_mask, num_landmarks, equal_segments=equal_segments)          # [b, m, kvh, d]
    q_real = q_landmark_real[:, None, None, :, None]                       # [b, 1, 1, l, 1]
    k_real = k_landmark_real[:, None, None, None, :]                       # [b, 1, 1, 1, m]

    kernel_f = softmax.masked_softmax(
        jnp.einsum("bnhgd,bmhd->bhgnm", grouped, k_landmarks) * self.scale,
        k_real)                                                            # F [b, kvh, g, n, m]
    kernel_a = softmax.masked_softmax(
        jnp.einsum("blhgd,bmhd->bhglm", q_landmarks, k_landmarks) * self.scale,
        q_real & k_real)                                                   # A [b, kvh, g, l, m]
    kernel_f = self.dropout(kernel_f, deterministic)
    landmark_values = nystrom.landmark_values(                             # B V [b, kvh, g, l, d]
        jnp.einsum("blhgd,bnhd->bhgln", q_landmarks, k) * self.scale,      # B's scores
        q_real & kv_mask[:, None, None, None, :], v, dropout_rate=self.dropout_rate,
        dropout_rng=self.dropout_rng(deterministic))
    inverse = pinv(kernel_a, self.options["pinv_iterations"],
                   batch_global=self.options["pinv_init"] == "batch_global")
    landmark_values = inverse @ landmark_values                            # A⁺ B V [.., m, d]
    out = jnp.einsum("bhgnm,bhgmd->bnhgd", kernel_f, landmark_values)      # [b, n, kvh, g, d]
    if self.conv is not None:
      out = out + self._skip_conv(v)
    return out.reshape(q.shape)

  def _check_padded_segments(self, length: int, num_landmarks: int):
    """The paper's LRA landmarks cut all n positions into m equal segments."""
    if length % num_landmarks:
      raise self.option_error("landmarks", f"'real_tokens' for a length n={length} that is not a "
                                           f"multiple of num_landmarks={num_landmarks} "
                                           "('padded_segments' cuts n into equal segments)")

  def _skip_conv(self, v):
    """Depthwise convolution over the sequence: v [b, n, kvh, d] -> [b, n, kvh, g, d]."""
    b, n, num_kv_heads, head_dim = v.shape
    channels_last = v.transpose(0, 3, 1, 2).reshape(b * head_dim, n, num_kv_heads)  # [b·d, n, kvh]
    out = nystrom.sequence_conv(channels_last, self.conv[...],
                                feature_group_count=num_kv_heads)          # [b·d, n, h], head-major
    group = self.num_heads // num_kv_heads
    return out.reshape(b, head_dim, n, num_kv_heads, group).transpose(0, 2, 3, 4, 1)


def pinv(a, iterations: int, *, batch_global: bool = False):
  """Iterative Moore-Penrose pseudo-inverse of a [..., m, m] with non-negative entries.

  Z₀ = Aᵀ / (‖A‖₁ ‖A‖∞) and the paper's third-order update; with `batch_global` each norm is
  its maximum over every matrix of `a` (the paper's LRA code). The m x m products (cheap) run
  at full f32 precision rather than a backend's reduced default (TF32): the iteration
  compounds rounding.
  """
  matmul = partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)
  identity = jnp.eye(a.shape[-1], dtype=a.dtype)
  norm_1, norm_inf = a.sum(axis=-2).max(axis=-1), a.sum(axis=-1).max(axis=-1)   # ‖A‖₁, ‖A‖∞ [...]
  if batch_global:
    norm_1, norm_inf = norm_1.max(), norm_inf.max()
  norm = norm_1 * norm_inf
  # An all-empty A stays 0.
  z = jnp.swapaxes(a, -1, -2) / jnp.where(norm > 0, norm, 1.0)[..., None, None]
  for _ in range(iterations):
    az = matmul(a, z)
    z = 0.25 * matmul(z, 13 * identity - matmul(az, 15 * identity - matmul(az, 7 * identity - az)))
  return z
