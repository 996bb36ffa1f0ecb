"""What the benchmark measures: its settings, the LRA Text config at a length, the status of one
measurement, and the programs it compiles and times, known from shapes before anything exists.

The model is the Text task's (configs/lra/text.py under the `fair` preset) as the trainer builds
it, with `model.max_len` set to the measured length and the benchmark's batch size, dtype, remat
policy, model sizes and attention options as config overrides: the Text model is defined in
that config file alone. The programs:

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
import enum
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import attention_zoo as az
from attention_zoo.models import DTYPES as MODEL_DTYPES
from attention_zoo.models import REMAT_POLICIES
from experiments import build, cli, measure, trainer

BASELINE = "full"                       # every speed-up is against it, measured in the same run
JAX_BASELINE = "jax_dot_product_attention"   # attention mode: jax.nn's XLA attention
MODES = ("train", "attention")
DTYPES = tuple(MODEL_DTYPES)
REMATS = tuple(REMAT_POLICIES)
TASK, PRESET = "text", "fair"


class Status(str, enum.Enum):
  """How a measurement ended. The code branches on it; the row's note says why, for people."""
  OK = "ok"
  OOM_COMPILED = "oom_compiled"            # the parameters, or the compiled program, exceed
                                           # the device's memory: not run
  OOM_RUNTIME = "oom_runtime"              # ran out of memory while running
  OVER_MEMORY_LIMIT = "over_memory_limit"  # fits the device but not the memory limit: not run
  OVER_TIME_BUDGET = "over_time_budget"    # predicted, or its first call, over the time budget
  NOT_TRIED = "not_tried"                  # a shorter length ran out of memory or time
  ERROR = "error"

  @property
  def stops_longer_lengths(self) -> bool:
    """Running out of memory or time at a length makes the longer ones hopeless. A length
    refused from its compiled memory does not: the longer ones still compile, which tells
    their memory."""
    return self in (Status.OOM_RUNTIME, Status.OVER_TIME_BUDGET)

  @property
  def label(self) -> str:
    """The cell a table shows for a measurement without a time."""
    return {Status.OK: "ok", Status.OOM_COMPILED: "OOM", Status.OOM_RUNTIME: "OOM",
            Status.ERROR: "error"}.get(self, "skipped")


# Why the longer lengths of a variant were not tried.
STOPPED = {Status.OOM_RUNTIME: "ran out of memory",
           Status.OVER_TIME_BUDGET: "exceeded the time budget"}


@dataclasses.dataclass(frozen=True)
class Settings:
  attentions: tuple[str, ...]
  lengths: tuple[int, ...]
  mode: str = "train"
  dtype: str = "float32"
  remat: str = "none"
  batch_size: int = 1
  repeats: int = 5
  warmup: int = 1
  time_budget_s: float = 60.0
  memory_limit_bytes: float | None = None    # None: default_memory_limit_bytes()
  num_layers: int | None = None              # None: the Text config's size
  emb_dim: int | None = None
  num_heads: int | None = None
  mlp_dim: int | None = None
  attention_options: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
  seed: int = 0
  matmul_size: int = 4096                    # attention mode: the matmul limit's n x n product;
                                             # 0 = not measured

  def __post_init__(self):
    for field, value, choices in (("mode", self.mode, MODES), ("dtype", self.dtype, DTYPES),
                                  ("remat", self.remat, REMATS)):
      if value not in choices:
        raise ValueError(f"{field}={value!r}; choose one of {', '.join(choices)}")
    if not self.attentions:
      raise ValueError("no attention variant to measure")
    if not self.lengths or any(int(n) != n or n < 1 for n in self.lengths):
      raise ValueError(f"lengths must be positive integers, got {self.lengths}")
    for field in ("batch_size", "repeats", "warmup", "num_layers", "emb_dim", "num_heads",
                  "mlp_dim"):
      value = getattr(self, field)
      if value is not None and value < 1:
        raise ValueError(f"{field} must be >= 1, got {value}")
    if self.time_budget_s <= 0:
      raise ValueError(f"time_budget_s must be > 0, got {self.time_budget_s}")
    if self.matmul_size < 0:
      raise ValueError(f"matmul_size must be >= 0 (0 = not measured), got {self.matmul_size}")
    for name in (*self.attentions, *self.attention_options):
      if cli.unknown_attention(name):
        raise ValueError(cli.unknown_attention(name))
      if self.mode == "attention" and az.spec(name).kind != "attention":
        raise ValueError(f"{name} is a sequence mixer (it takes x, not q, k, v): mode=attention "
                         f"measures attention variants alone; measure a mixer with mode=train")
      self.config(name, min(self.lengths))   # sizes and options checked against the config

  def names(self) -> list[str]:
    """The variants in measuring order: the baselines first."""
    baselines = [BASELINE] + ([JAX_BASELINE] if self.mode == "attention" else [])
    return baselines + [n for n in self.attentions if n not in baselines]

  def overrides(self, name: str, length: int) -> list[str]:
    """The benchmark's changes to the Text config, as `field=value`."""
    fields = {"model.max_len": length, "batch_size": self.batch_size, "model.dtype": self.dtype,
              "model.remat": self.remat, "model.num_layers": self.num_layers,
              "model.num_heads": self.num_heads, "model.mlp_dim": self.mlp_dim,
              "model.emb_dim": self.emb_dim, "model.qkv_dim": self.emb_dim}
    options = self.attention_options.get(name, {})
    if "seed" in az.spec(name).options and "seed" not in options:
      # A variant that draws its fixed random pattern when built (bigbird's random blocks, from
      # the params key) cannot draw it from shapes alone: it takes the run's seed instead. The
      # pattern differs from the trainer's draw; its cost does not.
      options = {**options, "seed": self.seed}
    options = {f"model.attention_options.{key}": value for key, value in options.items()}
    return [f"{k}={v}" for k, v in {**fields, **options}.items() if v is not None]

  def config(self, name: str, length: int):
    """The Text task's config for variant `name` at `length` with this run's overrides (the
    jax baseline takes `full`'s)."""
    variant = BASELINE if name == JAX_BASELINE else name
    try:
      return build.resolve(cli.task_config(TASK, variant, PRESET, seed=self.seed,
                                           overrides=self.overrides(variant, length)))
    except cli.HarnessError as e:
      raise ValueError(f"{name} at length {length}: {e}") from None


def parse_attention_options(items) -> dict[str, dict[str, str]]:
  """['performer:nb_features=128,redraw=false', 'local:block_size=64'] -> {name: {key: value}};
  values stay text, parsed as the config field's type when applied."""
  parsed: dict[str, dict[str, str]] = {}
  for item in items or ():
    name, sep, assignments = item.partition(":")
    if not sep or not name.strip():
      raise ValueError(f"--attention_options={item!r}: expected name:key=value,... "
                       "e.g. performer:nb_features=128,redraw=false")
    options = parsed.setdefault(name.strip(), {})
    for assignment in assignments.split(","):
      key, eq, value = assignment.partition("=")
      if not eq or not key.strip():
        raise ValueError(f"--attention_options={item!r}: {assignment!r} is not key=value")
      options[key.strip()] = value.strip()
  return parsed


def default_memory_limit_bytes() -> float:
  """The accelerator's memory, or half the free host memory on CPU (the host runs other
  things)."""
  if jax.default_backend() != "cpu":
    return measure.device_memory_bytes()
  return 0.5 * measure.free_host_bytes()


def default_batch_size() -> int:
  """1 on CPU (keeps a run short), the paper's 32 on an accelerator."""
  return 1 if jax.default_backend() == "cpu" else 32


def length_label(length: int) -> str:
  return f"{length // 1024}K" if length % 1024 == 0 else str(length)


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
                                 # FLOPs as attention_flops counts them

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


def attention_flops(batch: int, heads: int, length: int, head_dim: int, *, causal: bool,
                    backward: bool) -> float:
  """The nominal FLOPs of exact softmax attention as the FlashAttention papers count them:
  4·b·h·n²·d for the forward (two n x n x d products), halved when causal; the backward is
  2.5 x the forward (its recomputation included), so forward+backward is 3.5 x."""
  forward = 4 * batch * heads * length ** 2 * head_dim / (2 if causal else 1)
  return forward * (3.5 if backward else 1.0)
