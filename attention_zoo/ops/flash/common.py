"""What the Pallas flash kernels (GPU and TPU) share around the tile maths (tiles.py): the static
Geometry of a call, one tile's mask and base-2 scores, the mask_mod turned into kernel inputs,
the inputs padded to the blocks, and the custom VJP that pairs a forward kernel with its
backward ones.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from attention_zoo.ops.blocks import ceil_div, pad_to_multiple
from attention_zoo.ops.softmax import apply_sinks
from attention_zoo.ops.tiles import LOG2E, MASK_VALUE, dot_nt


@dataclasses.dataclass(frozen=True)
class Geometry:
  """Static facts every tile needs (hashable: it is a static argument of the custom_vjp)."""
  q_len: int            # unpadded lengths: ALiBi distances use these
  kv_len: int
  scale: float
  use_alibi: bool
  block_q: int
  block_k: int
  # mask_mod closure-converted: mask(b, h, q, kv, *mask_consts) -> bool, evaluated in partial
  # tiles only; None: every visited tile is full.
  mask: Callable | None = None
  softcap: float | None = None  # c of c · tanh(s / c) on the scaled dot product; None: off
  use_segments: bool = False    # compare the query's and key's segment ids in every tile

  @property
  def offset(self) -> int:
    """Bottom-right alignment of query i with key i + offset (ALiBi's distance)."""
    return self.kv_len - self.q_len


def tile_allowed(geo: Geometry, is_full, b, h, q_start, k_start, mask_consts):
  """mask_mod on one [block_q, block_k] tile (b, h scalars), or None when geo has no mask; a
  full tile (is_full nonzero: the block metadata says mask_mod is True on all of it) evaluates
  nothing."""
  if geo.mask is None:
    return None
  shape = (geo.block_q, geo.block_k)
  q = q_start + jax.lax.broadcasted_iota(jnp.int32, (geo.block_q, 1), 0)
  kv = k_start + jax.lax.broadcasted_iota(jnp.int32, (1, geo.block_k), 1)
  evaluate = lambda: jnp.broadcast_to(geo.mask(b, h, q, kv, *mask_consts), shape)
  return jax.lax.cond(is_full != 0, lambda: jnp.ones(shape, bool), evaluate)


def tile_scores(q, k, q_start, k_start, kv_valid, slope, geo: Geometry, allowed=None,
                segments=None):
  """Base-2 scores of one tile, MASK_VALUE where not allowed.

  q [bq, d], k [bk, d]; q_start, k_start: positions of the tile's first query / key; kv_valid
  int [1, bk] (0 for padding and padded-to-block keys); slope: the ALiBi slope (ignored unless
  geo.use_alibi); allowed: None or bool [bq, bk], tile_allowed's mask; segments: None or the
  tile's (query ids [bq, 1], key ids [1, bk]), read when geo.use_segments. Returns (s₂ [bq, bk]
  f32, the soft-cap's derivative 1 - tanh² [bq, bk], or None without geo.softcap).
  """
  if geo.softcap is None:
    scores, cap_grad = dot_nt(q, k) * (geo.scale * LOG2E), None            # [bq, bk]
  else:
    capped = jnp.tanh(dot_nt(q, k) * (geo.scale / geo.softcap))
    scores, cap_grad = capped * (geo.softcap * LOG2E), 1.0 - capped * capped
  allowed_here = jnp.broadcast_to(kv_valid, scores.shape) != 0            # [bq, bk]
  if allowed is not None:
    allowed_here = allowed_here & allowed
  if geo.use_segments:
    allowed_here = allowed_here & (segments[0] == segments[1])
  if geo.use_alibi:
    # softmax.alibi_bias for one head: -slope · |i + offset - j|, here in base-2 units.
    q_pos = q_start + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 0)
    k_pos = k_start + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
    distance = jnp.abs(q_pos + geo.offset - k_pos).astype(jnp.float32)
    scores = scores - (slope * LOG2E) * distance
  return jnp.where(allowed_here, scores, MASK_VALUE), cap_grad


def padded(length: int, block: int) -> int:
  return ceil_div(length, block) * block


def next_power_of_2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


# -- what every implementation shares around its kernels ---------------------------------------

def convert_mask(mask_mod, block_q: int, block_k: int):
  """mask_mod -> (mask(b, h, q, kv, *mask_consts) for one [block_q, block_k] tile, mask_consts):
  every array it closes over (traced or not) becomes an explicit kernel input, since a kernel may
  capture none; None -> (None, [])."""
  if mask_mod is None:
    return None, []
  closed = jax.make_jaxpr(mask_mod)(jnp.int32(0), jnp.int32(0),
                                    jnp.zeros((block_q, 1), jnp.int32),
                                    jnp.zeros((1, block_k), jnp.int32))
  mask = lambda b, h, q, kv, *consts: jax.core.eval_jaxpr(closed.jaxpr, consts, b, h, q, kv)[0]
  return mask, list(closed.consts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention_with_vjp(kernels, q, k, v, kv_valid, segments, slopes, metadata):
  """Runs `kernels.forward` and differentiates through `kernels.backward` (which recomputes P).
  -> (out, each row's log-sum-exp in natural units f32 [b, h, q_padded, 1], 0 for a row that
  sees no key); either may go unused.

  kernels: a hashable object with forward(q, k, v, kv_valid, segments, slopes, metadata) ->
  (out, lse₂) and backward(q, k, v, kv_valid, segments, slopes, metadata, out, lse₂, d_out,
  d_lse) -> (dq, dk, dv), d_lse the natural log-sum-exp's cotangent (it adds P · d_lse to dS:
  Δ - d_lse in place of Δ); segments: pad_inputs' (q ids, kv ids); metadata: the block lists
  and mask_mod's arrays the kernels read. Only (out, lse₂) are saved besides the inputs, so
  memory stays linear in length. ALiBi slopes are fixed constants (Press et al. 2022): they get
  no gradient; the int kv_valid mask, the segment ids and the metadata get none either.
  """
  out, lse = kernels.forward(q, k, v, kv_valid, segments, slopes, metadata)
  return out, lse / LOG2E


def _attention_fwd(kernels, q, k, v, kv_valid, segments, slopes, metadata):
  out, lse = kernels.forward(q, k, v, kv_valid, segments, slopes, metadata)
  return (out, lse / LOG2E), (q, k, v, kv_valid, segments, slopes, metadata, out, lse)


def _attention_bwd(kernels, residuals, cotangents):
  dq, dk, dv = kernels.backward(*residuals, *cotangents)
  no_grad = lambda tree: jax.tree.map(lambda _: None, tree)
  return dq, dk, dv, None, no_grad(residuals[4]), None, no_grad(residuals[6])


attention_with_vjp.defvjp(_attention_fwd, _attention_bwd)


def with_sinks(out, lse, sinks):
  """out [b, q_len, h, d] (padding cut) with the attention sinks (None: out itself), from
  attention_with_vjp's log-sum-exp [b, h, q_padded, 1]."""
  if sinks is None:
    return out
  return apply_sinks(out, jnp.swapaxes(lse[:, :, :out.shape[1], 0], 1, 2), sinks)


def pad_inputs(q, k, v, kv_mask, alibi_slopes, segment_ids=None, *, q_multiple: int,
               kv_multiple: int, head_dim: int):
  """Pads lengths to block multiples and head_dim to `head_dim` with zeros (exact: zero columns
  add nothing to Q Kᵀ and give zero output columns). Returns q, k, v, kv_valid int32
  [b, 1, kv_padded] (False for padding and padded positions), segments (query ids int32
  [b, q_padded, 1], key ids int32 [b, 1, kv_padded]; zeros if segment_ids is None) and slopes
  f32 [h] (zeros if None)."""
  q = pad_to_multiple(q, q_multiple, axis=1)
  k, v = (pad_to_multiple(x, kv_multiple, axis=1) for x in (k, v))
  if head_dim != q.shape[-1]:
    q, k, v = (pad_to_multiple(x, head_dim, axis=3) for x in (q, k, v))
  kv_valid = pad_to_multiple(kv_mask, kv_multiple, axis=1, value=False)
  kv_valid = kv_valid.astype(jnp.int32)[:, None, :]                        # [b, 1, kv_padded]
  num_heads = q.shape[2]
  slopes = (jnp.zeros((num_heads,), jnp.float32) if alibi_slopes is None
            else jnp.asarray(alibi_slopes, jnp.float32).reshape(num_heads))
  if segment_ids is None:
    segment_ids = (jnp.zeros(kv_mask.shape[:1] + q.shape[1:2], jnp.int32),
                   jnp.zeros(kv_mask.shape, jnp.int32))
  q_ids, kv_ids = (pad_to_multiple(jnp.asarray(ids, jnp.int32), multiple, axis=1)
                   for ids, multiple in zip(segment_ids, (q_multiple, kv_multiple)))
  return q, k, v, kv_valid, (q_ids[:, :, None], kv_ids[:, None, :]), slopes
