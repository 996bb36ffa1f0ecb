"""FlashAttention-2 as Pallas kernels for TPUs (the Mosaic lowering of `pl.pallas_call`).

The same tile math as the GPU kernels (attention_zoo.ops.tiles), arranged the TPU way: the
reduction over key (or query) blocks is the last, sequential ("arbitrary") grid axis, so every
grid step sees one [block, head_dim] tile in VMEM and the running statistics live in VMEM scratch.
Layout [batch, heads, len, head_dim] so the blocked dims are the last two (Mosaic tiles them
(8, 128)); row statistics are [len, 1] columns.
  forward  grid (batch, heads, q blocks, w)   step t: the t-th key block listed for the q block
  dq       grid (batch, heads, q blocks, w)
  dk, dv   grid (batch, kv heads, kv blocks, group · w'): the group's query heads are folded
           into the reduction axis, so GQA/MQA gradients are summed in VMEM, never per query head.
The lists are flex's block metadata (block_metadata.py), prefetched into SMEM for the index_maps
(splash attention's arrangement): w is the longest list, and a step past a block's list skips
its compute (`pl.when`) while its index_map repeats the last listed block, so nothing is fetched;
full tiles evaluate no mask, partial ones the mask_mod (causal flash: the causal block mask).
GQA/MQA: index_maps pick kv head `head // group`.
ALiBi slopes are read as scalars from SMEM.

Tested on CPU under the TPU interpreter (`interpret=pltpu.InterpretParams()`), which runs the
grid, VMEM scratch, SMEM and out-of-bounds checks, but not Mosaic's own compiler passes (layout
assignment, tiling): those need a TPU. On a TPU, block_k must be a multiple of 128 and block_q of
8 (16 for bf16/f16) unless one block spans the whole (padded) length.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attention_zoo.ops import tiles
from attention_zoo.ops.blocks import ceil_div
from attention_zoo.ops.flash import block_metadata, common

LANES, SUBLANES = 128, 8
# Untuned starting points (no TPU was available to tune them): tiles well inside VMEM.
DEFAULT_BLOCKS = dict(block_q=256, block_k=512, block_q_bwd=256, block_k_bwd=256)

# pltpu.CompilerParams / pltpu.SMEM / pltpu.VMEM / pltpu.InterpretParams are the names in jax 0.10
# and 0.11 (the TPU* spellings were removed in 0.8.1), so no compatibility shim is needed.
_SEQUENTIAL_LAST_AXIS = dict(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))


@dataclasses.dataclass(frozen=True)
class Kernels:
  """The forward and backward pallas_calls for one static configuration (hashable)."""
  fwd: common.Geometry
  bwd: common.Geometry
  interpret: object        # False (compile on a TPU) or a pltpu.InterpretParams

  def _call(self, kernel, lists, grid, in_specs, out_specs, out_shape, scratch_shapes, name):
    """pallas_call whose block lists (int32 `lists`) are prefetched into SMEM: index_maps and
    the kernel read them."""
    return pl.pallas_call(
        kernel, out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(lists), grid=grid, in_specs=in_specs, out_specs=out_specs,
            scratch_shapes=scratch_shapes),
        compiler_params=pltpu.CompilerParams(**_SEQUENTIAL_LAST_AXIS),
        interpret=self.interpret, name=name)

  def forward(self, q, k, v, kv_valid, segments, slopes, metadata):
    batch, num_heads, q_len, head_dim = q.shape
    group = num_heads // k.shape[1]
    lists, _, consts, _ = metadata
    geo = self.fwd
    bq, bk = geo.block_q, geo.block_k
    q_tile = pl.BlockSpec((None, None, bq, head_dim), lambda b, h, i, t, *_: (b, h, i, 0))
    kv_tile, kv_valid_tile = _listed_kv_tiles(bk, head_dim, group)
    row_stat = pl.BlockSpec((None, None, bq, 1), lambda b, h, i, t, *_: (b, h, i, 0))
    q_ids = pl.BlockSpec((None, bq, 1), lambda b, h, i, t, *_: (b, i, 0))
    return self._call(
        functools.partial(_forward_kernel, geo=geo, num_consts=len(consts)), lists,
        grid=(batch, num_heads, q_len // bq, lists[1].shape[1]),
        in_specs=[q_tile, kv_tile, kv_tile, kv_valid_tile, kv_valid_tile, q_ids,
                  pl.BlockSpec(memory_space=pltpu.SMEM), *_whole(*consts)],
        out_specs=[q_tile, row_stat],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((batch, num_heads, q_len, 1), jnp.float32)],
        scratch_shapes=[pltpu.VMEM((bq, head_dim), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
                        pltpu.VMEM((bq, 1), jnp.float32)],
        name="flash_forward")(*lists, q, k, v, kv_valid, segments[1], segments[0], slopes,
                              *consts)

  def backward(self, q, k, v, kv_valid, segments, slopes, metadata, out, lse, d_out, d_lse):
    batch, num_heads, q_len, head_dim = q.shape
    num_kv_heads, kv_len = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    geo = self.bwd
    bq, bk = geo.block_q, geo.block_k
    _, lists, _, consts = metadata
    d_out = d_out.astype(q.dtype)
    delta = jnp.einsum("bhqd,bhqd->bhq", out.astype(jnp.float32),
                       d_out.astype(jnp.float32))[..., None] - d_lse
    slopes_spec = pl.BlockSpec(memory_space=pltpu.SMEM)

    q_tile = pl.BlockSpec((None, None, bq, head_dim), lambda b, h, i, t, *_: (b, h, i, 0))
    kv_tile, kv_valid_tile = _listed_kv_tiles(bk, head_dim, group)
    row_stat = pl.BlockSpec((None, None, bq, 1), lambda b, h, i, t, *_: (b, h, i, 0))
    q_ids = pl.BlockSpec((None, bq, 1), lambda b, h, i, t, *_: (b, i, 0))
    dq = self._call(
        functools.partial(_dq_kernel, geo=geo, num_consts=len(consts)), lists[:3],
        grid=(batch, num_heads, q_len // bq, lists[1].shape[1]),
        in_specs=[q_tile, kv_tile, kv_tile, kv_valid_tile, kv_valid_tile, q_ids,
                  slopes_spec, q_tile, row_stat, row_stat, *_whole(*consts)],
        out_specs=q_tile, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_shapes=[pltpu.VMEM((bq, head_dim), jnp.float32)],
        name="flash_backward_dq")(*lists[:3], q, k, v, kv_valid, segments[1], segments[0],
                                  slopes, d_out, lse, delta, *consts)

    # Reduction step t of kv head g visits query head g·group + t // width and the (t % width)-th
    # query block listed for the key block (past the list: the last one again, not fetched).
    width = lists[4].shape[1]
    group_q_index = lambda b, g, j, t, *list_refs: (
        b, g * group + jax.lax.div(t, width), _listed(j, jax.lax.rem(t, width), *list_refs), 0)
    group_q_tile = pl.BlockSpec((None, None, bq, head_dim), group_q_index)
    group_row_stat = pl.BlockSpec((None, None, bq, 1), group_q_index)
    group_q_ids = pl.BlockSpec((None, bq, 1), lambda b, g, j, t, *list_refs: (
        b, _listed(j, jax.lax.rem(t, width), *list_refs), 0))
    kv_tile = pl.BlockSpec((None, None, bk, head_dim), lambda b, g, j, t, *_: (b, g, j, 0))
    key_block = pl.BlockSpec((None, 1, bk), lambda b, g, j, t, *_: (b, 0, j))
    dk, dv = self._call(
        functools.partial(_dkdv_kernel, geo=geo, group=group, width=width,
                          num_consts=len(consts)), lists[3:],
        grid=(batch, num_kv_heads, kv_len // bk, group * width),
        in_specs=[group_q_tile, kv_tile, kv_tile, key_block, key_block, group_q_ids,
                  slopes_spec, group_q_tile, group_row_stat, group_row_stat, *_whole(*consts)],
        out_specs=[kv_tile, kv_tile],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        scratch_shapes=[pltpu.VMEM((bk, head_dim), jnp.float32),
                        pltpu.VMEM((bk, head_dim), jnp.float32)],
        name="flash_backward_dkdv")(*lists[3:], q, k, v, kv_valid, segments[1], segments[0],
                                    slopes, d_out, lse, delta, *consts)
    return dq, dk, dv


def _listed(row, t, counts_ref, indices_ref, full_ref):
  """index_map helper: the t-th block listed for `row`; past its count, the last listed one
  again (the same block index: no DMA)."""
  del full_ref
  return indices_ref[row, jnp.minimum(t, jnp.maximum(counts_ref[row] - 1, 0))]


def _listed_kv_tiles(block_k: int, head_dim: int, group: int):
  """BlockSpecs of K (or V) and kv_valid (or the key segment ids) for a (batch, head, query
  block i, step t) grid: the t-th key block listed for query block i, of head h's kv head."""
  kv_tile = pl.BlockSpec((None, None, block_k, head_dim), lambda b, h, i, t, *list_refs: (
      b, jax.lax.div(h, group), _listed(i, t, *list_refs), 0))
  kv_valid_tile = pl.BlockSpec((None, 1, block_k), lambda b, h, i, t, *list_refs: (
      b, 0, _listed(i, t, *list_refs)))
  return kv_tile, kv_valid_tile


def _whole(*arrays):
  """BlockSpecs handing every grid step the whole of each array (mask_mod's arrays)."""
  return [pl.BlockSpec(x.shape, lambda *_, ndim=x.ndim: (0,) * ndim) for x in arrays]


def _forward_kernel(counts_ref, indices_ref, full_ref, q_ref, k_ref, v_ref, kv_valid_ref,
                    kv_ids_ref, q_ids_ref, slopes_ref, *refs, geo, num_consts):
  # counts_ref [nq], indices_ref, full_ref [nq, w] (SMEM): the key blocks each query block
  # visits; q_ref [bq, d]; k_ref, v_ref [bk, d]; kv_valid_ref, kv_ids_ref [1, bk]; q_ids_ref
  # [bq, 1]; mask_mod's arrays; then out_ref, acc_ref [bq, d]; lse_ref, m_ref, l_ref [bq, 1]
  consts = [ref[...] for ref in refs[:num_consts]]
  out_ref, lse_ref, acc_ref, m_ref, l_ref = refs[num_consts:]
  batch, head, q_block, t = (pl.program_id(axis) for axis in range(4))

  @pl.when(t == 0)
  def _start():
    acc_ref[...], m_ref[...], l_ref[...] = tiles.softmax_init(*acc_ref.shape)

  @pl.when(t < counts_ref[q_block])
  def _step():
    q_start, k_start = q_block * geo.block_q, indices_ref[q_block, t] * geo.block_k
    allowed = common.tile_allowed(geo, full_ref[q_block, t], batch, head, q_start, k_start,
                                  consts)
    scores, _ = common.tile_scores(q_ref[...], k_ref[...], q_start, k_start, kv_valid_ref[...],
                                   slopes_ref[head], geo, allowed,
                                   (q_ids_ref[...], kv_ids_ref[...]))
    acc_ref[...], m_ref[...], l_ref[...] = tiles.softmax_update(
        (acc_ref[...], m_ref[...], l_ref[...]), scores, v_ref[...])

  @pl.when(t == pl.num_programs(3) - 1)
  def _finish():
    out, lse = tiles.softmax_finish((acc_ref[...], m_ref[...], l_ref[...]))
    out_ref[...] = out.astype(out_ref.dtype)
    lse_ref[...] = lse


def _dq_kernel(counts_ref, indices_ref, full_ref, q_ref, k_ref, v_ref, kv_valid_ref, kv_ids_ref,
               q_ids_ref, slopes_ref, do_ref, lse_ref, delta_ref, *refs, geo, num_consts):
  # as _forward_kernel; do_ref, dq_ref, dq_acc_ref [bq, d]; lse_ref, delta_ref [bq, 1]
  consts = [ref[...] for ref in refs[:num_consts]]
  dq_ref, dq_acc_ref = refs[num_consts:]
  batch, head, q_block, t = (pl.program_id(axis) for axis in range(4))

  @pl.when(t == 0)
  def _start():
    dq_acc_ref[...] = jnp.zeros(dq_acc_ref.shape, jnp.float32)

  @pl.when(t < counts_ref[q_block])
  def _step():
    k = k_ref[...]
    q_start, k_start = q_block * geo.block_q, indices_ref[q_block, t] * geo.block_k
    allowed = common.tile_allowed(geo, full_ref[q_block, t], batch, head, q_start, k_start,
                                  consts)
    scores, cap_grad = common.tile_scores(q_ref[...], k, q_start, k_start, kv_valid_ref[...],
                                          slopes_ref[head], geo, allowed,
                                          (q_ids_ref[...], kv_ids_ref[...]))
    _, ds = tiles.tile_probs_and_dscores(scores, lse_ref[...], delta_ref[...], do_ref[...],
                                          v_ref[...], cap_grad=cap_grad)
    dq_acc_ref[...] += tiles.dot_nn(ds.astype(k.dtype), k)

  @pl.when(t == pl.num_programs(3) - 1)
  def _finish():
    dq_ref[...] = (dq_acc_ref[...] * geo.scale).astype(dq_ref.dtype)


def _dkdv_kernel(counts_ref, indices_ref, full_ref, q_ref, k_ref, v_ref, kv_valid_ref, kv_ids_ref,
                 q_ids_ref, slopes_ref, do_ref, lse_ref, delta_ref, *refs, geo, group, width,
                 num_consts):
  # counts_ref [nk], indices_ref, full_ref [nk, width] (SMEM): the query blocks visiting each
  # key block; q_ref, do_ref [bq, d]; k_ref, v_ref [bk, d]; kv_valid_ref, kv_ids_ref [1, bk];
  # q_ids_ref, lse_ref, delta_ref [bq, 1];
  # mask_mod's arrays; then dk_ref, dv_ref, d*_acc_ref [bk, d]
  consts = [ref[...] for ref in refs[:num_consts]]
  dk_ref, dv_ref, dk_acc_ref, dv_acc_ref = refs[num_consts:]
  batch, kv_head, kv_block, step = (pl.program_id(axis) for axis in range(4))
  head = kv_head * group + jax.lax.div(step, width)
  t = jax.lax.rem(step, width)

  @pl.when(step == 0)
  def _start():
    dk_acc_ref[...] = jnp.zeros(dk_acc_ref.shape, jnp.float32)
    dv_acc_ref[...] = jnp.zeros(dv_acc_ref.shape, jnp.float32)

  @pl.when(t < counts_ref[kv_block])
  def _step():
    q, do = q_ref[...], do_ref[...]
    q_start, k_start = indices_ref[kv_block, t] * geo.block_q, kv_block * geo.block_k
    allowed = common.tile_allowed(geo, full_ref[kv_block, t], batch, head, q_start, k_start,
                                  consts)
    scores, cap_grad = common.tile_scores(q, k_ref[...], q_start, k_start, kv_valid_ref[...],
                                          slopes_ref[head], geo, allowed,
                                          (q_ids_ref[...], kv_ids_ref[...]))
    p, ds = tiles.tile_probs_and_dscores(scores, lse_ref[...], delta_ref[...], do, v_ref[...],
                                          cap_grad=cap_grad)
    dk_acc_ref[...] += tiles.dot_tn(ds.astype(q.dtype), q)
    dv_acc_ref[...] += tiles.dot_tn(p.astype(do.dtype), do)

  @pl.when(step == pl.num_programs(3) - 1)
  def _finish():
    dk_ref[...] = (dk_acc_ref[...] * geo.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_acc_ref[...].astype(dv_ref.dtype)


def _blocks(fwd: int, bwd: int, length: int, multiple: int, what: str, compiled: bool):
  """(forward block, backward block, padded length) along one sequence axis.

  A length that fits both blocks is one block each (rounded up to 8 rows: the block then spans
  the whole padded axis, which Mosaic accepts at any size); otherwise the blocks are used as given
  (Mosaic wants multiples of `multiple`) and the length is padded to both.
  """
  for name, value in ((f"block_{what}", fwd), (f"block_{what}_bwd", bwd)):
    if value <= 0:
      raise ValueError(f"flash (pallas, TPU): {name} must be positive, got {value}")
  single = ceil_div(length, SUBLANES) * SUBLANES
  if single <= min(fwd, bwd):
    return single, single, single
  for name, value in ((f"block_{what}", fwd), (f"block_{what}_bwd", bwd)):
    if compiled and value % multiple:
      raise ValueError(f"flash (pallas, TPU): {name} must be a multiple of {multiple} "
                       f"(Mosaic's tile for this axis) when the length {length} needs several "
                       f"blocks, got {value}")
  return fwd, bwd, common.padded(length, math.lcm(fwd, bwd))


def flash_attention(q, k, v, kv_mask, alibi_slopes=None, *, causal: bool, scale: float,
                    softcap=None, segment_ids=None, block_q=None, block_k=None, block_q_bwd=None,
                    block_k_bwd=None, interpret=None, mask_mod=None, sinks=None):
  """Exact softmax attention. q [b, q_len, h, d]; k, v [b, kv_len, kvh, d]; kv_mask bool
  [b, kv_len]; alibi_slopes f32 [h] or None. Returns [b, q_len, h, d] in q's dtype.
  softcap, segment_ids, mask_mod, sinks: as for pallas_gpu.flash_attention.

  interpret=None compiles on a TPU; elsewhere pass `interpret=pltpu.InterpretParams()`.
  """
  q_len, kv_len = q.shape[1], k.shape[1]
  if interpret is None:
    if jax.default_backend() != "tpu":
      raise ValueError("flash (pallas, TPU): compiling needs a TPU; on another backend pass "
                       "interpret=pltpu.InterpretParams() (tests) or use the GPU kernels")
    interpret = False
  compiled = interpret is False
  pick = lambda value, name: DEFAULT_BLOCKS[name] if value is None else value
  rows = SUBLANES * max(1, 4 // q.dtype.itemsize)         # bf16/f16 pack two rows per sublane
  bq, bq_bwd, q_padded = _blocks(pick(block_q, "block_q"), pick(block_q_bwd, "block_q_bwd"),
                                 q_len, rows, "q", compiled)
  bk, bk_bwd, kv_padded = _blocks(pick(block_k, "block_k"), pick(block_k_bwd, "block_k_bwd"),
                                  kv_len, LANES, "k", compiled)
  q, k, v, kv_valid, segments, slopes = common.pad_inputs(
      q, k, v, kv_mask, alibi_slopes, segment_ids, head_dim=q.shape[-1], q_multiple=q_padded,
      kv_multiple=kv_padded)
  fwd, bwd, metadata = block_metadata.kernel_plan(
      mask_mod, causal, q_len=q_len, kv_len=kv_len, q_padded=q_padded, kv_padded=kv_padded,
      scale=scale, use_alibi=alibi_slopes is not None, softcap=softcap,
      use_segments=segment_ids is not None, block_q=bq, block_k=bk, block_q_bwd=bq_bwd,
      block_k_bwd=bk_bwd)
  kernels = Kernels(fwd=fwd, bwd=bwd, interpret=interpret)
  heads_major = lambda x: jnp.swapaxes(x, 1, 2)           # [b, len, h, d] <-> [b, h, len, d]
  out, lse = common.attention_with_vjp(kernels, heads_major(q), heads_major(k), heads_major(v),
                                       kv_valid, segments, slopes, metadata)
  return common.with_sinks(heads_major(out)[:, :q_len], lse, sinks)
