"""Measuring: compile a workload from its shapes, decide from its memory whether to run it, time
it under a budget; then the whole run over variants and lengths, with speed-ups, exponents and
FLOP rates.

- A model whose parameters (with the optimiser state) exceed the memory limit is not even
  compiled; a program whose compiled memory (experiments/memory.py) exceeds it is not run.
  Over the device's memory the status is OOM_COMPILED, over a lower limit OVER_MEMORY_LIMIT.
- Times are medians of `repeats` calls after `warmup` calls. The previous length's time, scaled
  by the FLOPs ratio, predicts a call's cost, and the first call measures it: a measurement that
  would exceed the time budget stops there (OVER_TIME_BUDGET).
- Running out of memory or time stops the longer lengths of that variant (NOT_TRIED); a length
  refused from its compiled memory does not (Status.stops_longer_lengths).
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import logging
import math
import os
import statistics
import time
from typing import Any, Callable

import jax
import numpy as np

from experiments import flops as flops_lib
from experiments import memory
from experiments.bench import hlo, workloads
from experiments.bench.settings import (BASELINE, JAX_BASELINE, Settings, Status,
                                        default_memory_limit_bytes, length_label)


@dataclasses.dataclass(frozen=True)
class Facts:
  """What compiling a program tells before it runs."""
  memory: memory.CompiledMemory | None
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
  return Facts(memory.compiled_memory(compiled), flops, hlo.loops_over_products(compiled))


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
                  what: str) -> tuple[Status, str] | None:
  """Whether `needed` bytes fit: None, or (status, note) when they do not."""
  if needed > device_memory:
    return Status.OOM_COMPILED, (f"{what} {needed / 1e9:.3g} GB > the device's "
                                 f"{device_memory / 1e9:.3g} GB (not run)")
  if needed > memory_limit:
    return Status.OVER_MEMORY_LIMIT, (f"{what} {needed / 1e9:.3g} GB > memory limit "
                                      f"{memory_limit / 1e9:.3g} GB (not run)")
  return None


def measure(name: str, length: int, settings: Settings, *, memory_limit: float,
            device_memory: float = math.inf, previous: dict | None = None,
            matmul_gflops: float | None = None) -> tuple[dict, dict]:
  """One (variant, length) -> (row, timings {program: (ms, flops, flops_in_loops)} of what
  ran). `previous`: the timings of this variant's last length that ran, with its length."""
  row: dict[str, Any] = {"attention": name, "length": length, "status": Status.OK, "note": ""}
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
    stats = memory.memory_stats()
    if stats and "peak_bytes_in_use" in stats:
      row["device_peak_bytes"] = int(stats["peak_bytes_in_use"])
  except OverBudget as error:
    row.update(status=Status.OVER_TIME_BUDGET, note=str(error))
  except Exception as error:  # XLA reports running out of memory as a runtime error
    if memory.is_out_of_memory(error):
      row.update(status=Status.OOM_RUNTIME if running else Status.OOM_COMPILED,
                 note=_first_line(error))
    else:
      logging.exception("%s at length %d failed", name, length)
      row.update(status=Status.ERROR, note=f"{type(error).__name__}: {_first_line(error)}")
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


def _first_line(error) -> str:
  text = str(error).strip()
  return text.splitlines()[0][:300] if text else type(error).__name__


# -- the whole run ----------------------------------------------------------------------------

STOPPED = {Status.OOM_RUNTIME: "ran out of memory",
           Status.OVER_TIME_BUDGET: "exceeded the time budget"}


def environment() -> dict[str, str]:
  device = jax.devices()[0]
  kind = getattr(device, "device_kind", "") or device.platform
  described = (f"{kind} ({device.platform}, {jax.device_count()} device(s), "
               f"{os.cpu_count()} host CPU cores)")
  return {"device": described, "backend": jax.default_backend(), "jax_version": jax.__version__,
          "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


def run(settings: Settings, *, progress: Callable | None = None,
        on_row: Callable[[list[dict]], None] | None = None) -> list[dict]:
  """Measures every (variant, length), the baselines first; returns the rows with speed-ups,
  exponents and the run's facts. `on_row(rows so far)` after each measurement (the command
  rewrites its outputs with it, so a run that is killed keeps what it measured)."""
  names = settings.names()
  memory_limit = settings.memory_limit_bytes or default_memory_limit_bytes()
  device_memory = memory.device_memory_bytes()
  env = environment()
  if settings.mode == "attention" and settings.matmul_size:
    env["matmul_gflops"] = flops_lib.matmul_gflops(settings.matmul_size, settings.dtype)
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
        bar.set_description(f"{name} @ {length_label(length)}")
      if stopped_by:
        row = {"attention": name, "length": length, "status": Status.NOT_TRIED,
               "note": f"length {stopped_by['length']} {STOPPED[stopped_by['status']]}"}
      else:
        row, timings = measure(name, length, settings, memory_limit=memory_limit,
                               device_memory=device_memory, previous=previous,
                               matmul_gflops=env.get("matmul_gflops"))
        if row["status"] is Status.OK:
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


def finished(rows: list[dict], settings: Settings, env: dict) -> list[dict]:
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
  for key, baseline, out in (("step_ms", BASELINE, "speedup_vs_full"),
                             ("fwd_ms", BASELINE, "fwd_speedup_vs_full"),
                             ("step_ms", JAX_BASELINE, "speedup_vs_jax")):
    times = {r["length"]: r.get(key) for r in rows if r["attention"] == baseline}
    for row in rows:
      mine, base = row.get(key), times.get(row["length"])
      row[out] = base / mine if mine and base else None
  fastest: dict[int, float] = {}
  for row in rows:
    if row["attention"] in (BASELINE, JAX_BASELINE) and row.get("step_ms"):
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
    ran = [r for r in mine if r["status"] is Status.OK]
    time_exp = fit_exponent([r["length"] for r in ran], [r.get("step_ms") for r in ran])
    mem_exp = fit_exponent([r["length"] for r in mine], [r.get("temp_bytes") for r in mine])
    for row in mine:
      row["time_exponent"], row["memory_exponent"] = time_exp, mem_exp
