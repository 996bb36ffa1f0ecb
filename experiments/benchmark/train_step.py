"""The train mode: a train step of the LRA Text model exactly as the trainer compiles and runs it
(experiments/train/steps.py make_steps: forward, backward, the config's optimiser and
learning-rate schedule, dropout on) on a batch of random tokens, every one real.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

import attention_zoo as az
from experiments.benchmark import programs
from experiments.benchmark.programs import Program, Workload
from experiments.benchmark.settings import Settings
from experiments.train import build, mesh, trainer
from experiments.train import data as data_lib
from experiments.train import steps as train_steps


def text_batch(config) -> dict[str, jax.Array]:
  """A batch as lra.iterate hands it to the trainer: random tokens (1.. vocab - 1; 0 is
  padding), every position real."""
  b, n = config.batch_size, config.model.max_len
  token_key, label_key = jax.random.split(jax.random.key(config.seed))
  return {"inputs": jax.random.randint(token_key, (b, n), 1, config.model.vocab_size, jnp.int32),
          "masks": jnp.ones((b, n), bool),
          "targets": jax.random.randint(label_key, (b,), 0, config.model.num_classes, jnp.int32),
          "weights": jnp.ones((b,), jnp.float32)}


def _with_sharding(shapes, sharding_of):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_of(x)),
                      shapes)


def per_device_bytes(tree, layout) -> int:
  """The bytes one device holds of a training-state tree placed by `layout`."""
  return sum(math.prod(layout.state(x).shard_shape(x.shape)) * x.dtype.itemsize
             for x in jax.tree.leaves(tree))


def train_workload(name: str, length: int, settings: Settings, mesh_sizes=None) -> Workload:
  """The trainer's compiled train step of the Text model, on one device, or on the first
  devices of a mesh of `mesh_sizes` ({axis: size}, experiments/train/mesh.py): compiled and
  run under it, its state and batch placed as the trainer places them."""
  config = settings.config(name, length)
  mesh_sizes = mesh_sizes or {}
  layout = mesh.Layout(mesh_sizes, jax.devices()[:math.prod(mesh_sizes.values())])
  make_model = lambda: trainer.build_model(config)[0]
  graphdef, params, rest = nnx.split(nnx.eval_shape(make_model), nnx.Param, ...)
  steps = train_steps.make_steps(config, graphdef, layout)
  state = jax.eval_shape(functools.partial(train_steps.initial_state, steps), params, rest)
  batch = jax.eval_shape(lambda: text_batch(config))

  def create():
    def initial():
      _, params, rest = nnx.split(make_model(), nnx.Param, ...)
      return train_steps.initial_state(steps, params, rest)
    with jax.set_mesh(layout.mesh):
      return steps.create(initial), data_lib.to_device(jax.device_get(text_batch(config)),
                                                       layout)

  def step(program, compiled, inputs):
    state, batch = inputs
    state, metrics = programs.call(compiled, state, batch)   # the state's buffers are donated
    return metrics, (state, batch)

  shapes = (_with_sharding(state, layout.state),
            _with_sharding(batch, lambda x: layout.batch(x.ndim)))
  return Workload(programs={"step": Program(steps.train, shapes, layout.mesh)},
                  resident_bytes=per_device_bytes((state.params, state.opt_state), layout),
                  create=create,
                  step=step, options=build.model_config(config).attention_options,
                  exact=az.spec(name).exact, nominal_flops=None)
