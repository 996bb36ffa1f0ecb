"""The (query, key) pairs an exact variant computes at a benchmark length, counted from the block
masks its forward hands the block-sparse engine (attention_zoo.flex): a full tile counts its
rows x columns, a partial tile the entries where its mask function holds; an empty tile is never
visited. So the count is the pattern's, read from the engine's own schedule, in memory that
grows with the number of blocks (a dense `pattern()` at 16K would be 256M entries a head).

The block masks are recorded while the forward is traced abstractly (jax.eval_shape, nothing
runs); their lists are concrete there because the engine computes a mask that depends on no
traced array while tracing. A variant that never calls the engine (full, flash: dense) has no
block mask: None. One whose pattern is data (segment ids, MoBA's chosen blocks) cannot be
counted before it runs: ValueError. A variant that computes some rows twice counts them twice
(longformer's global rows: its window call computes them before the global call replaces them,
at most g·(2w + g + 1) pairs, about 1/8K of its count at 8K with one global token).
"""
from __future__ import annotations

import contextlib

import jax
import numpy as np

from attention_zoo import flex as engine_face
from attention_zoo.ops import flex as engine


@contextlib.contextmanager
def recorded_block_masks():
  """Within it, every BlockMask passed to the engine's flex_attention (by attention_zoo.ops.flex
  or the face attention_zoo.flex) is appended to the list it yields; the engine runs as before."""
  masks = []
  run = engine.flex_attention

  def recording(*args, block_mask=None, **kwargs):
    masks.append(block_mask)
    return run(*args, block_mask=block_mask, **kwargs)

  for module in (engine, engine_face):
    module.flex_attention = recording
  try:
    yield masks
  finally:
    for module in (engine, engine_face):
      module.flex_attention = run


def pairs_of_block_mask(block_mask: engine.BlockMask, *, batch: int, heads: int) -> int:
  """The pairs `block_mask` keeps, summed over `batch` rows and `heads` query heads (a mask
  built for one row or head stands for all of them)."""
  lists = (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.kv_full)
  if any(isinstance(x, jax.core.Tracer) for x in lists):
    raise ValueError("the block mask depends on traced data (segment ids, blocks chosen from "
                     "the input): its pairs are known only when it runs")
  counts, indices, full = (np.asarray(x) for x in lists)
  rows_b, rows_h = counts.shape[:2]
  bq, bk, q_len, kv_len = (block_mask.block_q, block_mask.block_k, block_mask.q_len,
                           block_mask.kv_len)
  total = 0
  for b, h, i in np.ndindex(counts.shape):
    q = i * bq + np.arange(min(bq, q_len - i * bq))[:, None]
    for slot in range(counts[b, h, i]):
      j = indices[b, h, i, slot]
      kv = j * bk + np.arange(min(bk, kv_len - j * bk))[None, :]
      if full[b, h, i, slot] or block_mask.mask_mod is None:
        total += q.size * kv.size
      else:
        kept = block_mask.mask_mod(np.int32(b), np.int32(h), q, kv)
        total += int(np.broadcast_to(np.asarray(kept), (q.size, kv.size)).sum())
  return total * (batch // rows_b) * (heads // rows_h)


def kept_pairs(forward, *shapes, batch: int, heads: int) -> int | None:
  """The pairs the engine computes in `forward(*shapes)` (all its calls together), or None when
  it never calls the engine."""
  with recorded_block_masks() as masks:
    jax.eval_shape(forward, *shapes)
  if not masks:
    return None
  return sum(pairs_of_block_mask(m, batch=batch, heads=heads) for m in masks)
