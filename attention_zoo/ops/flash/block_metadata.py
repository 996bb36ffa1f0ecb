"""What the Pallas flash kernels read about the pattern: flex's block metadata and mask_mod.

Per query block, the key blocks to visit (ascending) and whether each is full (mask_mod True on
the whole tile: nothing evaluated) or partial (mask_mod evaluated on the tile); per key block the
query blocks that visit it, for the dK/dV kernel. Empty tiles are never visited, forward or
backward. Causal flash is the causal block mask; no mask is the full one. The lists are the
union over heads (attention_zoo.ops.flex._visits), each tile evaluating mask_mod at its own head.
"""
from __future__ import annotations

import functools
from typing import Callable

from attention_zoo.ops import flex
from attention_zoo.ops.flash import common


def kernel_plan(mask_mod: Callable | None, causal: bool, *, q_len: int, kv_len: int,
                q_padded: int, kv_padded: int, scale: float, use_alibi: bool, block_q: int,
                block_k: int, block_q_bwd: int, block_k_bwd: int, softcap: float | None = None,
                use_segments: bool = False):
  """-> (forward Geometry, backward Geometry, metadata) for kernels over lengths padded to
  multiples of their blocks. The pattern is mask_mod, or the zoo's causal rule when causal, or
  every key; segment ids (use_segments) are compared in every visited tile, so they need no
  lists of their own (a tile between two documents is visited and contributes nothing).
  metadata = (forward lists (counts, indices, full) per query block, backward lists per query
  block then per key block, forward mask arrays, backward mask arrays), all int32 except
  mask_mod's arrays."""
  if causal and mask_mod is not None:
    raise ValueError("flash (pallas): pass causal=True or a mask_mod, not both (write the "
                     "causal rule into the mask_mod)")
  if causal:
    mask_mod = flex.causal_mask(q_len, kv_len)
  mask_fwd, consts_fwd = common.convert_mask(mask_mod, block_q, block_k)
  mask_bwd, consts_bwd = common.convert_mask(mask_mod, block_q_bwd, block_k_bwd)
  lists = functools.partial(flex.kernel_lists, mask_mod, q_padded, kv_padded)
  geometry = functools.partial(common.Geometry, q_len=q_len, kv_len=kv_len, scale=float(scale),
                               use_alibi=use_alibi, use_segments=use_segments,
                               softcap=None if softcap is None else float(softcap))
  metadata = (lists(block_q=block_q, block_k=block_k)[:3],
              lists(block_q=block_q_bwd, block_k=block_k_bwd), consts_fwd, consts_bwd)
  return (geometry(block_q=block_q, block_k=block_k, mask=mask_fwd),
          geometry(block_q=block_q_bwd, block_k=block_k_bwd, mask=mask_bwd), metadata)
