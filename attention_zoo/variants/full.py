"""Full softmax attention (Vaswani et al. 2017), the O(n²) baseline every variant is compared to.

    Attention(Q, K, V) = softmax(Q Kᵀ / sqrt(d) + B) V

with B = -inf outside the allowed keys (padding, causal) and B = ALiBi when slopes are given.
`impl="xla"` is softmax.masked_softmax_attention: the dense path with grouped heads (no K/V
copy for GQA/MQA) and a hand-written backward that saves only the weights;
`impl="cudnn"` calls `jax.nn.dot_product_attention(implementation="cudnn")` and runs only on
an NVIDIA GPU (f32 inputs are rounded to bf16 for it); `impl="auto"` (the default) takes cuDNN
for a call it computes without rounding: on a GPU, bf16/f16 inputs, head_dim <= 128 and a
multiple of 8, no attention dropout, no causal cross-attention, no `softcap`, no forward-mode
autodiff (JAX's cuDNN attention is a custom VJP, which JAX cannot differentiate forward; the xla
path can: ops/autodiff.py); every other call takes "xla", so f32 stays exact everywhere.
jax.nn.dot_product_attention has no soft-capping and no attention sinks, so impl="cudnn" refuses
softcap and sink=True (auto takes "xla" for them); segment ids (packed sequences) are a dense
[b, 1, q, kv] mask for cuDNN and part of the mask on the xla path.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from attention_zoo.contract import Attention, register
from attention_zoo.ops import softmax
from attention_zoo.ops.autodiff import autodiff_modes
from attention_zoo.ops.context import context_size
from attention_zoo.variants.masked import attend_all
from attention_zoo.options import Choice

CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
CUDNN_MAX_HEAD_DIM = 128


def cudnn_refusal(q, k, *, causal: bool, dropout: bool, softcap=None,
                  forward_mode: bool = False, sinks: bool = False) -> str | None:
  """Why the cuDNN path cannot compute this call, or None when it can."""
  if sinks:
    return "jax.nn.dot_product_attention has no attention sinks; use impl='xla' with sink=True"
  if forward_mode:
    return ("JAX's cuDNN attention is a custom VJP, which JAX cannot differentiate in forward "
            "mode (jax.jvp, jax.jacfwd, jax.hessian); use impl='xla' or 'auto'")
  if softcap is not None:
    return "jax.nn.dot_product_attention has no soft-capping; use impl='xla' with softcap"
  if dropout:
    return "impl='cudnn' has no attention dropout here; use impl='xla' for training with " \
           "dropout_rate > 0"
  if causal and q.shape[1] != k.shape[1]:
    return "cuDNN's causal mask is top-left aligned; use impl='xla' for causal cross-attention"
  return None


def auto_picks_cudnn(q, k, *, causal: bool, dropout: bool, backend: str, softcap=None,
                     forward_mode: bool = False, sinks: bool = False) -> bool:
  """impl='auto': cuDNN only where it is exact to the inputs' precision and supported."""
  head_dim = q.shape[-1]
  return (backend == "gpu" and q.dtype in CUDNN_DTYPES
          and head_dim <= CUDNN_MAX_HEAD_DIM and head_dim % 8 == 0
          and cudnn_refusal(q, k, causal=causal, dropout=dropout, softcap=softcap,
                            forward_mode=forward_mode, sinks=sinks) is None)


@register("full", exact=True, supports_causal=True, supports_cross=True, complexity="O(n²)",
          paper="Vaswani et al. 2017, Attention Is All You Need (arXiv:1706.03762)",
          can_decode=True, supports_alibi=True, supports_softcap=True, supports_segment_ids=True,
          supports_context_parallel=True, supports_sinks=True)
class FullAttention(Attention):
  OPTIONS = {"impl": Choice("auto", ("auto", "xla", "cudnn"))}

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    if self.options["impl"] == "cudnn" and jax.default_backend() != "gpu":
      raise self.option_error("impl", f"'xla' or 'auto' on the {jax.default_backend()!r} "
                                      f"backend (impl='cudnn' needs an NVIDIA GPU)")

  def pattern(self, q_len: int, kv_len: int):
    return softmax.causal_pattern(q_len, kv_len, self.causal)

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic, alibi_slopes=None,
             segment_ids=None):
    if context_size() > 1:   # the sequence split over the mesh: ring attention (ops/ring.py)
      return attend_all(self, q, k, v, kv_mask=kv_mask, deterministic=deterministic,
                        alibi_slopes=alibi_slopes, segment_ids=segment_ids)
    dropout_rng = self.dropout_rng(deterministic)
    impl = self.options["impl"]
    cases = dict(causal=self.causal, dropout=dropout_rng is not None, softcap=self.softcap,
                 forward_mode="forward" in autodiff_modes(), sinks=self.sink_logits is not None)
    if impl == "auto":
      impl = ("cudnn" if auto_picks_cudnn(q, k, backend=jax.default_backend(), **cases)
              else "xla")
    if impl == "cudnn":
      refusal = cudnn_refusal(q, k, **cases)
      if refusal:
        raise ValueError(f"full: {refusal}")
      return self._cudnn(q, k, v, kv_mask, alibi_slopes, segment_ids)
    # Masked query rows are zeroed by the base class, so only the keys are masked here.
    return softmax.masked_softmax_attention(
        q, k, v, kv_mask=kv_mask, causal=self.causal, scale=self.scale, alibi_slopes=alibi_slopes,
        dropout_rate=self.dropout_rate, dropout_rng=dropout_rng, softcap=self.softcap,
        segment_ids=segment_ids, sinks=self.sinks())

  def _cudnn(self, q, k, v, kv_mask, alibi_slopes, segment_ids):
    q_len, kv_len = q.shape[1], k.shape[1]
    dtype = q.dtype if q.dtype in CUDNN_DTYPES else jnp.bfloat16
    bias = None
    if alibi_slopes is not None:
      bias = softmax.alibi_bias(alibi_slopes, jnp.arange(q_len)[:, None],
                                  jnp.arange(kv_len)[None, :], q_len, kv_len)[None]  # [1, h, q, k]
      bias = bias.astype(dtype)
    mask = kv_mask[:, None, None, :]                                        # [b, 1, 1|q, kv]
    if segment_ids is not None:
      mask = mask & (segment_ids[0][:, None, :, None] == segment_ids[1][:, None, None, :])
    out = jax.nn.dot_product_attention(
        q.astype(dtype), k.astype(dtype), v.astype(dtype), bias=bias, mask=mask,
        scale=self.scale, is_causal=self.causal, implementation="cudnn")
    # cuDNN leaves the rows that see no key undefined
    sees_a_key = jnp.any(mask, axis=-1).transpose(0, 2, 1)[..., None]      # [b, 1|q, 1, 1]
    return jnp.where(sees_a_key, out, 0).astype(q.dtype)
