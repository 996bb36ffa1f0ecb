"""Block-sparse softmax attention: the machinery shared by local, sliding_window,
sparse_transformer, longformer and bigbird (it registers no variant itself).

    out_i = Σ_{j ∈ A(i)} softmax_j(q_i · k_j · scale + bias_ij) v_j

computed without any n x n tensor. Queries are cut into blocks of B consecutive *slots* of a
`Frame`, and each query block attends to a few *segments* of keys, with one softmax over their
union:

  Neighbours(offsets)  the key blocks n + o of query block n        (own block, bands)
  SharedKeys(indices)  the same keys for every query block           (global tokens, summaries)
  BlockTable(table)    key blocks listed per query head and block    (BigBird's random blocks)

Inside a segment a rule on positions (`Band`, `OtherBlock`, `KeyBlockNotIn`) keeps the entries
of the variant's pattern; causality, padding masks and ALiBi are applied here from the same
positions. The segments of one variant must be disjoint (a key present twice in a row would be
counted twice in its softmax). `global_rows` are queries that see every key: they are computed
in a separate O(G·n) pass.

Cost: O(n · keys per block). When a segment grows with n (Sparse Transformer summaries),
`query_blocks_per_step` sends the query blocks through a checkpointed `lax.map`, so score memory
stays O(blocks per step · keys) and the backward pass recomputes a step instead of storing it.

Positions: a slot's position is a key index; a query i sits at its bottom-right aligned position
i + (kv_len - q_len) (the contract's causal alignment), so one coordinate serves queries, keys,
causality and ALiBi distances.

Frames, segments and rules compare and hash by value, so the whole computation is one jitted
function per plan and shape: an eager call compiles once, not op by op, and a second module
with the same options reuses it.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from attention_zoo import reference
from attention_zoo.base import ceil_div


class _ByValue:
  """Equality and hash by content (numpy arrays by their bytes), for static jit arguments."""

  def _key(self):
    return tuple((v.dtype.str, v.shape, v.tobytes()) if isinstance(v, np.ndarray) else v
                 for v in (getattr(self, f.name) for f in dataclasses.fields(self)))

  def __eq__(self, other):
    return type(self) is type(other) and self._key() == other._key()

  def __hash__(self):
    return hash((type(self), self._key()))


def aligned_positions(q_len: int, kv_len: int):
  """For `pattern()`: numpy aligned query positions [q_len, 1] and key positions [1, kv_len]."""
  return np.arange(q_len)[:, None] + (kv_len - q_len), np.arange(kv_len)[None, :]


# -- where queries and keys sit -------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class Frame(_ByValue):
  """Slots shared by queries and keys, cut into blocks of `block_size` (numpy, static)."""
  block_size: int
  positions: np.ndarray     # [slots] position of each slot (key index / aligned query position)
  key_index: np.ndarray     # [slots] index into k, -1 for a slot without a key
  query_index: np.ndarray   # [slots] index into q, -1 for a slot without a query

  @property
  def num_blocks(self) -> int:
    return len(self.positions) // self.block_size

  @classmethod
  def aligned(cls, q_len: int, kv_len: int, block_size: int) -> "Frame":
    """Slots in position order. Key blocks start at multiples of block_size; when q_len > kv_len
    the first queries have negative positions, so whole blocks of empty key slots go in front."""
    offset = kv_len - q_len
    key_pad = ceil_div(max(0, -offset), block_size) * block_size
    positions = np.arange(ceil_div(key_pad + kv_len, block_size) * block_size) - key_pad
    key_index = np.where((positions >= 0) & (positions < kv_len), positions, -1)
    query_index = np.where((positions >= offset) & (positions < offset + q_len),
                           positions - offset, -1)
    return cls(block_size, positions, key_index, query_index)

  @classmethod
  def interleaved(cls, length: int, block_size: int, stride: int) -> "Frame":
    """Self-attention slots grouped by position mod stride (0, s, 2s, ..., 1, 1+s, ...): a band
    dilated by `stride` becomes a plain band inside each group. Groups are padded to whole
    blocks."""
    per_group = ceil_div(ceil_div(length, stride), block_size) * block_size
    positions = (np.arange(stride)[:, None] + stride * np.arange(per_group)[None, :]).reshape(-1)
    index = np.where(positions < length, positions, -1)
    return cls(block_size, positions, index, index)


def _place(x, index: np.ndarray):
  """x [b, len, ...] -> [b, len(index), ...] = x[:, index], zeros where index is -1.

  A contiguous run is a slice and a pad (cheap, and so is its gradient); otherwise a gather.
  """
  valid = index >= 0
  taken = index[valid]
  start = int(np.argmax(valid))
  contiguous = np.array_equal(index[start:start + taken.size],
                              np.arange(taken[0], taken[0] + taken.size)) if taken.size else False
  if contiguous:
    widths = [(0, 0)] * x.ndim
    widths[1] = (start, len(index) - start - taken.size)
    return jnp.pad(x[:, taken[0]:taken[0] + taken.size], widths)
  gathered = jnp.take(x, np.maximum(index, 0), axis=1)
  return jnp.where(valid.reshape((1, -1) + (1,) * (x.ndim - 2)), gathered, jnp.zeros((), x.dtype))


def _shift(x, start: int, stop: int):
  """x[start:stop] along axis 0, zeros for indices outside [0, len)."""
  length = x.shape[0]
  part = x[max(start, 0):min(stop, length)]
  return jnp.pad(part, [(max(0, -start), max(0, stop - length))] + [(0, 0)] * (x.ndim - 1))


# -- rules: which entries of a segment belong to the pattern (jnp, broadcasting positions) ----

@dataclasses.dataclass(frozen=True)
class Band:
  """|i - j| <= width, (i - j) divisible by stride, and j >= first_key."""
  width: int
  stride: int = 1
  first_key: int = 0

  def __call__(self, q_pos, k_pos):
    keep = jnp.abs(q_pos - k_pos) <= self.width
    if self.stride > 1:
      keep &= (q_pos - k_pos) % self.stride == 0
    return keep & (k_pos >= self.first_key) if self.first_key else keep


@dataclasses.dataclass(frozen=True)
class OtherBlock:
  """Key and query in different blocks of block_size."""
  block_size: int

  def __call__(self, q_pos, k_pos):
    return q_pos // self.block_size != k_pos // self.block_size


@dataclasses.dataclass(frozen=True)
class KeyBlockNotIn:
  """Key block (of block_size) not among `blocks`."""
  block_size: int
  blocks: tuple[int, ...]

  def __call__(self, q_pos, k_pos):
    block = k_pos // self.block_size
    return ~functools.reduce(jnp.logical_or, [block == b for b in self.blocks], jnp.zeros((), bool))


Rule = Band | OtherBlock | KeyBlockNotIn


# -- segments: which keys a query block is scored against ----------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class _Context:
  """What segments are cut from: the frame, the query blocks, and keys laid on the frame."""
  frame: Frame
  blocks: np.ndarray     # [n] frame block index of each query block
  k: jax.Array             # [b, kv_len, kvh, d], as given
  v: jax.Array
  kv_mask: jax.Array       # [b, kv_len]
  k_blocks: jax.Array      # [N, b, B, kvh, d]: k laid on the frame
  v_blocks: jax.Array
  mask_blocks: jax.Array   # [N, b, B]: kv_mask on the frame, False on empty slots
  num_heads: int


@dataclasses.dataclass(frozen=True, eq=False)
class _Keys:
  """One segment's keys for the query blocks. kind 'blocks': k [n, b, K, kvh, d], mask [n, b, K],
  pos [n, K]; 'shared': k [b, K, kvh, d], mask [b, K], pos [K]; 'heads': k [n, kvh, g, b, K, d],
  mask [n, h, b, K], pos [n, h, K]."""
  kind: str
  k: jax.Array
  v: jax.Array
  mask: jax.Array
  pos: jax.Array
  rule: Rule | None

  def layout(self):
    """pos [1|h, n|1, 1, 1, K] and mask [1|h, n|1, b, 1, K], broadcastable to scores
    [h, n, b, B, K]."""
    if self.kind == "blocks":
      return self.pos[None, :, None, None, :], self.mask[None, :, :, None, :]
    if self.kind == "shared":
      return self.pos[None, None, None, None, :], self.mask[None, None, :, None, :]
    return (jnp.swapaxes(self.pos, 0, 1)[:, :, None, None, :],
            jnp.swapaxes(self.mask, 0, 1)[:, :, :, None, :])


_K_SPEC = {"blocks": "nbkhd", "shared": "bkhd", "heads": "nhgbkd"}


@dataclasses.dataclass(frozen=True, eq=False)
class Neighbours(_ByValue):
  """For query block n, the key blocks n + o for each o in `offsets` (frame blocks)."""
  offsets: tuple[int, ...]
  rule: Rule | None = None

  def prepare(self, ctx: _Context) -> _Keys | None:
    num_blocks, block = ctx.frame.num_blocks, ctx.frame.block_size
    first, stop = int(ctx.blocks[0]), int(ctx.blocks[-1]) + 1
    # Offsets that reach no block are skipped.
    offsets = [o for o in self.offsets if first + o < num_blocks and stop + o > 0]
    if not offsets:
      return None
    cut = lambda x: jnp.concatenate([_shift(x, first + o, stop + o) for o in offsets], axis=2)
    slots = ((ctx.blocks[:, None, None] + np.asarray(offsets)[None, :, None]) * block
             + np.arange(block))
    pos = ctx.frame.positions[np.clip(slots, 0, len(ctx.frame.positions) - 1)]
    # [n, b, K, kvh, d] twice, [n, b, K], [n, K]
    return _Keys("blocks", cut(ctx.k_blocks), cut(ctx.v_blocks), cut(ctx.mask_blocks),
                 jnp.asarray(pos.reshape(len(ctx.blocks), -1)), self.rule)


@dataclasses.dataclass(frozen=True, eq=False)
class SharedKeys(_ByValue):
  """The keys at `indices` (into k) for every query block."""
  indices: np.ndarray
  rule: Rule | None = None

  def prepare(self, ctx: _Context) -> _Keys | None:
    indices = np.asarray(self.indices)
    if not indices.size:
      return None
    # [b, K, kvh, d] twice, [b, K], [K]
    return _Keys("shared", _place(ctx.k, indices), _place(ctx.v, indices),
                 _place(ctx.kv_mask, indices), jnp.asarray(indices), self.rule)


@dataclasses.dataclass(frozen=True, eq=False)
class BlockTable(_ByValue):
  """For query head h and query block n, the key blocks table[h, n, :] (frame blocks; -1 = none).
  Query blocks past the table's rows get none."""
  table: np.ndarray       # int [num_heads, rows, r]
  rule: Rule | None = None

  def prepare(self, ctx: _Context) -> _Keys | None:
    heads, rows, per_block = self.table.shape
    if not per_block:
      return None
    kvh = ctx.k.shape[2]
    group, block, n = heads // kvh, ctx.frame.block_size, len(ctx.blocks)
    table = np.full((heads, n, per_block), -1)
    inside = ctx.blocks < rows
    table[:, inside] = self.table[:, ctx.blocks[inside]]
    table = table.reshape(kvh, group, n, per_block).transpose(2, 0, 1, 3)   # [n, kvh, g, r]
    picked = np.maximum(table, 0)
    kv_head = np.arange(kvh)[None, :, None, None]

    def gather(x):   # [N, b, B, kvh, d] -> [n, kvh, g, b, r·B, d]: each query head's own blocks
      x = jnp.moveaxis(x, 3, 1)[picked, kv_head]           # [n, kvh, g, r, b, B, d]
      return jnp.moveaxis(x, 4, 3).reshape(n, kvh, group, x.shape[4], per_block * block,
                                           x.shape[-1])

    mask = ctx.mask_blocks[picked] & (table >= 0)[..., None, None]       # [n, kvh, g, r, b, B]
    mask = jnp.moveaxis(mask, 4, 3).reshape(n, heads, -1, per_block * block)
    pos = ctx.frame.positions[picked[..., None] * block + np.arange(block)].reshape(n, heads, -1)
    return _Keys("heads", gather(ctx.k_blocks), gather(ctx.v_blocks), mask, jnp.asarray(pos),
                 self.rule)


# -- the computation ------------------------------------------------------------------------

def _alibi(slopes, q_pos, k_pos):
  """reference.alibi_bias head by head (random blocks give each head its own key positions).

  q_pos [1, n, 1, B, 1], k_pos [1|h, n|1, 1, 1, K] (aligned already, hence q_len = kv_len = 0)
  -> [h, n, 1, B, K].
  """
  per_head = k_pos.shape[0] > 1
  one_head = lambda slope, k: reference.alibi_bias(slope[None], q_pos[0], k, 0, 0)[0]
  return jax.vmap(one_head, in_axes=(0, 0 if per_head else None))(
      slopes, k_pos if per_head else k_pos[0])


def _attend_blocks(q_blocks, q_pos, segments, *, causal, scale, slopes, dropout_rate, dropout_rng):
  """q_blocks [n, b, B, kvh, g, d], q_pos [n, B] -> [n, b, B, kvh, g, d] (f32).

  One softmax over the union of the segments' keys.
  """
  n, b, block, kvh, group, _ = q_blocks.shape
  q_pos = jnp.asarray(q_pos)[None, :, None, :, None]                              # [1, n, 1, B, 1]
  scores, allowed = [], []
  for seg in segments:
    s = jnp.einsum(f"nbqhgd,{_K_SPEC[seg.kind]}->hgnbqk", q_blocks, seg.k,
                   preferred_element_type=jnp.float32)                  # [kvh, g, n, b, B, K]
    s = s.reshape((kvh * group,) + s.shape[2:]) * scale                           # [h, n, b, B, K]
    k_pos, ok = seg.layout()
    if seg.rule is not None:
      ok = ok & seg.rule(q_pos, k_pos)
    if causal:
      ok = ok & reference.causal_allowed(q_pos, k_pos, 0, 0)   # positions are aligned already
    if slopes is not None:
      s = s + _alibi(slopes, q_pos, k_pos)
    scores.append(s)
    allowed.append(jnp.broadcast_to(ok, s.shape))
  weights = reference.masked_softmax(jnp.concatenate(scores, -1), jnp.concatenate(allowed, -1))
  if dropout_rng is not None:
    weights = reference.dropout(weights, dropout_rate, dropout_rng)
  out, start = 0.0, 0
  for seg, s in zip(segments, scores):
    w = weights[..., start:start + s.shape[-1]].reshape(
        (kvh, group) + s.shape[1:])                                         # [kvh, g, n, b, B, K]
    start += s.shape[-1]
    out = out + jnp.einsum(f"hgnbqk,{_K_SPEC[seg.kind]}->nbqhgd", w.astype(seg.v.dtype), seg.v,
                           preferred_element_type=jnp.float32)      # [n, b, B, kvh, g, d]
  return out


def _map_blocks(q_blocks, q_pos, segments, per_step, rng, **kwargs):
  """_attend_blocks over all query blocks at once, or `per_step` blocks at a time in a
  checkpointed lax.map (memory per step instead of for all blocks)."""
  n = q_blocks.shape[0]
  if per_step is None or per_step >= n:
    return _attend_blocks(q_blocks, q_pos, segments, dropout_rng=rng, **kwargs)
  steps = ceil_div(n, per_step)

  def split(x):   # [n, ...] -> [steps, per_step, ...], padded with masked blocks
    x = jnp.pad(x, [(0, steps * per_step - n)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape((steps, per_step) + x.shape[1:])

  blocked = [(s.k, s.v, s.mask, s.pos) for s in segments if s.kind != "shared"]

  @jax.checkpoint
  def step(xs):
    i, q_chunk, pos_chunk, chunks = xs
    chunks = iter(chunks)
    segs = [s if s.kind == "shared"
            else dataclasses.replace(s, **dict(zip(("k", "v", "mask", "pos"), next(chunks))))
            for s in segments]
    step_rng = None if rng is None else jax.random.fold_in(rng, i)
    return _attend_blocks(q_chunk, pos_chunk, segs, dropout_rng=step_rng, **kwargs)

  out = jax.lax.map(step, (jnp.arange(steps), split(q_blocks), split(jnp.asarray(q_pos)),
                           jax.tree.map(split, blocked)))
  return out.reshape((steps * per_step,) + out.shape[2:])[:n]


@dataclasses.dataclass(frozen=True, eq=False)
class _Plan(_ByValue):
  """Everything static about one call: the jit cache key."""
  frame: Frame
  segments: tuple
  causal: bool
  scale: float
  dropout_rate: float
  global_rows: np.ndarray
  query_blocks_per_step: int | None


def blockwise_attention(q, k, v, frame: Frame, segments, *, kv_mask, causal: bool, scale: float,
                        alibi_slopes=None, dropout_rate: float = 0.0, dropout_rng=None,
                        global_rows=None, global_qkv=None,
                        query_blocks_per_step: int | None = None):
  """Block-sparse attention over `segments`; q [b, q_len, h, d], k, v [b, kv_len, kvh, d],
  kv_mask bool [b, kv_len] -> [b, q_len, h, d] (f32).

  global_rows: query indices (numpy) that attend to every key instead (O(G·n) pass).
  global_qkv: optional (queries [b, G, h, d], k, v) that pass uses in place of q[:, global_rows],
  k and v (Longformer's separate global projections).
  """
  rows = np.asarray([] if global_rows is None else global_rows, int)
  plan = _Plan(frame, tuple(segments), bool(causal), float(scale), float(dropout_rate), rows,
               query_blocks_per_step)
  return _compute(q, k, v, kv_mask, alibi_slopes, dropout_rng, global_qkv, plan=plan)


@functools.partial(jax.jit, static_argnames="plan")
def _compute(q, k, v, kv_mask, alibi_slopes, dropout_rng, global_qkv, *, plan: _Plan):
  frame = plan.frame
  b, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  block, num_blocks = frame.block_size, frame.num_blocks
  group = num_heads // num_kv_heads
  has_query = (frame.query_index >= 0).reshape(num_blocks, block).any(1)
  # The blocks holding queries.
  blocks = np.arange(np.argmax(has_query), num_blocks - np.argmax(has_query[::-1]))
  slots = slice(blocks[0] * block, (blocks[-1] + 1) * block)

  to_blocks = lambda x: jnp.swapaxes(x.reshape((b, num_blocks, block) + x.shape[2:]), 0, 1)
  ctx = _Context(frame, blocks, k, v, kv_mask,
                 to_blocks(_place(k, frame.key_index)),           # [N, b, B, kvh, d]
                 to_blocks(_place(v, frame.key_index)),           # [N, b, B, kvh, d]
                 to_blocks(_place(kv_mask, frame.key_index)),     # [N, b, B]
                 num_heads)
  keys = [s for s in (seg.prepare(ctx) for seg in plan.segments) if s is not None]
  q_blocks = _place(q, frame.query_index[slots]).reshape(b, len(blocks), block, num_kv_heads,
                                                         group, head_dim)
  q_blocks = jnp.swapaxes(q_blocks, 0, 1)                               # [n, b, B, kvh, g, d]
  q_pos = frame.positions[slots].reshape(len(blocks), block)            # [n, B]

  rngs = (None, None) if dropout_rng is None else jax.random.split(dropout_rng)
  common = dict(causal=plan.causal, scale=plan.scale, slopes=alibi_slopes,
                dropout_rate=plan.dropout_rate)
  if keys:
    out = _map_blocks(q_blocks, q_pos, keys, plan.query_blocks_per_step, rngs[0], **common)
  else:   # no key lies in any segment (e.g. q_len > kv_len and only the own block)
    out = jnp.zeros(q_blocks.shape, jnp.float32)
  out = jnp.swapaxes(out, 0, 1).reshape(b, -1, num_heads, head_dim)     # [b, slots, h, d]
  slot_of_query = np.empty(q_len, int)
  in_range = frame.query_index[slots]
  slot_of_query[in_range[in_range >= 0]] = np.flatnonzero(in_range >= 0)
  out = _place(out, slot_of_query)                                      # [b, q_len, h, d]

  rows = plan.global_rows
  if len(rows):
    q_rows, k_all, v_all = (_place(q, rows), k, v) if global_qkv is None else global_qkv
    q_rows = q_rows.reshape(b, 1, len(rows), num_kv_heads, group, head_dim)
    everything = _Keys("shared", k_all, v_all, kv_mask, jnp.arange(kv_len), None)
    rows_out = _attend_blocks(jnp.swapaxes(q_rows, 0, 1), (rows + kv_len - q_len)[None],
                              [everything], dropout_rng=rngs[1], **common)  # [1, b, G, kvh, g, d]
    out = out.at[:, rows].set(rows_out[0].reshape(b, len(rows), num_heads, head_dim))
  return out
