"""Linear Transformer (Katharopoulos et al. 2020): attention with the feature map elu(x) + 1.

    out_i = φ(q_i)ᵀ Σ_j φ(k_j) v_jᵀ / φ(q_i)ᵀ Σ_j φ(k_j),   φ(x) = elu(x) + 1

over the keys j query i sees (real keys; j <= i + kv_len - q_len when causal). The sums run in
`ops.kernelized.linear_attention`: once for all queries, or as chunked prefix sums when causal,
which also makes the model an RNN for decoding (the state Σ φ(k) vᵀ, Σ φ(k) replaces the KV
cache). φ(q)·φ(k) has no temperature, so the `scale` option is refused.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from attention_zoo.contract import register
from attention_zoo.variants import kernelized


@register("linear_transformer", exact=False, supports_causal=True, supports_cross=True,
          complexity="O(n·d)",
          paper="Katharopoulos et al. 2020, Transformers are RNNs: Fast Autoregressive "
                "Transformers with Linear Attention (arXiv:2006.16236)",
          can_decode=True, supports_dropout=False, supports_context_parallel=True)
class LinearTransformerAttention(kernelized.KernelizedAttention):
  TEST_OPTIONS = dict(chunk_size=4)

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    if self.options["scale"] is not None:
      raise self.option_error("scale", "None (φ(q)·φ(k) with φ = elu + 1 has no temperature, "
                                       "so a scale would be ignored)")

  @classmethod
  def feature_count(cls, head_dim: int, options: dict) -> int:
    return head_dim

  def feature_maps(self, q, k, *, deterministic: bool, kv_mask=None):
    # log(elu(x) + 1): log(1 + x) for x > 0, x otherwise (never the log of an underflowed exp)
    log_phi = lambda x: jnp.log1p(jax.nn.relu(x)) + jnp.minimum(x, 0.0)
    return log_phi(q), log_phi(k)
