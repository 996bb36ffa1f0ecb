"""The device mesh of a run (config.mesh) and where each array of it lives.

    mesh.data × mesh.fsdp × mesh.context = the device count (of every process; -1: the rest)

  data     the batch is split over it; everything else is copied on each of its devices
  fsdp     the batch is split over it too, and so are the parameters and the optimiser state
           (fully sharded data parallelism): each array is cut along its largest axis that
           the fsdp size divides (an array with no such axis is copied; shard_spec, in
           attention_zoo/ops/fsdp.py); the model gathers each layer's parameters just before
           that layer runs (a block's again in its backward pass), and their gradient is
           summed over the devices and cut back, so a device holds one block's parameters
           whole at a time, not the model's; the activations stay split over the batch
  context  the sequence is split over it (context parallelism): inputs [b, n] are sharded
           P(("data", "fsdp"), "context"); the attention variants and mixers whose spec has
           `supports_context_parallel` switch to their context-parallel form when the active
           mesh has this axis (attention_zoo/ops/context.py); others are refused

The rule that shards the parameters reads an array's shape alone, so the optimiser's moments
(shaped like the parameters) land where their parameter does, the library's models carry no
knowledge of the harness, and a plug-in's parameters are cut with no annotation. NNX's sharding
metadata (`nnx.with_partitioning` names per parameter axis, mapped to mesh axes by logical
axis rules) would say the same for fsdp only after every variant's and mixer's parameters were
annotated, and the moments would need the names carried over from their parameters; it earns
its place once an axis must be chosen by meaning rather than size, as a `tensor` axis over the
heads would be. A run is traced and compiled under `jax.set_mesh(layout.mesh)`, so that the
ops see the mesh.

Every check here runs before the data is read or anything compiles (trainer.check_config);
each names the field and the values that would work.
"""
from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import attention_zoo as az
from attention_zoo.ops.context import BATCH_AXES, CONTEXT_AXIS, DATA_AXIS, FSDP_AXIS
from attention_zoo.ops.fsdp import shard_spec
from experiments.common.dry_run import count
from experiments.common import tasks
from experiments.common.errors import HarnessError

AXES = (DATA_AXIS, FSDP_AXIS, CONTEXT_AXIS)   # config.mesh's fields, in the mesh's order
REST = -1   # a size that takes the devices the other axes leave


def divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def sizes(mesh_config, device_count: int) -> dict[str, int]:
  """{axis: size} of config.mesh on `device_count` devices, -1 resolved; HarnessError naming
  the field and the sizes that would work."""
  given = {axis: mesh_config[axis] for axis in AXES}
  for axis, size in given.items():
    if not isinstance(size, int) or size == 0 or size < REST:
      raise HarnessError(f"config.mesh.{axis}={size}: a mesh size is a number of devices "
                         f"dividing {device_count} ({', '.join(map(str, divisors(device_count)))}),"
                         " or -1 for the devices the other axes leave")
  rest = [axis for axis, size in given.items() if size == REST]
  if len(rest) > 1:
    raise HarnessError(f"config.mesh.{rest[0]} and config.mesh.{rest[1]} are both -1: at most "
                       "one axis takes the devices the others leave; give the other a size")
  fixed = math.prod(size for size in given.values() if size != REST)
  product = " × ".join(f"mesh.{axis}={size}" for axis, size in given.items() if size != REST)
  if rest:
    if device_count % fixed:
      raise HarnessError(f"config.mesh: {product} needs {fixed} devices, which do not divide the "
                         f"{count(device_count, 'device')} of this run, so mesh.{rest[0]}=-1 has "
                         f"no size; use sizes whose product divides {device_count}: "
                         f"{', '.join(map(str, divisors(device_count)))}")
    return {**given, rest[0]: device_count // fixed}
  if fixed != device_count:
    raise HarnessError(f"config.mesh: {product} is {fixed} devices but this run has "
                       f"{device_count}; make the product {device_count} (mesh.data=-1 takes "
                       "the devices the other axes leave)")
  return dict(given)


def check(config, device_count: int) -> dict[str, int]:
  """The checks of a resolved config's mesh against the batch, the length and the variant
  (before anything is built); returns its sizes. HarnessError naming the field."""
  mesh = sizes(config.mesh, device_count)
  batch_devices = mesh[DATA_AXIS] * mesh[FSDP_AXIS]
  split = f"mesh.data × mesh.fsdp ({mesh[DATA_AXIS]} × {mesh[FSDP_AXIS]})"
  for name, size in (("batch_size / grad_accum_steps",
                      config.batch_size // config.grad_accum_steps),
                     ("eval_batch_size", config.eval_batch_size)):
    if size % batch_devices:
      raise HarnessError(f"{name} = {size} is not divisible by the {batch_devices} devices of "
                         f"{split}, which split the batch: each device takes an equal share; "
                         f"use a multiple of {batch_devices}, or mesh sizes whose product "
                         f"divides {size}")
  context = mesh[CONTEXT_AXIS]
  if context == 1:
    return mesh
  attention = config.model.attention
  if not az.spec(attention).supports_context_parallel:
    able = az.registry.accepting("supports_context_parallel")
    raise HarnessError(
        f"mesh.context={context} splits the sequence, which {attention} cannot (its spec has no "
        f"supports_context_parallel); variants that can: {', '.join(able) or 'none registered'}"
        "; or mesh.context=1 (mesh.fsdp shards the parameters and the batch instead)")
  length = config.model.max_len
  if length % context:
    fits = [n for n in (length - length % context, length + context - length % context) if n]
    raise HarnessError(
        f"model.max_len={length} is not divisible by mesh.context={context}, which splits the "
        f"sequence into equal shards; use model.max_len={' or '.join(map(str, fits))}, or a "
        f"mesh.context dividing {length}: {', '.join(map(str, divisors(length)[:12]))}")
  if tasks.task_spec(config.task).objective != "next_token" and config.model.pooling == "cls":
    raise HarnessError(
        f"model.pooling=cls prepends a token, so the layers see max_len + 1 = {length + 1} "
        f"positions, which mesh.context={context} cannot split as it splits the "
        f"{length} of the batch; use model.pooling=mean (or padded_mean), or mesh.context=1")
  if config.length_bucket:
    raise HarnessError(f"length_bucket={config.length_bucket} cuts the sequence to lengths "
                       f"that mesh.context={context} need not divide; use 0")
  return mesh


def describe(mesh_sizes: dict[str, int]) -> str:
  """"data 2 × fsdp 1 × context 2 (4 devices)"."""
  return (" × ".join(f"{axis} {size}" for axis, size in mesh_sizes.items())
          + f" ({count(math.prod(mesh_sizes.values()), 'device')})")


class Layout:
  """A mesh over `devices` with the sizes {axis: size} (sizes()), and the shardings of a run's
  arrays on it: the training state's (`state`, `constrain`), the batch's (`batch`)."""

  def __init__(self, mesh_sizes: dict[str, int], devices=None):
    self.sizes = {axis: mesh_sizes.get(axis, 1) for axis in AXES}
    devices = list(jax.devices() if devices is None else devices)
    shape = tuple(self.sizes.values())
    if math.prod(shape) != len(devices):
      raise ValueError(f"mesh {self.sizes} needs {math.prod(shape)} devices, got {len(devices)}")
    auto = (AxisType.Auto,) * len(AXES)
    if len(devices) == jax.device_count():   # the topology-aware order of every device
      self.mesh = jax.make_mesh(shape, AXES, axis_types=auto, devices=devices)
    else:
      self.mesh = jax.sharding.Mesh(np.array(devices).reshape(shape), AXES, axis_types=auto)
    self.replicated = NamedSharding(self.mesh, PartitionSpec())

  def describe(self) -> str:
    return describe(self.sizes)

  def state(self, x) -> NamedSharding:
    """The sharding of an array of the training state (parameters, optimiser state, step)."""
    return NamedSharding(self.mesh, shard_spec(x.shape, self.sizes[FSDP_AXIS]))

  def constrain(self, tree):
    """`tree` (inside jit) placed as `state` says, leaf by leaf."""
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, self.state(x)), tree)

  def batch(self, ndim: int) -> NamedSharding:
    """The sharding of a batch array: rows over data and fsdp, positions (a second axis, as in
    inputs [b, n]) over context."""
    return NamedSharding(self.mesh, PartitionSpec(BATCH_AXES, *([CONTEXT_AXIS] if ndim > 1
                                                                else [])))

  def lines(self, params, opt_state, batch) -> list[str]:
    """The mesh and each array's sharding (abstract trees of shapes): a dry run's report."""
    def rows(prefix, tree, sharding_of):
      return [f"  {prefix}{jax.tree_util.keystr(path).replace('.value', '')} {list(x.shape)} "
              f"{x.dtype}: "
              f"{sharding_of(x).spec}" for path, x in jax.tree_util.tree_leaves_with_path(tree)]
    gathering = (["  params cut over fsdp: the model gathers a layer's whole just before it runs "
                  "it (and again in its backward pass), one layer at a time"]
                 if self.sizes[FSDP_AXIS] > 1 else [])
    return [f"mesh: {self.describe()}", *gathering, *rows("params", params, self.state),
            *rows("opt_state", opt_state, self.state),
            *rows("batch", batch, lambda x: self.batch(x.ndim))]
