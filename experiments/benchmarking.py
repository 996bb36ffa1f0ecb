"""Cost of every attention variant as the sequence grows: time, compiled memory, FLOPs.

The measuring behind `python -m experiments.benchmark` (LRA Table 2, extended):

- `train` mode: the LRA Text model (a `Classifier`) and a train step (forward+backward, then
  the Adam update); `attention` mode: the attention module alone, forward and forward+backward.
- Every program is compiled ahead of time, so memory (`memory_analysis()`) and FLOPs
  (`cost_analysis()`) are known before it runs; a program whose compiled memory exceeds the
  memory limit is not run, and a model whose parameters (with Adam's moments) exceed it is not
  even created. Times are medians of `repeats` calls after `warmup` calls; the first
  call estimates the cost, and a measurement that would exceed the time budget is skipped
  together with the longer lengths of that variant.
- `full` is always measured in the same process: every speed-up is relative to it.
- A length that runs out of memory, or whose compiled memory exceeds the device's, is recorded
  as `OOM`; one over the memory limit or the time budget as `skipped`: neither stops the run.
"""
from __future__ import annotations

import csv
import dataclasses
import datetime
import gc
import json
import logging
import math
import os
import re
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import attention_zoo as az
from attention_zoo.models import Classifier, TransformerConfig
from configs.lra import common as lra_configs
from configs.lra.paper_tables import TABLE2 as PAPER_TABLE2, TABLE2_LENGTHS as PAPER_TABLE2_LENGTHS
from configs.lra.paper_tables import TABLE2_SPEEDUPS as PAPER_TABLE2_SPEEDUPS

BASELINE = "full"
MODES = ("train", "attention")
DTYPES = ("float32", "bfloat16")
TEXT_VOCAB = 257          # LRA Text: bytes + 1, 0 = padding
TEXT_CLASSES = 2

CSV_COLUMNS = (
    "attention", "length", "status", "note", "step_ms", "steps_per_s", "speedup_vs_full",
    "fwd_ms", "fwd_speedup_vs_full", "first_call_ms",
    "temp_bytes_fwd", "temp_bytes_fwd_bwd", "compiled_peak_bytes", "flops", "flops_fwd",
    "flops_lower_bound",
    "device_peak_bytes", "device_peak_set_here", "time_exponent", "memory_exponent", "compile_s",
    "mode", "dtype", "batch_size", "options", "device", "backend", "jax_version", "xla_flags", "date")


NOT_RUN = " (not run)"   # ends the note of a measurement skipped before its first call


class OverBudget(Exception):
  """A measurement that would take longer than the time budget."""
  PREFIXES = ("first call", "predicted")   # how its messages start


@dataclasses.dataclass(frozen=True)
class Settings:
  attentions: tuple[str, ...]
  lengths: tuple[int, ...]
  mode: str = "train"
  dtype: str = "float32"
  batch_size: int = 1
  repeats: int = 5
  warmup: int = 1
  time_budget_s: float = 60.0
  memory_limit_bytes: float | None = None    # None: default_memory_limit_bytes()
  num_layers: int = 4                        # the LRA Text model
  emb_dim: int = 256
  num_heads: int = 4
  mlp_dim: int = 1024
  attention_options: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
  seed: int = 0

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"mode={self.mode!r}; choose one of {', '.join(MODES)}")
    if self.dtype not in DTYPES:
      raise ValueError(f"dtype={self.dtype!r}; choose one of {', '.join(DTYPES)}")
    if not self.attentions:
      raise ValueError("no attention variant to measure")
    for name in (*self.attentions, *self.attention_options):
      az.registry.get(name)       # unknown name -> ValueError listing the registered ones
    if not self.lengths or any(int(n) != n or n < 1 for n in self.lengths):
      raise ValueError(f"lengths must be positive integers, got {self.lengths}")
    for field in ("batch_size", "repeats", "num_layers", "emb_dim", "num_heads", "mlp_dim"):
      if getattr(self, field) < 1:
        raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
    if self.warmup < 1:
      raise ValueError(f"warmup must be >= 1 (the first call estimates the cost), got {self.warmup}")
    if self.emb_dim % self.num_heads:
      raise ValueError(f"emb_dim ({self.emb_dim}) must be divisible by num_heads ({self.num_heads})")
    if self.time_budget_s <= 0:
      raise ValueError(f"time_budget_s must be > 0, got {self.time_budget_s}")
    for name, options in self.attention_options.items():
      accepted = az.spec(name).options
      unknown = sorted(set(options) - set(accepted))
      if unknown:
        raise ValueError(f"--attention_options for {name}: unknown option(s) {', '.join(unknown)}; accepted: "
                         + ", ".join(sorted(accepted)))

  def options_for(self, name: str) -> dict[str, Any]:
    """The variant's Text options under the `fair` preset, overridden by the user's."""
    settings = lra_configs.attention_settings("text", name, "fair")
    options = {k.split(".", 1)[1]: v for k, v in settings.items() if k.startswith("attention.")}
    return {**options, **self.attention_options.get(name, {})}


# -- parsing command-line values -------------------------------------------------------------

def parse_option_value(text: str):
  """'256' -> 256, '0.5' -> 0.5, 'true' -> True, 'none' -> None, anything else stays a string."""
  lowered = text.strip().lower()
  if lowered in ("true", "false"):
    return lowered == "true"
  if lowered == "none":
    return None
  for cast in (int, float):
    try:
      return cast(text)
    except ValueError:
      pass
  return text.strip()


def parse_attention_options(items) -> dict[str, dict[str, Any]]:
  """['performer:nb_features=128,redraw=false', 'local:block_size=64'] -> {name: {key: value}}."""
  parsed: dict[str, dict[str, Any]] = {}
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
      options[key.strip()] = parse_option_value(value)
  return parsed


def device_memory_bytes() -> float:
  """What the device holds: an accelerator's memory, or the host's physical memory on CPU."""
  stats = _memory_stats(jax.devices()[0])
  if stats and stats.get("bytes_limit"):
    return float(stats["bytes_limit"])
  try:
    return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
  except (ValueError, OSError, AttributeError):
    return math.inf


def default_memory_limit_bytes() -> float:
  """The accelerator's memory, or half the free host memory on CPU (the host runs other things)."""
  if jax.default_backend() != "cpu":
    return device_memory_bytes()
  try:
    return 0.5 * os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError, AttributeError):
    return device_memory_bytes()


def default_batch_size() -> int:
  """1 on CPU (keeps a run short), the paper's 32 on an accelerator."""
  return 1 if jax.default_backend() == "cpu" else 32


def length_label(length: int) -> str:
  return f"{length // 1024}K" if length % 1024 == 0 else str(length)


# -- the programs ------------------------------------------------------------------------------

@dataclasses.dataclass
class Program:
  """A function to compile ahead of time, with example arguments."""
  fn: Callable
  args: tuple
  donate: tuple[int, ...] = ()


@dataclasses.dataclass
class Timed:
  """One timed call: `run(compiled, state) -> (result, next state)`, waited for on its result."""
  programs: tuple[str, ...]   # the compiled programs it calls: their FLOPs add up
  run: Callable
  state: Any


def build(name: str, length: int, settings: Settings) -> tuple[dict[str, Program], dict[str, Timed]]:
  """Programs to compile ('fwd', 'fwd_bwd', ...) and what to time; the last timed is the main one."""
  if settings.mode == "train":
    return _train_workload(name, length, settings)
  return _attention_workload(name, length, settings)


def call(compiled, args):
  """One call of a compiled program (asynchronous). Separate so that tests can make it fail."""
  return compiled(*args)


def model_config(name: str, length: int, settings: Settings) -> TransformerConfig:
  return TransformerConfig(
      vocab_size=TEXT_VOCAB, max_len=length, num_layers=settings.num_layers, emb_dim=settings.emb_dim,
      num_heads=settings.num_heads, mlp_dim=settings.mlp_dim, num_classes=TEXT_CLASSES,
      attention=name, attention_options=settings.options_for(name), dtype=settings.dtype)


def make_module(name: str, length: int, settings: Settings) -> nnx.Module:
  """The LRA Text classifier (train mode) or the attention module alone (attention mode)."""
  if settings.mode == "train":
    return Classifier(model_config(name, length, settings), rngs=nnx.Rngs(settings.seed))
  h = settings.num_heads
  return az.create(name, num_heads=h, head_dim=settings.emb_dim // h, max_len=length,
                   rngs=nnx.Rngs(settings.seed), **settings.options_for(name))


def resident_bytes(name: str, length: int, settings: Settings) -> int:
  """Bytes held between steps: the parameters, plus Adam's two moments in train mode. Computed
  from shapes alone (nnx.eval_shape), so a model too large to create is never created: the
  synthesizer's per-head max_len x max_len matrices reach 17 GB at 16K."""
  params = nnx.state(nnx.eval_shape(lambda: make_module(name, length, settings)), nnx.Param)
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  return param_bytes * (3 if settings.mode == "train" else 1)


def _train_workload(name, length, settings):
  """The train step = compiled forward+backward, then the compiled Adam update.

  Two executables rather than one fused step, so that forward+backward is compiled once for
  both its memory figure and the timing (compiling dominates a CPU run); the update is a
  per-parameter elementwise pass, a small cost beside the model's.
  """
  model = make_module(name, length, settings)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)   # rest: RNG counters, ...
  tx = optax.adam(1e-4, b1=0.9, b2=0.98, eps=1e-9)            # LRA's Adam settings
  token_key, label_key = jax.random.split(jax.random.key(settings.seed))
  b = settings.batch_size
  data = (jax.random.randint(token_key, (b, length), 1, TEXT_VOCAB),   # tokens
          jnp.ones((b, length), bool),                                 # mask: every token real
          jax.random.randint(label_key, (b,), 0, TEXT_CLASSES))        # labels

  def loss_of(model, tokens, mask, labels):
    logits = model(tokens, mask, deterministic=False)         # dropout on, as in training
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  def fwd(params, rest, *data):
    model = nnx.merge(graphdef, params, rest)
    return loss_of(model, *data), _rest_of(model)

  def fwd_bwd(params, rest, *data):
    model = nnx.merge(graphdef, params, rest)
    loss, grads = nnx.value_and_grad(loss_of)(model, *data)
    return loss, grads, _rest_of(model)

  def update(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def train_step(compiled, state):
    params, opt_state, rest = state
    loss, grads, rest = call(compiled["fwd_bwd"], (params, rest, *data))
    params, opt_state = call(compiled["update"], (params, opt_state, grads))
    return loss, (params, opt_state, rest)

  opt_state = tx.init(params)
  programs = {"fwd": Program(fwd, (params, rest, *data)),
              "fwd_bwd": Program(fwd_bwd, (params, rest, *data)),
              "update": Program(update, (params, opt_state, params), donate=(0, 1))}  # grads shaped as params
  return programs, {"step": Timed(("fwd_bwd", "update"), train_step, (params, opt_state, rest))}


def _attention_workload(name, length, settings):
  h = settings.num_heads
  d = settings.emb_dim // h
  attention = make_module(name, length, settings)
  graphdef, params, rest = nnx.split(attention, nnx.Param, ...)
  dtype = jnp.dtype(settings.dtype)
  keys = jax.random.split(jax.random.key(settings.seed), 3)
  q, k, v = (jax.random.normal(key, (settings.batch_size, length, h, d), dtype) for key in keys)
  mask = jnp.ones((settings.batch_size, length), bool)

  def attend(attention, q, k, v, mask):
    return attention(q, k, v, q_mask=mask, kv_mask=mask)

  def fwd(params, rest, q, k, v, mask):
    attention = nnx.merge(graphdef, params, rest)
    return attend(attention, q, k, v, mask), _rest_of(attention)

  def fwd_bwd(params, rest, q, k, v, mask):
    attention = nnx.merge(graphdef, params, rest)
    loss_of = lambda *args: jnp.sum(attend(*args).astype(jnp.float32))
    loss, grads = nnx.value_and_grad(loss_of, argnums=(0, 1, 2, 3))(attention, q, k, v, mask)  # params, q, k, v
    return loss, grads, _rest_of(attention)

  def timed(program):
    def run(compiled, rest):
      *result, rest = call(compiled[program], (params, rest, q, k, v, mask))
      return result, rest
    return Timed((program,), run, rest)

  args = (params, rest, q, k, v, mask)
  return ({"fwd": Program(fwd, args), "fwd_bwd": Program(fwd_bwd, args)},
          {"fwd": timed("fwd"), "fwd_bwd": timed("fwd_bwd")})


def _rest_of(module):
  """The module's non-parameter state (RNG counters, fixed random features...) after a call."""
  return nnx.split(module, nnx.Param, ...)[2]


# -- measuring one (variant, length) ------------------------------------------------------------

def is_out_of_memory(error: BaseException) -> bool:
  text = str(error)
  return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def _memory_stats(device) -> dict | None:
  try:
    return device.memory_stats()
  except Exception:   # backends without allocator statistics (some CPU builds) raise or return None
    return None


def _flops(compiled) -> float | None:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):   # older jax returns one dict per computation
    cost = cost[0] if cost else None
  return None if not cost or "flops" not in cost else float(cost["flops"])


def _has_loop(compiled) -> bool:
  """Whether a while loop runs matrix products: XLA's cost analysis counts a loop body once, so
  the FLOPs of such a program (a scan over chunks) are a lower bound. Loops without products
  (RNG key derivation) change nothing."""
  try:
    hlo = compiled.as_text()
  except Exception:   # no HLO text on this backend: say nothing
    return False
  computations, current = {}, None
  for line in hlo.splitlines():
    if line.endswith("{") and not line.startswith(" "):   # "[ENTRY ]%name (args) -> type {"
      current = line.removeprefix("ENTRY ").split()[0].lstrip("%")
      computations[current] = []
    elif current is not None and line.startswith(" "):
      computations[current].append(line)
  calls = {name: {ref for line in lines for ref in re.findall(r"%([\w.\-]+)", line) if ref in computations}
           for name, lines in computations.items()}
  has_product = {name: any(re.search(r"\b(dot|convolution)\(", line) for line in lines)
                 for name, lines in computations.items()}
  todo = [body for lines in computations.values() for line in lines if " while(" in line
          for body in re.findall(r"body=%([\w.\-]+)", line)]
  seen = set()
  while todo:
    name = todo.pop()
    if name in seen:
      continue
    seen.add(name)
    if has_product.get(name):
      return True
    todo.extend(calls.get(name, ()))
  return False


def compile_program(program: Program):
  """-> (compiled, memory facts): temp and total (arguments + outputs - aliased + temp) bytes, FLOPs."""
  compiled = jax.jit(program.fn, donate_argnums=program.donate).lower(*program.args).compile()
  memory = compiled.memory_analysis()
  facts = {"flops": _flops(compiled), "temp_bytes": None, "total_bytes": None,
           "flops_in_loops": _has_loop(compiled)}
  if memory is not None:
    facts["temp_bytes"] = int(memory.temp_size_in_bytes)
    facts["total_bytes"] = int(memory.argument_size_in_bytes + memory.output_size_in_bytes
                               - memory.alias_size_in_bytes + memory.temp_size_in_bytes)
  return compiled, facts


def time_program(compiled: dict, timed: Timed, *, warmup: int, repeats: int, budget_s: float,
                 predicted_call_s: float | None = None):
  """-> (median ms, first-call ms). Raises OverBudget before running or after the first call."""
  calls = warmup + repeats
  if predicted_call_s is not None and predicted_call_s * calls > budget_s:
    raise OverBudget(f"predicted {calls} x {predicted_call_s:.3g} s > time budget {budget_s:g} s" + NOT_RUN)
  state, times = timed.state, []
  for i in range(calls):
    start = time.perf_counter()
    result, state = timed.run(compiled, state)
    jax.block_until_ready((result, state))
    times.append(time.perf_counter() - start)
    del result
    if i == 0 and times[0] * calls > budget_s:
      raise OverBudget(f"first call {times[0]:.3g} s x {calls} calls > time budget {budget_s:g} s")
  return 1e3 * statistics.median(times[warmup:]), 1e3 * times[0]


def measure(name: str, length: int, settings: Settings, *, memory_limit: float,
            device_memory: float = math.inf, previous: dict | None = None) -> tuple[dict, dict]:
  """One (variant, length) -> (row, timings). Row status: ok | OOM | skipped | error.

  timings {timed: (ms, flops, flops_in_loops)} of what ran. `previous` is the timings of this
  variant's last length that ran, with its length: scaled by the FLOPs ratio, it predicts this
  length's cost, so a hopeless measurement is skipped before its first call.
  """
  row: dict[str, Any] = {"attention": name, "length": length, "status": "ok", "note": "",
                         "options": json.dumps(settings.options_for(name), sort_keys=True)}
  timings: dict[str, tuple] = {}
  compiled: dict[str, Any] = {}
  try:
    resident = resident_bytes(name, length, settings)
    if resident > min(memory_limit, device_memory):
      oom = resident > device_memory
      limit = f"the device's {device_memory / 1e9:.3g}" if oom else f"memory limit {memory_limit / 1e9:.3g}"
      row.update(status="OOM" if oom else "skipped",
                 note=f"parameters{' and optimizer state' if settings.mode == 'train' else ''} "
                      f"{resident / 1e9:.3g} GB > {limit} GB" + NOT_RUN)
      return row, timings
    start = time.perf_counter()
    programs, timed = build(name, length, settings)
    facts = {}
    for key, program in programs.items():
      compiled[key], facts[key] = compile_program(program)
    row["compile_s"] = round(time.perf_counter() - start, 2)
    cost = {key: _combined([facts[p] for p in t.programs]) for key, t in timed.items()}
    main = list(timed)[-1]                             # the train step, or forward+backward
    row.update(temp_bytes_fwd=facts["fwd"]["temp_bytes"], temp_bytes_fwd_bwd=facts["fwd_bwd"]["temp_bytes"],
               compiled_peak_bytes=cost[main]["total_bytes"], flops=cost[main]["flops"],
               flops_fwd=facts["fwd"]["flops"], flops_lower_bound=cost[main]["flops_in_loops"])
    needed = max(c["total_bytes"] or 0 for c in cost.values())
    if needed > device_memory:
      row.update(status="OOM", note=f"compiled memory {needed / 1e9:.3g} GB > the device's "
                 f"{device_memory / 1e9:.3g} GB" + NOT_RUN)
      return row, timings
    if needed > memory_limit:
      row.update(status="skipped", note=f"compiled memory {needed / 1e9:.3g} GB > memory limit "
                 f"{memory_limit / 1e9:.3g} GB" + NOT_RUN)
      return row, timings
    for key, t in timed.items():
      ms, first_ms = time_program(compiled, t, warmup=settings.warmup, repeats=settings.repeats,
                                  budget_s=settings.time_budget_s,
                                  predicted_call_s=_predict_call_s(previous, key, cost[key], length))
      timings[key] = (ms, cost[key]["flops"], cost[key]["flops_in_loops"])
      if key == main:
        row.update(step_ms=ms, steps_per_s=1e3 / ms, first_call_ms=first_ms)
    if settings.mode == "attention":
      row["fwd_ms"] = timings["fwd"][0]
    stats = _memory_stats(jax.devices()[0])
    if stats and "peak_bytes_in_use" in stats:
      row["device_peak_bytes"] = int(stats["peak_bytes_in_use"])
  except OverBudget as error:
    row.update(status="skipped", note=str(error))
  except Exception as error:  # XLA reports running out of memory as a runtime error
    if is_out_of_memory(error):
      row.update(status="OOM", note=_first_line(error))
    else:
      logging.exception("%s at length %d failed", name, length)
      row.update(status="error", note=f"{type(error).__name__}: {_first_line(error)}")
  finally:
    compiled.clear()
    gc.collect()
  return row, timings


def _combined(facts: list[dict]) -> dict:
  """Programs run one after the other: FLOPs add up, the memory peak is the largest one's."""
  flops = [f["flops"] for f in facts]
  totals = [f["total_bytes"] for f in facts]
  return {"flops": None if None in flops else sum(flops),
          "total_bytes": None if None in totals else max(totals),
          "flops_in_loops": any(f["flops_in_loops"] for f in facts)}


def _predict_call_s(previous, key, cost, length):
  """Seconds per call: the previous length's time scaled by the FLOPs ratio, or by the length
  ratio where FLOPs are unknown or undercounted (loops)."""
  if not previous or key not in previous["timings"]:
    return None
  prior_ms, prior_flops, prior_loops = previous["timings"][key]
  ratio = length / previous["length"]
  if cost["flops"] and prior_flops:
    flops_ratio = cost["flops"] / prior_flops
    ratio = max(ratio, flops_ratio) if cost["flops_in_loops"] or prior_loops else flops_ratio
  return prior_ms / 1e3 * ratio


def _first_line(error) -> str:
  text = str(error).strip()
  return text.splitlines()[0][:300] if text else type(error).__name__


# -- the whole run --------------------------------------------------------------------------------

def environment() -> dict[str, str]:
  device = jax.devices()[0]
  kind = getattr(device, "device_kind", "") or device.platform
  cores = os.cpu_count()
  described = f"{kind} ({device.platform}, {jax.device_count()} device(s), {cores} host CPU cores)"
  return {"device": described, "backend": jax.default_backend(), "jax_version": jax.__version__,
          "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


def run(settings: Settings, *, progress: Callable | None = None,
        on_row: Callable[[list[dict]], None] | None = None) -> list[dict]:
  """Measures every (variant, length), `full` first; returns the rows with speed-ups and exponents.

  `on_row(rows so far)` after each measurement (the command rewrites its outputs with it, so a
  run that is killed keeps what it measured)."""
  names = [BASELINE] + [n for n in settings.attentions if n != BASELINE]
  memory_limit = settings.memory_limit_bytes or default_memory_limit_bytes()
  device_memory = device_memory_bytes()
  env = environment()
  logging.info("benchmark: %s mode, %s, batch %d on %s, jax %s; device memory %.3g GB, memory limit "
               "%.3g GB, time budget %g s", settings.mode, settings.dtype, settings.batch_size, env["device"],
               env["jax_version"], device_memory / 1e9, memory_limit / 1e9, settings.time_budget_s)
  pairs = [(name, length) for name in names for length in sorted(settings.lengths)]
  bar = progress(total=len(pairs)) if progress else None
  rows, peak_so_far = [], 0
  for name in names:
    previous, stop_reason = None, None
    for length in sorted(settings.lengths):
      if bar is not None:
        bar.set_description(f"{name} @ {length_label(length)}")
      if stop_reason:
        row = {"attention": name, "length": length, "status": "skipped", "note": stop_reason,
               "options": json.dumps(settings.options_for(name), sort_keys=True)}
      else:
        row, timings = measure(name, length, settings, memory_limit=memory_limit,
                               device_memory=device_memory, previous=previous)
        if row["status"] == "ok":
          previous = {"length": length, "timings": timings}
        stop_reason = _stop_reason(row)
      peak = row.get("device_peak_bytes")
      row["device_peak_set_here"] = None if peak is None else peak > peak_so_far
      peak_so_far = max(peak_so_far, peak or 0)
      logging.info("%-20s %6d  %-7s %s", name, length, row["status"], _summary(row))
      rows.append(row)
      if on_row is not None:
        on_row(_finished(rows, settings, env))
      if bar is not None:
        bar.update()
  if bar is not None:
    bar.close()
  return _finished(rows, settings, env)


def _finished(rows: list[dict], settings: Settings, env: dict) -> list[dict]:
  """Copies of the rows with the run's facts, speed-ups and exponents (over the rows so far)."""
  rows = [{**row, "mode": settings.mode, "dtype": settings.dtype, "batch_size": settings.batch_size, **env}
          for row in rows]
  add_speedups(rows)
  add_exponents(rows)
  return rows


def _stop_reason(row) -> str | None:
  """Why the longer lengths of this variant are not tried: this one ran out of memory or time.
  (Over the memory limit before running is no reason: the longer lengths still compile, which
  gives their memory.)"""
  if row["status"] == "OOM" and not row["note"].endswith(NOT_RUN):
    return f"length {row['length']} ran out of memory"
  if row["status"] == "skipped" and row["note"].startswith(OverBudget.PREFIXES):
    return f"length {row['length']} exceeded the time budget"
  return None


def _summary(row) -> str:
  parts = []
  if row.get("step_ms") is not None:
    parts.append(f"{row['step_ms']:.1f} ms/step")
  if row.get("temp_bytes_fwd_bwd") is not None:
    parts.append(f"temp fwd+bwd {row['temp_bytes_fwd_bwd'] / 1e6:.1f} MB")
  if row.get("note"):
    parts.append(row["note"])
  return ", ".join(parts)


def add_speedups(rows: list[dict]) -> None:
  """speedup_vs_full = full's time / the variant's time at the same length (same process)."""
  for key, out in (("step_ms", "speedup_vs_full"), ("fwd_ms", "fwd_speedup_vs_full")):
    baseline = {r["length"]: r.get(key) for r in rows if r["attention"] == BASELINE}
    for row in rows:
      mine, base = row.get(key), baseline.get(row["length"])
      row[out] = base / mine if mine and base else None


def fit_exponent(lengths, values) -> float | None:
  """Slope of log(value) against log(length), least squares; None with fewer than two lengths."""
  points = [(n, v) for n, v in zip(lengths, values) if v is not None and v > 0]
  if len({n for n, _ in points}) < 2:
    return None
  x = np.log([n for n, _ in points])
  y = np.log([v for _, v in points])
  return float(np.polyfit(x, y, 1)[0])


def add_exponents(rows: list[dict]) -> None:
  """time_exponent over the lengths that ran; memory_exponent over those that compiled."""
  for name in dict.fromkeys(r["attention"] for r in rows):
    mine = [r for r in rows if r["attention"] == name]
    ran = [r for r in mine if r["status"] == "ok"]
    time_exp = fit_exponent([r["length"] for r in ran], [r.get("step_ms") for r in ran])
    mem_exp = fit_exponent([r["length"] for r in mine], [r.get("temp_bytes_fwd_bwd") for r in mine])
    for row in mine:
      row["time_exponent"], row["memory_exponent"] = time_exp, mem_exp


# -- outputs ------------------------------------------------------------------------------------

def output_paths(out_dir: str, mode: str) -> dict[str, str]:
  stem = os.path.join(out_dir, f"benchmark_{mode}")
  return {"csv": stem + ".csv", "markdown": stem + ".md", "json": stem + ".json",
          "time_plot": stem + "_time.png", "memory_plot": stem + "_memory.png"}


def write_outputs(rows: list[dict], settings: Settings, out_dir: str, *, command: str = "",
                  plots: bool = True) -> dict[str, str]:
  """CSV, markdown, JSON and (with `plots`) the two PNGs; the paths by kind."""
  os.makedirs(out_dir, exist_ok=True)
  paths = output_paths(out_dir, settings.mode)
  write_csv(rows, paths["csv"])
  with open(paths["markdown"], "w", encoding="utf-8") as f:
    f.write(markdown(rows, settings, command=command))
  with open(paths["json"], "w", encoding="utf-8") as f:
    json.dump({"settings": {**dataclasses.asdict(settings), "command": command},
               "environment": environment_of(rows), "rows": rows}, f, indent=1, default=str)
  if not plots:
    return {kind: path for kind, path in paths.items() if not kind.endswith("_plot")}
  plot(rows, "step_ms", "time per step (ms)", paths["time_plot"], settings)
  plot(rows, "temp_bytes_fwd_bwd", "compiled temp memory, forward+backward (bytes)", paths["memory_plot"],
       settings)
  return paths


def environment_of(rows) -> dict[str, str]:
  return {key: rows[0][key] for key in ("device", "backend", "jax_version", "xla_flags", "date")} if rows else environment()


def write_csv(rows: list[dict], path: str) -> None:
  with open(path, "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    for row in rows:
      writer.writerow({k: _csv_value(row.get(k)) for k in CSV_COLUMNS})


def _csv_value(value):
  if value is None:
    return ""
  if isinstance(value, float):
    return f"{value:.6g}"
  return value


def _gb(value) -> str:
  return "" if value is None else f"{value / 1e9:.3g}"


def markdown(rows: list[dict], settings: Settings, *, command: str = "") -> str:
  """LRA Table 2 layout: steps/s (speed-up vs full) per length, then memory per length."""
  env = environment_of(rows)
  lengths = sorted({r["length"] for r in rows})
  names = list(dict.fromkeys(r["attention"] for r in rows))
  by_key = {(r["attention"], r["length"]): r for r in rows}
  what = ("train step (forward+backward, then the Adam update) of the LRA Text model "
          f"({settings.num_layers} layers, emb {settings.emb_dim}, {settings.num_heads} heads, "
          f"MLP {settings.mlp_dim}, vocab {TEXT_VOCAB})" if settings.mode == "train" else
          f"the attention module alone, forward+backward ({settings.num_heads} heads, "
          f"head_dim {settings.emb_dim // settings.num_heads})")
  lines = [
      f"# Efficiency benchmark ({settings.mode} mode)", "",
      f"- Device: {env['device']}; jax {env['jax_version']}; {env['date']}"
      + (f"; XLA_FLAGS=`{env['xla_flags']}`" if env["xla_flags"] else ""),
      f"- Measured: {what}; batch {settings.batch_size}, {settings.dtype}.",
      f"- Steps/s: median of {settings.repeats} timed calls after {settings.warmup} warm-up call(s); "
      f"(Nx) = speed-up vs `{BASELINE}` measured in the same process.",
      "- Memory: compiled temporary memory of forward+backward, `memory_analysis().temp_size_in_bytes`, "
      "in GB (1e9 bytes); it excludes parameters and inputs.",
      "- Exponents: least-squares slope of log(time) and log(memory) against log(length) "
      "(time over the lengths that ran, memory over those that compiled).",
      "- FLOPs (CSV) come from `cost_analysis()`, which counts a loop body once: where `flops_lower_bound` "
      "is true (chunked/scanned variants) they are a lower bound.",
  ]
  if command:
    lines.append(f"- Command: `{command}`")
  header = (["Model"] + [length_label(n) for n in lengths]
            + [("Mem " if i == 0 else "") + length_label(n) for i, n in enumerate(lengths)]
            + ["time exponent", "memory exponent"])
  lines += ["", "## Ours", "", _row(header), _row(["---"] * len(header))]
  for name in names:
    cells = [name]
    for n in lengths:
      cells.append(_speed_cell(by_key.get((name, n)), name, by_key.get((BASELINE, n))))
    for n in lengths:
      row = by_key.get((name, n), {})
      mem = _gb(row.get("temp_bytes_fwd_bwd"))
      cells.append(mem if mem and row.get("status") == "ok" else
                   f"{mem} ({row.get('status')})" if mem else row.get("status", ""))
    first = by_key[(name, lengths[0])]
    cells += [_fmt(first.get("time_exponent")), _fmt(first.get("memory_exponent"))]
    lines.append(_row(cells))

  peaks = [r for r in rows if r.get("device_peak_set_here")]
  if peaks:
    lines += ["", "Device peak memory (`memory_stats()['peak_bytes_in_use']`, GB) where a measurement raised "
              "the process's high-water mark (a smaller run's own peak cannot be read back):", ""]
    lines += [f"- {r['attention']} @ {length_label(r['length'])}: {_gb(r['device_peak_bytes'])}" for r in peaks]

  lines += ["", "## The paper's Table 2 (published figures, quoted, not measured here)", "",
            "Tay et al. 2021 (arXiv:2011.04006), LRA Text, batch 32, TPU v3: steps/s (speed-up vs "
            "Transformer), then peak memory in GB.", ""]
  paper_header = (["Model (ours = paper)"] + [length_label(n) for n in PAPER_TABLE2_LENGTHS]
                  + [("Mem " if i == 0 else "") + length_label(n) for i, n in enumerate(PAPER_TABLE2_LENGTHS)])
  lines += [_row(paper_header), _row(["---"] * len(paper_header))]
  for name in names:
    if name not in PAPER_TABLE2:
      continue
    title, steps, memory = PAPER_TABLE2[name]
    speedups = PAPER_TABLE2_SPEEDUPS.get(name)
    speed = [f"{s:.1f}" + (f" ({speedups[i]:.1f}x)" if speedups else "") for i, s in enumerate(steps)]
    lines.append(_row([f"{name} = {title}"] + speed + [f"{m:.2f}" for m in memory]))
  absent = [n for n in names if n not in PAPER_TABLE2]
  if absent:
    lines += ["", f"Not in the paper's Table 2: {', '.join(absent)}."]

  notes = [r for r in rows if r["status"] != "ok"]
  if notes:
    lines += ["", "## Not measured", ""]
    lines += [f"- {r['attention']} @ {length_label(r['length'])}: {r['status']}: {r.get('note', '')}"
              for r in notes]
  return "\n".join(lines) + "\n"


def _speed_cell(row, name, baseline) -> str:
  """steps/s, with the speed-up vs full, or why there is none (full did not run at this length)."""
  if row is None:
    return ""
  if row["status"] != "ok":
    return row["status"]
  cell = f"{row['steps_per_s']:.3g}"
  if name == BASELINE:
    return cell
  if row.get("speedup_vs_full") is not None:
    return cell + f" ({row['speedup_vs_full']:.1f}x)"
  return cell + f" (full {baseline['status'] if baseline else 'not measured'})"


def _fmt(value) -> str:
  return "" if value is None else f"{value:.2f}"


def _row(cells) -> str:
  return "| " + " | ".join(str(c) for c in cells) + " |"


def plot(rows: list[dict], key: str, ylabel: str, path: str, settings: Settings) -> None:
  """Log-log `key` against length per variant, the fitted slope in the legend."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  env = environment_of(rows)
  fig, ax = plt.subplots(figsize=(9, 5))
  status_ok = key == "step_ms"
  markers = "osD^v<>ph*X"   # with 20 colours, no two variants look alike
  for i, name in enumerate(dict.fromkeys(r["attention"] for r in rows)):
    points = [(r["length"], r.get(key)) for r in rows if r["attention"] == name
              and r.get(key) and (r["status"] == "ok" or not status_ok)]
    if not points:
      continue
    slope = fit_exponent(*zip(*points))
    label = name if slope is None else f"{name} (slope {slope:.2f})"
    style = (dict(color="black", linestyle="--", linewidth=2) if name == "full"
             else dict(color=plt.cm.tab20(i % 20)))
    ax.plot(*zip(*points), marker=markers[i % len(markers)], label=label, **style)
  ax.set_xscale("log", base=2)
  lengths = sorted({r["length"] for r in rows})
  ax.set_xticks(lengths, [length_label(n) for n in lengths])
  ax.minorticks_off()
  ax.set_yscale("log")
  ax.set_xlabel("sequence length")
  ax.set_ylabel(ylabel)
  ax.set_title(f"{settings.mode} mode, batch {settings.batch_size}, {settings.dtype}\n"
               f"{env['device']}, jax {env['jax_version']}, {env['date'][:10]}", fontsize=9)
  ax.grid(True, which="both", alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
