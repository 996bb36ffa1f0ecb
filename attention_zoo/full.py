"""Full softmax attention (Vaswani et al. 2017), the O(n²) baseline every variant is compared to.

    Attention(Q, K, V) = softmax(Q Kᵀ / sqrt(d) + B) V

with B = -inf outside the allowed keys (padding, causal) and B = ALiBi when slopes are given.
`impl="xla"` is reference.masked_softmax_attention: the dense path with grouped heads (no K/V
copy for GQA/MQA) and a hand-written backward that saves only the weights;
`impl="cudnn"` calls `jax.nn.dot_product_attention(implementation="cudnn")` and runs only on
an NVIDIA GPU.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from attention_zoo import reference
from attention_zoo.base import Attention
from attention_zoo.options import Choice
from attention_zoo.registry import register


@register("full", exact=True, supports_causal=True, supports_cross=True, complexity="O(n²)",
          paper="Vaswani et al. 2017, Attention Is All You Need (arXiv:1706.03762)",
          can_decode=True, supports_alibi=True)
class FullAttention(Attention):
  OPTIONS = {"impl": Choice("xla", ("xla", "cudnn"))}

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    if self.options["impl"] == "cudnn" and jax.default_backend() != "gpu":
      raise self.option_error("impl", f"'xla' on the {jax.default_backend()!r} backend "
                                      f"(impl='cudnn' needs an NVIDIA GPU)")

  def pattern(self, q_len: int, kv_len: int):
    return reference.causal_pattern(q_len, kv_len, self.causal)

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic, alibi_slopes=None):
    if self.options["impl"] == "cudnn":
      return self._cudnn(q, k, v, kv_mask, alibi_slopes, deterministic)
    # Masked query rows are zeroed by the base class, so only the keys are masked here.
    return reference.masked_softmax_attention(
        q, k, v, kv_mask=kv_mask, causal=self.causal, scale=self.scale, alibi_slopes=alibi_slopes,
        dropout_rate=self.dropout_rate, dropout_rng=self.dropout_rng(deterministic))

  def _cudnn(self, q, k, v, kv_mask, alibi_slopes, deterministic):
    if self.dropout_rng(deterministic) is not None:
      raise ValueError("full: impl='cudnn' has no attention dropout here; use impl='xla' for "
                       "training with dropout_rate > 0")
    q_len, kv_len = q.shape[1], k.shape[1]
    if q_len != kv_len and self.causal:
      raise ValueError("full: cuDNN's causal mask is top-left aligned; use impl='xla' for causal "
                       "cross-attention")
    dtype = q.dtype if q.dtype in (jnp.bfloat16, jnp.float16) else jnp.bfloat16
    bias = None
    if alibi_slopes is not None:
      bias = reference.alibi_bias(alibi_slopes, jnp.arange(q_len)[:, None],
                                  jnp.arange(kv_len)[None, :], q_len, kv_len)[None]  # [1, h, q, k]
      bias = bias.astype(dtype)
    out = jax.nn.dot_product_attention(
        q.astype(dtype), k.astype(dtype), v.astype(dtype), bias=bias,
        mask=kv_mask[:, None, None, :], scale=self.scale, is_causal=self.causal,
        implementation="cudnn")
    sees_a_key = jnp.any(kv_mask, axis=-1)[:, None, None, None]  # cuDNN leaves empty rows undefined
    return jnp.where(sees_a_key, out, 0).astype(q.dtype)
