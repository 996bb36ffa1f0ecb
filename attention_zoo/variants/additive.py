"""Additive attention (Bahdanau, Cho & Bengio 2015): a one-layer MLP scores each query-key pair.

    e_ij = vᵀ tanh(W_q q_i + W_k k_j),   out_i = Σ_j softmax_j(e_ij) v_j

per head: W_q [d, d_a] for each query head, W_k [d, d_a] for each K/V head (shared by the query
heads of its group, as K and V are), v [d_a] for each query head; d_a = `attention_dim`
(default head_dim). No 1/sqrt(d) scale (v learns the temperature); an explicit `scale` option
multiplies e. The one score in the zoo that is not a dot product: it runs on
`attention_zoo.ops.flex`'s online softmax with a tile score, so W_q q and W_k k are projected once
(O(n·d_a)) and tanh(·) is formed one (query block, key block) tile at a time, [rows, block,
d_a]: memory O(L_q · block · d_a), never O(L_q · L_k · d_a). Causal (bottom-right), cross-
attention, padding, ALiBi (added to e) and dropout as for every exact variant.

Luong's `general` score qᵢᵀ W kⱼ is dot-product attention after a learned projection of q (or
k), so it is not a variant of its own (docs/adding_an_attention.md).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from attention_zoo.ops import flex
from attention_zoo.contract import Attention, register
from attention_zoo.options import Int


@register("additive", exact=False, supports_causal=True, supports_cross=True,
          complexity="O(n²·d_a) time, O(n·b·d_a) memory",
          paper="Bahdanau, Cho & Bengio 2015, Neural Machine Translation by Jointly Learning to "
                "Align and Translate (arXiv:1409.0473)",
          can_decode=True, supports_alibi=True)
class AdditiveAttention(Attention):
  # attention_dim None: head_dim; block_size: queries and keys per tile.
  OPTIONS = {"attention_dim": Int(None, minimum=1, optional=True),
             "block_size": Int(64, minimum=1)}

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    d = self.head_dim
    self.attention_dim = self.options["attention_dim"] or d
    init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    self.query_map = nnx.Param(init(self.rngs.params(), (self.num_heads, d, self.attention_dim)))
    self.key_map = nnx.Param(init(self.rngs.params(), (self.num_kv_heads, d, self.attention_dim)))
    self.score_vector = nnx.Param(jax.random.normal(                   # v [h, d_a], std 1/sqrt(d_a)
        self.rngs.params(), (self.num_heads, self.attention_dim)) * self.attention_dim ** -0.5)
    self.temperature = 1.0 if self.options["scale"] is None else self.scale

  def scores(self, q_blocks, k_blocks, head):
    """e of one tile: q_blocks W_q [b, kvh, rows, d_a], k_blocks W_k [b, kvh, bk, d_a], head
    [1, kvh, rows, 1] (each row's query head) -> [b, kvh, rows, bk]."""
    hidden = jnp.tanh(q_blocks[..., :, None, :] + k_blocks[..., None, :, :])   # [b, kvh, r, bk, a]
    vector = self.score_vector[...][head[0, :, :, 0]]                         # [kvh, rows, a]
    return jnp.einsum("bhrka,hra->bhrk", hidden, vector.astype(hidden.dtype),
                      preferred_element_type=jnp.float32) * self.temperature

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic, alibi_slopes=None):
    q_len, kv_len = q.shape[1], k.shape[1]
    projected_q = jnp.einsum("bqhd,hda->bqha", q, self.query_map[...].astype(q.dtype))
    projected_k = jnp.einsum("bkhd,hda->bkha", k, self.key_map[...].astype(k.dtype))
    block = dict(block_q=self.options["block_size"], block_k=self.options["block_size"])
    block_mask = (flex.create_block_mask(flex.causal_mask(q_len, kv_len), None, None, q_len,
                                         kv_len, **block)
                  if self.causal else flex.full_block_mask(q_len, kv_len, **block))
    score_mod = None if alibi_slopes is None else flex.alibi(alibi_slopes, q_len, kv_len)
    return flex.flex_attention(
        projected_q, projected_k, v, block_mask=block_mask, score_mod=score_mod,
        kv_mask=kv_mask, tile_score=self.scores, dropout_rate=self.dropout_rate,
        dropout_rng=self.dropout_rng(deterministic))
