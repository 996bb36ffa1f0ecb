"""Measuring: what a compiled program needs and how long it takes; for the trainer's memory check,
the efficiency benchmark, the capacity table and the kernel benchmarks alike.

Memory. A compiled program's memory (XLA's `memory_analysis()`, per device) is

    total = arguments + outputs - aliased (donated buffers reused as outputs) + temporaries

and a device has its accelerator's memory, or on CPU the host's physical memory.

FLOPs. XLA's cost analysis counts a while loop's body once, so the FLOPs of a program that scans
over chunks with a matmul in the body are a lower bound (`loops_over_products` reads that from
the HLO text). The device's matmul speed (`matmul_gflops`, one square matmul, 2·n³ FLOPs) is the
yardstick for an attention kernel's FLOP rate.

The benchmark's measurements:
- A model whose parameters (with the optimiser state) exceed the memory limit is not even
  compiled; a program whose compiled memory exceeds it is not run. Over the device's memory the
  status is OOM_COMPILED, over a lower limit OVER_MEMORY_LIMIT.
- Times are medians of `repeats` calls after `warmup` calls. The previous length's time, scaled
  by the FLOPs ratio, predicts a call's cost, and the first call measures it: a measurement that
  would exceed the time budget stops there (OVER_TIME_BUDGET).
- Running out of memory or time stops the longer lengths of that variant (NOT_TRIED); a length
  refused from its compiled memory does not (Status.stops_longer_lengths).
"""
from __future__ import annotations

import dataclasses
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

from experiments import cli, provenance, workloads

# The run's facts each benchmark row carries (and the CSVs list).
ENVIRONMENT = ("device", "host", "backend", "jax_version", "xla_flags", "date")


def run_environment() -> dict:
  """provenance.environment()'s facts a benchmark row carries, with jax's backend and version
  and the XLA flags in use."""
  env = provenance.environment()
  env.update(backend=jax.default_backend(), jax_version=jax.__version__,
             xla_flags=os.environ.get("XLA_FLAGS", ""))
  return {key: env[key] for key in ENVIRONMENT}


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
  """The memory of one compiled program, in bytes."""
  temp_bytes: int      # temporaries (activations kept for the backward pass, workspaces)
  buffer_bytes: int    # arguments + outputs - aliased

  @property
  def total_bytes(self) -> int:
    return self.temp_bytes + self.buffer_bytes


def compiled_memory(compiled) -> CompiledMemory | None:
  """The memory a compiled program needs; None on a backend without the analysis."""
  analysis = compiled.memory_analysis()
  if analysis is None:
    return None
  return CompiledMemory(
      temp_bytes=int(analysis.temp_size_in_bytes),
      buffer_bytes=int(analysis.argument_size_in_bytes + analysis.output_size_in_bytes
                       - analysis.alias_size_in_bytes))


def memory_stats(device=None) -> dict | None:
  """The allocator's statistics (bytes_limit, peak_bytes_in_use, ...), or None where the
  backend keeps none (CPU)."""
  device = device or jax.devices()[0]
  try:
    return device.memory_stats()
  except Exception:   # backends without allocator statistics (some CPU builds) raise
    return None


def device_memory_bytes() -> float:
  """What the device holds: an accelerator's memory, or the host's physical memory on CPU."""
  stats = memory_stats()
  if stats and stats.get("bytes_limit"):
    return float(stats["bytes_limit"])
  try:
    return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
  except (ValueError, OSError, AttributeError):
    return math.inf


def free_host_bytes() -> float:
  """The host memory free now (what a CPU run can take without pushing others out)."""
  try:
    return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
  except (ValueError, OSError, AttributeError):
    return device_memory_bytes()


def is_out_of_memory(error: BaseException) -> bool:
  """Whether an exception is XLA running out of device memory."""
  text = str(error)
  return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def median_call_s(fn, *args, repeats: int = 5) -> float:
  """Median seconds of `repeats` calls of a compiled fn(*args), after one warm-up call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def matmul_gflops(n: int = 4096, dtype: str = "float32", repeats: int = 5) -> float:
  """GFLOP/s of an n x n by n x n matmul (2·n³ FLOPs) on the default device, median of `repeats`."""
  a, b = jax.random.normal(jax.random.key(0), (2, n, n), jnp.dtype(dtype))
  product = jax.jit(jnp.matmul).lower(a, b).compile()
  return 2 * n ** 3 / median_call_s(product, a, b, repeats=repeats) / 1e9


def loops_over_products(compiled) -> bool:
  """Whether a while loop's body (or what it calls) holds a dot or a convolution."""
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
  calls = {name: {ref for line in lines for ref in re.findall(r"%([\w.\-]+)", line)
                 if ref in computations}
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


@dataclasses.dataclass(frozen=True)
class Facts:
  """What compiling a program tells before it runs."""
  memory: CompiledMemory | None
  flops: float | None      # XLA's cost analysis
  flops_in_loops: bool     # a loop runs products: `flops` is a lower bound


def compile_program(program: workloads.Program):
  """-> (compiled, Facts)."""
  compiled = program.compile()
  return compiled, compile_facts(compiled)


def compile_facts(compiled) -> Facts:
  """Memory, FLOPs (XLA's cost analysis) and whether a loop undercounts them."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):   # older jax returns one dict per computation
    cost = cost[0] if cost else None
  flops = None if not cost or "flops" not in cost else float(cost["flops"])
  return Facts(compiled_memory(compiled), flops, loops_over_products(compiled))


class OverBudget(Exception):
  """A measurement that would take longer than the time budget."""


def time_calls(workload: workloads.Workload, program: str, compiled, inputs, *, warmup: int,
               repeats: int, budget_s: float, predicted_call_s: float | None = None):
  """-> (median ms, first-call ms, the inputs of the next call). Raises OverBudget before
  running when the prediction exceeds the budget, or after the first call when it does."""
  calls = warmup + repeats
  if predicted_call_s is not None and predicted_call_s * calls > budget_s:
    raise OverBudget(f"predicted {calls} x {predicted_call_s:.3g} s > time budget {budget_s:g} s"
                     " (not run)")
  times = []
  for i in range(calls):
    start = time.perf_counter()
    result, inputs = workload.step(program, compiled, inputs)
    jax.block_until_ready((result, inputs))
    times.append(time.perf_counter() - start)
    del result
    if i == 0 and times[0] * calls > budget_s:
      raise OverBudget(f"first call {times[0]:.3g} s x {calls} calls > time budget {budget_s:g} s")
  return 1e3 * statistics.median(times[warmup:]), 1e3 * times[0], inputs


def memory_status(needed: float, *, device_memory: float, memory_limit: float,
                  what: str) -> tuple[workloads.Status, str] | None:
  """Whether `needed` bytes fit: None, or (status, note) when they do not."""
  if needed > device_memory:
    return workloads.Status.OOM_COMPILED, (f"{what} {needed / 1e9:.3g} GB > the device's "
                                 f"{device_memory / 1e9:.3g} GB (not run)")
  if needed > memory_limit:
    return workloads.Status.OVER_MEMORY_LIMIT, (f"{what} {needed / 1e9:.3g} GB > memory limit "
                                      f"{memory_limit / 1e9:.3g} GB (not run)")
  return None


def measure(name: str, length: int, settings: workloads.Settings, *, memory_limit: float,
            device_memory: float = math.inf, previous: dict | None = None,
            matmul_gflops: float | None = None) -> tuple[dict, dict]:
  """One (variant, length) -> (row, timings {program: (ms, flops, flops_in_loops)} of what
  ran). `previous`: the timings of this variant's last length that ran, with its length."""
  row: dict[str, Any] = {"attention": name, "length": length, "status": workloads.Status.OK,
                         "note": ""}
  timings: dict[str, tuple] = {}
  compiled: dict[str, Any] = {}
  running = False
  try:
    workload = workloads.build_workload(name, length, settings)
    row.update(options=json.dumps(workload.options, sort_keys=True, default=str),
               resident_bytes=workload.resident_bytes)
    what = "parameters" + (" and optimizer state" if settings.mode == "train" else "")
    refused = memory_status(workload.resident_bytes, device_memory=device_memory,
                            memory_limit=memory_limit, what=what)
    if refused:
      row.update(status=refused[0], note=refused[1])
      return row, timings
    start = time.perf_counter()
    facts = {}
    for key, program in workload.programs.items():
      compiled[key], facts[key] = compile_program(program)
    row["compile_s"] = round(time.perf_counter() - start, 2)
    main = facts[workload.main]
    row.update(temp_bytes=main.memory and main.memory.temp_bytes, flops=main.flops,
               flops_lower_bound=main.flops_in_loops)
    if "fwd" in facts and facts["fwd"].memory:
      row.update(temp_bytes_fwd=facts["fwd"].memory.temp_bytes, flops_fwd=facts["fwd"].flops)
    needed = max((f.memory.total_bytes for f in facts.values() if f.memory), default=0)
    row["compiled_total_bytes"] = needed
    refused = memory_status(needed, device_memory=device_memory, memory_limit=memory_limit,
                            what="compiled memory")
    if refused:
      row.update(status=refused[0], note=refused[1])
      return row, timings
    running = True
    inputs = workload.create()
    for key in workload.programs:
      ms, first_ms, inputs = time_calls(
          workload, key, compiled[key], inputs, warmup=settings.warmup,
          repeats=settings.repeats, budget_s=settings.time_budget_s,
          predicted_call_s=_predict_call_s(previous, key, facts[key], length))
      timings[key] = (ms, facts[key].flops, facts[key].flops_in_loops)
    del inputs
    # ms, first_ms: of the last program timed, the main one
    row.update(step_ms=ms, steps_per_s=1e3 / ms, first_call_ms=first_ms)
    if "fwd" in timings:
      row["fwd_ms"] = timings["fwd"][0]
    if settings.mode == "attention" and workload.exact:
      _add_rate(row, workload, ms, matmul_gflops)
    stats = memory_stats()
    if stats and "peak_bytes_in_use" in stats:
      row["device_peak_bytes"] = int(stats["peak_bytes_in_use"])
  except OverBudget as error:
    row.update(status=workloads.Status.OVER_TIME_BUDGET, note=str(error))
  except Exception as error:  # XLA reports running out of memory as a runtime error
    if is_out_of_memory(error):
      row.update(status=workloads.Status.OOM_RUNTIME if running else workloads.Status.OOM_COMPILED,
                 note=cli.first_line(error))
    else:
      logging.exception("%s at length %d failed", name, length)
      row.update(status=workloads.Status.ERROR,
                 note=f"{type(error).__name__}: {cli.first_line(error)}")
  finally:
    compiled.clear()
    gc.collect()
  return row, timings


def _add_rate(row: dict, workload: workloads.Workload, ms: float, matmul_gflops) -> None:
  """GFLOP/s of forward+backward of an exact variant, and its fraction of the matmul limit.
  Dense attention (full, flash, the jax baseline) is counted nominally (flops.attention_flops),
  the same count for all three; a sparse exact variant by XLA's cost analysis (a lower bound
  when it loops over products)."""
  if workload.nominal_flops is not None:
    counted, source = workload.nominal_flops, "nominal 3.5·4·b·h·n²·d"
  elif row.get("flops"):
    counted = row["flops"]
    source = "cost_analysis" + (" (lower bound: loops)" if row["flops_lower_bound"] else "")
  else:
    return
  gflops = counted / (ms / 1e3) / 1e9
  row.update(rate_flops=counted, flops_source=source, gflops_per_s=gflops,
             fraction_of_matmul=gflops / matmul_gflops if matmul_gflops else None)


def _predict_call_s(previous, key, facts: Facts, length):
  """Seconds per call: the previous length's time scaled by the FLOPs ratio, or by the length
  ratio where FLOPs are unknown or undercounted (loops)."""
  if not previous or key not in previous["timings"]:
    return None
  prior_ms, prior_flops, prior_loops = previous["timings"][key]
  ratio = length / previous["length"]
  if facts.flops and prior_flops:
    flops_ratio = facts.flops / prior_flops
    ratio = max(ratio, flops_ratio) if facts.flops_in_loops or prior_loops else flops_ratio
  return prior_ms / 1e3 * ratio


# -- the whole run ----------------------------------------------------------------------------

def run(settings: workloads.Settings, *, progress: Callable | None = None,
        on_row: Callable[[list[dict]], None] | None = None) -> list[dict]:
  """Measures every (variant, length), the baselines first; returns the rows with speed-ups,
  exponents and the run's facts. `on_row(rows so far)` after each measurement (the command
  rewrites its outputs with it, so a run that is killed keeps what it measured)."""
  names = settings.names()
  memory_limit = settings.memory_limit_bytes or workloads.default_memory_limit_bytes()
  device_memory = device_memory_bytes()
  env = run_environment()
  if settings.mode == "attention" and settings.matmul_size:
    env["matmul_gflops"] = matmul_gflops(settings.matmul_size, settings.dtype)
  logging.info("benchmark: %s mode, %s, remat %s, batch %d on %s, jax %s; device memory %.3g GB, "
               "memory limit %.3g GB, time budget %g s", settings.mode, settings.dtype,
               settings.remat, settings.batch_size, env["device"], env["jax_version"],
               device_memory / 1e9, memory_limit / 1e9, settings.time_budget_s)
  lengths = sorted(settings.lengths)
  bar = progress(total=len(names) * len(lengths)) if progress else None
  rows, peak_so_far = [], 0
  for name in names:
    previous, stopped_by = None, None
    for length in lengths:
      if bar is not None:
        bar.set_description(f"{name} @ {workloads.length_label(length)}")
      if stopped_by:
        row = {"attention": name, "length": length, "status": workloads.Status.NOT_TRIED,
               "note": f"length {stopped_by['length']} "
                       f"{workloads.STOPPED[stopped_by['status']]}"}
      else:
        row, timings = measure(name, length, settings, memory_limit=memory_limit,
                               device_memory=device_memory, previous=previous,
                               matmul_gflops=env.get("matmul_gflops"))
        if row["status"] is workloads.Status.OK:
          previous = {"length": length, "timings": timings}
        if row["status"].stops_longer_lengths:
          stopped_by = row
      peak = row.get("device_peak_bytes")
      row["device_peak_set_here"] = None if peak is None else peak > peak_so_far
      peak_so_far = max(peak_so_far, peak or 0)
      logging.info("%-25s %6d  %-17s %s", name, length, row["status"].value, _summary(row))
      rows.append(row)
      if on_row is not None:
        on_row(finished(rows, settings, env))
      if bar is not None:
        bar.update()
  if bar is not None:
    bar.close()
  return finished(rows, settings, env)


def finished(rows: list[dict], settings: workloads.Settings, env: dict) -> list[dict]:
  """Copies of the rows with the run's facts, speed-ups and exponents (over the rows so far)."""
  rows = [{**row, "mode": settings.mode, "dtype": settings.dtype, "remat": settings.remat,
           "batch_size": settings.batch_size, **env} for row in rows]
  add_speedups(rows)
  add_exponents(rows)
  return rows


def _summary(row) -> str:
  parts = []
  if row.get("step_ms") is not None:
    parts.append(f"{row['step_ms']:.1f} ms/step")
  if row.get("temp_bytes") is not None:
    parts.append(f"temp {row['temp_bytes'] / 1e6:.1f} MB")
  if row.get("note"):
    parts.append(row["note"])
  return ", ".join(parts)


def add_speedups(rows: list[dict]) -> None:
  """speedup_vs_<baseline> = the baseline's time / the variant's time at the same length;
  speedup_vs_best against the faster of the baselines measured (full, and in attention mode
  jax.nn's), so that a speed-up is never stated against a slow reference."""
  for key, baseline, out in (("step_ms", workloads.BASELINE, "speedup_vs_full"),
                             ("fwd_ms", workloads.BASELINE, "fwd_speedup_vs_full"),
                             ("step_ms", workloads.JAX_BASELINE, "speedup_vs_jax")):
    times = {r["length"]: r.get(key) for r in rows if r["attention"] == baseline}
    for row in rows:
      mine, base = row.get(key), times.get(row["length"])
      row[out] = base / mine if mine and base else None
  fastest: dict[int, float] = {}
  for row in rows:
    if row["attention"] in (workloads.BASELINE, workloads.JAX_BASELINE) and row.get("step_ms"):
      fastest[row["length"]] = min(row["step_ms"], fastest.get(row["length"], float("inf")))
  for row in rows:
    mine, base = row.get("step_ms"), fastest.get(row["length"])
    row["speedup_vs_best"] = base / mine if mine and base else None


def fit_exponent(lengths, values) -> float | None:
  """Slope of log(value) against log(length), least squares; None with fewer than two
  lengths."""
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
    ran = [r for r in mine if r["status"] is workloads.Status.OK]
    time_exp = fit_exponent([r["length"] for r in ran], [r.get("step_ms") for r in ran])
    mem_exp = fit_exponent([r["length"] for r in mine], [r.get("temp_bytes") for r in mine])
    for row in mine:
      row["time_exponent"], row["memory_exponent"] = time_exp, mem_exp
