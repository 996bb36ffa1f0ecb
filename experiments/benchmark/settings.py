"""What the train and attention modes measure: their settings (the LRA Text config at each
length), and how a measurement ended (its Status).

The model is the Text task's (configs/lra/text.py under the `fair` preset) as the trainer builds
it, with `model.max_len` set to the measured length and the benchmark's batch size, dtype, remat
policy, model sizes and attention options as config overrides: the Text model is defined in
that config file alone. What each mode compiles and times from it: train_step.py, attention.py.
"""
from __future__ import annotations

import dataclasses
import enum

import jax

import attention_zoo as az
from attention_zoo.models import DTYPES as MODEL_DTYPES
from attention_zoo.models import REMAT_POLICIES
from experiments.common import device
from experiments.common.command_line import integers
from experiments.common.errors import HarnessError
from experiments.common.task_configs import task_config
from experiments.common.variant_names import unknown_attention
from experiments.train import build

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
  pooling: str | None = None                 # None: the Text config's (cls)
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
      if unknown_attention(name):
        raise ValueError(unknown_attention(name))
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
              "model.emb_dim": self.emb_dim, "model.qkv_dim": self.emb_dim,
              "model.pooling": self.pooling}
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
      return build.check(task_config(TASK, variant, PRESET, seed=self.seed,
                                       overrides=self.overrides(variant, length)))[0]
    except HarnessError as e:
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
    return device.device_memory_bytes()
  return 0.5 * device.free_host_bytes()


def default_batch_size() -> int:
  """1 on CPU (keeps a run short), the paper's 32 on an accelerator."""
  return 1 if jax.default_backend() == "cpu" else 32


def length_label(length: int) -> str:
  return f"{length // 1024}K" if length % 1024 == 0 else str(length)


def lengths_text(lengths) -> str:
  """Lengths as the command line writes them: "1024,2048"."""
  return ",".join(map(str, lengths))


def every_encoder_variant(kind: str | None = None) -> tuple[str, ...]:
  """The registered names (of `kind`: None for every kind) that the Text model, an encoder, can
  hold: those with a bidirectional form (a causal-only variant is refused there)."""
  return tuple(n for n in az.available(kind) if az.spec(n).supports_bidirectional)


def settings_from_flags(values) -> Settings:
  """Settings of the train and attention modes from the parsed flags with the mode's defaults
  (any object with the flags as attributes)."""
  return Settings(
      attentions=tuple(values.attentions) or every_encoder_variant(
          None if values.mode == "train" else "attention"),
      lengths=tuple(integers(values.lengths, "lengths")), mode=values.mode, dtype=values.dtype,
      remat=values.remat, batch_size=values.batch_size or default_batch_size(),
      repeats=values.repeats, warmup=values.warmup, time_budget_s=values.time_budget_s,
      memory_limit_bytes=None if values.memory_limit_gb is None else values.memory_limit_gb * 1e9,
      num_layers=values.num_layers, emb_dim=values.emb_dim, num_heads=values.num_heads,
      mlp_dim=values.mlp_dim, attention_options=parse_attention_options(values.attention_options),
      seed=values.seed, matmul_size=values.matmul_size)
