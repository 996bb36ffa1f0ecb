"""The key blocks MoBA and NSA choose for each query (variants/moba.py, variants/nsa.py), as
functions of the query's scores and its GLOBAL position: their one-device forms and their
context-parallel form (ops/selection_ring.py) call the same functions, so a query chooses the
same blocks wherever it sits. NSA's compression blocks are here too, for the same reason.

- `gate_choice`: MoBA's gate, the top_k blocks by q · (the block's mean real key) among the past
  blocks (causal) or all but the own block, the own block in slot 0.
- `importance_choice`: NSA's, the blocks by the importance that the compressed branch's softmax
  gives them ((9)-(10) of the paper), the first, previous and own blocks forced.

Ties go to the lower block (`lax.top_k`'s order); -1 marks an empty slot.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from attention_zoo.ops import softmax
from attention_zoo.ops.blocks import ceil_div


def gate_choice(q, positions, means, counts, *, block: int, top_k: int, causal: bool):
  """MoBA's blocks for the queries q [B, g, d] (a K/V head's group) at global positions int [B]:
  means f32 [N, d] the mean real key of each of the sequence's N blocks, counts [N] its real
  keys -> int32 [B, g, 1 + top_k'], slot 0 the own block, then the chosen ones by decreasing gate
  score, top_k' = min(top_k, N - 1); -1 where fewer blocks are candidates."""
  num_blocks = means.shape[0]
  own_block = positions // block                                                 # [B]
  own = jnp.broadcast_to(own_block[:, None, None], (*q.shape[:2], 1))
  slots = min(top_k, num_blocks - 1)
  if slots == 0:
    return own.astype(jnp.int32)
  scores = jnp.einsum("qgd,jd->qgj", q.astype(jnp.float32), means,
                      precision=jax.lax.Precision.HIGHEST)                        # [B, g, N]
  blocks = jnp.arange(num_blocks)
  before = blocks < own_block[:, None] if causal else blocks != own_block[:, None]
  candidate = (counts > 0) & before                                              # [B, N]
  best, chosen = jax.lax.top_k(jnp.where(candidate[:, None], scores, -jnp.inf), slots)
  return jnp.concatenate([own, jnp.where(best > -jnp.inf, chosen, -1)], -1).astype(jnp.int32)


def compressed_seen(positions, compressed_real, *, length: int, stride: int, causal: bool):
  """bool [B, N]: which of the N compressed blocks (block i: positions i·stride .. i·stride +
  length - 1) the queries at positions [B] see: the real ones, causally those ending by the
  query."""
  ends = jnp.arange(compressed_real.shape[-1]) * stride + length - 1
  return compressed_real & ((ends <= positions[:, None]) | (not causal))


def importance_choice(p, positions, has_real, *, length: int, stride: int, block: int,
                      count: int, causal: bool):
  """NSA's selection blocks for the queries at global positions int [B]: p f32 [B, N] the
  compressed branch's softmax over the N compressed blocks, summed over the group's heads (10);
  has_real bool [N_s] whether selection block j holds a real key (N_s·block: the length padded
  to whole selection blocks) -> int32 [B, min(count, N_s)] by decreasing importance (9), the
  forced blocks (0, c - 1, c for the own block c) first; -1 for an empty slot."""
  num_blocks, num_compressed = has_real.shape[0], p.shape[-1]
  segments, per_compressed = num_blocks * block // stride, length // stride
  # (9): segment s is covered by compression blocks s - l/d + 1 .. s; block j has l'/d segments
  p = jnp.pad(p, [(0, 0), (per_compressed - 1, segments - num_compressed)])
  covered = sum(p[:, r:r + segments] for r in range(per_compressed))            # [B, L/d]
  weight = covered.reshape(p.shape[0], num_blocks, block // stride).sum(-1)      # [B, N_s]
  own, blocks = (positions // block)[:, None], jnp.arange(num_blocks)
  forced = (blocks == 0) | (blocks == own) | (blocks == own - 1)
  candidate = has_real & ((blocks <= own) | (not causal))
  weight = jnp.where(candidate, jnp.where(forced, jnp.inf, weight), -jnp.inf)
  best, chosen = jax.lax.top_k(weight, min(count, num_blocks))
  return jnp.where(best > -jnp.inf, chosen, -1)


def group_probabilities(q, compressed_keys, seen, *, scale: float):
  """The compressed softmax that the selection reads, summed over a group's heads: q [B, g, d],
  compressed_keys [N, d], seen bool [B, N] -> f32 [B, N] (float32 scores, no gradient needed)."""
  scores = jnp.einsum("qgd,jd->qgj", q.astype(jnp.float32), compressed_keys.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST) * scale               # [B, g, N]
  return softmax.masked_softmax(scores, seen[:, None]).sum(1)


def compression_blocks(x, *, length: int, stride: int):
  """x [b, n, kvh, d] -> [b, ⌈n/stride⌉, kvh, length, d]: block i holds positions
  i·stride .. i·stride + length - 1, zeros past the end. stride divides length, so a block is
  length/stride consecutive stride segments."""
  num_blocks, per_block = ceil_div(x.shape[1], stride), length // stride
  padded = jnp.pad(x, [(0, 0), (0, (num_blocks + per_block - 1) * stride - x.shape[1])]
                   + [(0, 0)] * (x.ndim - 2))
  segments = padded.reshape(x.shape[0], -1, stride, *x.shape[2:])      # [b, N + l/d - 1, d, kvh, ·]
  blocks = jnp.concatenate([segments[:, r:r + num_blocks] for r in range(per_block)], axis=2)
  return jnp.moveaxis(blocks, 2, 3)                                     # [b, N, kvh, l, ·]
