"""The programs the benchmark compiles and times, known from shapes before anything exists.

train      the LRA Text model's train step exactly as the trainer compiles and runs it
           (trainer.make_steps: forward, backward, the config's optimiser and learning-rate
           schedule, dropout on) on a batch of random tokens, every one real.
attention  the attention module alone as that model holds it (its heads, head_dim and
           options), forward and forward+backward (the gradients of q, k, v and of its
           parameters), on random q, k, v; plus jax.nn.dot_product_attention(implementation=
           "xla") as a baseline from outside this code base.

Every program is compiled from ShapeDtypeStructs (nnx.eval_shape, jax.eval_shape), so its
memory and FLOPs are known before an array of it exists, and the parameters' bytes are known
before it is even compiled; `Workload.create()` makes the arrays once the measurement has
decided to run.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import attention_zoo as az
from experiments import build, trainer
from experiments.bench.settings import JAX_BASELINE, Settings
from experiments.flops import attention_flops


@dataclasses.dataclass
class Program:
  jitted: Any      # a jax.jit-wrapped function
  shapes: tuple    # its arguments as ShapeDtypeStructs

  def compile(self):
    return self.jitted.lower(*self.shapes).compile()


@dataclasses.dataclass
class Workload:
  """What one (variant, length) measures."""
  programs: dict[str, Program]   # compiled and timed in this order; the last is the main one
  resident_bytes: int            # parameters, plus the optimiser state in train mode
  create: Callable[[], Any]      # -> the inputs of the first call, as arrays
  step: Callable                 # (program name, compiled, inputs) -> (result, next inputs)
  options: dict                  # the variant's attention options as built
  exact: bool                    # computes exact attention (a FLOP rate is meaningful)
  nominal_flops: float | None    # attention mode, dense exact attention: forward+backward's
                                 # FLOPs as flops.attention_flops counts them

  @property
  def main(self) -> str:
    return list(self.programs)[-1]


def call(compiled, *args):
  """One call of a compiled program (asynchronous); the one place programs are called, so that
  tests can make a call fail."""
  return compiled(*args)


def build_workload(name: str, length: int, settings: Settings) -> Workload:
  if settings.mode == "train":
    return train_workload(name, length, settings)
  return attention_workload(name, length, settings)


def nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def text_batch(config) -> dict[str, jax.Array]:
  """A batch as lra.iterate hands it to the trainer: random tokens (1.. vocab - 1; 0 is
  padding), every position real."""
  b, n = config.batch_size, config.model.max_len
  token_key, label_key = jax.random.split(jax.random.key(config.seed))
  return {"inputs": jax.random.randint(token_key, (b, n), 1, config.model.vocab_size, jnp.int32),
          "masks": jnp.ones((b, n), bool),
          "targets": jax.random.randint(label_key, (b,), 0, config.model.num_classes, jnp.int32),
          "weights": jnp.ones((b,), jnp.float32)}


def _with_sharding(shapes, sharding):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), shapes)


def train_workload(name: str, length: int, settings: Settings) -> Workload:
  """The trainer's compiled train step of the Text model, on one device."""
  config = settings.config(name, length)
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  replicated = NamedSharding(mesh, PartitionSpec())
  batch_sharding = NamedSharding(mesh, PartitionSpec("data"))
  make_model = lambda: trainer.build_model(config)[0]
  graphdef, params, rest = nnx.split(nnx.eval_shape(make_model), nnx.Param, ...)
  steps = trainer.make_steps(config, graphdef, replicated)
  state = jax.eval_shape(functools.partial(trainer.initial_state, steps), params, rest)
  batch = jax.eval_shape(lambda: text_batch(config))

  def create():
    _, params, rest = nnx.split(make_model(), nnx.Param, ...)
    state = steps.replicate(trainer.initial_state(steps, params, rest))
    return state, jax.device_put(text_batch(config), batch_sharding)

  def step(program, compiled, inputs):
    state, batch = inputs
    state, metrics = call(compiled, state, batch)   # the state's buffers are donated
    return metrics, (state, batch)

  shapes = (_with_sharding(state, replicated), _with_sharding(batch, batch_sharding))
  return Workload(programs={"step": Program(steps.train, shapes)},
                  resident_bytes=nbytes((state.params, state.opt_state)), create=create,
                  step=step, options=build.model_config(config).attention_options,
                  exact=az.spec(name).exact, nominal_flops=None)


class JaxDotProductAttention(nnx.Module):
  """jax.nn.dot_product_attention with XLA's implementation, called as a variant is."""

  def __call__(self, q, k, v, *, q_mask, kv_mask):
    del q_mask   # a padded query's output is unused; masking keys is what the variants do
    return jax.nn.dot_product_attention(q, k, v, mask=kv_mask[:, None, None, :],
                                        implementation="xla")


def attention_workload(name: str, length: int, settings: Settings) -> Workload:
  """The attention module of the Text model alone: forward, and forward+backward."""
  config = settings.config(name, length)
  model = build.model_config(config)
  heads = model.num_heads
  head_dim = (model.qkv_dim or model.emb_dim) // heads
  kv_heads = model.num_kv_heads or heads
  spec = az.spec(model.attention)
  baseline = name == JAX_BASELINE

  def make_attention():
    if baseline:
      return JaxDotProductAttention()
    return az.create(name, num_heads=heads, head_dim=head_dim, num_kv_heads=kv_heads,
                     max_len=length, rngs=nnx.Rngs(config.seed), **model.attention_options)

  graphdef, params, rest = nnx.split(nnx.eval_shape(make_attention), nnx.Param, ...)
  b, dtype = config.batch_size, jnp.dtype(config.model.dtype)
  q_shape, kv_shape = (b, length, heads, head_dim), (b, length, kv_heads, head_dim)

  def fwd(params, rest, q, k, v, mask):
    attention = nnx.merge(graphdef, params, rest)
    return attention(q, k, v, q_mask=mask, kv_mask=mask), nnx.split(attention, nnx.Param, ...)[2]

  def fwd_bwd(params, rest, q, k, v, mask):
    def loss_of(params, q, k, v):
      out, rest_after = fwd(params, rest, q, k, v, mask)
      return jnp.sum(out.astype(jnp.float32)), rest_after
    (loss, rest_after), grads = jax.value_and_grad(loss_of, argnums=(0, 1, 2, 3), has_aux=True)(
        params, q, k, v)
    return (loss, grads), rest_after

  def create():
    _, params, rest = nnx.split(make_attention(), nnx.Param, ...)
    keys = jax.random.split(jax.random.key(config.seed), 3)
    q = jax.random.normal(keys[0], q_shape, dtype)
    k, v = (jax.random.normal(key, kv_shape, dtype) for key in keys[1:])
    return params, rest, q, k, v, jnp.ones((b, length), bool)

  def step(program, compiled, inputs):
    params, rest, *data = inputs
    result, rest = call(compiled, params, rest, *data)
    return result, (params, rest, *data)

  shapes = (params, rest, jax.ShapeDtypeStruct(q_shape, dtype),
            *(jax.ShapeDtypeStruct(kv_shape, dtype),) * 2, jax.ShapeDtypeStruct((b, length), bool))
  dense = baseline or (spec.exact and spec.complexity.startswith("O(n²)"))
  return Workload(
      programs={"fwd": Program(jax.jit(fwd), shapes), "fwd_bwd": Program(jax.jit(fwd_bwd), shapes)},
      resident_bytes=nbytes(params), create=create, step=step,
      options={} if baseline else dict(model.attention_options), exact=baseline or spec.exact,
      nominal_flops=attention_flops(b, heads, length, head_dim, causal=False, backward=True)
      if dense else None)
