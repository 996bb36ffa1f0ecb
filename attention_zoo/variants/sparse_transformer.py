"""Sparse Transformer, fixed pattern (Child et al. 2019): a query sees its own block of B
positions and the last c positions ("summaries") of every block.

    A(i) = { j : ⌊i'/B⌋ = ⌊j/B⌋ } ∪ { j : j mod B >= B - c }   (causal: ∩ { j <= i' })
    out_i = Σ_{j ∈ A(i)} softmax_j(q_i·k_j / sqrt(d)) v_j

with i' = i + (kv_len - q_len) the bottom-right aligned query position. Bidirectional for
encoders, causal (own block up to i', summaries of earlier blocks) for decoders; the LRA
reference code was causal even for classification and built a dense n x n mask.

Each query sees B + c·n/B keys, so time is O(n·(B + c·n/B)): with fixed B and c the summaries
make it quadratic, about c/B of full attention (Child et al. take B ~ sqrt(n)). A mask function
(variants/masked.py), over the keys followed by a compact copy of the summaries: the copies
are seen outside the query's own block and the originals inside it, so no key counts twice and
the tiles visited are the diagonal ones and the summary copies. Memory is linear (flex's tiles:
`query_chunk` query rows by 128 keys).

With the sequence split over a mesh's `context` axis, `attend` is the ring (ops/ring.py) over
`mask_mod` at global positions, without the copies: every shard holds summaries, so every ring
step and nearly every tile is visited (dense attention's work and traffic, O(n/C) memory).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from attention_zoo.contract import register
from attention_zoo.ops import softmax
from attention_zoo.ops.context import context_size
from attention_zoo.options import Int
from attention_zoo.variants.masked import MaskAttention, masked_attention


@register("sparse_transformer", exact=True, supports_causal=True, supports_cross=True,
          complexity="O(n·(b + c·n/b))",
          paper="Child et al. 2019, Generating Long Sequences with Sparse Transformers "
                "(arXiv:1904.10509)",
          supports_alibi=True, supports_softcap=True, supports_segment_ids=True,
          supports_sinks=True, supports_context_parallel=True)
class SparseTransformerAttention(MaskAttention):
  # query_chunk: query rows per tile of the engine.
  OPTIONS = {"block_size": Int(50, minimum=1), "num_summary": Int(10, minimum=1),
             "query_chunk": Int(512, minimum=1)}
  TEST_OPTIONS = dict(block_size=6, num_summary=2, query_chunk=12)

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.block_size, self.num_summary, self.query_chunk = (
        self.options[k] for k in ("block_size", "num_summary", "query_chunk"))
    if self.num_summary > self.block_size:
      raise self.option_error("num_summary", f"an integer <= block_size ({self.block_size}) "
                                             f"(the summaries are the last positions of a block)")

  def mask_mod(self, q_len: int, kv_len: int):
    """(b, h, q, kv) -> whether query q sees key kv: its own block or a summary (the pattern;
    `attend` runs it over the keys and copies of the summaries)."""
    block, offset = self.block_size, kv_len - q_len

    def allowed(b, h, q, kv):
      keep = ((q + offset) // block == kv // block) | (kv % block >= block - self.num_summary)
      return keep & softmax.causal_allowed(q, kv, q_len, kv_len) if self.causal else keep
    return allowed

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic, alibi_slopes=None,
             segment_ids=None):
    if context_size() > 1:   # split over the mesh: the ring over mask_mod (no copied keys)
      return super().attend(q, k, v, q_mask=q_mask, kv_mask=kv_mask, deterministic=deterministic,
                            alibi_slopes=alibi_slopes, segment_ids=segment_ids)
    q_len, kv_len, block = q.shape[1], k.shape[1], self.block_size
    summaries = np.flatnonzero(np.arange(kv_len) % block >= block - self.num_summary)
    with_copies = lambda x: jnp.concatenate([x, x[:, summaries]], axis=1)
    key_positions = np.concatenate([np.arange(kv_len), summaries])    # of keys and copies

    def allowed(b, h, q, kv):
      i, j = q + (kv_len - q_len), jnp.asarray(key_positions)[kv]
      # originals inside the query's block, copies of summaries outside it
      keep = (kv < kv_len) == (i // block == j // block)
      return keep & softmax.causal_allowed(i, j, kv_len, kv_len) if self.causal else keep

    return masked_attention(self, q, with_copies(k), with_copies(v), allowed,
                            kv_mask=with_copies(kv_mask), deterministic=deterministic,
                            alibi_slopes=alibi_slopes, segment_ids=segment_ids,
                            block_q=self.query_chunk, sequence_lengths=(q_len, kv_len),
                            key_positions=key_positions)
