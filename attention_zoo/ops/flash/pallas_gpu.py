"""FlashAttention-2 as Pallas kernels for NVIDIA GPUs (the Triton lowering of `pl.pallas_call`).

Three kernels over the [batch, len, heads, head_dim] layout, each program owning one tile row:
  forward  grid (q blocks, batch, heads):    loops over the key blocks listed for the query
                                             block, writes out and the base-2 log-sum-exp;
  dq       grid (q blocks, batch, heads):    loops over the same key blocks;
  dk, dv   grid (kv blocks, batch, kv heads): loops over the query heads of the kv head's group and
                                             the query blocks listed for the key block, so
                                             GQA/MQA gradients are summed inside the kernel.
The lists are flex's block metadata (block_metadata.py): empty tiles are never loaded, full ones
evaluate no mask, partial ones the mask_mod (causal flash: the causal block mask).
GQA/MQA: the BlockSpec index_map picks kv head `head // group` for query head `head`; K/V are
never copied per query head.

On a CPU the same kernels run with `interpret=True` (how they are tested here); on a GPU they
compile through Triton, selected explicitly with `pltriton.CompilerParams` because jax 0.10+ sends
a `pallas_call` without compiler params to Mosaic GPU. Triton needs power-of-two tiles: blocks
are powers of two (at least 16 when compiled) and head_dim is zero-padded to a power of two.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from attention_zoo.ops import tiles
from attention_zoo.ops.flash import block_metadata, common

MIN_COMPILED_BLOCK = 16      # tl.dot needs every matmul dimension >= 16
MAX_COMPILED_HEAD_DIM = 256  # larger tiles do not fit the shared memory of one SM


def block_rule(compiled: bool) -> tuple[str, object]:
  """What a tile size must be for these kernels: (description, predicate on the size)."""
  power_of_two = lambda n: n > 0 and n & (n - 1) == 0
  if compiled:
    return (f"a power of two >= {MIN_COMPILED_BLOCK} (Triton tiles on a GPU)",
            lambda n: power_of_two(n) and n >= MIN_COMPILED_BLOCK)
  return "a power of two (Triton tiles)", power_of_two


def default_blocks(head_dim: int) -> dict[str, int]:
  """Forward (block_q, block_k) and backward (block_q_bwd, block_k_bwd) defaults, by head_dim.

  Untuned starting points in the range FlashAttention-2's Triton kernels use on A100/H100;
  smaller tiles for d = 256 keep the backward's four [block, d] accumulators in registers.
  """
  if head_dim <= 64:
    return dict(block_q=128, block_k=128, block_q_bwd=64, block_k_bwd=64)
  if head_dim <= 128:
    return dict(block_q=128, block_k=64, block_q_bwd=64, block_k_bwd=64)
  return dict(block_q=64, block_k=32, block_q_bwd=32, block_k_bwd=32)


@dataclasses.dataclass(frozen=True)
class Kernels:
  """The forward and backward pallas_calls for one static configuration (hashable)."""
  fwd: common.Geometry
  bwd: common.Geometry
  interpret: object        # False (compile), True, or a pltpu.InterpretParams (tests)
  num_warps: int

  def _call(self, kernel, grid, in_specs, out_specs, out_shape, name, num_warps=None):
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps or self.num_warps,
                                                num_stages=2),
        interpret=self.interpret, name=name)

  def forward(self, q, k, v, kv_valid, segments, slopes, metadata):
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, group = k.shape[1], num_heads // k.shape[2]
    lists, _, consts, _ = metadata
    bq = self.fwd.block_q
    tile = lambda rows: pl.BlockSpec((None, rows, None, head_dim), lambda i, b, h: (b, i, h, 0))
    whole_kv = _whole_kv(kv_len, head_dim, group)
    return self._call(
        functools.partial(_forward_kernel, geo=self.fwd, num_consts=len(consts)),
        grid=(q_len // bq, batch, num_heads),
        in_specs=[*_whole(*lists), tile(bq), whole_kv, whole_kv, *_row_of_keys(kv_len, 2),
                  _query_ids(bq), pl.BlockSpec((num_heads,), lambda i, b, h: (0,)),
                  *_whole(*consts)],
        out_specs=[tile(bq), pl.BlockSpec((None, None, bq, 1), lambda i, b, h: (b, h, i, 0))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((batch, num_heads, q_len, 1), jnp.float32)],
        name="flash_forward")(*lists, q, k, v, kv_valid, segments[1], segments[0], slopes,
                              *consts)

  def backward(self, q, k, v, kv_valid, segments, slopes, metadata, out, lse, d_out, d_lse):
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    bq, bk = self.bwd.block_q, self.bwd.block_k
    _, lists, _, consts = metadata
    d_out = d_out.astype(q.dtype)
    delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32),
                       d_out.astype(jnp.float32))[..., None] - d_lse
    slopes_spec = pl.BlockSpec((num_heads,), lambda *_: (0,))

    q_tile = pl.BlockSpec((None, bq, None, head_dim), lambda i, b, h: (b, i, h, 0))
    whole_kv = _whole_kv(kv_len, head_dim, group)
    row_stat = pl.BlockSpec((None, None, bq, 1), lambda i, b, h: (b, h, i, 0))
    dq = self._call(
        functools.partial(_dq_kernel, geo=self.bwd, num_consts=len(consts)),
        grid=(q_len // bq, batch, num_heads),
        in_specs=[*_whole(*lists[:3]), q_tile, whole_kv, whole_kv, *_row_of_keys(kv_len, 2),
                  _query_ids(bq), slopes_spec, q_tile, row_stat, row_stat, *_whole(*consts)],
        out_specs=q_tile, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        name="flash_backward_dq")(*lists[:3], q, k, v, kv_valid, segments[1], segments[0],
                                  slopes, d_out, lse, delta, *consts)

    # One program per (key block, kv head): it sees the whole query length of its group's heads.
    group_q = pl.BlockSpec((None, q_len, group, head_dim), lambda j, b, g: (b, 0, g, 0))
    group_stat = pl.BlockSpec((None, group, q_len, 1), lambda j, b, g: (b, g, 0, 0))
    kv_tile = pl.BlockSpec((None, bk, None, head_dim), lambda j, b, g: (b, j, g, 0))
    key_block = pl.BlockSpec((None, 1, bk), lambda j, b, g: (b, 0, j))
    dk, dv = self._call(
        functools.partial(_dkdv_kernel, geo=self.bwd, group=group, num_consts=len(consts)),
        grid=(kv_len // bk, batch, num_kv_heads),
        in_specs=[*_whole(*lists[3:]), group_q, kv_tile, kv_tile, key_block, key_block,
                  pl.BlockSpec((None, q_len, 1), lambda j, b, g: (b, 0, 0)),
                  slopes_spec, group_q, group_stat, group_stat, *_whole(*consts)],
        out_specs=[kv_tile, kv_tile],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        name="flash_backward_dkdv")(*lists[3:], q, k, v, kv_valid, segments[1], segments[0],
                                    slopes, d_out, lse, delta, *consts)
    return dq, dk, dv


def _whole(*arrays):
  """BlockSpecs handing every program the whole of each array (block lists, mask_mod's arrays)."""
  return [pl.BlockSpec(x.shape, lambda *_, ndim=x.ndim: (0,) * ndim) for x in arrays]


def _row_of_keys(kv_len: int, count: int):
  """BlockSpecs of `count` per-key rows [b, 1, kv_len] (kv_valid, key segment ids), whole, for a
  (q block, batch, head) grid."""
  return [pl.BlockSpec((None, 1, kv_len), lambda i, b, h: (b, 0, 0))] * count


def _query_ids(block_q: int):
  """The BlockSpec of the query segment ids [b, q_len, 1]: a [block_q, 1] column."""
  return pl.BlockSpec((None, block_q, 1), lambda i, b, h: (b, i, 0))


def _whole_kv(kv_len: int, head_dim: int, group: int):
  """The whole K or V of query head h's kv head, for a (block, batch, head) grid."""
  return pl.BlockSpec((None, kv_len, None, head_dim),
                      lambda i, b, h: (b, 0, jax.lax.div(h, group), 0))


def _forward_kernel(counts_ref, indices_ref, full_ref, q_ref, k_ref, v_ref, kv_valid_ref,
                    kv_ids_ref, q_ids_ref, slopes_ref, *refs, geo, num_consts):
  # counts_ref [nq]; indices_ref, full_ref [nq, w]: the key blocks each query block visits;
  # q_ref [bq, d]; k_ref, v_ref [kv_len, d]; kv_valid_ref, kv_ids_ref [1, kv_len]; q_ids_ref
  # [bq, 1]; then mask_mod's arrays, out_ref [bq, d], lse_ref [bq, 1]
  consts = [ref[...] for ref in refs[:num_consts]]
  out_ref, lse_ref = refs[num_consts:]
  q_block, batch, head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  bq, bk = geo.block_q, geo.block_k
  q, q_ids = q_ref[...], q_ids_ref[...]
  slope = slopes_ref[head] if geo.use_alibi else 0.0

  def key_block(t, state):
    j = indices_ref[q_block, t]
    keys = pl.ds(j * bk, bk)
    allowed = common.tile_allowed(geo, full_ref[q_block, t], batch, head, q_block * bq, j * bk,
                                  consts)
    scores, _ = common.tile_scores(q, k_ref[keys, :], q_block * bq, j * bk,
                                   kv_valid_ref[:, keys], slope, geo, allowed,
                                   (q_ids, kv_ids_ref[:, keys]))
    return tiles.softmax_update(state, scores, v_ref[keys, :])

  out, lse = tiles.softmax_finish(jax.lax.fori_loop(
      0, counts_ref[q_block], key_block, tiles.softmax_init(bq, q.shape[1])))
  out_ref[...] = out.astype(out_ref.dtype)
  lse_ref[...] = lse


def _dq_kernel(counts_ref, indices_ref, full_ref, q_ref, k_ref, v_ref, kv_valid_ref, kv_ids_ref,
               q_ids_ref, slopes_ref, do_ref, lse_ref, delta_ref, *refs, geo, num_consts):
  # as _forward_kernel; do_ref, dq_ref [bq, d]; lse_ref, delta_ref [bq, 1]
  consts = [ref[...] for ref in refs[:num_consts]]
  (dq_ref,) = refs[num_consts:]
  q_block, batch, head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  bq, bk = geo.block_q, geo.block_k
  q, q_ids, do, lse, delta = q_ref[...], q_ids_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
  slope = slopes_ref[head] if geo.use_alibi else 0.0

  def key_block(t, dq):
    j = indices_ref[q_block, t]
    keys = pl.ds(j * bk, bk)
    k = k_ref[keys, :]
    allowed = common.tile_allowed(geo, full_ref[q_block, t], batch, head, q_block * bq, j * bk,
                                  consts)
    scores, cap_grad = common.tile_scores(q, k, q_block * bq, j * bk, kv_valid_ref[:, keys],
                                          slope, geo, allowed, (q_ids, kv_ids_ref[:, keys]))
    _, ds = tiles.tile_probs_and_dscores(scores, lse, delta, do, v_ref[keys, :],
                                          cap_grad=cap_grad)
    return dq + tiles.dot_nn(ds.astype(k.dtype), k)                       # [bq, d]

  dq = jax.lax.fori_loop(0, counts_ref[q_block], key_block, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * geo.scale).astype(dq_ref.dtype)


def _dkdv_kernel(counts_ref, indices_ref, full_ref, q_ref, k_ref, v_ref, kv_valid_ref, kv_ids_ref,
                 q_ids_ref, slopes_ref, do_ref, lse_ref, delta_ref, *refs, geo, group,
                 num_consts):
  # counts_ref [nk]; indices_ref, full_ref [nk, w]: the query blocks that visit each key block;
  # q_ref, do_ref [q_len, group, d]; k_ref, v_ref, dk_ref, dv_ref [bk, d]; kv_valid_ref,
  # kv_ids_ref [1, bk]; q_ids_ref [q_len, 1]; lse_ref, delta_ref [group, q_len, 1]
  consts = [ref[...] for ref in refs[:num_consts]]
  dk_ref, dv_ref = refs[num_consts:]
  kv_block, batch, kv_head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  bq, bk = geo.block_q, geo.block_k
  k, v, kv_valid, kv_ids = k_ref[...], v_ref[...], kv_valid_ref[...], kv_ids_ref[...]

  def query_head(g, grads):
    head = kv_head * group + g
    slope = slopes_ref[head] if geo.use_alibi else 0.0

    def query_block(t, grads):
      dk, dv = grads
      i = indices_ref[kv_block, t]
      rows = pl.ds(i * bq, bq)
      q, do = q_ref[rows, g, :], do_ref[rows, g, :]                       # [bq, d]
      allowed = common.tile_allowed(geo, full_ref[kv_block, t], batch, head, i * bq,
                                    kv_block * bk, consts)
      scores, cap_grad = common.tile_scores(q, k, i * bq, kv_block * bk, kv_valid, slope, geo,
                                            allowed, (q_ids_ref[rows, :], kv_ids))
      p, ds = tiles.tile_probs_and_dscores(scores, lse_ref[g, rows, :], delta_ref[g, rows, :],
                                            do, v, cap_grad=cap_grad)
      return dk + tiles.dot_tn(ds.astype(q.dtype), q), dv + tiles.dot_tn(p.astype(do.dtype), do)

    return jax.lax.fori_loop(0, counts_ref[kv_block], query_block, grads)

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = jax.lax.fori_loop(0, group, query_head, (zeros, zeros))
  dk_ref[...] = (dk * geo.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def flash_attention(q, k, v, kv_mask, alibi_slopes=None, *, causal: bool, scale: float,
                    softcap=None, segment_ids=None, block_q=None, block_k=None, block_q_bwd=None,
                    block_k_bwd=None, interpret=None, mask_mod=None, sinks=None):
  """Exact softmax attention. q [b, q_len, h, d]; k, v [b, kv_len, kvh, d]; kv_mask bool
  [b, kv_len]; alibi_slopes f32 [h] or None; softcap None or c (scores c · tanh(s / c), in the
  kernels, forward and backward); segment_ids None or (int [b, q_len], int [b, kv_len]) (a query
  sees only keys of its own segment); sinks None or a sink logit per head f32 [h] (applied to
  the kernels' output and log-sum-exp: softmax.apply_sinks). Returns [b, q_len, h, d] in q's
  dtype.

  mask_mod: None (every key, or the causal rule when causal), or a flex mask_mod
  (b, h, q_idx, kv_idx) -> bool; it is evaluated on padded indices too (their keys are masked
  anyway), so arrays it indexes should clip or be long enough.

  interpret=None runs the kernels interpreted on a CPU and compiled (Triton) on a GPU.
  """
  b, q_len, num_heads, head_dim = q.shape
  kv_len = k.shape[1]
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  compiled = interpret is False
  if compiled and head_dim > MAX_COMPILED_HEAD_DIM:
    raise ValueError(f"flash (pallas, GPU): head_dim must be <= {MAX_COMPILED_HEAD_DIM}, "
                     f"got {head_dim}")
  defaults = default_blocks(head_dim)
  asked = dict(block_q=block_q, block_k=block_k, block_q_bwd=block_q_bwd, block_k_bwd=block_k_bwd)
  expected, allowed = block_rule(compiled)
  blocks = {}
  for name, value in asked.items():
    value = defaults[name] if value is None else value
    if not allowed(value):
      raise ValueError(f"flash (pallas, GPU): {name} must be {expected}, got {value}")
    length = kv_len if name.startswith("block_k") else q_len
    floor = MIN_COMPILED_BLOCK if compiled else 1
    # Short inputs: one block.
    blocks[name] = min(value, max(common.next_power_of_2(length), floor))
  padded_head_dim = max(common.next_power_of_2(head_dim), MIN_COMPILED_BLOCK if compiled else 1)
  q, k, v, kv_valid, segments, slopes = common.pad_inputs(
      q, k, v, kv_mask, alibi_slopes, segment_ids, head_dim=padded_head_dim,
      q_multiple=max(blocks["block_q"], blocks["block_q_bwd"]),      # powers of two: max = lcm
      kv_multiple=max(blocks["block_k"], blocks["block_k_bwd"]))
  fwd, bwd, metadata = block_metadata.kernel_plan(
      mask_mod, causal, q_len=q_len, kv_len=kv_len, q_padded=q.shape[1], kv_padded=k.shape[1],
      scale=scale, use_alibi=alibi_slopes is not None, softcap=softcap,
      use_segments=segment_ids is not None, **blocks)
  kernels = Kernels(fwd=fwd, bwd=bwd, interpret=interpret,
                    num_warps=4 if padded_head_dim <= 64 else 8)
  out, lse = common.attention_with_vjp(kernels, q, k, v, kv_valid, segments, slopes, metadata)
  return common.with_sinks(out[:, :q_len, :, :head_dim], lse, sinks)
