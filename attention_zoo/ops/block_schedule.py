"""The static block schedule: a block-sparse pattern known while tracing, run as a few dense
batched matmuls instead of a loop over tiles.

flex.py's loops visit one (query block, key block) tile per iteration; at the small tiles a
sparse pattern wants (a band of 128, BigBird's blocks of 64) each iteration's bookkeeping (a
dynamic slice of K/V, a `cond` for the mask, the online softmax's rescaling) costs as much as
its two products (docs/benchmark_attention.md). When the tile lists are concrete, this module
plans the whole call in NumPy instead:

- The query blocks are split into a few *passes* of blocks that visit about as many key blocks
  (BigBird's global rows, which see every key, apart from the others).
- Each pass gives every query block the same number of *slots*, one key block each: first the
  offsets that most blocks share (a band's j = i - 1, i, i + 1), then the key blocks that most
  blocks share (global columns), then the rest in ascending order (random blocks). A block with
  nothing in a slot gets an empty tile there, masked out entirely.
- A pass is one dense problem: its query blocks [b, kvh, R, rows, d] against their slots' keys
  side by side [b, kvh, R, S·bk, d], run in steps of as many query blocks as keep a step's
  scores in cache (CHUNK_BYTES), each step one batched matmul for the scores, a plain softmax
  over the S·bk keys (no online rescaling), one batched matmul for the output. K/V reach a slot
  without a gather by traced indices: an offset slot is a static slice of the blocked K/V (the
  "shifted view"), a shared column a broadcast of one block, the rest a take by constant
  indices.
- The mask is evaluated only in the slots that hold a partial tile; full tiles only check key
  padding, empty ones are masked.

The backward (a custom VJP) recomputes each pass's scores from the forward's log-sum-exp, as
flash does, and returns the keys' gradients through the transpose of each slot's view. Scores are
live one step at a time; the slots' keys side by side take O(length · slots · d), linear. A
pattern that computes more than MAX_KEYS_PER_QUERY keys for its average query (dense or causal
attention, flash) is not planned: the loops' O(block²) tiles serve it better. Nor, for now, one
whose passes need more than MAX_SLOTS slots: on the 2-core CPU the copies of K/V into the slots
cost more than the loops' per-tile overhead saves.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from attention_zoo.ops import softmax, tiles

EMPTY, PARTIAL, FULL = 0, 1, 2     # what a (query block, key block) tile is under a mask

# Above this many keys computed (kept or masked) for the average query the loops run instead:
# dense and causal attention (flash), whose large tiles the loops already run near the matmul rate.
MAX_KEYS_PER_QUERY = 4096
# Passes of more slots than this are not planned (the loops run): each extra slot costs a copy of
# K and V (the slots' views side by side) and, in the backward, the transposes of those views.
# Sliding window, Longformer and BigBird (3-8 slots) ran 1.1-1.4x slower than the loops at 8K,
# local (1 slot) 1.4x faster, on the shared 2-core CPU (docs/benchmark_attention.md).
MAX_SLOTS = 1
# A pass holds query blocks visiting at most this many times the key blocks of its least busy one,
# so padding its slots wastes at most about half of its work.
PASS_SPREAD = 2.0
# An offset or a key block shared by at least this share of a pass's (head, query block) pairs
# gets a slot of its own (a slice or a broadcast).
SHARED = 0.5
# A step of a pass holds as many query blocks as keep its scores within this many bytes (in
# cache: the whole pass's scores at once ran 1.4x slower than the loops, bound by memory).
CHUNK_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True, eq=False)
class Slot:
  """One key block per (kv head, query block of the pass). blocks int [H, R] (H = 1: the same for
  every head); state int8 [H, R], flex's EMPTY / PARTIAL / FULL. An empty entry's block is any
  valid block (its tile is masked out). kind: "shift" (blocks = the pass's query blocks + offset
  wherever not empty), "column" (one block for all) or "take"."""
  blocks: np.ndarray
  state: np.ndarray
  kind: str
  offset: int = 0


@dataclasses.dataclass(frozen=True, eq=False)
class Pass:
  """Query blocks `rows` (int [R], ascending) and their slots."""
  rows: np.ndarray
  slots: tuple[Slot, ...]

  @property
  def contiguous(self) -> bool:
    return bool(np.all(np.diff(self.rows) == 1))


def build_schedule(states: np.ndarray, *, rows_per_block: int, block_k: int,
                   q_rows: int) -> tuple[Pass, ...] | None:
  """The passes of a pattern given by tile states int [H, nq, nk] (H = 1: one pattern for every
  kv head; else per kv head), or None when the schedule would compute more than
  MAX_KEYS_PER_QUERY keys for the average of the q_rows query rows (the loops serve it)."""
  listed = states != EMPTY
  heads, num_q, num_k = states.shape
  cost = listed.sum(-1).max(0)                                      # [nq] key blocks, busiest head
  passes, computed = [], 0
  for members in _group(np.flatnonzero(cost), cost):
    slots = _slots(states[:, members], listed[:, members], members, num_k)
    passes.append(Pass(members, tuple(slots)))
    computed += len(members) * rows_per_block * len(slots) * block_k
  if computed > MAX_KEYS_PER_QUERY * q_rows or any(len(p.slots) > MAX_SLOTS for p in passes):
    return None
  return tuple(passes)


def _group(blocks: np.ndarray, cost: np.ndarray) -> list[np.ndarray]:
  """The query blocks that visit anything, in passes of similar cost (each pass ascending)."""
  groups, current, least = [], [], 0
  for i in blocks[np.argsort(cost[blocks], kind="stable")]:
    if current and cost[i] > PASS_SPREAD * least:
      groups.append(current)
      current = []
    if not current:
      least = cost[i]
    current.append(i)
  if current:
    groups.append(current)
  return [np.sort(np.asarray(g)) for g in groups]


def _slots(states, listed, rows, num_k: int) -> list[Slot]:
  """The slots of one pass: states, listed [H, R, nk] of its query blocks `rows` [R]."""
  heads, num_rows, _ = listed.shape
  left = listed.copy()                                      # the tiles no slot holds yet
  least = SHARED * heads * num_rows
  slots = []

  head, row = np.arange(heads)[:, None], np.arange(num_rows)

  def slot(blocks, kind, offset=0, within=True):
    """Gives each (head, query block) the tile at `blocks` [H, R] that no slot holds yet."""
    taken = left[head, row, blocks] & within
    state = np.where(taken, states[head, row, blocks], EMPTY)
    left[head, row, blocks] &= ~taken
    slots.append(Slot(blocks, state.astype(np.int8), kind, offset))

  offsets = (np.nonzero(listed)[2] - rows[np.nonzero(listed)[1]])
  for offset in _most_common(offsets):
    blocks = np.broadcast_to(np.clip(rows + offset, 0, num_k - 1), (heads, num_rows))
    within = (rows + offset >= 0) & (rows + offset < num_k)
    if (left[head, row, blocks] & within).sum() < least:
      break
    slot(blocks, "shift", int(offset), within)
  for column in _most_common(np.nonzero(left)[2]):
    if left[..., column].sum() < least:
      break
    slot(np.full((heads, num_rows), column), "column")
  while left.any():   # the rest, each (head, query block) its next key block in ascending order
    slot(np.where(left.any(-1), np.argmax(left, axis=-1), 0), "take")
  return slots


def _most_common(values: np.ndarray) -> np.ndarray:
  """The distinct values, most frequent first."""
  distinct, counts = np.unique(values, return_counts=True)
  return distinct[np.argsort(-counts, kind="stable")]


# -- running a schedule ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
  """The call's static shapes: query blocks of `block_q` rows per query head, `group` query heads
  per kv head stacked as the rows of a tile, key blocks of `block_k`."""
  batch: int
  kv_heads: int
  group: int
  block_q: int
  block_k: int
  num_q: int

  def indices(self, pass_: Pass):
    """mask_mod / score_mod's index arrays for a pass: b [B,1,1,1,1],
    h [1,kvh,1,rows,1], q [1,1,R,rows,1], kv [1,H,R,1,S·bk] (NumPy, int32)."""
    rows = np.arange(self.group * self.block_q)
    head = np.arange(self.kv_heads)[:, None] * self.group + rows // self.block_q
    q = pass_.rows[:, None] * self.block_q + rows % self.block_q
    kv = np.concatenate([s.blocks[..., None] * self.block_k + np.arange(self.block_k)
                         for s in pass_.slots], axis=-1)
    as_int = lambda x: x.astype(np.int32)
    return (as_int(np.arange(self.batch)[:, None, None, None, None]),
            as_int(head[None, :, None, :, None]), as_int(q[None, None, :, :, None]),
            as_int(kv[None, :, :, None, :]))

  def chunk(self, pass_: Pass) -> int:
    """Query blocks per step of a pass: the most (a divisor of R) whose scores fit in
    CHUNK_BYTES, so a step's tiles stay in cache."""
    per_block = (self.batch * self.kv_heads * self.group * self.block_q * len(pass_.slots)
                 * self.block_k * 4)
    most = max(1, CHUNK_BYTES // per_block)
    return max(c for c in range(1, min(most, len(pass_.rows)) + 1) if len(pass_.rows) % c == 0)

  def step_states(self, pass_: Pass) -> np.ndarray:
    """The slots' tile states in the steps' layout, int8 [R, 1, H, 1, S]."""
    states = np.stack([s.state for s in pass_.slots], axis=-1)           # [H, R, S]
    return np.transpose(states, (1, 0, 2))[:, None, :, None, :]

  def chunk_indices(self, pass_: Pass):
    """mask_mod's and score_mod's index arrays in the steps' layout [R, b, kvh, rows, ·]:
    (b, h) whole, (q, kv) to be split along R with the step's inputs."""
    b, h, q, kv = self.indices(pass_)
    first = lambda x: np.moveaxis(x, 2, 0)
    return (first(b), first(h)), (first(q), first(kv))


def pass_rows(x, pass_: Pass):
  """x [b, kvh, nq, ...] -> the pass's query blocks [b, kvh, R, ...]: a slice if contiguous."""
  if pass_.contiguous:
    return x[:, :, pass_.rows[0]:pass_.rows[-1] + 1]
  return jnp.take(x, pass_.rows, axis=2)


def slot_view(x, pass_: Pass, slot: Slot):
  """x [b, kvh, nk, bk, c] -> each query block's key block in `slot`, [b, kvh, R, bk, c]: a
  static slice for an offset (zeros where it runs off the sequence: those tiles are empty), a
  broadcast for a shared column, else a take by constant indices."""
  num_rows, num_k = len(pass_.rows), x.shape[2]
  if slot.kind == "shift" and pass_.contiguous:
    start = int(pass_.rows[0]) + slot.offset
    inside = x[:, :, max(start, 0):min(start + num_rows, num_k)]
    widths = [(0, 0)] * x.ndim
    widths[2] = (max(-start, 0), max(start + num_rows - num_k, 0))
    return jnp.pad(inside, widths)
  if slot.kind == "column":
    column = int(slot.blocks.flat[0])
    return jnp.broadcast_to(x[:, :, column:column + 1], x.shape[:2] + (num_rows,) + x.shape[3:])
  if np.all(slot.blocks == slot.blocks[:1]):
    return jnp.take(x, slot.blocks[0], axis=2)
  return x[:, np.arange(x.shape[1])[:, None], slot.blocks]                # per kv head


def pass_keys(x, pass_: Pass):
  """x [b, kvh, nk, bk, c] -> the pass's keys, its slots side by side: [b, kvh, R, S·bk, c]."""
  views = [slot_view(x, pass_, s) for s in pass_.slots]
  views = [v.reshape(v.shape[:3] + (-1, x.shape[-1])) for v in views]
  return views[0] if len(views) == 1 else jnp.concatenate(views, axis=3)


def key_validity(pass_: Pass, kv_valid):
  """kv_valid bool [b, nk, bk] (key padding and kv_mask) -> the pass's keys' validity in the
  steps' layout [R, b, H, 1, S·bk]."""
  valid = jnp.concatenate([kv_valid[:, s.blocks] for s in pass_.slots], axis=-1)  # [b, H, R, ·]
  return jnp.transpose(valid, (2, 0, 1, 3))[:, :, :, None, :]


def hoist_all(fn, *example):
  """(fn', consts): fn'(*args, *consts) == fn(*args), with every array fn closes over in
  consts. jax.closure_convert hoists only values that may carry a tangent, so an integer array
  traced in a loop body (a mask's data: segment ids, a selection) would stay closed over and
  leak into a backward traced outside that body; a mask gets no gradient, so all of its arrays
  can travel as arguments."""
  closed = jax.make_jaxpr(fn)(*example)

  def converted(*args):
    return jax.core.eval_jaxpr(closed.jaxpr, args[len(example):], *args[:len(example)])[0]
  return converted, list(closed.consts)


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
  """What is static about one scheduled call (the custom VJP's nondiff argument): the passes,
  the layout, the scale, per pass the closure-converted score_mod (None: none) and dropout."""
  passes: tuple[Pass, ...]
  layout: Layout
  scale: float
  score_mods: tuple
  masks: tuple
  dropout_rate: float

  def keep(self, p: int, index, states, valid, mask_consts):
    """bool [C, b|1, kvh|1, rows|1, S·bk] of a step: the slots' tile states [C, 1, H, 1, S],
    mask_mod only in the slots holding a partial tile, the keys' validity (or None); None
    when every score is kept."""
    slots, bk = self.passes[p].slots, self.layout.block_k
    if valid is None and all(np.all(s.state == FULL) for s in slots):
      return None
    parts = []
    for t, slot in enumerate(slots):
      state = states[..., t:t + 1]
      keep = state == FULL
      if np.any(slot.state == PARTIAL):
        kv = index[3][..., t * bk:(t + 1) * bk]
        keep = keep | ((state == PARTIAL) & self.masks[p](*index[:3], kv, *mask_consts))
      parts.append(keep)
    shape = np.broadcast_shapes(*(x.shape[:-1] for x in parts)) + (bk,)
    keep = jnp.concatenate([jnp.broadcast_to(x, shape) for x in parts], axis=-1)
    return keep if valid is None else keep & valid

  def scores(self, p: int, q_rows, keys, keep, index, mod_consts):
    """(base-2 masked scores [C, b, kvh, rows, S·bk] of a chunk of C query blocks, the
    score_mod's pullback or None); index: the chunk's indices (`chunk_indices`)."""
    raw = tiles.dot_nt(q_rows, keys) * self.scale
    pull = None
    if self.score_mods[p] is not None:
      modify = lambda s, *c: jnp.broadcast_to(self.score_mods[p](s, *index, *c),
                                              s.shape).astype(jnp.float32)
      raw, pull = jax.vjp(modify, raw, *mod_consts)
    base2 = raw * tiles.LOG2E
    return (base2 if keep is None else jnp.where(keep, base2, tiles.MASK_VALUE)), pull

  def chunk(self, p: int) -> int:
    return self.layout.chunk(self.passes[p])

  def chunk_indices(self, p: int):
    return self.layout.chunk_indices(self.passes[p])

  def kept(self, rng, p: int, chunk, shape):
    """Attention dropout of step `chunk` (its first query block's place in the pass, [C]) of
    pass p: keep / (1 - rate) (the same in the backward), or None."""
    if rng is None:
      return None
    key = jax.random.fold_in(jax.random.fold_in(rng, p), chunk[0])
    keep = softmax.keep_mask(key, shape, self.dropout_rate)
    return keep.astype(jnp.float32) / (1.0 - self.dropout_rate)

  def assemble(self, parts, fill):
    """Per-pass arrays [b, kvh, R, rows, c] -> [b, kvh, nq, rows, c] in query-block order; the
    query blocks no pass holds (they see no key) get `fill`."""
    order = np.concatenate([p.rows for p in self.passes])
    if len(order) == self.layout.num_q and np.all(order == np.arange(len(order))):
      return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=2)
    shape = parts[0].shape
    rest = self.layout.num_q - len(order)
    parts = parts + [jnp.full(shape[:2] + (rest,) + shape[3:], fill, parts[0].dtype)]
    where = np.empty(self.layout.num_q, np.int64)
    where[np.concatenate([order, np.setdiff1d(np.arange(self.layout.num_q), order)])] = (
        np.arange(self.layout.num_q))
    return jnp.take(jnp.concatenate(parts, axis=2), where, axis=2)


def _steps(plan: Plan, p: int, step, *arrays):
  """lax.map of step(*chunks) over chunks of plan.chunk(p) query blocks of pass p: arrays
  [b, kvh, R, ...] (None, or already [R, ...] when a tuple holds (array,)) -> step's outputs
  [R, ...] each."""
  size = plan.chunk(p)
  def split(x):
    x = x[0] if isinstance(x, tuple) else None if x is None else jnp.moveaxis(x, 2, 0)
    if x is None:
      return None
    return x.reshape((x.shape[0] // size, size) + x.shape[1:])
  results = jax.lax.map(lambda xs: step(*xs), [split(x) for x in arrays])
  return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), results)


def _forward(plan: Plan, q, k, v, valid, rng, mask_consts, mod_consts):
  """q [b, kvh, nq, rows, d'], k [b, kvh, nk, bk, d'], v [b, kvh, nk, bk, dv] -> (out like q
  with dv channels, in q's dtype; lse₂ f32 [b, kvh, nq, rows, 1], 0 for a row that saw no key;
  the natural-unit log-sum-exp, -inf for such a row)."""
  outs, lses, seens = [], [], []
  for p, pass_ in enumerate(plan.passes):
    whole, (q_index, kv_index) = plan.chunk_indices(p)
    num_chunks = len(pass_.rows) // plan.chunk(p)

    def step(q_rows, keys, values, states, valid_at, q_at, kv_at, chunk):
      index = (*whole, q_at, kv_at)
      keep = plan.keep(p, index, states, valid_at, mask_consts[p])
      scores, _ = plan.scores(p, q_rows, keys, keep, index, mod_consts[p])
      init = tuple(jnp.broadcast_to(x, scores.shape[:-2] + x.shape)
                   for x in tiles.softmax_init(scores.shape[-2], values.shape[-1]))
      state = tiles.softmax_update(init, scores, values, plan.kept(rng, p, chunk, scores.shape))
      out, lse = tiles.softmax_finish(state)
      return out.astype(q.dtype), lse, state[2] > 0

    out, lse, seen = _steps(plan, p, step, pass_rows(q, pass_), pass_keys(k, pass_),
                            pass_keys(v, pass_), (plan.layout.step_states(pass_),), (valid[p],),
                            (q_index,), (kv_index,),
                            (np.arange(num_chunks * plan.chunk(p)),))
    for results, x in ((outs, out), (lses, lse), (seens, seen)):
      results.append(jnp.moveaxis(x, 0, 2))
  lse, seen = plan.assemble(lses, 0.0), plan.assemble(seens, False)
  return plan.assemble(outs, 0), lse, jnp.where(seen, lse / tiles.LOG2E, -jnp.inf)


def _attend_fwd(plan, q, k, v, valid, rng, mask_consts, mod_consts):
  out, lse, natural_lse = _forward(plan, q, k, v, valid, rng, mask_consts, mod_consts)
  return (out, natural_lse), (q, k, v, valid, rng, mask_consts, mod_consts, out, lse)


def _backward(plan: Plan, residuals, cotangents):
  """Each pass's tiles recomputed from the forward's log-sum-exp (FlashAttention-2's backward,
  the whole pass at once); the keys' gradients return through the transpose of each slot's
  view. The log-sum-exp's cotangent enters as Δ - d_lse (see flex._backward)."""
  q, k, v, valid, rng, mask_consts, mod_consts, out, lse = residuals
  d_out, d_lse = cotangents
  d_out = d_out.astype(q.dtype)
  delta = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1,
                  keepdims=True) - d_lse
  dq, dk, dv = (jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))
  d_mods = []
  for p, pass_ in enumerate(plan.passes):
    whole, (q_index, kv_index) = plan.chunk_indices(p)
    num_chunks = len(pass_.rows) // plan.chunk(p)
    q_rows, pull_q = jax.vjp(lambda x: pass_rows(x, pass_), q)
    keys, pull_k = jax.vjp(lambda x: pass_keys(x, pass_), k)
    values, pull_v = jax.vjp(lambda x: pass_keys(x, pass_), v)

    def step(q_rows, keys, values, states, valid_at, q_at, kv_at, chunk, lse_rows, delta_rows,
             d_out_rows):
      index = (*whole, q_at, kv_at)
      keep = plan.keep(p, index, states, valid_at, mask_consts[p])
      scores, pull_mod = plan.scores(p, q_rows, keys, keep, index, mod_consts[p])
      probs, d_scores = tiles.tile_probs_and_dscores(
          scores, lse_rows, delta_rows, d_out_rows, values,
          plan.kept(rng, p, chunk, scores.shape))
      d_mod = []
      if pull_mod is not None:
        d_scores, *d_mod = pull_mod(d_scores)
      d_scores = d_scores.astype(q.dtype)
      return (tiles.dot_nn(d_scores, keys) * plan.scale,
              tiles.dot_tn(d_scores, q_rows) * plan.scale,
              tiles.dot_tn(probs.astype(d_out.dtype), d_out_rows),
              [d[None] for d in d_mod])          # one per step, summed after

    rows = lambda x: pass_rows(x, pass_)
    d_q_rows, d_keys, d_values, d_mod = _steps(
        plan, p, step, q_rows, keys, values, (plan.layout.step_states(pass_),), (valid[p],),
        (q_index,), (kv_index,),
        (np.arange(num_chunks * plan.chunk(p)),), rows(lse), rows(delta), rows(d_out))
    back = lambda x: jnp.moveaxis(x, 0, 2)
    dq += pull_q(back(d_q_rows).astype(q.dtype))[0]
    dk += pull_k(back(d_keys).astype(k.dtype))[0]
    dv += pull_v(back(d_values).astype(v.dtype))[0]
    d_mods.append([d.sum(0).astype(c.dtype) for d, c in zip(d_mod, mod_consts[p])])
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
          [None] * len(valid), None, [[None] * len(c) for c in mask_consts], d_mods)


_attend = jax.custom_vjp(lambda plan, *args: _forward(plan, *args)[::2], nondiff_argnums=(0,))
_attend.defvjp(_attend_fwd, _backward)


def scheduled_attention(passes, layout: Layout, q, k, v, *, mask_mod, kv_valid, scale: float,
                        score_mod, dropout_rate: float, dropout_rng, plain: bool):
  """Attention over `passes`. q [b, kvh, nq, rows, d'] (flex's query blocks, the blocks axis
  third), k [b, kvh, nk, bk, d'], v [b, kvh, nk, bk, dv]; mask_mod the pattern's (None: every
  listed tile full); kv_valid bool [b, nk, bk] or None (no key padding, no kv_mask); score_mod
  flex's (b, h, q, kv indices as Layout.indices). plain: the forward as plain JAX (forward-mode
  autodiff, which a custom VJP refuses). -> (out [b, kvh, nq, rows, dv], natural-unit lse
  [b, kvh, nq, rows, 1])."""
  valid = [None if kv_valid is None else key_validity(p, kv_valid) for p in passes]
  # the functions as one step sees them, the arrays they close over as explicit arguments
  masks, mask_consts, mods, mod_consts = [], [], [], []
  for pass_ in passes:
    (b, h), (q_at, kv_at) = layout.chunk_indices(pass_)
    size = layout.chunk(pass_)
    index = (b, h, q_at[:size], kv_at[:size])
    mask, consts = None, []
    if mask_mod is not None and any(np.any(s.state == PARTIAL) for s in pass_.slots):
      mask, consts = hoist_all(mask_mod, *index[:3], index[3][..., :layout.block_k])
    masks.append(mask)
    mask_consts.append(consts)
    mod, consts = None, []
    if score_mod is not None:
      scores = (size, layout.batch, layout.kv_heads, layout.group * layout.block_q,
                len(pass_.slots) * layout.block_k)
      mod, consts = jax.closure_convert(score_mod, jnp.zeros(scores, jnp.float32), *index)
    mods.append(mod)
    mod_consts.append(consts)
  plan = Plan(tuple(passes), layout, scale, tuple(mods), tuple(masks), float(dropout_rate))
  rng = dropout_rng if dropout_rate > 0 else None
  args = (q, k, v, valid, rng, mask_consts, mod_consts)
  if plain:
    out, _, lse = _forward(plan, *args)
    return out, lse
  return _attend(plan, *args)
