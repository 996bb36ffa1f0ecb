"""Context-parallel MoBA and NSA (variants/moba.py, variants/nsa.py): attention over key blocks
chosen from the data, with the sequence split over the mesh's `context` axis (C devices, device i
holding tokens [i·n/C, (i+1)·n/C)), equal to one device.

Ring attention (ops/ring.py) plans its shard pairs from a mask function of positions while
tracing; a choice made from the data is known only at run time. So:

1. What the choice reads is made whole on every device; it is small, and it is what grows with
   the length beyond the shard. MoBA: each block's sum of real keys and its count (a block may
   straddle two shards: each device adds its tokens into the ⌈n/B⌉ block rows, a `psum` over
   `context` completes them), [b, n/B, kvh, d] per device. NSA: the compressed keys and values
   (one per stride d, each from l tokens: a device compresses the blocks that start in its shard,
   with a halo of the next shard's first l - d tokens) are `all_gather`ed, [b, n/d, kvh, d] each,
   with the key-padding counts of the selection blocks (a `psum` of n/l' integers per row).
2. Each device chooses for its own queries with ops/block_selection.py's functions at the
   queries' global positions: the blocks one device chooses (ties, causal rule, forced blocks).
   NSA's compressed branch is computed here as well (its softmax is what the selection reads):
   each query against every compressed key, a chunk of queries at a time.
3. A ring over the K/V shards (`ppermute`, with the key padding): at step s device i holds
   shard (i - s) mod C, and each query attends to the keys of its chosen blocks that lie in that
   shard (gathered from the held shard, a chunk of queries at a time, the rest masked); the
   partial results merge by log-sum-exp (ring._merge). A step whose shard holds none of the
   device's chosen blocks is skipped at run time (`lax.cond`; causally every shard after the
   device's own): which blocks are chosen is known only then, so no step is skipped while
   tracing (any past block can be chosen).

The backward is JAX's autodiff of the `shard_map`: the ppermutes transpose to the reverse ring,
the `all_gather` to a reduce-scatter and the `psum` to itself; each query chunk's gathers are
rematerialised (`jax.checkpoint`). It keeps each step's K/V shard for the backward, C shards:
memory per device grows linearly with n (the K/V of the whole sequence, n·kvh·d floats each, the
summaries, and the shard's queries, choices and partial results), with no array of
(n/C) x (n/B) or (n/C) x (chosen keys) alive beyond one chunk.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from attention_zoo.ops import ring, softmax
from attention_zoo.ops.block_selection import (compressed_seen, compression_blocks, gate_choice,
                                               importance_choice)
from attention_zoo.ops.blocks import ceil_div, pad_to_multiple
from attention_zoo.ops.context import (BATCH_AXES, CONTEXT_AXIS, context_size, exchange_halo,
                                        sequence_spec)
from attention_zoo.ops.tiles import matmul_precision

_HIGHEST = jax.lax.Precision.HIGHEST
# per (batch row, K/V head): x [b, S, c, ...] at indices [b, ..., c, ...] -> [b, ..., c, ..., x's]
_gather = jax.vmap(jax.vmap(lambda x, i: x[i], in_axes=(1, 1), out_axes=1))


def _split(local, *args, replicated: int = 0):
  """`local` under shard_map over the active mesh: every argument but the last `replicated`
  split [batch axes, context], the outputs likewise."""
  spec = sequence_spec()
  batch_axes = [a for a in BATCH_AXES if a in jax.sharding.get_abstract_mesh().axis_names]
  split = (spec,) * (len(args) - replicated) + (jax.sharding.PartitionSpec(),) * replicated
  return jax.shard_map(local, in_specs=split, out_specs=spec,
                       axis_names={CONTEXT_AXIS, *batch_axes}, check_vma=False)(*args)


def _require_shards(name: str, length: int) -> int:
  size = ring._require_context()
  if length % size:
    raise ValueError(f"{name} on a context mesh: the length ({length}) must be a multiple of "
                     f"context={size}; pad the sequence to a multiple of {size}")
  return size


def _positions(shard: int):
  """The global positions of this device's tokens."""
  return jax.lax.axis_index(CONTEXT_AXIS) * shard + jnp.arange(shard)


def _block_totals(x, block_of, num_blocks: int):
  """x [b, S, ...] of this shard, block_of int [S] each token's block -> the totals of every
  block over the whole sequence, [b, num_blocks, ...] (a `psum` over `context`)."""
  totals = jnp.zeros((x.shape[0], num_blocks, *x.shape[2:]), x.dtype).at[:, block_of].add(x)
  return jax.lax.psum(totals, CONTEXT_AXIS)


def _chunks(x, chunk: int):
  """[b, S, ...] -> [S'/chunk, b, chunk, ...] (S padded to S', a multiple of chunk)."""
  x = pad_to_multiple(x, chunk)
  return jnp.moveaxis(x.reshape(x.shape[0], -1, chunk, *x.shape[2:]), 1, 0)


def _unchunk(x, length: int):
  """_chunks' inverse: [S'/chunk, b, chunk, ...] -> [b, length, ...]."""
  x = jnp.moveaxis(x, 0, 1)
  return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :length]


def _attend_held(q, chosen, q_positions, k, v, kv_real, start, rng, *, block: int, causal: bool,
                 scale: float, dropout_rate: float):
  """One chunk of queries against the K/V shard held (global positions start ..): q [b, B, c,
  g, d], chosen int32 [b, B, c, g', s] (g' = g, a choice per head, or 1, shared by the group; -1:
  none), q_positions [B]; k, v [b, S, c, d], kv_real bool [b, S, c] -> (softmax attention over
  the chosen keys in this shard, f32 [b, B, c, g, dv]; its natural log-sum-exp [b, B, c, g, 1],
  -inf where no key)."""
  shard = k.shape[1]
  key_positions = (chosen[..., None] * block + jnp.arange(block)).reshape(*chosen.shape[:-1], -1)
  local = key_positions - start                                                # [b, B, c, g', K]
  inside = (jnp.repeat(chosen, block, -1) >= 0) & (local >= 0) & (local < shard)
  local = jnp.clip(local, 0, shard - 1)
  allowed = inside & _gather(kv_real, local)
  if causal:
    allowed = allowed & (key_positions <= q_positions[None, :, None, None, None])
  k_chosen, v_chosen = _gather(k, local), _gather(v, local)                    # [b, B, c, g', K, d]
  scores = jnp.matmul(q[..., None, :], jnp.swapaxes(k_chosen, -1, -2),
                      precision=matmul_precision(q.dtype),
                      preferred_element_type=jnp.float32)[..., 0, :] * scale   # [b, B, c, g, K]
  allowed = jnp.broadcast_to(allowed, scores.shape)
  scores = jnp.where(allowed, scores, softmax.MASK_VALUE)
  top = jax.lax.stop_gradient(jnp.max(scores, -1, keepdims=True))
  weights = jnp.where(allowed, jnp.exp(scores - top), 0.0)
  total = weights.sum(-1, keepdims=True)
  seen = total > 0
  total = jnp.where(seen, total, 1.0)
  lse = jnp.where(seen, top + jnp.log(total), -jnp.inf)
  weights = weights / total
  if rng is not None:
    weights = softmax.dropout(weights, dropout_rate, rng)
  out = jnp.matmul(weights[..., None, :], v_chosen.astype(jnp.float32), precision=_HIGHEST)
  return out[..., 0, :], lse


def _ring_over_chosen(q_chunks, chosen, q_positions, k, v, kv_real, rng, *, block: int,
                      causal: bool, scale: float, dropout_rate: float):
  """Inside shard_map: each query's softmax attention over the keys of its chosen blocks, the
  K/V shards passed around the ring. q_chunks [n, b, B, c, g, d], chosen int32 [n, b, B, c, g',
  s] (global block indices, -1: none), q_positions [n, B] (global); k, v [b, S, c, d], kv_real
  bool [b, S] this device's shard -> f32 [n, b, B, c, g, dv]."""
  size, device = jax.lax.axis_size(CONTEXT_AXIS), jax.lax.axis_index(CONTEXT_AXIS)
  shard = k.shape[1]
  kv_real = jnp.broadcast_to(kv_real[..., None], k.shape[:3])
  attend = functools.partial(_attend_held, block=block, causal=causal, scale=scale,
                             dropout_rate=dropout_rate)

  def step(held, source):
    k_s, v_s, real_s = held

    @jax.checkpoint
    def chunk(args):
      index, q_c, chosen_c, positions_c = args
      key = None if rng is None else jax.random.fold_in(
          jax.random.fold_in(jax.random.fold_in(rng, device), source), index)
      return attend(q_c, chosen_c, positions_c, k_s, v_s, real_s, source * shard, key)

    return jax.lax.map(chunk, (jnp.arange(len(q_chunks)), q_chunks, chosen, q_positions))

  out = jnp.zeros(q_chunks.shape[:-1] + v.shape[-1:], jnp.float32)
  lse = jnp.full(q_chunks.shape[:-1] + (1,), -jnp.inf)
  nothing = lambda held, source: (jnp.zeros_like(out), jnp.full_like(lse, -jnp.inf))
  held = (k, v, kv_real)
  for hop in range(size):
    held = ring._shift(held, min(hop, 1), size)
    source = (device - hop) % size
    start = source * shard
    touches = (chosen >= 0) & (chosen * block < start + shard) & ((chosen + 1) * block > start)
    needed = jnp.any(touches) & ((source <= device) if causal else True)
    out_s, lse_s = jax.lax.cond(needed, step, nothing, held, source)
    out, lse = ring._merge(out, lse, out_s, lse_s)
  return out


def moba_ring(q, k, v, *, q_mask, kv_mask, block: int, top_k: int, causal: bool, scale: float,
              dropout_rate: float = 0.0, dropout_rng=None):
  """MoBA (variants/moba.py) with the sequence split over the active mesh's `context` axis:
  q [b, n, h, d], k, v [b, n, kvh, d], masks bool [b, n], sharded [batch axes, context] ->
  [b, n, h, dv] f32 (padded queries: 0), what one device's MoBA attention gives."""
  _require_shards("moba", q.shape[1])
  kv_heads, num_blocks = k.shape[2], ceil_div(q.shape[1], block)
  choose = functools.partial(gate_choice, block=block, top_k=top_k, causal=causal)
  # per (batch row, K/V head): q [B, g, d], means [N, d], counts [N]
  choose = jax.vmap(jax.vmap(choose, in_axes=(1, None, 1, None), out_axes=1),
                    in_axes=(0, None, 0, 0))

  def local(q, k, v, q_mask, kv_mask, rng):
    batch, shard, heads, _ = q.shape
    block_of = _positions(shard) // block
    sums = _block_totals(jnp.where(kv_mask[..., None, None], k, 0).astype(jnp.float32), block_of,
                         num_blocks)                                           # [b, N, c, d]
    counts = _block_totals(kv_mask.astype(jnp.int32), block_of, num_blocks)    # [b, N]
    means = sums / jnp.maximum(counts, 1)[..., None, None]
    q_chunks = _chunks(softmax.group_heads(q, kv_heads), block)               # [n, b, B, c, g, d]
    positions = _chunks(_positions(shard)[None], block)[:, 0]                 # [n, B]

    def chunk_choice(args):
      q_c, positions_c, real_c = args
      chosen = choose(jax.lax.stop_gradient(q_c), positions_c, means, counts)  # [b, B, c, g, s]
      return jnp.where(real_c[:, :, None, None, None], chosen, -1)

    chosen = jax.lax.map(chunk_choice, (q_chunks, positions, _chunks(q_mask, block)))
    out = _ring_over_chosen(q_chunks, chosen, positions, k, v, kv_mask, rng, block=block,
                            causal=causal, scale=scale, dropout_rate=dropout_rate)
    return _unchunk(out, shard).reshape(batch, shard, heads, -1)

  rng = dropout_rng if dropout_rate > 0 else None
  return _split(local, q, k, v, q_mask, kv_mask, rng, replicated=1)


def sequence_compression_blocks(x, *, length: int, stride: int):
  """block_selection.compression_blocks of x [b, n, kvh, ...]; with the sequence split over the
  active mesh's `context` axis, each device makes the blocks that start in its shard (a halo of
  the next shard's first length - stride tokens), and the result [b, n/stride, kvh, length, ...]
  is split likewise."""
  size = context_size()
  if size == 1:
    return compression_blocks(x, length=length, stride=stride)
  _require_shards("nsa", x.shape[1])
  shard = x.shape[1] // size
  if shard % stride:
    raise ValueError(f"nsa on a context mesh: a shard's length ({shard} = {x.shape[1]}/{size}) "
                     f"must be a multiple of block_stride={stride}, so that each compression "
                     f"block starts in one shard; choose a length or context that makes it so")

  def local(x):
    haloed = exchange_halo(x, 0, length - stride)
    return compression_blocks(haloed, length=length, stride=stride)[:, :shard // stride]

  return _split(local, x)


def nsa_ring(q, k, v, compressed_keys, compressed_values, compressed_real, *, q_mask, kv_mask,
             length: int, stride: int, block: int, count: int, causal: bool, scale: float,
             dropout_rate: float = 0.0, dropout_rng=None):
  """NSA's compressed and selected branches (variants/nsa.py) with the sequence split over the
  active mesh's `context` axis: q [b, n, h, d], k, v [b, n, kvh, d], the compressed keys and
  values [b, n/stride, kvh, d] and which hold a real key [b, n/stride] (from
  sequence_compression_blocks), masks bool [b, n], all sharded [batch axes, context] -> (the
  compressed branch, the selected branch), each [b, n, h, d] f32."""
  _require_shards("nsa", q.shape[1])
  kv_heads, num_blocks = k.shape[2], ceil_div(q.shape[1], block)
  choose = functools.partial(importance_choice, length=length, stride=stride, block=block,
                             count=count, causal=causal)
  # per (batch row, K/V head): p [B, N], has_real [N_s]
  choose = jax.vmap(jax.vmap(choose, in_axes=(1, None, None), out_axes=1), in_axes=(0, None, 0))
  seen_by = functools.partial(compressed_seen, length=length, stride=stride, causal=causal)

  def local(q, k, v, compressed_keys, compressed_values, compressed_real, q_mask, kv_mask, rng):
    batch, shard, heads, _ = q.shape
    gather = lambda x: jax.lax.all_gather(x, CONTEXT_AXIS, axis=1, tiled=True)
    keys, values = (gather(x).astype(jnp.float32) for x in (compressed_keys, compressed_values))
    real = gather(compressed_real)                                             # [b, N]
    has_real = _block_totals(kv_mask.astype(jnp.int32), _positions(shard) // block,
                             num_blocks) > 0                                   # [b, N_s]
    q_chunks = _chunks(softmax.group_heads(q, kv_heads), block)               # [n, b, B, c, g, d]
    positions = _chunks(_positions(shard)[None], block)[:, 0]                 # [n, B]
    device = jax.lax.axis_index(CONTEXT_AXIS)
    compressed_rng, selected_rng = (None, None) if rng is None else jax.random.split(rng)

    @jax.checkpoint
    def chunk(args):   # the compressed branch, and the blocks its softmax selects
      index, q_c, positions_c, real_c = args
      seen = jax.vmap(lambda r: seen_by(positions_c, r))(real)                 # [b, B, N]
      scores = jnp.einsum("bqcgd,bjcd->bqcgj", q_c.astype(jnp.float32), keys,
                          precision=_HIGHEST) * scale                          # [b, B, c, g, N]
      p = softmax.masked_softmax(scores, seen[:, :, None, None])
      chosen = choose(jax.lax.stop_gradient(p).sum(3), positions_c, has_real)  # [b, B, c, s]
      chosen = jnp.where(real_c[:, :, None, None], chosen, -1)[:, :, :, None]  # shared by g
      if rng is not None:
        key = jax.random.fold_in(jax.random.fold_in(compressed_rng, device), index)
        p = softmax.dropout(p, dropout_rate, key)
      return jnp.einsum("bqcgj,bjcd->bqcgd", p, values, precision=_HIGHEST), chosen

    compressed, chosen = jax.lax.map(chunk, (jnp.arange(len(q_chunks)), q_chunks, positions,
                                             _chunks(q_mask, block)))
    selected = _ring_over_chosen(q_chunks, chosen, positions, k, v, kv_mask, selected_rng,
                                 block=block, causal=causal, scale=scale,
                                 dropout_rate=dropout_rate)
    as_heads = lambda x: _unchunk(x, shard).reshape(batch, shard, heads, -1)
    return as_heads(compressed), as_heads(selected)

  rng = dropout_rng if dropout_rate > 0 else None
  return _split(local, q, k, v, compressed_keys, compressed_values, compressed_real, q_mask,
                kv_mask, rng, replicated=1)
