"""Block-sparse softmax attention written as two small functions (the FlexAttention / splash
style): the engine under every exact sparse pattern (it registers no variant itself).

    out_i = Σ_{j : mask_mod(b, h, i, j)} softmax_j(score_mod(scale · q_i·k_j, b, h, i, j)) v_j

`mask_mod(b, h, q_idx, kv_idx) -> bool` says which keys a query sees; `score_mod(score, b, h,
q_idx, kv_idx) -> score` changes a score (soft-capping, ALiBi, a relative-position bias). Both
are jnp functions called on broadcastable int32 index arrays (b [B, 1, 1, 1], h and q_idx
[1, ·, rows, 1], kv_idx [1, 1, 1, cols]) and may index arrays they close over (segment ids,
slopes, per-token gates): write them as for scalars, with jnp.where instead of `if`.

    causal = lambda b, h, q, kv: kv <= q
    softcap = lambda score, b, h, q, kv: 30 * jnp.tanh(score / 30)
    mask = create_block_mask(causal, None, None, q_len, kv_len)
    out = flex_attention(q, k, v, block_mask=mask, score_mod=softcap)

`create_block_mask` evaluates mask_mod one strip of `block_q` queries at a time and keeps, per
query block, the key blocks that are *partial* (mask_mod applied in the tile) or *full* (no mask
evaluated), listed in ascending order, and per key block the query blocks that visit it; every
other block is *empty* and never visited, forward or backward. Its memory grows with the number
of blocks, never with q_len · kv_len. A mask_mod that closes over no traced array is evaluated
while tracing, so a jitted call does not recompute it.

`flex_attention` runs FlashAttention's online softmax (the tile maths of tiles.py) over those
lists: `lax.map` over query blocks, a loop over each block's listed key blocks; the
backward (custom VJP) recomputes every tile from the saved log-sum-exp, key block by key block
over the query blocks that visit it (FlashAttention-2's order), so memory is linear in length
both ways. Under forward-mode differentiation (jax.jvp, jacfwd: autodiff.py), which JAX refuses
through a custom VJP, the forward runs as plain JAX and JAX differentiates its loops, still in
linear memory; forward over reverse (jax.jvp of jax.grad, jax.hessian) keeps the custom VJP,
whose backward is plain JAX; reverse over forward (jax.grad of jax.jvp) is refused (the plain
loops run a data-dependent number of steps). Arrays that score_mod (or a `tile_score`) closes
over get gradients; those of mask_mod do not. A query that sees no key returns 0 (and passes no
gradient). Lengths that are not multiples of the blocks are padded, and the padding masked.

`block_mask_from_states` builds the metadata from tile states a caller derived itself (a
pattern that is data, as MoBA's per-query block selection), and `flex_attention(...,
return_lse=True)` also returns each row's log-sum-exp, differentiable, so attention over
disjoint key sets computed in separate calls merges exactly.

For the variants: `causal_mask`, `softcap` and `alibi` build the zoo's causal rule, soft-capping
and ALiBi, `score_function` composes the last two (cap first, then the bias), `with_segments`
ANDs a block mask with "same segment" (packed sequences), `pattern_attention` is flex_attention
over a mask_mod with all of them, `dense_mask` evaluates a mask_mod densely (for `pattern()`).

Segment ids are data, so `with_segments` builds its block metadata from them inside jit: a tile
is empty when its queries' and keys' id ranges do not meet, full when all of them hold one id
(and the variant's tile is full), otherwise partial (the mask evaluated), so packing costs
O(blocks) to plan and skips the tiles between documents.

A tile holds every batch row and head (the query heads sharing a K/V head stacked as rows, so
GQA never copies K/V): when the mask differs across batch rows or heads (BlockMask with batch or
heads > 1), the tiles visited are the union over them, each evaluated with the true mask_mod.
A mask built for batch=None or heads=None is assumed not to depend on b or h.

`tile_score(q_block, k_block, h) -> scores` replaces the dot product for a score that is not
one (additive attention): q_block [b, kvh, rows, d'], k_block [b, kvh, cols, d'], h the head of
each row [1, kvh, rows, 1]; it returns natural-unit scores [b, kvh, rows, cols] (scale included).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from attention_zoo.ops import softmax, tiles
from attention_zoo.ops.autodiff import autodiff_modes
from attention_zoo.ops.blocks import ceil_div, pad_to_multiple

EMPTY, PARTIAL, FULL = 0, 1, 2     # what a (query block, key block) tile is under a mask
DEFAULT_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class BlockMask:
  """Which key blocks each query block visits, and (for the backward) which query blocks each key
  block is visited by. B and H are 1 for a mask built with batch=None or heads=None;
  nq = ceil(q_len / block_q), nk = ceil(kv_len / block_k); the first kv_num_blocks entries of a
  row of kv_indices are its key blocks (ascending), the rest filler; likewise q_*."""
  kv_num_blocks: jax.Array    # int32 [B, H, nq]
  kv_indices: jax.Array       # int32 [B, H, nq, width]
  kv_full: jax.Array          # bool [B, H, nq, width]: mask_mod is True on the whole tile
  q_num_blocks: jax.Array     # int32 [B, H, nk]
  q_indices: jax.Array        # int32 [B, H, nk, width']
  q_full: jax.Array           # bool [B, H, nk, width']
  mask_mod: Callable | None   # None: every listed tile is full
  q_len: int
  kv_len: int
  block_q: int
  block_k: int

  @property
  def num_q_blocks(self) -> int:
    return ceil_div(self.q_len, self.block_q)

  @property
  def num_kv_blocks(self) -> int:
    return ceil_div(self.kv_len, self.block_k)

  def states(self):
    """int8 [B, H, nq, nk]: EMPTY, PARTIAL or FULL for every tile (for tests and union)."""
    width = self.kv_indices.shape[-1]
    listed = jnp.arange(width) < self.kv_num_blocks[..., None]                # [B, H, nq, w]
    state = jnp.where(listed, jnp.where(self.kv_full, FULL, PARTIAL), EMPTY).astype(jnp.int8)
    # filler entries go to a spare column that is cut off
    column = jnp.where(listed, self.kv_indices, self.num_kv_blocks)
    batch, heads, rows, _ = column.shape
    b, h, i = np.ix_(np.arange(batch), np.arange(heads), np.arange(rows))
    states = jnp.zeros((batch, heads, rows, self.num_kv_blocks + 1), jnp.int8)
    return states.at[b[..., None], h[..., None], i[..., None], column].max(state)[..., :-1]


jax.tree_util.register_dataclass(
    BlockMask, data_fields=["kv_num_blocks", "kv_indices", "kv_full", "q_num_blocks", "q_indices",
                            "q_full"],
    meta_fields=["mask_mod", "q_len", "kv_len", "block_q", "block_k"])


def _both_lists(states):
  """states [..., nq, nk] -> _lists of the rows (per query block), then of the columns."""
  return _lists(states) + _lists(jnp.swapaxes(states, -1, -2))


def _lists(states):
  """states int [..., nq, nk] -> (counts int32 [..., nq], indices int32 [..., nq, width], full
  bool [..., nq, width]): the non-empty blocks first, ascending. Concrete states give
  width = the largest count (at least 1), traced ones width = nk."""
  listed = states != EMPTY
  indices = jnp.argsort(~listed, axis=-1, stable=True).astype(jnp.int32)
  counts = jnp.sum(listed, axis=-1, dtype=jnp.int32)
  full = jnp.take_along_axis(states == FULL, indices, axis=-1)
  if not isinstance(counts, jax.core.Tracer):
    width = max(1, int(counts.max()))
    indices, full = indices[..., :width], full[..., :width]
  return counts, indices, full


def _check_block(name: str, value) -> int:
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
    raise ValueError(f"flex: {name} must be a positive integer, got {value!r}")
  return int(value)


def _block_lists(mask_mod, batch, heads, q_len, kv_len, block_q, block_k):
  """create_block_mask's lists: _both_lists of the [B, H, nq, nk] tile states."""
  num_q, num_k = ceil_div(q_len, block_q), ceil_div(kv_len, block_k)
  b = jnp.arange(batch or 1)[:, None, None, None]
  h = jnp.arange(heads or 1)[None, :, None, None]
  kv = jnp.arange(num_k * block_k)[None, None, None, :]
  real_kv = kv[0, 0] < kv_len                                                   # [1, nk·bk]

  def strip(i):   # -> int8 [B, H, nk]
    q = (i * block_q + jnp.arange(block_q))[None, None, :, None]
    real = (q[0, 0] < q_len) & real_kv                                          # [bq, nk·bk]
    allowed = jnp.broadcast_to(mask_mod(b, h, q, kv), b.shape[:1] + h.shape[1:2] + real.shape)
    tiles = lambda x: x.reshape(x.shape[:-2] + (block_q, num_k, block_k))
    seen = jnp.any(tiles(allowed & real), axis=(-3, -1))                        # [B, H, nk]
    whole = jnp.all(tiles(allowed | ~real), axis=(-3, -1))
    return jnp.where(whole, FULL, jnp.where(seen, PARTIAL, EMPTY)).astype(jnp.int8)

  states = jax.jit(lambda: jax.lax.map(strip, jnp.arange(num_q)))()            # [nq, B, H, nk]
  return _both_lists(jnp.moveaxis(states, 0, 2))


def create_block_mask(mask_mod: Callable, batch: int | None, heads: int | None, q_len: int,
                      kv_len: int, *, block_q: int = DEFAULT_BLOCK,
                      block_k: int = DEFAULT_BLOCK) -> BlockMask:
  """The block metadata of `mask_mod` for queries 0..q_len-1 and keys 0..kv_len-1.

  batch / heads: how many batch rows / query heads the mask differs over, or None when it does
  not depend on b / h (then mask_mod is evaluated at b = 0 / h = 0). Blocks larger than a length
  shrink to it. Evaluated one strip of block_q queries at a time: O(block_q · kv_len) at once.
  """
  block_q = min(_check_block("block_q", block_q), q_len)
  block_k = min(_check_block("block_k", block_k), kv_len)
  # A mask_mod that closes over no traced array gives concrete metadata even under jit:
  # computed once while tracing, not in every call.
  with jax.ensure_compile_time_eval():
    lists = _block_lists(mask_mod, batch, heads, q_len, kv_len, block_q, block_k)
  return BlockMask(*lists, mask_mod, q_len, kv_len, block_q, block_k)


def full_block_mask(q_len: int, kv_len: int, *, block_q: int = DEFAULT_BLOCK,
                    block_k: int = DEFAULT_BLOCK) -> BlockMask:
  """Every query sees every key (mask_mod None: no mask is evaluated anywhere)."""
  block_q = min(_check_block("block_q", block_q), q_len)
  block_k = min(_check_block("block_k", block_k), kv_len)
  num_q, num_k = ceil_div(q_len, block_q), ceil_div(kv_len, block_k)
  with jax.ensure_compile_time_eval():
    lists = _both_lists(jnp.full((1, 1, num_q, num_k), FULL, jnp.int8))
  return BlockMask(*lists, None, q_len, kv_len, block_q, block_k)


def block_mask_from_states(states, mask_mod: Callable | None, q_len: int, kv_len: int, *,
                           block_q: int, block_k: int) -> BlockMask:
  """A BlockMask from tile states the caller derived itself: int [B|1, H|1, nq, nk] of EMPTY,
  PARTIAL (mask_mod evaluated in the tile) and FULL, nq = ceil(q_len / block_q), nk likewise.
  For a pattern that is data (a selection per query, inside jit) and whose tiles are cheaper to
  derive from the data than by evaluating mask_mod everywhere. Traced states give traced lists,
  as wide as nk (and nq)."""
  want = (ceil_div(q_len, block_q), ceil_div(kv_len, block_k))
  if states.ndim != 4 or tuple(states.shape[-2:]) != want:
    raise ValueError(f"flex: states must be [B|1, H|1, nq, nk] = [·, ·, {want[0]}, {want[1]}] "
                     f"for q_len={q_len}, kv_len={kv_len} in blocks of {block_q} x {block_k}; "
                     f"got {states.shape}")
  return BlockMask(*_both_lists(jnp.asarray(states, jnp.int8)), mask_mod, q_len, kv_len,
                   block_q, block_k)


def causal_mask(q_len: int, kv_len: int) -> Callable:
  """mask_mod of the zoo's causal rule: query i sees key j iff j <= i + (kv_len - q_len)."""
  return lambda b, h, q, kv: softmax.causal_allowed(q, kv, q_len, kv_len)


def alibi(slopes, q_len: int, kv_len: int, *, query_positions=None,
          key_positions=None) -> Callable:
  """score_mod adding ALiBi (softmax.alibi_bias): -slope_h · |i + (kv_len - q_len) - j|.
  query_positions / key_positions (int arrays, default the identity) map a query / key index to
  its sequence position, for variants that reorder or repeat keys."""
  slopes = jnp.asarray(slopes, jnp.float32)
  at = lambda positions, index: index if positions is None else jnp.asarray(positions)[index]

  def score_mod(score, b, h, q, kv):
    distance = jnp.abs(at(query_positions, q) + (kv_len - q_len) - at(key_positions, kv))
    return score - slopes[h] * distance
  return score_mod


def softcap(cap: float) -> Callable:
  """score_mod of tanh soft-capping (Gemma 2): s -> cap · tanh(s / cap), |s| < cap after."""
  cap = float(cap)
  return lambda score, b, h, q, kv: cap * jnp.tanh(score / cap)


def score_function(*, softcap_value: float | None, alibi_slopes, q_len: int, kv_len: int,
                   query_positions=None, key_positions=None) -> Callable | None:
  """An exact variant's score_mod: soft-capping (softcap_value, None: none) of the scaled dot
  product, then the ALiBi bias (alibi_slopes, None: none; positions as for `alibi`), as Gemma 2
  caps the logits before adding its mask. None when neither is given."""
  mods = []
  if softcap_value is not None:
    mods.append(softcap(softcap_value))
  if alibi_slopes is not None:
    mods.append(alibi(alibi_slopes, q_len, kv_len, query_positions=query_positions,
                      key_positions=key_positions))
  if not mods:
    return None

  def score_mod(score, b, h, q, kv):
    for mod in mods:
      score = mod(score, b, h, q, kv)
    return score
  return score_mod


def _block_range(ids, block: int):
  """ids int [B, len] -> per block (min, max) [B, n_blocks]; the tail is padded with the last id
  (padding never widens a range: it is masked anyway)."""
  padded = jnp.pad(ids, ((0, 0), (0, -ids.shape[1] % block)), mode="edge")
  blocks = padded.reshape(ids.shape[0], -1, block)
  return blocks.min(-1), blocks.max(-1)


def with_segments(block_mask: BlockMask, q_segment_ids, kv_segment_ids) -> BlockMask:
  """block_mask AND "query and key in the same segment" (packed sequences): q_segment_ids int
  [B, q_len], kv_segment_ids int [B, kv_len], indexed by the engine's query / key index (a
  variant that reorders or copies keys passes them in that order). Works on traced ids (the
  lists are then traced, as wide as the key blocks); the tiles whose id ranges do not meet are
  empty, so contiguous segments skip every tile between two documents."""
  q_ids, kv_ids = jnp.asarray(q_segment_ids, jnp.int32), jnp.asarray(kv_segment_ids, jnp.int32)
  bq, bk = block_mask.block_q, block_mask.block_k
  (q_lo, q_hi), (kv_lo, kv_hi) = _block_range(q_ids, bq), _block_range(kv_ids, bk)
  meet = (q_lo[:, :, None] <= kv_hi[:, None, :]) & (kv_lo[:, None, :] <= q_hi[:, :, None])
  one_id = ((q_lo == q_hi)[:, :, None] & (kv_lo == kv_hi)[:, None, :]
            & (q_lo[:, :, None] == kv_lo[:, None, :]))
  segment_states = jnp.where(one_id, FULL, jnp.where(meet, PARTIAL, EMPTY))[:, None]
  states = block_mask.states()                                                # [1|B, 1|H, nq, nk]
  states = jnp.where((states == EMPTY) | (segment_states == EMPTY), EMPTY,
                     jnp.where((states == FULL) & (segment_states == FULL), FULL, PARTIAL))
  inner = block_mask.mask_mod

  def mask_mod(b, h, q, kv):
    same = q_ids[b, q] == kv_ids[b, kv]           # padded indices clamp: their keys are masked
    return same if inner is None else same & inner(b, h, q, kv)
  return BlockMask(*_both_lists(states.astype(jnp.int8)), mask_mod, block_mask.q_len,
                   block_mask.kv_len, bq, bk)


def aligned_positions(q_len: int, kv_len: int):
  """For `pattern()`: numpy aligned query positions [q_len, 1] (i + kv_len - q_len) and key
  positions [1, kv_len]."""
  return np.arange(q_len)[:, None] + (kv_len - q_len), np.arange(kv_len)[None, :]


def dense_mask(mask_mod: Callable, heads: int | None, q_len: int, kv_len: int) -> np.ndarray:
  """mask_mod on every entry at b = 0: numpy bool [heads or 1, q_len, kv_len] (`pattern()`)."""
  h = np.arange(heads or 1)[:, None, None]
  q, kv = np.arange(q_len)[None, :, None], np.arange(kv_len)[None, None, :]
  return np.broadcast_to(np.asarray(mask_mod(0, h, q, kv)), (len(h), q_len, kv_len))


def pattern_attention(q, k, v, mask_mod: Callable, *, kv_mask, scale: float, softcap=None,
                      alibi_slopes=None, dropout_rate: float = 0.0, dropout_rng=None,
                      segment_ids=None, heads: int | None = None, block_q: int = DEFAULT_BLOCK,
                      block_k: int = DEFAULT_BLOCK,
                      sequence_lengths: tuple[int, int] | None = None, query_positions=None,
                      key_positions=None, sinks=None):
  """flex_attention over mask_mod (per head when `heads`) with the zoo's soft-capping (softcap:
  None or the cap), ALiBi, attention dropout, and the segment mask of packed sequences
  (segment_ids: (q ids [b, q_len], kv ids [b, kv_len]) by sequence position, or None) and the
  attention sinks (sinks: None or a logit per head, f32 [h]). A
  pattern that reorders or repeats queries or keys passes their sequence positions and the
  sequence's (q_len, kv_len). A variant's `attend()` on it: attention_zoo.variants.masked."""
  q_len, kv_len = q.shape[1], k.shape[1]
  block_mask = create_block_mask(mask_mod, None, heads, q_len, kv_len, block_q=block_q,
                                 block_k=block_k)
  if segment_ids is not None:
    in_order = lambda ids, positions: ids if positions is None else ids[:, positions]
    block_mask = with_segments(block_mask, in_order(segment_ids[0], query_positions),
                               in_order(segment_ids[1], key_positions))
  sequence_q_len, sequence_kv_len = sequence_lengths or (q_len, kv_len)
  score_mod = score_function(softcap_value=softcap, alibi_slopes=alibi_slopes,
                             q_len=sequence_q_len, kv_len=sequence_kv_len,
                             query_positions=query_positions, key_positions=key_positions)
  return flex_attention(q, k, v, block_mask=block_mask, score_mod=score_mod, scale=scale,
                        kv_mask=kv_mask, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                        sinks=sinks)


def kernel_lists(mask_mod: Callable | None, q_len: int, kv_len: int, *, block_q: int,
                 block_k: int):
  """What a kernel reads (the Pallas flash kernels): _visits of mask_mod's block mask (None:
  every key) as int32 arrays. The lengths should be multiples of the blocks (kernels pad)."""
  if mask_mod is None:
    block_mask = full_block_mask(q_len, kv_len, block_q=block_q, block_k=block_k)
  else:
    block_mask = create_block_mask(mask_mod, None, None, q_len, kv_len, block_q=block_q,
                                   block_k=block_k)
  with jax.ensure_compile_time_eval():
    return tuple(x.astype(jnp.int32) for x in _visits(block_mask))


def _visits(block_mask: BlockMask):
  """The tiles a call visits, the union over the mask's batch rows and heads (full only where
  full for all of them): (counts [nq], indices [nq, w], full [nq, w]) per query block, then the
  same per key block."""
  if block_mask.kv_num_blocks.shape[:2] == (1, 1):
    return tuple(x[0, 0] for x in (block_mask.kv_num_blocks, block_mask.kv_indices,
                                   block_mask.kv_full, block_mask.q_num_blocks,
                                   block_mask.q_indices, block_mask.q_full))
  states = block_mask.states()
  listed = jnp.any(states != EMPTY, axis=(0, 1))
  full = jnp.all(states == FULL, axis=(0, 1))
  return _both_lists(jnp.where(full, FULL, jnp.where(listed, PARTIAL, EMPTY)))


# -- the engine ----------------------------------------------------------------------------

def _tile_indices(block_q: int, block_k: int, group: int, batch: int, kv_heads: int, i, j):
  """Tile (i, j)'s b [B, 1, 1, 1], h [1, kvh, rows, 1], q [1, 1, rows, 1] and kv [1, 1, 1, bk]
  indices: row r is query i·bq + r mod bq of head kvh·group + r // bq."""
  rows = jnp.arange(group * block_q)
  head = jnp.arange(kv_heads)[:, None] * group + rows // block_q
  return (jnp.arange(batch)[:, None, None, None], head[None, :, :, None],
          (i * block_q + rows % block_q)[None, None, :, None],
          (j * block_k + jnp.arange(block_k))[None, None, None, :])


@dataclasses.dataclass(frozen=True)
class _Plan:
  """What is static about one call (the custom VJP's nondiff argument). tile_score(q_i, k_j, h,
  *tile_consts), score_mod(scores, b, h, q, kv, *mod_consts) and mask(b, h, q, kv,
  *mask_consts) are closure-converted, so the arrays they close over are explicit arguments;
  None: the dot product, no score_mod, no mask_mod."""
  tile_score: Callable | None
  score_mod: Callable | None
  mask: Callable | None
  scale: float
  block_q: int
  block_k: int
  group: int
  dropout_rate: float

  def raw_scores(self, q_i, k_j, head, tile_consts):
    """[b, kvh, rows, bk] natural-unit scores before score_mod."""
    if self.tile_score is None:
      return tiles.dot_nt(q_i, k_j) * self.scale
    return self.tile_score(q_i, k_j, head, *tile_consts).astype(jnp.float32)

  def modified(self, scores, index, mod_consts):
    if self.score_mod is None:
      return scores
    modified = self.score_mod(scores, *index, *mod_consts)
    return jnp.broadcast_to(modified, scores.shape).astype(jnp.float32)

  def indices(self, batch: int, kv_heads: int, i, j):
    return _tile_indices(self.block_q, self.block_k, self.group, batch, kv_heads, i, j)

  def masked(self, scores, index, is_full, kv_valid_j, mask_consts):
    """Natural-unit scores [b, kvh, rows, bk] -> base-2 scores, MASK_VALUE on key padding and,
    unless the tile is full, where mask_mod is False."""
    shape = scores.shape
    allowed = jnp.broadcast_to(kv_valid_j, shape)
    if self.mask is not None:
      evaluate = lambda: jnp.broadcast_to(self.mask(*index, *mask_consts), shape)
      allowed &= jax.lax.cond(is_full, lambda: jnp.ones(shape, bool), evaluate)
    return jnp.where(allowed, scores * tiles.LOG2E, tiles.MASK_VALUE)

  def kept(self, rng, i, j, shape):
    """Attention dropout of tile (i, j): keep / (1 - rate) (the same in the backward), or None."""
    if rng is None:
      return None
    keep = softmax.keep_mask(jax.random.fold_in(jax.random.fold_in(rng, i), j), shape,
                             self.dropout_rate)
    return keep.astype(jnp.float32) / (1.0 - self.dropout_rate)


def _forward(plan: _Plan, q_blocks, k, v, kv_valid, visits, rng, mask_consts, tile_consts,
             mod_consts):
  """q_blocks [nq, b, kvh, rows, d'], k [b, kvh, kv_len, d'], v [b, kvh, kv_len, dv], kv_valid
  bool [b, 1, 1, kv_len] -> out [nq, b, kvh, rows, dv] (q's dtype), lse₂ [nq, b, kvh, rows, 1]
  (0 for a row that saw no key, as the backward wants it) and the natural-unit log-sum-exp that
  flex_attention returns (-inf for such a row)."""
  counts, indices, full = visits[:3]
  _, batch, kv_heads, rows, _ = q_blocks.shape
  bk = plan.block_k
  init = jax.tree.map(lambda x: jnp.broadcast_to(x, (batch, kv_heads) + x.shape),
                      tiles.softmax_init(rows, v.shape[-1]))

  def query_block(args):
    i, q_i = args

    def key_block(t, state):
      j = indices[i, t]
      index = plan.indices(batch, kv_heads, i, j)
      scores = plan.raw_scores(q_i, _slice(k, j, bk), index[1], tile_consts)  # [b, kvh, rows, bk]
      scores = plan.modified(scores, index, mod_consts)
      scores = plan.masked(scores, index, full[i, t], _slice(kv_valid, j, bk, 3), mask_consts)
      return tiles.softmax_update(state, scores, _slice(v, j, bk),
                                   plan.kept(rng, i, j, scores.shape))

    state = jax.lax.fori_loop(0, counts[i], key_block, init)
    out, lse = tiles.softmax_finish(state)
    seen = state[2] > 0
    return out.astype(q_blocks.dtype), lse, jnp.where(seen, lse / tiles.LOG2E, -jnp.inf)

  return jax.lax.map(query_block, (jnp.arange(q_blocks.shape[0]), q_blocks))


def _slice(x, j, block: int, axis: int = 2):
  """Key block j of x along `axis` (k, v [b, kvh, len, c]: 2; kv_valid [b, 1, 1, len]: 3)."""
  return jax.lax.dynamic_slice_in_dim(x, j * block, block, axis=axis)


def _backward(plan: _Plan, residuals, cotangents):
  """FlashAttention-2's backward over the visited tiles, key block by key block: dKᵀ, dVᵀ of a
  key block accumulate over the query blocks that see it (transposed, [d, bk], so the tiles P
  and dS are never transposed), each tile adds its share of dQ; arrays that tile_score and
  score_mod close over get their share too. The log-sum-exp's cotangent d_lse adds
  d_lse · ∂lse/∂s = d_lse · P to dS, i.e. Δ - d_lse in place of Δ."""
  q_blocks, k, v, kv_valid, visits, rng, mask_consts, tile_consts, mod_consts, out, lse = residuals
  d_out, d_lse = cotangents
  counts, indices, full = visits[3:]
  _, batch, kv_heads, _, _ = q_blocks.shape
  bk = plan.block_k
  d_out = d_out.astype(q_blocks.dtype)
  delta = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1, keepdims=True)
  delta = delta - d_lse
  consts = (*tile_consts, *mod_consts)
  trained = [jnp.issubdtype(c.dtype, jnp.inexact) for c in consts]
  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  dot_scale = plan.scale if plan.tile_score is None else 1.0   # tile_score's grads are scaled
  transposed_zeros = lambda x: jnp.zeros(x.shape[:2] + (x.shape[3], bk), jnp.float32)

  def tile_grads(i, j, t, q_i, k_j, v_j, kv_valid_j, do_i):
    """(dq [b, kvh, rows, d'], dkᵀ [b, kvh, d', bk], dvᵀ [b, kvh, dv, bk], d consts) of tile
    (i, j); dq and dkᵀ still to be multiplied by dot_scale."""
    index = plan.indices(batch, kv_heads, i, j)
    if plan.tile_score is None:
      raw = plan.raw_scores(q_i, k_j, index[1], ())
    else:
      raw, pull_raw = jax.vjp(lambda q, k, *c: plan.raw_scores(q, k, index[1], c), q_i, k_j,
                              *tile_consts)
    scores, pull_mod = jax.vjp(lambda s, *c: plan.modified(s, index, c), raw, *mod_consts)
    scores = plan.masked(scores, index, full[j, t], kv_valid_j, mask_consts)
    p, ds = tiles.tile_probs_and_dscores(scores, lse[i], delta[i], do_i, v_j,
                                          plan.kept(rng, i, j, scores.shape))
    ds, *d_mod = pull_mod(ds)
    dv_t = tiles.dot_tn(do_i, p.astype(do_i.dtype))                         # [b, kvh, dv, bk]
    if plan.tile_score is None:
      ds = ds.astype(q_i.dtype)
      # dq, dkᵀ without the scale: applied once per key block (dK) and at the end (dQ)
      return tiles.dot_nn(ds, k_j), tiles.dot_tn(q_i, ds), dv_t, d_mod   # [b, kvh, ·, ·]
    dq, dk, *d_tile = pull_raw(ds)
    return dq, jnp.swapaxes(dk, -1, -2), dv_t, [*d_tile, *d_mod]

  def key_block(j, grads):
    dq, dk, dv, d_consts = grads
    k_j, v_j, kv_valid_j = _slice(k, j, bk), _slice(v, j, bk), _slice(kv_valid, j, bk, 3)

    def query_block(t, grads):
      dq, dk_t, dv_t, d_consts = grads
      i = indices[j, t]
      dq_i, dk_part, dv_part, d_parts = tile_grads(i, j, t, q_blocks[i], k_j, v_j, kv_valid_j,
                                                   d_out[i])
      d_consts = [d + part.astype(d.dtype) if ok else d
                  for d, part, ok in zip(d_consts, d_parts, trained)]
      return (dq.at[i].add(dq_i.astype(jnp.float32)), dk_t + dk_part, dv_t + dv_part, d_consts)

    dq, dk_t, dv_t, d_consts = jax.lax.fori_loop(
        0, counts[j], query_block, (dq, transposed_zeros(k), transposed_zeros(v), d_consts))
    put = lambda full_grad, block_t: jax.lax.dynamic_update_slice_in_dim(
        full_grad, jnp.swapaxes(block_t, -1, -2).astype(full_grad.dtype), j * bk, axis=2)
    return dq, put(dk, dk_t * dot_scale), put(dv, dv_t), d_consts

  grads = (zeros(q_blocks), jnp.zeros(k.shape, k.dtype), jnp.zeros(v.shape, v.dtype),
           [zeros(c) if ok else jnp.zeros((), jnp.float32) for c, ok in zip(consts, trained)])
  dq, dk, dv, d_consts = jax.lax.fori_loop(0, k.shape[2] // bk, key_block, grads)
  dq = dq * dot_scale
  d_consts = [d.astype(c.dtype) if ok else None for d, c, ok in zip(d_consts, consts, trained)]
  return (dq.astype(q_blocks.dtype), dk, dv, None, None, None, [None] * len(mask_consts),
          d_consts[:len(tile_consts)], d_consts[len(tile_consts):])


def _hoist_all(fn: Callable, *example):
  """(fn', consts): fn'(*args, *consts) == fn(*args), with every array fn closes over in
  consts. jax.closure_convert hoists only values that may carry a tangent, so an integer array
  traced in a loop body (a mask's data: segment ids, a selection) would stay closed over and
  leak into the backward, which is traced outside that body; a mask gets no gradient, so all of
  its arrays can travel as arguments."""
  closed = jax.make_jaxpr(fn)(*example)

  def converted(*args):
    return jax.core.eval_jaxpr(closed.jaxpr, args[len(example):], *args[:len(example)])[0]
  return converted, list(closed.consts)


def _attend_fwd(plan, *args):
  out, lse, natural_lse = _forward(plan, *args)
  return (out, natural_lse), (*args, out, lse)


# -> (out, natural-unit log-sum-exp); either may go unused.
_attend = jax.custom_vjp(lambda plan, *args: _forward(plan, *args)[::2], nondiff_argnums=(0,))
_attend.defvjp(_attend_fwd, _backward)


def flex_attention(q, k, v, *, block_mask: BlockMask | None = None,
                   score_mod: Callable | None = None, scale: float | None = None, kv_mask=None,
                   tile_score: Callable | None = None, dropout_rate: float = 0.0,
                   dropout_rng=None, return_lse: bool = False, sinks=None):
  """Softmax attention over `block_mask`'s pattern. q [b, q_len, h, d']; k [b, kv_len, kvh, d'];
  v [b, kv_len, kvh, dv]; kv_mask bool [b, kv_len] (True = real key) or None. Returns
  [b, q_len, h, dv] in q's dtype; a query that sees no key gives 0.

  block_mask None: every key (blocks of DEFAULT_BLOCK). scale None: 1/sqrt(d'). score_mod,
  tile_score: see the module docstring. dropout_rate with a dropout_rng: attention dropout on
  the tiles' weights (the same draws in the backward). sinks: None, or f32 [h], a learned sink
  logit per head in every row's denominator (softmax.apply_sinks on the finished rows).

  return_lse: also return each row's log-sum-exp of its (modified, masked) scores, natural
  units, f32 [b, q_len, h] (-inf for a row that sees no key; of the weights before dropout
  and without the sinks), as (out, lse); it is differentiable, so outputs over disjoint sets
  of keys can be merged exactly (softmax over their lse weighs them).
  """
  batch, q_len, num_heads, head_dim = q.shape
  kv_len, kv_heads = k.shape[1], k.shape[2]
  if k.shape[:3] != v.shape[:3] or k.shape[0] != batch or num_heads % kv_heads:
    raise ValueError(f"flex: expected q [b, q_len, h, d], k [b, kv_len, kvh, d] and v "
                     f"[b, kv_len, kvh, dv] with h a multiple of kvh; got {q.shape}, {k.shape}, "
                     f"{v.shape}")
  if block_mask is None:
    block_mask = full_block_mask(q_len, kv_len)
  if (block_mask.q_len, block_mask.kv_len) != (q_len, kv_len):
    raise ValueError(f"flex: block_mask was built for q_len={block_mask.q_len}, "
                     f"kv_len={block_mask.kv_len}; the inputs have q_len={q_len}, kv_len={kv_len}")
  mask_batch, mask_heads = block_mask.kv_num_blocks.shape[:2]
  if mask_batch not in (1, batch) or mask_heads not in (1, num_heads):
    raise ValueError(f"flex: block_mask was built for batch={mask_batch}, heads={mask_heads}; "
                     f"the inputs have batch={batch}, heads={num_heads} (build it for those, "
                     f"or None)")
  scale = head_dim ** -0.5 if scale is None else float(scale)
  bq, bk, group = block_mask.block_q, block_mask.block_k, num_heads // kv_heads

  q_blocks = query_blocks(q, kv_heads, bq)
  k, v = key_layout(k, bk), key_layout(v, bk)
  kv_valid = key_validity(kv_mask, batch, kv_len, bk)

  # The arrays the functions close over become explicit arguments of the custom VJP.
  index = _tile_indices(bq, bk, group, batch, kv_heads, 0, 0)
  convert = lambda fn, *example: (None, []) if fn is None else jax.closure_convert(fn, *example)
  tile_fn, tile_consts = convert(tile_score, q_blocks[0], k[:, :, :bk], index[1])
  scores_example = jnp.zeros((batch, kv_heads, group * bq, bk), jnp.float32)
  mod_fn, mod_consts = convert(score_mod, scores_example, *index)
  mask_fn, mask_consts = (None, []) if block_mask.mask_mod is None else _hoist_all(
      block_mask.mask_mod, *index)
  plan = _Plan(tile_fn, mod_fn, mask_fn, scale, bq, bk, group, float(dropout_rate))
  rng = dropout_rng if dropout_rate > 0 else None
  args = (q_blocks, k, v, kv_valid, _visits(block_mask), rng, mask_consts, tile_consts,
          mod_consts)
  modes = autodiff_modes()
  if modes[:1] == ("forward",):   # the forward as plain JAX, which JAX differentiates forward
    if "reverse" in modes:
      raise ValueError(
          "flex_attention: reverse mode over forward mode (jax.grad of jax.jvp) is not "
          "supported: the plain forward's key-block loops run a data-dependent number of steps, "
          "which JAX cannot reverse. Differentiate forward over reverse instead (jax.jvp of "
          "jax.grad, as jax.hessian does)")
    out, _, lse = _forward(plan, *args)
  else:
    out, lse = _attend(plan, *args)                               # [nq, b, kvh, rows, ·]

  in_sequence = lambda x: from_query_blocks(x, group, q_len)
  out, lse = in_sequence(out), in_sequence(lse)[..., 0]
  if sinks is not None:
    out = softmax.apply_sinks(out, lse, sinks)
  return (out, lse) if return_lse else out


# -- the engine's layout, shared with the ring (context_parallel/ring.py) --------------------

def query_blocks(q, kv_heads: int, block_q: int):
  """q [b, q_len, h, d] -> [nq, b, kvh, g·bq, d], padded to whole blocks: the query heads that
  share a K/V head stacked as rows of one tile (GQA never copies K/V)."""
  batch, _, num_heads, head_dim = q.shape
  group = num_heads // kv_heads
  q = pad_to_multiple(q, block_q)
  blocks = jnp.moveaxis(softmax.group_heads(q, kv_heads), 1, 3)              # [b, kvh, g, q, d]
  blocks = blocks.reshape(batch, kv_heads, group, -1, block_q, head_dim)
  return jnp.moveaxis(blocks, 3, 0).reshape(-1, batch, kv_heads, group * block_q, head_dim)


def from_query_blocks(x, group: int, q_len: int):
  """query_blocks' inverse: [nq, b, kvh, g·bq, c] -> [b, q_len, kvh·g, c] (padding cut)."""
  _, batch, kv_heads, rows, channels = x.shape
  x = x.reshape(-1, batch, kv_heads, group, rows // group, channels)
  x = jnp.moveaxis(x, 0, 3).reshape(batch, kv_heads, group, -1, channels)[:, :, :, :q_len]
  return jnp.moveaxis(x, 3, 1).reshape(batch, q_len, kv_heads * group, channels)


def key_layout(x, block_k: int):
  """k or v [b, kv_len, kvh, c] -> [b, kvh, kv_len', c], padded to whole key blocks."""
  return jnp.swapaxes(pad_to_multiple(x, block_k), 1, 2)


def key_validity(kv_mask, batch: int, kv_len: int, block_k: int):
  """kv_mask bool [b, kv_len] or None -> [b, 1, 1, kv_len'] (key padding False)."""
  valid = jnp.ones((batch, kv_len), bool) if kv_mask is None else jnp.asarray(kv_mask, bool)
  return pad_to_multiple(valid, block_k, value=False)[:, None, None, :]
