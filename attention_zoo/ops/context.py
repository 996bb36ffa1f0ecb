"""The `context` mesh axis: where a sequence is split across devices (context parallelism).

The harness places a run under a device mesh (`jax.set_mesh`); an op that has a
context-parallel form asks `context_size()` whether the active mesh splits the sequence and, if
so, runs its `shard_map` form over `CONTEXT_AXIS` with JAX's collectives. With no mesh, or a
mesh without a `context` axis of size > 1, every op runs its one-device form. The mesh's axes are
`jax.sharding.AxisType.Auto` (XLA's partitioner places what the ops do not place themselves),
and the sequence is split in contiguous shards: device i of `context` holds tokens
[i·n/C, (i+1)·n/C).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

# The mesh axis names the harness uses (experiments/train builds the mesh from config.mesh).
DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
CONTEXT_AXIS = "context"
TENSOR_AXIS = "tensor"
# The axes the batch is split over.
BATCH_AXES = (DATA_AXIS, FSDP_AXIS)


def context_size() -> int:
  """The size of the active mesh's `context` axis (1 without a mesh or without the axis)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or CONTEXT_AXIS not in mesh.axis_names:
    return 1
  return mesh.shape[CONTEXT_AXIS]


def sequence_spec() -> jax.sharding.PartitionSpec:
  """The active mesh's PartitionSpec of a [batch, length, ...] array: the batch over the batch
  axes the mesh has, the length over `context` (a `shard_map`'s in_specs and out_specs)."""
  names = jax.sharding.get_abstract_mesh().axis_names
  batch = tuple(axis for axis in BATCH_AXES if axis in names)
  return jax.sharding.PartitionSpec(batch or None, CONTEXT_AXIS)


def exchange_halo(x, before: int, after: int):
  """Inside a `shard_map` over `context`: this shard x [batch, n/C, ...] with the previous
  shard's last `before` positions in front and the next shard's first `after` behind (zeros at
  the sequence's ends) -> [batch, before + n/C + after, ...]. A window op over the sequence
  (a convolution) then needs nothing else from other shards."""
  length, shards = x.shape[1], jax.lax.axis_size(CONTEXT_AXIS)
  if max(before, after) > length:
    raise ValueError(f"a halo of {max(before, after)} positions needs shards at least that long; "
                     f"a shard holds {length}: use a smaller `context` or a longer sequence")
  forward = [(i, i + 1) for i in range(shards - 1)]
  parts = [x]
  if before:
    parts.insert(0, jax.lax.ppermute(x[:, length - before:], CONTEXT_AXIS, forward))
  if after:
    parts.append(jax.lax.ppermute(x[:, :after], CONTEXT_AXIS, [(j, i) for i, j in forward]))
  return jnp.concatenate(parts, axis=1)
