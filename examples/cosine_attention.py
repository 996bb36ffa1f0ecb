"""Scaled cosine attention (Liu et al. 2022, Swin Transformer V2): a plug-in outside the package.

    Attention(Q, K, V) = softmax(cos(q_i, k_j) / τ_h) V,   τ_h > 0 learned per head

Cosine similarities lie in [-1, 1], so the logits are bounded whatever the norms of q and k.
This file shows the whole extension contract in a few lines; check it and train with it:

    python -m attention_zoo.conformance examples.cosine_attention
    python -m experiments.train ... --plugins=examples.cosine_attention   # then attention "cosine"
"""
import math

import jax.numpy as jnp
from flax import nnx

import attention_zoo as az


@az.register("cosine", exact=False, supports_causal=True, supports_cross=True, complexity="O(n²)",
             paper="Liu et al. 2022, Swin Transformer V2: Scaling Up Capacity and Resolution "
                   "(arXiv:2111.09883)")
class CosineAttention(az.Attention):
  OPTIONS = {"init_temperature": az.Float(0.1, above=0)}   # τ at initialisation, then learned
  # How the conformance suite builds it at its small shapes (length 20, head_dim 8): a softer τ
  # than the default; a blockwise variant would set a block size below the length here.
  TEST_OPTIONS = {"init_temperature": 0.5}

  def __init__(self, **kwargs):
    super().__init__(**kwargs)   # validates heads, causal, every option; sets self.options, ...
    if self.options["scale"] is not None:
      raise self.option_error("scale", "None (the logit scale is 1/τ, learned per head: set "
                                       "init_temperature)")
    # log(1/τ) per head, so the learned temperature stays positive.
    self.log_inverse_temperature = nnx.Param(
        jnp.full((self.num_heads,), -math.log(self.options["init_temperature"])))

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic):
    def unit(x):   # [..., d] -> unit vectors, in f32 (bf16 inputs work)
      x = x.astype(jnp.float32)
      return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-6)

    # Folding 1/τ_h into the queries makes the scores cos(q_i, k_j) / τ_h.
    q = unit(q) * jnp.exp(self.log_inverse_temperature[...])[:, None]    # [b, q, h, d]
    return az.reference.masked_softmax_attention(
        q, unit(k), v, q_mask=q_mask, kv_mask=kv_mask, causal=self.causal, scale=1.0,
        dropout_rate=self.dropout_rate, dropout_rng=self.dropout_rng(deterministic))
