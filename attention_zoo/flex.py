"""The block-sparse engine for variant authors: attention_zoo.ops.flex's functions (the engine
itself: `create_block_mask`, `block_mask_from_states`, `flex_attention`, the mask and score
functions, `dense_mask`), and `attend`, a variant's whole `attend()` over a mask function (ring
attention when the active mesh splits the sequence: ops/ring.py):

    def attend(self, q, k, v, *, q_mask, kv_mask, deterministic, alibi_slopes=None,
               segment_ids=None):
      return flex.attend(self, q, k, v, self.mask_mod(q.shape[1], k.shape[1]), kv_mask=kv_mask,
                         deterministic=deterministic, alibi_slopes=alibi_slopes,
                         segment_ids=segment_ids)

docs/adding_an_attention.md (section 2) writes a variant this way.
"""
from __future__ import annotations

from typing import Callable

from attention_zoo.ops.context import context_size
from attention_zoo.ops.flex import (DEFAULT_BLOCK, EMPTY, FULL, PARTIAL, BlockMask, alibi,
                                    aligned_positions, block_mask_from_states, causal_mask,
                                    create_block_mask, dense_mask, flex_attention,
                                    full_block_mask, kernel_lists, pattern_attention,
                                    score_function, softcap, with_segments)
from attention_zoo.ops.ring import ring_attention

__all__ = ["DEFAULT_BLOCK", "EMPTY", "FULL", "PARTIAL", "BlockMask", "alibi", "aligned_positions",
           "attend", "attend_all", "block_mask_from_states", "causal_mask", "create_block_mask",
           "dense_mask", "flex_attention", "full_block_mask", "kernel_lists", "pattern_attention",
           "score_function", "softcap", "with_segments"]


def attend(variant, q, k, v, mask_mod: Callable, *, kv_mask, deterministic: bool, alibi_slopes,
           segment_ids=None, **engine):
  """An exact variant's `attend` on the engine: `pattern_attention` over mask_mod with the
  variant's scale, soft-capping (variant.softcap) and attention dropout. `engine`: heads,
  block_q, block_k, sequence_lengths, query_positions, key_positions (see pattern_attention).
  When the active mesh splits the sequence (a `context` axis), the same attention runs as ring
  attention (ops/ring.py); mask_mod None there means every key."""
  attention = ring_attention if context_size() > 1 else pattern_attention
  return attention(q, k, v, mask_mod, kv_mask=kv_mask, scale=variant.scale,
                   softcap=variant.softcap, alibi_slopes=alibi_slopes,
                   dropout_rate=variant.dropout_rate,
                   dropout_rng=variant.dropout_rng(deterministic), segment_ids=segment_ids,
                   **engine)


def attend_all(variant, q, k, v, *, kv_mask, deterministic: bool, alibi_slopes, segment_ids=None):
  """Ring attention (ops/ring.py) over every key, or the causal rule when variant.causal: the
  context-parallel form of `full` and `flash`, whose one-device forms are their own."""
  return ring_attention(q, k, v, None, causal=variant.causal, kv_mask=kv_mask,
                        scale=variant.scale, softcap=variant.softcap, alibi_slopes=alibi_slopes,
                        dropout_rate=variant.dropout_rate,
                        dropout_rng=variant.dropout_rng(deterministic), segment_ids=segment_ids)
