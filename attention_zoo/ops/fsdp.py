"""The `fsdp` mesh axis: parameters cut across devices (fully sharded data parallelism) and
gathered one layer at a time.

The harness cuts every array of the training state over `fsdp` (`shard_spec`: along the array's
largest axis that the fsdp size divides) and splits the batch over it too. A model asks for a
layer's parameters whole just before it runs that layer (`gathered`): XLA's SPMD partitioner
all-gathers them there, and their gradient, which each device holds summed over its share of
the batch, is summed over the devices and cut back (a reduce-scatter; XLA:CPU compiles it as an
all-reduce and a slice). So a device holds one layer's parameters whole at a time, not the
whole model's (models.py runs each block in a computation of its own, and its backward pass
gathers them again rather than keep them). With no mesh, or a mesh without an `fsdp` axis of
size > 1, `gathered` is the identity.

The rule reads an array's shape alone, so the optimiser's moments (shaped like the parameters)
are cut as their parameter is, a layer and its gradient agree without a table of axis names,
and a plug-in's parameters need no annotation.
"""
from __future__ import annotations

import jax
from jax.sharding import PartitionSpec

from attention_zoo.ops.context import FSDP_AXIS


def fsdp_size() -> int:
  """The size of the active mesh's `fsdp` axis (1 without a mesh or without the axis)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or FSDP_AXIS not in mesh.axis_names:
    return 1
  return mesh.shape[FSDP_AXIS]


def shard_spec(shape, fsdp: int) -> PartitionSpec:
  """Where an array of the training state is cut: along its largest axis that `fsdp` divides
  (the last of equal ones), over the fsdp axis; copied when no axis is divisible."""
  axes = [i for i, n in enumerate(shape) if fsdp > 1 and n % fsdp == 0]
  if not axes:
    return PartitionSpec()
  cut = max(axes, key=lambda i: (shape[i], i))
  return PartitionSpec(*(FSDP_AXIS if i == cut else None for i in range(len(shape))))


def gathered(tree):
  """Inside jit under a mesh with fsdp > 1: the arrays of `tree` (of the training state, cut by
  `shard_spec`) whole on every device, and their cotangents cut back (an all-gather forward, a
  reduce-scatter backward); `tree` itself otherwise. Where XLA places the gather is its
  scheduler's choice: models.py runs each block in a computation of its own to keep it there."""
  fsdp = fsdp_size()
  if fsdp == 1:
    return tree

  def whole(x):
    # The first constraint is where x already is; a constraint's transpose constrains the
    # cotangent alike, so the gradient leaves cut, not whole.
    x = jax.lax.with_sharding_constraint(x, shard_spec(x.shape, fsdp))
    return jax.lax.with_sharding_constraint(x, PartitionSpec())
  return jax.tree.map(whole, tree)
