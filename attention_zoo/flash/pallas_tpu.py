"""FlashAttention-2 as Pallas kernels for TPUs (the Mosaic lowering of `pl.pallas_call`).

The same tile math as the GPU kernels (attention_zoo.flash.common), arranged the TPU way: the
reduction over key (or query) blocks is the last, sequential ("arbitrary") grid axis, so every
grid step sees one [block, head_dim] tile in VMEM and the running statistics live in VMEM scratch.
Layout [batch, heads, len, head_dim] so the blocked dims are the last two (Mosaic tiles them
(8, 128)); row statistics are [len, 1] columns.
  forward  grid (batch, heads, q blocks, kv blocks)
  dq       grid (batch, heads, q blocks, kv blocks)
  dk, dv   grid (batch, kv heads, kv blocks, group · q blocks): the group's query heads are folded
           into the reduction axis, so GQA/MQA gradients are summed in VMEM, never per query head.
GQA/MQA: index_maps pick kv head `head // group`. Causal: a fully masked tile skips its compute
(`pl.when`) and its index_map repeats the previous block index, so its K/V (or Q) are not fetched.
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

from attention_zoo.base import ceil_div
from attention_zoo.flash import common

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

  def _call(self, kernel, grid, in_specs, out_specs, out_shape, scratch_shapes, name):
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        scratch_shapes=scratch_shapes,
        compiler_params=pltpu.CompilerParams(**_SEQUENTIAL_LAST_AXIS),
        interpret=self.interpret, name=name)

  def forward(self, q, k, v, kv_valid, slopes):
    batch, num_heads, q_len, head_dim = q.shape
    kv_len, group = k.shape[2], num_heads // k.shape[1]
    geo = self.fwd
    bq, bk = geo.block_q, geo.block_k
    kv_block = _kv_block_index(geo, kv_len // bk)
    q_tile = pl.BlockSpec((None, None, bq, head_dim), lambda b, h, i, j: (b, h, i, 0))
    kv_tile = pl.BlockSpec((None, None, bk, head_dim),
                           lambda b, h, i, j: (b, jax.lax.div(h, group), kv_block(i, j), 0))
    row_stat = pl.BlockSpec((None, None, bq, 1), lambda b, h, i, j: (b, h, i, 0))
    return self._call(
        functools.partial(_forward_kernel, geo=geo),
        grid=(batch, num_heads, q_len // bq, kv_len // bk),
        in_specs=[q_tile, kv_tile, kv_tile,
                  pl.BlockSpec((None, 1, bk), lambda b, h, i, j: (b, 0, kv_block(i, j))),
                  pl.BlockSpec(memory_space=pltpu.SMEM)],
        out_specs=[q_tile, row_stat],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((batch, num_heads, q_len, 1), jnp.float32)],
        scratch_shapes=[pltpu.VMEM((bq, head_dim), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
                        pltpu.VMEM((bq, 1), jnp.float32)],
        name="flash_forward")(q, k, v, kv_valid, slopes)

  def backward(self, q, k, v, kv_valid, slopes, out, lse, d_out):
    batch, num_heads, q_len, head_dim = q.shape
    num_kv_heads, kv_len = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    geo = self.bwd
    bq, bk = geo.block_q, geo.block_k
    num_q_blocks, num_kv_blocks = q_len // bq, kv_len // bk
    d_out = d_out.astype(q.dtype)
    delta = jnp.einsum("bhqd,bhqd->bhq", out.astype(jnp.float32),
                       d_out.astype(jnp.float32))[..., None]
    slopes_spec = pl.BlockSpec(memory_space=pltpu.SMEM)

    kv_block = _kv_block_index(geo, num_kv_blocks)
    q_tile = pl.BlockSpec((None, None, bq, head_dim), lambda b, h, i, j: (b, h, i, 0))
    kv_tile = pl.BlockSpec((None, None, bk, head_dim),
                           lambda b, h, i, j: (b, jax.lax.div(h, group), kv_block(i, j), 0))
    row_stat = pl.BlockSpec((None, None, bq, 1), lambda b, h, i, j: (b, h, i, 0))
    dq = self._call(
        functools.partial(_dq_kernel, geo=geo),
        grid=(batch, num_heads, num_q_blocks, num_kv_blocks),
        in_specs=[q_tile, kv_tile, kv_tile,
                  pl.BlockSpec((None, 1, bk), lambda b, h, i, j: (b, 0, kv_block(i, j))),
                  slopes_spec, q_tile, row_stat, row_stat],
        out_specs=q_tile, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_shapes=[pltpu.VMEM((bq, head_dim), jnp.float32)],
        name="flash_backward_dq")(q, k, v, kv_valid, slopes, d_out, lse, delta)

    # Reduction step t of kv head g visits query head g·group + t // num_q_blocks, query block
    # t % num_q_blocks.
    def head_of(g, t):
      return g * group + jax.lax.div(t, num_q_blocks)

    def q_block_of(j, t):   # blocks that cannot see key block j repeat the first one that can
      first = jnp.minimum(common.first_q_block_seeing(j, geo), num_q_blocks - 1)
      return jnp.maximum(jax.lax.rem(t, num_q_blocks), first)

    group_q_index = lambda b, g, j, t: (b, head_of(g, t), q_block_of(j, t), 0)
    group_q_tile = pl.BlockSpec((None, None, bq, head_dim), group_q_index)
    group_row_stat = pl.BlockSpec((None, None, bq, 1), group_q_index)
    kv_tile = pl.BlockSpec((None, None, bk, head_dim), lambda b, g, j, t: (b, g, j, 0))
    dk, dv = self._call(
        functools.partial(_dkdv_kernel, geo=geo, group=group, num_q_blocks=num_q_blocks),
        grid=(batch, num_kv_heads, num_kv_blocks, group * num_q_blocks),
        in_specs=[group_q_tile, kv_tile, kv_tile,
                  pl.BlockSpec((None, 1, bk), lambda b, g, j, t: (b, 0, j)),
                  slopes_spec, group_q_tile, group_row_stat, group_row_stat],
        out_specs=[kv_tile, kv_tile],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        scratch_shapes=[pltpu.VMEM((bk, head_dim), jnp.float32),
                        pltpu.VMEM((bk, head_dim), jnp.float32)],
        name="flash_backward_dkdv")(q, k, v, kv_valid, slopes, d_out, lse, delta)
    return dq, dk, dv


def _kv_block_index(geo, num_kv_blocks):
  """index_map helper: key blocks a query block cannot see repeat its last visible block (no
  DMA)."""
  def kv_block(i, j):
    if not geo.causal:
      return j
    return jnp.minimum(j, jnp.maximum(common.kv_blocks_seen(i, geo, num_kv_blocks) - 1, 0))
  return kv_block


def _forward_kernel(q_ref, k_ref, v_ref, kv_valid_ref, slopes_ref, out_ref, lse_ref, acc_ref, m_ref,
                    l_ref, *, geo):
  # q_ref, out_ref, acc_ref [bq, d]; k_ref, v_ref [bk, d]; kv_valid_ref [1, bk];
  # lse_ref, m_ref, l_ref [bq, 1]
  head, q_block, kv_block = pl.program_id(1), pl.program_id(2), pl.program_id(3)

  @pl.when(kv_block == 0)
  def _start():
    acc_ref[...], m_ref[...], l_ref[...] = common.softmax_init(*acc_ref.shape)

  @pl.when(kv_block < common.kv_blocks_seen(q_block, geo, pl.num_programs(3)))
  def _step():
    scores = common.tile_scores(q_ref[...], k_ref[...], q_block * geo.block_q,
                                kv_block * geo.block_k, kv_valid_ref[...], slopes_ref[head], geo)
    acc_ref[...], m_ref[...], l_ref[...] = common.softmax_update(
        (acc_ref[...], m_ref[...], l_ref[...]), scores, v_ref[...])

  @pl.when(kv_block == pl.num_programs(3) - 1)
  def _finish():
    out, lse = common.softmax_finish((acc_ref[...], m_ref[...], l_ref[...]))
    out_ref[...] = out.astype(out_ref.dtype)
    lse_ref[...] = lse


def _dq_kernel(q_ref, k_ref, v_ref, kv_valid_ref, slopes_ref, do_ref, lse_ref, delta_ref, dq_ref,
               dq_acc_ref, *, geo):
  # q_ref, do_ref, dq_ref, dq_acc_ref [bq, d]; k_ref, v_ref [bk, d]; lse_ref, delta_ref [bq, 1]
  head, q_block, kv_block = pl.program_id(1), pl.program_id(2), pl.program_id(3)

  @pl.when(kv_block == 0)
  def _start():
    dq_acc_ref[...] = jnp.zeros(dq_acc_ref.shape, jnp.float32)

  @pl.when(kv_block < common.kv_blocks_seen(q_block, geo, pl.num_programs(3)))
  def _step():
    k = k_ref[...]
    scores = common.tile_scores(q_ref[...], k, q_block * geo.block_q, kv_block * geo.block_k,
                                kv_valid_ref[...], slopes_ref[head], geo)
    _, ds = common.tile_probs_and_dscores(scores, lse_ref[...], delta_ref[...], do_ref[...],
                                          v_ref[...])
    dq_acc_ref[...] += common.dot_nn(ds.astype(k.dtype), k)

  @pl.when(kv_block == pl.num_programs(3) - 1)
  def _finish():
    dq_ref[...] = (dq_acc_ref[...] * geo.scale).astype(dq_ref.dtype)


def _dkdv_kernel(q_ref, k_ref, v_ref, kv_valid_ref, slopes_ref, do_ref, lse_ref, delta_ref,
                 dk_ref, dv_ref, dk_acc_ref, dv_acc_ref, *, geo, group, num_q_blocks):
  # q_ref, do_ref [bq, d]; k_ref, v_ref, dk_ref, dv_ref, d*_acc_ref [bk, d];
  # lse_ref, delta_ref [bq, 1]
  kv_head, kv_block, step = pl.program_id(1), pl.program_id(2), pl.program_id(3)
  head = kv_head * group + jax.lax.div(step, num_q_blocks)
  q_block = jax.lax.rem(step, num_q_blocks)

  @pl.when(step == 0)
  def _start():
    dk_acc_ref[...] = jnp.zeros(dk_acc_ref.shape, jnp.float32)
    dv_acc_ref[...] = jnp.zeros(dv_acc_ref.shape, jnp.float32)

  @pl.when(q_block >= common.first_q_block_seeing(kv_block, geo))
  def _step():
    q, do = q_ref[...], do_ref[...]
    scores = common.tile_scores(q, k_ref[...], q_block * geo.block_q, kv_block * geo.block_k,
                                kv_valid_ref[...], slopes_ref[head], geo)
    p, ds = common.tile_probs_and_dscores(scores, lse_ref[...], delta_ref[...], do, v_ref[...])
    dk_acc_ref[...] += common.dot_tn(ds.astype(q.dtype), q)
    dv_acc_ref[...] += common.dot_tn(p.astype(do.dtype), do)

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
                    block_q=None, block_k=None, block_q_bwd=None, block_k_bwd=None, interpret=None):
  """Exact softmax attention. q [b, q_len, h, d]; k, v [b, kv_len, kvh, d]; kv_mask bool
  [b, kv_len]; alibi_slopes f32 [h] or None. Returns [b, q_len, h, d] in q's dtype.

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
  q, k, v, kv_valid, slopes = common.pad_inputs(q, k, v, kv_mask, alibi_slopes,
                                                head_dim=q.shape[-1], q_multiple=q_padded,
                                                kv_multiple=kv_padded)
  geometry = functools.partial(common.Geometry, q_len=q_len, kv_len=kv_len, causal=bool(causal),
                               scale=float(scale), use_alibi=alibi_slopes is not None)
  kernels = Kernels(fwd=geometry(block_q=bq, block_k=bk),
                    bwd=geometry(block_q=bq_bwd, block_k=bk_bwd), interpret=interpret)
  heads_major = lambda x: jnp.swapaxes(x, 1, 2)           # [b, len, h, d] <-> [b, h, len, d]
  out = common.attention_with_vjp(kernels, heads_major(q), heads_major(k), heads_major(v),
                                  kv_valid, slopes)
  return heads_major(out)[:, :q_len]
