r"""Context parallelism for the linear recurrences (engine.py): the chunkwise algorithm one level
up, each device of the mesh's `context` axis one chunk.

Every recurrence of the engine is affine in its state, column by column: each of the V columns
of S [K, V] evolves by the same K x K map (decay, delta step, DPLR step; 0 at a segment start)
plus what the token writes into that column, and o_t = S_tᵀ q_t reads each column alone. So a
shard of tokens, run from an entering state S₀, gives

    S_out = Φ S₀ + S_out⁰,      o_t = o_t⁰ + R_t S₀          Φ [K, K], R_t = q_tᵀ Φ_t [K]

with ⁰ the run from the zero state and Φ_t the product of the transitions up to t. One run of
the shard's recurrence with K extra value columns, zero values in them and the identity as
their entering state, gives all four at once: the extra columns of S_out are Φ and those of o_t
are R_t. Each device runs its shard so (its own chunk and scan machinery unchanged; the extra
columns cost (V + K) / V of the work on values, nothing on the C x C products and the solve),
then the devices exchange (Φ, S_out⁰), [B, H, K, K + V] each, independent of the length, by one
`all_gather` over `context`; each device composes the summaries of the shards before it
(S₀ of shard i = Φ_{i-1} (... (Φ_0 S_init + S⁰_0) ...) + S⁰_{i-1}, C - 1 small matmuls) and
corrects its outputs by R_t S₀. An all_gather and a local prefix rather than log2(C) `ppermute`
steps: the summaries are a few kilobytes, so one collective round costs less latency than
log2(C) rounds, and the prefix is C matmuls of K x K by K x V on every device.

Packed sequences: a shard whose rows hold a segment start has Φ = 0 from there on (the
recurrence resets the identity columns like any other), so nothing of earlier shards crosses
the start. A shard learns whether its first token starts a segment from the previous shard's
last id (one `ppermute` of [B] ids).

Gradients: JAX differentiates through `shard_map` and the collectives (the all_gather's
transpose is a reduce-scatter of the summaries' cotangents); each device keeps only its own
shard's residuals, so memory per device is linear in T / C.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from attention_zoo.ops.context import BATCH_AXES, CONTEXT_AXIS
from attention_zoo.ops.segments import segment_starts


def _batch_axes() -> tuple[str, ...]:
  """The axes of the active mesh the batch is split over (those of BATCH_AXES it has)."""
  names = jax.sharding.get_abstract_mesh().axis_names
  return tuple(axis for axis in BATCH_AXES if axis in names)


def _from_previous_shard(x):
  """x [B, ...] on each device of `context` -> the previous device's x (zeros on the first)."""
  size = jax.lax.axis_size(CONTEXT_AXIS)
  return jax.lax.ppermute(x, CONTEXT_AXIS, [(i, i + 1) for i in range(size - 1)])


def shard_segment_starts(segment_ids):
  """Inside a `shard_map` over `context`: the shard's segment_ids int [B, T/C] -> bool
  [B, T/C], True where a run starts after another (as `segment_starts` of the whole row: never
  at the row's first token, at a shard's first token where the previous shard's last id
  differs)."""
  starts = segment_starts(segment_ids)
  previous = _from_previous_shard(segment_ids[:, -1])                       # [B]
  first = (previous != segment_ids[:, 0]) & (jax.lax.axis_index(CONTEXT_AXIS) > 0)
  return starts.at[:, 0].set(first)


def _compose(initial_state, transitions, written):
  """The state entering each of the C shards and leaving the last: S_{i+1} = Φ_i S_i + S⁰_i
  from S_0 = initial_state [B, H, K, V]; transitions [C, B, H, K, K], written [C, B, H, K, V]
  -> ([C, B, H, K, V], [B, H, K, V])."""
  states = [initial_state]
  for transition, state in zip(transitions, written):
    states.append(jnp.einsum("bhij,bhjv->bhiv", transition, states[-1],
                             precision=jax.lax.Precision.HIGHEST) + state)
  return jnp.stack(states[:-1]), states[-1]


def split_over_context(recurrence, v, per_token, initial_state, segment_ids):
  """Runs `recurrence` with the sequence split over the active mesh's `context` axis (see the
  module docstring). recurrence(v, per_token, initial_state, resets) -> (o [B, T, H, V],
  final state [B, H, K, V]) is one of the engine's forms on whole arrays: v [B, T, H, V];
  per_token a tuple of [B, T, ...] arrays or None (q first: q [B, T, H, K]); initial_state
  [B, H, K, V]; resets bool [B, T] or None; segment_ids int [B, T] or None. Each device runs
  it on its shard, then corrects its outputs by its true entering state. -> as recurrence."""
  size, length = jax.sharding.get_abstract_mesh().shape[CONTEXT_AXIS], v.shape[1]
  if length % size:
    raise ValueError(f"a sequence split over the mesh's context axis ({size} devices) needs a "
                     f"length divisible by {size}, got {length}")
  batch = _batch_axes() or None
  tokens, state_spec = P(batch, CONTEXT_AXIS), P(batch)

  def shard(v, per_token, initial_state, segment_ids):
    B, T, H, V = v.shape
    K = initial_state.shape[-2]
    resets = None if segment_ids is None else shard_segment_starts(segment_ids)
    identity = jnp.broadcast_to(jnp.eye(K, dtype=initial_state.dtype), (B, H, K, K))
    # the shard's run starts from the same state on every device, but its scans carry what
    # varies along `context`
    entering = jax.lax.pcast(jnp.concatenate([jnp.zeros_like(initial_state), identity], axis=-1),
                             CONTEXT_AXIS, to="varying")
    o, leaving = recurrence(jnp.concatenate([v, jnp.zeros((B, T, H, K), v.dtype)], axis=-1),
                            per_token, entering, resets)
    written, transition = leaving[..., :V], leaving[..., V:]                 # S⁰_out, Φ
    # the same on every device of `context`: the final state leaves the shard_map replicated
    gathered = jax.lax.all_gather((transition, written), CONTEXT_AXIS, to="invarying")
    entering, final_state = _compose(initial_state, *gathered)
    entering = entering[jax.lax.axis_index(CONTEXT_AXIS)]                   # [B, H, K, V]
    correction = jnp.einsum("bthk,bhkv->bthv", o[..., V:], entering.astype(o.dtype),
                            precision=jax.lax.Precision.HIGHEST)
    return o[..., :V] + correction, final_state

  per_token_specs = tuple(None if x is None else tokens for x in per_token)
  run = jax.shard_map(
      shard, in_specs=(tokens, per_token_specs, state_spec,
                       None if segment_ids is None else tokens),
      out_specs=(tokens, state_spec), axis_names={CONTEXT_AXIS, *(batch or ())})
  return run(v, per_token, initial_state, segment_ids)
