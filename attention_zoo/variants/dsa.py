"""DSA, DeepSeek Sparse Attention (DeepSeek-AI 2025, DeepSeek-V3.2-Exp): a lightning indexer
scores every (query, key) pair cheaply, each query keeps its top_k keys by that score, and
softmax attention runs over those keys only.

    I_ts = Σ_{j < H_I} w_tj · ReLU(q^I_tj · k^I_s)             the index score, s visible to t
    S_t  = the top_k keys s by I_ts (all of them when t sees fewer)
    o_t  = Σ_{s ∈ S_t} softmax_s(q_t·k_s / sqrt(d)) v_s

Here, per K/V head c (the query heads of its group share one selection; with one K/V head, as
DeepSeek's MLA in its MQA form, one selection per token for every head, as in the paper), with
q̄_tc = [q_t,i for the group's heads i] (g·d features) and k_sc the K/V head's key:

    q^I_tcj = W^I_Q,j q̄_tc,   w_tcj = (W^I_w q̄_tc)_j,   k^I_sc = W^I_K k_sc     [H_I·e], [H_I], [e]

H_I = indexer_heads, e = indexer_dim (None: d). Causally t sees s <= t (bottom-right aligned
for q_len != kv_len); padded keys are never chosen; ties go to the lower position.

What trains the indexer: nothing here. The selection is integers, so no gradient reaches W^I_Q,
W^I_w, W^I_K (they keep their initial values) and the indexer path passes none to q or k; q, k,
v are trained only through the attention over the chosen keys. The paper trains the indexer
with an auxiliary loss, the KL divergence from the main attention's distribution (summed over
heads, L1-normalised) to softmax(I_t·) (dense warm-up, then over S_t), on an input detached from
the main model; the zoo's trainers have no auxiliary loss, so that loss is not implemented: the
indexer here is a fixed random projection of the learned q and k.

Where ours differs from the paper (and DeepSeek's inference code):
- The indexer's inputs: a variant is handed q, k, v, so its query comes from the group's
  queries (the paper's: the query latent c^Q_t; its weights w from the layer input h_t) and its
  key from the K/V head's key (the paper's: LayerNorm(W h_t) with a partial RoPE). With GQA
  each K/V head selects for its own group (the paper's MQA has one K/V head).
- The paper's constant factors (H_I^-1/2 on w, e^-1/2 on the products) scale every score of a
  query alike and do not change its top-k: left out. No FP8 indexer.
- Sizes for the zoo's lengths: top_k = 256 (the paper's 2048 at 128K), H_I = 4 (64), e = d
  (128).

Tiled (ops/top_k_selection.py): the index scores one block of queries against one block of keys
at a time, merged into a running top-k per query (O(n²·H_I·e) time like the paper's indexer, no
n×n array), then each query block gathers its chosen keys and values [b, B, kvh, top_k, d] and
attends, rematerialised in the backward pass: memory O(n·kvh·top_k) for the choice and one
block's gather. Decoding: the KV cache, each new query's top_k among the cached keys (the paper
caches the indexer keys too; here they are recomputed from the cached keys).
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from attention_zoo.contract import Attention, register
from attention_zoo.ops import softmax
from attention_zoo.ops.top_k_selection import attend_selected, lightning_top_k
from attention_zoo.options import Int


@register("dsa", exact=False, supports_causal=True, supports_cross=True, can_decode=True,
          complexity="O(n²·H_I·e + n·k·d) time, O(n·k) memory",
          paper="DeepSeek-AI 2025, DeepSeek-V3.2-Exp: Boosting Long-Context Efficiency with "
                "DeepSeek Sparse Attention (tech report)")
class DeepSeekSparseAttention(Attention):
  OPTIONS = {"top_k": Int(256, minimum=1), "indexer_heads": Int(4, minimum=1),
             "indexer_dim": Int(None, minimum=1, optional=True), "block_size": Int(128, minimum=1)}
  # Length 20: a top_k below the length (later queries choose), blocks of 8 (a partial last one).
  TEST_OPTIONS = dict(top_k=6, indexer_heads=2, indexer_dim=4, block_size=8)

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.top_k, self.block_size = self.options["top_k"], self.options["block_size"]
    self.indexer_heads = heads = self.options["indexer_heads"]
    self.indexer_dim = dim = self.options["indexer_dim"] or self.head_dim
    group_features = self.num_heads // self.num_kv_heads * self.head_dim
    linear = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=self.rngs)
    self.index_query = linear(group_features, heads * dim)     # W^I_Q
    self.index_weight = linear(group_features, heads)          # W^I_w
    self.index_key = linear(self.head_dim, dim)                # W^I_K

  def indexer(self, q, k):
    """q [b, m, h, d], k [b, n, kvh, d] -> (q^I [b, m, kvh, H_I, e], w [b, m, kvh, H_I],
    k^I [b, n, kvh, e]), f32."""
    b, m = q.shape[:2]
    grouped = softmax.group_heads(q, self.num_kv_heads).reshape(b, m, self.num_kv_heads, -1)
    grouped = grouped.astype(jnp.float32)
    index_q = self.index_query(grouped).reshape(b, m, self.num_kv_heads, self.indexer_heads, -1)
    return index_q, self.index_weight(grouped), self.index_key(k.astype(jnp.float32))

  def select(self, q, k, kv_mask):
    """The chosen keys: int32 [b, m, kvh, min(top_k, n)], -1 for an empty slot."""
    return lightning_top_k(*self.indexer(q, k), kv_mask=kv_mask, top_k=self.top_k,
                           causal=self.causal, block_size=self.block_size)

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic):
    rng = self.dropout_rng(deterministic)
    return attend_selected(q, k, v, self.select(q, k, kv_mask), scale=self.scale,
                           block_size=self.block_size, dropout_rate=self.dropout_rate,
                           dropout_rng=rng)
