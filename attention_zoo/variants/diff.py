"""Differential attention (Ye et al. 2024, Differential Transformer, arXiv:2410.05258).

Each head's query and key split into two halves of d/2 channels, [Q₁ Q₂] and [K₁ K₂]; the
value keeps all d channels:

    A = (softmax(Q₁K₁ᵀ / √(d/2)) − λ softmax(Q₂K₂ᵀ / √(d/2))) V
    λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init
    out = (1 − λ_init) · RMSNorm(A)            (per head, over its d channels, learned scale)

The two softmaxes are two calls of the block-sparse engine (ops/flex.py) on the flash pattern
(every key, or the bottom-right causal triangle), so no n × n array exists and memory is linear
in the length; dropout (dropout_rate) drops each map's weights. One-token decoding uses the
base class's KV cache (one cache: K holds both halves).

Options: lambda_init (default 0.8, the paper's value deep in a network). The paper sets it by
the layer's depth l = 1, 2, ...: λ_init = 0.8 − 0.6·exp(−0.3·(l − 1)) (`lambda_init_for_depth`);
a variant does not know its layer, so a model that wants the rule passes the value per layer.
block_q, block_k: the engine's tiles (None: 128).

What differs from the authors' code (microsoft/unilm, Diff-Transformer, multihead_diffattn.py
and multihead_flashdiff_*.py):
  - heads: a head here is one differential head (their num_heads) of head_dim d = their
    2·head_dim; Q₁, Q₂ (K₁, K₂) are the first and second half of its channels, where they view
    the projection as 2·num_heads interleaved heads (the same up to a permutation of the
    projection's columns). The scale is (d/2)^-1/2 as theirs unless `scale` is given.
  - GQA: query head h's halves meet the halves of K/V head h // group. They repeat the 2·kvh
    split key heads with repeat_kv, so with n_rep > 1 both halves of one differential head can
    read the same key half.
  - λ_init is an option, not computed from a layer index (above).
  - their flash form runs four flash calls (v split in halves) or two with a 2·head_dim value;
    here two calls of the engine, which takes a value wider than the key.
  The parameters are theirs: λ_q1, λ_k1, λ_q2, λ_k2 [d/2] shared by the layer's heads, drawn
  from N(0, 0.1²); the RMSNorm (eps 1e-5) has one scale [d] shared by the heads.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from attention_zoo.contract import Attention, register
from attention_zoo.norms import GatedRMSNorm
from attention_zoo.ops import flex
from attention_zoo.ops.flash.chunked import block_mask
from attention_zoo.options import Float, Int

LAMBDA_STD = 0.1


def lambda_init_for_depth(layer: int) -> float:
  """The paper's λ_init for layer `layer` = 1, 2, ...: 0.8 − 0.6·exp(−0.3·(layer − 1))."""
  if layer < 1:
    raise ValueError(f"diff: layer must be >= 1 (the first layer is 1), got {layer}")
  return 0.8 - 0.6 * math.exp(-0.3 * (layer - 1))


@register("diff", exact=False, supports_causal=True, supports_cross=True,
          complexity="O(n²) time, O(n) memory",
          paper="Ye et al. 2024, Differential Transformer (arXiv:2410.05258)", can_decode=True)
class DiffAttention(Attention):
  OPTIONS = {"lambda_init": Float(0.8, minimum=0, below=1),
             "block_q": Int(None, minimum=1, optional=True),
             "block_k": Int(None, minimum=1, optional=True)}
  # Tiles smaller than the suite's length 20: several tiles, padding to the block.
  TEST_OPTIONS = dict(block_q=8, block_k=8)

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    if self.head_dim % 2:
      raise ValueError(f"diff: head_dim must be even (each head's query and key split into two "
                       f"halves), got {self.head_dim}")
    half = self.head_dim // 2
    if self.options["scale"] is None:
      self.scale = half ** -0.5
    self.lambda_init = self.options["lambda_init"]
    draw = lambda: nnx.Param(LAMBDA_STD * jax.random.normal(self.rngs.params(), (half,)))
    self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (draw() for _ in range(4))
    self.norm = GatedRMSNorm(self.head_dim)

  def reweighting(self):
    """λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init, a f32 scalar."""
    dot = lambda a, b: jnp.sum(a[...] * b[...])
    return (jnp.exp(dot(self.lambda_q1, self.lambda_k1))
            - jnp.exp(dot(self.lambda_q2, self.lambda_k2)) + self.lambda_init)

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic, alibi_slopes=None,
             segment_ids=None):
    del q_mask   # the base class zeroes masked query rows
    half = self.head_dim // 2
    mask = block_mask(q.shape[1], k.shape[1], causal=self.causal,
                      block_q=self.options["block_q"], block_k=self.options["block_k"])

    def softmax_map(q_half, k_half):   # [b, q, h, d/2], [b, kv, kvh, d/2] -> [b, q, h, d]
      return flex.flex_attention(q_half, k_half, v, block_mask=mask, scale=self.scale,
                                 kv_mask=kv_mask, dropout_rate=self.dropout_rate,
                                 dropout_rng=self.dropout_rng(deterministic)).astype(jnp.float32)

    first = softmax_map(q[..., :half], k[..., :half])
    second = softmax_map(q[..., half:], k[..., half:])
    out = self.norm(first - self.reweighting() * second)                  # [b, q, h, d]
    return ((1.0 - self.lambda_init) * out).astype(q.dtype)
