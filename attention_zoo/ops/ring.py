"""Context-parallel softmax attention. Ring attention: exact softmax attention with the
sequence split over the mesh's `context` axis (Liu et al. 2023, "Ring Attention with Blockwise
Transformers", arXiv:2310.01889), for every softmax variant whose pattern is a mask function of
token positions (`full`, `flash`, the engine's mask-function variants, FoX, MLA).

Device i of `context` (C devices) holds the queries, keys and values of its shard. The keys and
values (with their padding mask and segment ids) travel around the ring with
`jax.lax.ppermute`; at ring step s device i holds shard (i - s) mod C and runs the block-sparse
engine's tile loop (ops/flex.py's `_forward`) of its queries against it, the mask and score
functions evaluated at GLOBAL positions (causal rule, window, ALiBi distance, soft-cap), and
merges the partial results by their log-sum-exp. The backward (a custom VJP) saves only the
shard's q, k, v, the output and its log-sum-exp, and runs the ring again: the keys and values
travel with their dK/dV accumulators, each step adds the engine's tile gradients
(ops/flex.py's `_backward`, FlashAttention-2's recomputation from the saved log-sum-exp), and
the accumulators go home at the end. No score matrix outlives its tile, so memory per device is
O(n/C) (plus the tiles), forward and backward.

Which shard pairs meet is known while tracing: the mask function is evaluated at every pair's
positions once (numpy), a ring step that no device needs is skipped (a window only needs its
neighbour shards: 2 steps causal, 3 not, whatever C), the K/V block then jumps the skipped
hops in one `ppermute`, and inside a step each device visits only its non-empty tiles (a table
of tile states per device and step, read at `axis_index`).

Layouts (`layout=`): "contiguous" (device i holds tokens [i·n/C, (i+1)·n/C), as the harness
shards) or "zigzag": the sequence is cut into 2C chunks and device i holds chunks i and
2C-1-i, so under a causal mask every device has the same number of visible (query, key) pairs
(contiguous: device C-1 does C times the work of device 0, and the ring runs at the slowest's
pace). Zigzag costs one exchange of q, k, v, masks and segment ids into that layout and one
of the output back (two `ppermute`s each way: about one ring step's traffic), inside the op.

FoX's forget-gate bias c_i - c_j (`log_forget=`, `forgetting_attention_ring`) needs c, the
cumulative log forget, at global positions: each shard's own cumulative sum plus the sum of the
shards before it (an exclusive scan of the gathered shard totals); the key side of c travels
with its K/V block, and its gradient with dK/dV. `packed_ring_attention` is the entry of the
mixers that own their softmax (FoX, MLA). `head_parallel_attention` is the all-to-all form
(DeepSpeed-Ulysses): the heads split instead of the sequence, the one-device engine in between.

Segment ids (packed sequences) are part of the mask: tiles are not skipped by segment (the
tile tables are static), only masked. Attention dropout draws each tile's mask from the key
folded with (device, source shard): valid dropout, but not the one-device call's draws.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from attention_zoo.ops import flex, tiles
from attention_zoo.ops.context import BATCH_AXES, CONTEXT_AXIS, context_size
from attention_zoo.ops.flex import EMPTY, FULL, PARTIAL
from attention_zoo.ops.forgetting_attention import (add_two_float, cumsum_two_float,
                                                    gate_difference)
from attention_zoo.ops.segments import segment_runs

LAYOUTS = ("contiguous", "zigzag")


@dataclasses.dataclass(frozen=True, eq=False)
class _Ring:
  """What is static about one ring call (hashed by identity): the shard count, the ring steps
  taken (shifts s: at step s device i holds shard (i - s) mod C), each device's global query
  and key positions (int32 [C, padded shard length]) and the tile states of every (step,
  device) pair (int8 [steps, C, nq, nk])."""
  size: int
  steps: tuple[int, ...]
  q_positions: np.ndarray
  kv_positions: np.ndarray
  states: np.ndarray


def shard_positions(length: int, size: int, layout: str) -> np.ndarray:
  """int [size, length // size]: the global positions of the tokens device i holds."""
  if layout == "contiguous":
    return np.arange(length).reshape(size, -1)
  chunks = np.arange(length).reshape(2 * size, -1)
  return np.concatenate([chunks[:size], chunks[::-1][:size]], axis=1)


def _padded(positions: np.ndarray, block: int) -> np.ndarray:
  """Positions padded to whole blocks with each row's last position (padding is masked)."""
  return np.pad(positions, ((0, 0), (0, -positions.shape[1] % block)), mode="edge")


def _tile_states(mask_mod, heads, q_pos, kv_pos, q_real: int, kv_real: int, block_q: int,
                 block_k: int):
  """int8 [nq, nk] EMPTY / PARTIAL / FULL of one shard pair, the union over heads (full only
  where full for every head); padding counts as allowed for FULL and never as seen."""
  if mask_mod is None:
    allowed = jnp.ones((1, len(q_pos), len(kv_pos)), bool)
  else:
    h = jnp.arange(heads or 1)[:, None, None]
    allowed = mask_mod(0, h, q_pos[None, :, None], kv_pos[None, None, :])
    allowed = jnp.broadcast_to(allowed, (len(h), len(q_pos), len(kv_pos)))
  real = (jnp.arange(len(q_pos)) < q_real)[:, None] & (jnp.arange(len(kv_pos)) < kv_real)[None]
  as_tiles = lambda x: x.reshape(x.shape[0], -1, block_q, len(kv_pos) // block_k, block_k)
  seen = jnp.any(as_tiles(allowed & real), axis=(0, 2, 4))
  whole = jnp.all(as_tiles(allowed | ~real), axis=(0, 2, 4))
  return jnp.where(whole, FULL, jnp.where(seen, PARTIAL, EMPTY)).astype(jnp.int8)


def _causal_states(q_pos: np.ndarray, kv_pos: np.ndarray, block_q: int, block_k: int):
  """The causal rule's tile states from each tile's position range (any layout): full where
  every key precedes every query, empty where none does."""
  q_tiles, kv_tiles = q_pos.reshape(-1, block_q), kv_pos.reshape(-1, block_k)
  full = kv_tiles.max(1)[None, :] <= q_tiles.min(1)[:, None]
  empty = kv_tiles.min(1)[None, :] > q_tiles.max(1)[:, None]
  return np.where(full, FULL, np.where(empty, EMPTY, PARTIAL)).astype(np.int8)


def _plan_ring(mask_mod, causal: bool, heads, length: int, size: int, layout: str, block_q: int,
               block_k: int) -> _Ring:
  """The tile states of every (step, device) pair and the steps some device needs. The causal
  rule alone (or no mask) is read from the tiles' position ranges; a mask_mod is evaluated at
  every pair's positions while tracing (one compiled loop over the pairs: O(n²) evaluations
  once per trace, as the one-device engine's create_block_mask)."""
  positions = shard_positions(length, size, layout)
  q_positions, kv_positions = _padded(positions, block_q), _padded(positions, block_k)
  shard = length // size
  source = lambda step, device: kv_positions[(device - step) % size]
  if mask_mod is None:
    every = np.full((len(q_positions[0]) // block_q, len(kv_positions[0]) // block_k), FULL,
                    np.int8)
    pairs = np.stack([np.stack([
        _causal_states(q_positions[i], source(s, i), block_q, block_k) if causal else every
        for i in range(size)]) for s in range(size)])
  else:
    allowed = (lambda b, h, q, kv: mask_mod(b, h, q, kv) & (kv <= q)) if causal else mask_mod

    def pair(index):   # index = s·C + i: device i against shard (i - s) mod C
      step, device = index // size, index % size
      return _tile_states(allowed, heads, jnp.asarray(q_positions)[device],
                          jnp.asarray(kv_positions)[(device - step) % size], shard, shard,
                          block_q, block_k)

    with jax.ensure_compile_time_eval():
      pairs = np.asarray(jax.jit(lambda: jax.lax.map(pair, jnp.arange(size * size)))())
    pairs = pairs.reshape(size, size, *pairs.shape[1:])
  needed = tuple(s for s in range(size) if np.any(pairs[s] != EMPTY))
  return _Ring(size, needed, q_positions.astype(np.int32), kv_positions.astype(np.int32),
               pairs[list(needed)])


def _require_context() -> int:
  """The active mesh's context size; ValueError when it does not split the sequence."""
  size = context_size()
  if size < 2:
    raise ValueError("context-parallel attention needs an active mesh (jax.set_mesh) whose "
                     f"'{CONTEXT_AXIS}' axis has size > 1; got {size}. On one device use "
                     "ops.flex.pattern_attention")
  return size


def _shift(tree, hop: int, size: int):
  """Every device sends `tree` to the device `hop` places on: device i then holds what device
  i - hop held."""
  if hop % size == 0:
    return tree
  return jax.lax.ppermute(tree, CONTEXT_AXIS, [(i, (i + hop) % size) for i in range(size)])


def _step_inputs(plan, ring: _Ring, index: int, device, q_ids, kv_ids, user_consts, slopes,
                 q_gates, kv_gates):
  """(visits, mask consts, score consts) of ring step `index` on `device` (traced)."""
  source = (device - ring.steps[index]) % ring.size
  q_pos = jnp.asarray(ring.q_positions)[device]
  kv_pos = jnp.asarray(ring.kv_positions)[source]
  states = jnp.asarray(ring.states)[index, device]
  ids = () if q_ids is None else (q_ids, kv_ids)
  if ids:   # a full tile skips the mask, which now holds the segments
    states = jnp.where(states == FULL, PARTIAL, states)
  visits = flex._both_lists(states)
  mod_consts = [q_pos, kv_pos, *slopes, *q_gates, *kv_gates] if plan.score_mod else []
  return visits, [q_pos, kv_pos, *ids, *user_consts], mod_consts


def _merge(out, lse, out_step, lse_step):
  """Two softmax results over disjoint keys, by their natural log-sum-exp (-inf: no key).
  Differentiable (ops/selection_ring.py's ring is autodiffed): no exp(-inf - -inf) is formed."""
  total = jnp.logaddexp(lse, lse_step)
  nothing = jnp.isneginf(total)
  weight = lambda x: jnp.where(nothing, 0.0, jnp.exp(x - jnp.where(nothing, 0.0, total)))
  return out * weight(lse) + out_step.astype(jnp.float32) * weight(lse_step), total


def _dropout_key(rng, device, index: int, ring: _Ring):
  if rng is None:
    return None
  source = (device - ring.steps[index]) % ring.size
  return jax.random.fold_in(jax.random.fold_in(rng, device), source)


def _ring_forward(plan, ring: _Ring, q_blocks, k, v, kv_valid, q_ids, kv_ids, user_consts,
                  slopes, rng, q_gates, kv_gates):
  device = jax.lax.axis_index(CONTEXT_AXIS)
  out = jnp.zeros(q_blocks.shape[:-1] + v.shape[-1:], jnp.float32)
  lse = jnp.full(q_blocks.shape[:-1] + (1,), -jnp.inf, jnp.float32)
  held, position = (k, v, kv_valid, kv_ids, kv_gates), 0
  for index, step in enumerate(ring.steps):
    held, position = _shift(held, step - position, ring.size), step
    k_s, v_s, valid_s, ids_s, gates_s = held
    visits, mask_consts, mod_consts = _step_inputs(plan, ring, index, device, q_ids, ids_s,
                                                   user_consts, slopes, q_gates, gates_s)
    out_s, _, lse_s = flex._forward(plan, q_blocks, k_s, v_s, valid_s, visits,
                                    _dropout_key(rng, device, index, ring), mask_consts, [],
                                    mod_consts)
    out, lse = _merge(out, lse, out_s, lse_s)
  lse2 = jnp.where(jnp.isneginf(lse), 0.0, lse * tiles.LOG2E)   # the engine's backward's form
  out = out.astype(q_blocks.dtype)
  return out, (q_blocks, k, v, kv_valid, q_ids, kv_ids, user_consts, slopes, rng, q_gates,
               kv_gates, out, lse2)


def _ring_backward(plan, ring: _Ring, residuals, d_out):
  (q_blocks, k, v, kv_valid, q_ids, kv_ids, user_consts, slopes, rng, q_gates, kv_gates, out,
   lse2) = residuals
  device = jax.lax.axis_index(CONTEXT_AXIS)
  f32_zeros = lambda xs: [jnp.zeros(x.shape, jnp.float32) for x in xs]
  dq, d_q_gates = jnp.zeros(q_blocks.shape, jnp.float32), f32_zeros(q_gates)
  # the K/V block held (with its key-side gates), and the gradients it has gathered so far:
  # they travel together
  held = (k, v, kv_valid, kv_ids, kv_gates, f32_zeros((k, v)), f32_zeros(kv_gates))
  position = 0
  no_lse_grad = jnp.zeros(lse2.shape, jnp.float32)
  add = lambda totals, parts: [t + p.astype(jnp.float32) for t, p in zip(totals, parts)]
  for index, step in enumerate(ring.steps):
    held, position = _shift(held, step - position, ring.size), step
    k_s, v_s, valid_s, ids_s, gates_s, d_kv, d_gates = held
    visits, mask_consts, mod_consts = _step_inputs(plan, ring, index, device, q_ids, ids_s,
                                                   user_consts, slopes, q_gates, gates_s)
    step_residuals = (q_blocks, k_s, v_s, valid_s, visits, _dropout_key(rng, device, index, ring),
                      mask_consts, [], mod_consts, out, lse2)
    dq_step, dk_step, dv_step, *_, d_mod = flex._backward(plan, step_residuals,
                                                          (d_out, no_lse_grad))
    dq = dq + dq_step.astype(jnp.float32)
    gate_grads = d_mod[len(mod_consts) - len(q_gates) - len(kv_gates):]
    d_q_gates = add(d_q_gates, gate_grads[:len(q_gates)])
    held = (k_s, v_s, valid_s, ids_s, gates_s, add(d_kv, (dk_step, dv_step)),
            add(d_gates, gate_grads[len(q_gates):]))
  (dk, dv), d_kv_gates = _shift(held[5:], -position, ring.size)   # home to the shard's device
  none = lambda xs: [None] * len(xs)
  d_kv_gates = [d.astype(g.dtype) for d, g in zip(d_kv_gates, kv_gates)]
  return (dq.astype(q_blocks.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None,
          none(user_consts), [jnp.zeros_like(s) for s in slopes], None,
          d_q_gates, d_kv_gates)


_ring_attention = jax.custom_vjp(lambda plan, ring, *args: _ring_forward(plan, ring, *args)[0],
                                 nondiff_argnums=(0, 1))
_ring_attention.defvjp(_ring_forward, _ring_backward)


def _zigzag_exchange(tree, size: int, inverse: bool = False):
  """Contiguous shards (device i: chunks 2i, 2i+1 of 2C) <-> zigzag (device i: chunks i and
  2C-1-i), each array's axis 1 the shard's tokens. Four `ppermute`s of half a shard each."""
  def home(chunk):            # (device, half) holding chunk c in the contiguous layout
    return chunk // 2, chunk % 2

  def zigzag(chunk):          # ... in the zigzag layout
    return (chunk, 0) if chunk < size else (2 * size - 1 - chunk, 1)

  source, target = (zigzag, home) if inverse else (home, zigzag)
  halves = jax.tree.map(lambda x: jnp.split(x, 2, axis=1), tree,
                        is_leaf=lambda x: isinstance(x, jax.Array))
  received = [jax.tree.map(lambda h: jnp.zeros_like(h[0]), halves,
                           is_leaf=lambda x: isinstance(x, list)) for _ in range(2)]
  device = jax.lax.axis_index(CONTEXT_AXIS)
  for from_half in range(2):
    for to_half in range(2):
      perm = [(source(c)[0], target(c)[0]) for c in range(2 * size)
              if source(c)[1] == from_half and target(c)[1] == to_half]
      if not perm:
        continue
      sent = jax.tree.map(lambda h: h[from_half], halves, is_leaf=lambda x: isinstance(x, list))
      moved = jax.lax.ppermute(sent, CONTEXT_AXIS, perm)
      receives = jnp.isin(device, jnp.asarray([t for _, t in perm]))
      received[to_half] = jax.tree.map(lambda old, new: jnp.where(receives, new, old),
                                       received[to_half], moved)
  return jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1), *received)


def ring_attention(q, k, v, mask_mod: Callable | None = None, *, causal: bool = False,
                   kv_mask=None,
                   scale: float | None = None, softcap: float | None = None, alibi_slopes=None,
                   dropout_rate: float = 0.0, dropout_rng=None, segment_ids=None,
                   heads: int | None = None, block_q: int = flex.DEFAULT_BLOCK,
                   block_k: int = flex.DEFAULT_BLOCK, layout: str = "contiguous",
                   log_forget=None, **engine):
  """Softmax self-attention over mask_mod (flex's (b, h, q, kv) -> bool at sequence positions;
  None: every key) and, with `causal`, the causal rule (cheaper to plan than a mask_mod that
  holds it), with the sequence split over the active mesh's `context` axis. Arguments as
  ops.flex.pattern_attention's; q [b, n, h, d], k, v [b, n, kvh, d] as global arrays, sharded
  [batch axes, context]; n a multiple of the context size (of twice it for layout="zigzag").
  log_forget: None, or FoX's log forget gates f32 [b, n, h] (0 at padding): the scores then add
  c_i - c_j, c the cumulative sum of log_forget along the whole sequence (each shard's prefix
  is an exclusive scan of the shards' totals, `all_gather` of one pair per row and head).
  Returns [b, n, h, d], sharded likewise."""
  if engine:
    raise ValueError(f"ring attention: {', '.join(sorted(engine))} (a pattern over reordered "
                     f"or copied keys) has no ring form; give mask_mod at sequence positions")
  if log_forget is not None and layout != "contiguous":
    raise ValueError("ring attention: log_forget (FoX's gate) needs layout='contiguous': its "
                     "cumulative sum runs along the sequence in order")
  if layout not in LAYOUTS:
    raise ValueError(f"ring attention: layout must be one of {LAYOUTS}, got {layout!r}")
  size = _require_context()
  batch, length, num_heads, head_dim = q.shape
  kv_heads = k.shape[2]
  if k.shape[1] != length:
    raise ValueError(f"ring attention is self-attention only: q_len ({length}) != kv_len "
                     f"({k.shape[1]}); run cross-attention without a context axis")
  chunks = size * (2 if layout == "zigzag" else 1)
  if length % chunks:
    raise ValueError(f"ring attention: the length ({length}) must be a multiple of "
                     f"{chunks} (context={size}, layout={layout!r})")
  shard = length // size
  block_q, block_k = min(block_q, shard), min(block_k, shard)
  group = num_heads // kv_heads
  ring = _plan_ring(mask_mod, causal, heads, length, size, layout, block_q, block_k)
  scale = head_dim ** -0.5 if scale is None else float(scale)
  kv_mask = jnp.ones((batch, length), bool) if kv_mask is None else jnp.asarray(kv_mask, bool)
  q_ids, kv_ids = (None, None) if segment_ids is None else segment_ids
  slopes = [] if alibi_slopes is None else [jnp.asarray(alibi_slopes, jnp.float32)]
  rng = dropout_rng if dropout_rate > 0 else None

  def local(q, k, v, kv_mask, q_ids, kv_ids, slopes, rng, log_forget):
    if layout == "zigzag":
      q, k, v, kv_mask, q_ids, kv_ids = _zigzag_exchange((q, k, v, kv_mask, q_ids, kv_ids), size)
    # mask_mod's arrays (closed over, concrete) become explicit arguments, as in the engine
    user_mask, user_consts = (None, []) if mask_mod is None else flex._hoist_all(
        mask_mod, *flex._tile_indices(block_q, block_k, group, q.shape[0], kv_heads, 0, 0))
    gates = [] if log_forget is None else _sequence_cumsum(log_forget)        # [b, h, shard]
    pad = lambda x, block: None if x is None else jnp.pad(
        x, ((0, 0),) * (x.ndim - 1) + ((0, -shard % block),), mode="edge")
    q_gates, kv_gates = [pad(c, block_q) for c in gates], [pad(c, block_k) for c in gates]
    plan = flex._Plan(None, _score_function(softcap, len(slopes), length, group if gates else 0),
                      _mask_function(user_mask, q_ids is not None, causal), scale, block_q, block_k,
                      group, float(dropout_rate))
    out = _ring_attention(plan, ring, flex.query_blocks(q, kv_heads, block_q),
                          flex.key_layout(k, block_k), flex.key_layout(v, block_k),
                          flex.key_validity(kv_mask, q.shape[0], shard, block_k),
                          pad(q_ids, block_q), pad(kv_ids, block_k), user_consts, slopes, rng,
                          q_gates, kv_gates)
    out = flex.from_query_blocks(out, group, shard)
    return _zigzag_exchange(out, size, inverse=True) if layout == "zigzag" else out

  mesh = jax.sharding.get_abstract_mesh()
  batch_axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names) or None
  sequence = P(batch_axes, CONTEXT_AXIS)
  return jax.shard_map(
      local, in_specs=(sequence,) * 6 + (P(), P(), sequence), out_specs=sequence,
      axis_names={CONTEXT_AXIS, *(batch_axes or ())}, check_vma=False,
  )(q, k, v, kv_mask, q_ids, kv_ids, slopes, rng, log_forget)


def _mask_function(user_mask, packed: bool, causal: bool):
  """The plan's mask (b, h, q, kv, q_pos, kv_pos, [q_ids, kv_ids,] *user consts): q and kv are
  shard-local indices; the causal rule and the user's mask_mod see their global positions."""
  if user_mask is None and not packed and not causal:
    return None

  def mask(b, h, q, kv, q_pos, kv_pos, *rest):
    allowed = kv_pos[kv] <= q_pos[q] if causal else True
    if packed:
      q_ids, kv_ids, *rest = rest
      allowed = allowed & (q_ids[b, q] == kv_ids[b, kv])
    if user_mask is not None:
      allowed = allowed & user_mask(b, h, q_pos[q], kv_pos[kv], *rest)
    return allowed
  return mask


def _score_function(softcap, num_slopes: int, length: int, gate_group: int):
  """The plan's score_mod (score, b, h, q, kv, q_pos, kv_pos, *slopes, *query gates, *key
  gates): soft-cap, then ALiBi at global positions (as flex.score_function), then FoX's
  c_i - c_j (gate_group: query heads per K/V head; 0 without the gate); None when none."""
  if softcap is None and not num_slopes and not gate_group:
    return None

  def score_mod(score, b, h, q, kv, q_pos, kv_pos, *rest):
    slopes, gates = rest[:num_slopes], rest[num_slopes:]
    if softcap is not None or slopes:
      score = flex.score_function(softcap_value=softcap, alibi_slopes=slopes[0] if slopes else None,
                                  q_len=length, kv_len=length, query_positions=q_pos,
                                  key_positions=kv_pos)(score, b, h, q, kv)
    if gates:
      score = score + gate_difference(gates[:2], gates[2:], gate_group, b, h, q, kv)
    return score
  return score_mod


def _sequence_cumsum(log_forget):
  """The shard's [b, shard, h] log forget gates -> their cumulative sum along the WHOLE
  sequence as a float pair (hi, lo), each [b, h, shard]: the shard's own, plus the sum of the
  shards before it (an exclusive scan of the gathered shard totals)."""
  hi, lo = cumsum_two_float(log_forget, axis=1)          # [b, shard, h]
  totals = jax.lax.all_gather((hi[:, -1], lo[:, -1]), CONTEXT_AXIS)           # [C, b, h] each
  before = jax.lax.associative_scan(add_two_float, totals, axis=0)
  device = jax.lax.axis_index(CONTEXT_AXIS)
  offset = [jnp.where(device > 0, x[jnp.maximum(device - 1, 0)], 0.0)[:, None] for x in before]
  hi, lo = add_two_float((hi, lo), offset)
  return [jnp.moveaxis(hi, 1, 2), jnp.moveaxis(lo, 1, 2)]


def forgetting_attention_ring(q, k, v, log_f, *, scale: float | None = None, mask=None,
                              segment_ids=None, block_size: int | None = None):
  """ops.forgetting_attention (FoX) with the sequence split over the mesh's `context` axis:
  the same arguments and result, by ring attention with the forget-gate bias."""
  batch, length = q.shape[:2]
  mask = jnp.ones((batch, length), bool) if mask is None else jnp.asarray(mask, bool)
  log_f = jnp.where(mask[..., None], log_f.astype(jnp.float32), 0.0)       # f = 1 at padding
  out = packed_ring_attention(q, k, v, kv_mask=mask, causal=True, scale=scale,
                              segment_ids=segment_ids, block_size=block_size, log_forget=log_f)
  return jnp.where(mask[:, :, None, None], out, 0).astype(q.dtype)


def packed_ring_attention(q, k, v, *, kv_mask, causal: bool, scale: float | None,
                          segment_ids=None, block_size: int | None = None, log_forget=None):
  """ring_attention for the mixers that own their softmax (FoX, MLA): segment_ids int [b, n]
  are taken as runs (equal ids in separate runs are separate sequences, as ops/segments.py
  says), block_size None: the ring's default tiles."""
  runs = None if segment_ids is None else segment_runs(segment_ids)
  blocks = {} if block_size is None else dict(block_q=block_size, block_k=block_size)
  return ring_attention(q, k, v, causal=causal, kv_mask=kv_mask, scale=scale,
                        segment_ids=None if runs is None else (runs, runs),
                        log_forget=log_forget, **blocks)


def head_parallel_attention(q, k, v, mask_mod: Callable | None = None, *, causal: bool = False,
                            kv_mask=None, scale: float | None = None, softcap: float | None = None,
                            alibi_slopes=None, dropout_rate: float = 0.0, dropout_rng=None,
                            segment_ids=None, heads: int | None = None,
                            block_q: int = flex.DEFAULT_BLOCK, block_k: int = flex.DEFAULT_BLOCK):
  """The all-to-all form (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv:2309.14509) of
  ring_attention, same arguments and result: one `all_to_all` turns each device's shard of the
  sequence with every head into the whole sequence with C-th of the heads (query and K/V heads
  alike), the one-device engine (flex.pattern_attention) runs on it, and one more brings the
  output back; the key padding and segment ids are gathered whole (small integers). Needs the
  query and K/V head counts to be multiples of the context size. Traffic per device: about its
  shard of q, k, v and the output, once each, against the ring's (C - 1) K/V shards; memory: the
  whole sequence for h/C heads, the engine's O(n) per head."""
  size = _require_context()
  batch, length, num_heads, head_dim = q.shape
  kv_heads = k.shape[2]
  if num_heads % size or kv_heads % size:
    raise ValueError(f"head-parallel attention: the query heads ({num_heads}) and K/V heads "
                     f"({kv_heads}) must be multiples of context={size}; ring_attention "
                     f"splits any head count")
  if k.shape[1] != length or length % size:
    raise ValueError(f"head-parallel attention is self-attention over a length that context="
                     f"{size} divides; got q_len={length}, kv_len={k.shape[1]}")
  kv_mask = jnp.ones((batch, length), bool) if kv_mask is None else jnp.asarray(kv_mask, bool)
  q_ids, kv_ids = (None, None) if segment_ids is None else segment_ids
  slopes = None if alibi_slopes is None else jnp.asarray(alibi_slopes, jnp.float32)
  rng = dropout_rng if dropout_rate > 0 else None
  local_heads = num_heads // size
  # The block lists, built here (outside shard_map, while tracing) over every head: the union
  # of the heads' tiles, full only where full for all; each device evaluates its own heads.
  rule = flex.causal_mask(length, length) if causal else None
  if mask_mod is None and rule is None:
    tiles_of = flex.full_block_mask(length, length, block_q=block_q, block_k=block_k)
  else:
    both = rule if mask_mod is None else mask_mod if rule is None else (
        lambda b, h, q, kv: rule(b, h, q, kv) & mask_mod(b, h, q, kv))
    built = flex.create_block_mask(both, None, heads, length, length, block_q=block_q,
                                   block_k=block_k)
    with jax.ensure_compile_time_eval():
      states = np.asarray(built.states())
    union = np.where(np.all(states == FULL, axis=1), FULL,
                     np.where(np.any(states != EMPTY, axis=1), PARTIAL, EMPTY))[:, None]
    with jax.ensure_compile_time_eval():
      tiles_of = flex.block_mask_from_states(union, both, length, length,
                                             block_q=built.block_q, block_k=built.block_k)

  # as numpy: arrays made under the (auto) mesh would clash with shard_map's manual one
  tiles_of = jax.tree.map(np.asarray, tiles_of)

  def local(q, k, v, kv_mask, q_ids, kv_ids, slopes, rng):
    to_heads = lambda x: jax.lax.all_to_all(x, CONTEXT_AXIS, 2, 1, tiled=True)
    gather = lambda x: jax.lax.all_gather(x, CONTEXT_AXIS, axis=1, tiled=True)
    device = jax.lax.axis_index(CONTEXT_AXIS)
    first_head = device * local_heads
    block_mask = jax.tree.map(jnp.asarray, tiles_of)
    if heads is not None:   # the mask sees each local head's global index
      block_mask = dataclasses.replace(
          block_mask, mask_mod=lambda b, h, q, kv: tiles_of.mask_mod(b, h + first_head, q, kv))
    if q_ids is not None:
      block_mask = flex.with_segments(block_mask, gather(q_ids), gather(kv_ids))
    score_mod = flex.score_function(
        softcap_value=softcap, q_len=length, kv_len=length,
        alibi_slopes=None if slopes is None else jax.lax.dynamic_slice_in_dim(
            slopes, first_head, local_heads))
    out = flex.flex_attention(
        to_heads(q), to_heads(k), to_heads(v), block_mask=block_mask, score_mod=score_mod,
        scale=scale, kv_mask=gather(kv_mask), dropout_rate=dropout_rate,
        dropout_rng=None if rng is None else jax.random.fold_in(rng, device))
    return jax.lax.all_to_all(out, CONTEXT_AXIS, 1, 2, tiled=True)

  mesh = jax.sharding.get_abstract_mesh()
  batch_axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names) or None
  sequence = P(batch_axes, CONTEXT_AXIS)
  return jax.shard_map(
      local, in_specs=(sequence,) * 6 + (P(), P()), out_specs=sequence,
      axis_names={CONTEXT_AXIS, *(batch_axes or ())}, check_vma=False,
  )(q, k, v, kv_mask, q_ids, kv_ids, slopes, rng)
