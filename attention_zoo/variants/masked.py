"""Exact variants whose pattern is a mask function on the block-sparse engine
(attention_zoo.ops.flex): `MaskAttention`, the base class, and `masked_attention`, the engine
call with a variant's scale, soft-capping and attention dropout.

A subclass of MaskAttention defines `mask_mod(q_len, kv_len)` -> (b, h, q, kv) -> bool, and
`engine_options()` when its tiles or per-head masks differ from the engine's defaults; its dense
`pattern` (the oracle's mask) and its `attend` both follow from the one mask function, so they
cannot disagree. A variant that runs a rearranged problem on the engine (keys followed by copies
of the global ones, as longformer and sparse_transformer do) overrides `attend` and calls
`masked_attention` itself; the pattern still comes from `mask_mod`.

When the active mesh splits the sequence (a `context` axis, ops/context.py), `masked_attention`
runs the same attention as ring attention (ops/ring.py), and `attend_all` is the ring over every
key (or the causal rule): the context-parallel form of `full` and `flash`.
"""
from __future__ import annotations

from typing import Callable

from attention_zoo.contract import Attention
from attention_zoo.ops.context import context_size
from attention_zoo.ops.flex import dense_mask, pattern_attention
from attention_zoo.ops.ring import ring_attention


def masked_attention(variant: Attention, q, k, v, mask_mod: Callable, *, kv_mask,
                     deterministic: bool, alibi_slopes, segment_ids=None, **engine):
  """`pattern_attention` over mask_mod with the variant's scale, soft-capping (variant.softcap),
  attention sinks (variant.sinks()) and attention dropout. `engine`: heads, block_q, block_k,
  sequence_lengths, query_positions, key_positions (see attention_zoo.ops.flex.
  pattern_attention). Ring attention when the active mesh splits the sequence."""
  shared = dict(kv_mask=kv_mask, scale=variant.scale, softcap=variant.softcap,
                alibi_slopes=alibi_slopes, dropout_rate=variant.dropout_rate,
                dropout_rng=variant.dropout_rng(deterministic), segment_ids=segment_ids, **engine)
  if context_size() > 1:   # the base class refuses sinks here
    return ring_attention(q, k, v, mask_mod, **shared)
  return pattern_attention(q, k, v, mask_mod, sinks=variant.sinks(), **shared)


def attend_all(variant: Attention, q, k, v, *, kv_mask, deterministic: bool, alibi_slopes,
               segment_ids=None):
  """Ring attention (ops/ring.py) over every key, or the causal rule when variant.causal: the
  context-parallel form of `full` and `flash`, whose one-device forms are their own."""
  return ring_attention(q, k, v, None, causal=variant.causal, kv_mask=kv_mask,
                        scale=variant.scale, softcap=variant.softcap, alibi_slopes=alibi_slopes,
                        dropout_rate=variant.dropout_rate,
                        dropout_rng=variant.dropout_rng(deterministic), segment_ids=segment_ids)


class MaskAttention(Attention):
  """An exact variant given by a mask function: `pattern` and `attend` from `mask_mod`."""

  def mask_mod(self, q_len: int, kv_len: int) -> Callable:
    """(b, h, q, kv) -> whether query q (of head h) sees key kv, for these lengths."""
    raise NotImplementedError(f"{type(self).__qualname__} must define mask_mod(q_len, kv_len)")

  def engine_options(self) -> dict:
    """The engine's tiling for this variant: heads (a mask that differs per head), block_q,
    block_k; empty: one mask for every head, the engine's default tiles."""
    return {}

  def pattern(self, q_len: int, kv_len: int):
    heads = self.engine_options().get("heads")
    return dense_mask(self.mask_mod(q_len, kv_len), heads, q_len, kv_len)

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic, alibi_slopes=None,
             segment_ids=None):
    return masked_attention(self, q, k, v, self.mask_mod(q.shape[1], k.shape[1]),
                            kv_mask=kv_mask, deterministic=deterministic,
                            alibi_slopes=alibi_slopes, segment_ids=segment_ids,
                            **self.engine_options())
