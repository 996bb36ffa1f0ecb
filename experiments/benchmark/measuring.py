"""The train and attention modes: every variant at every length, the baselines first, each
measurement a row of the outputs (outputs.py), rewritten after every one.

- A model whose parameters (with the optimiser state) exceed the memory limit is not even
  compiled; a program whose compiled memory exceeds it is not run. Over the device's memory the
  status is OOM_COMPILED, over a lower limit OVER_MEMORY_LIMIT.
- Times are medians of `repeats` calls after `warmup` calls. The previous length's time, scaled
  by the FLOPs ratio, predicts a call's cost, and the first call measures it: a measurement that
  would exceed the time budget stops there (OVER_TIME_BUDGET; programs.time_calls).
- Running out of memory or time stops the longer lengths of that variant (NOT_TRIED); a length
  refused from its compiled memory does not (Status.stops_longer_lengths).
"""
from __future__ import annotations

import gc
import json
import logging
import math
import sys
import time
from typing import Any, Callable

from tqdm import tqdm

from experiments.benchmark import attention, outputs, train_step
from experiments.benchmark.outputs import fit_exponent, run_environment
from experiments.benchmark.programs import OverBudget, Program, Workload, time_calls
from experiments.benchmark.settings import (BASELINE, JAX_BASELINE, STOPPED, Settings, Status,
                                            default_memory_limit_bytes, length_label, lengths_text,
                                            settings_from_flags)
from experiments.common import device, dry_run
from experiments.common.errors import HarnessError, first_line


def workload(name: str, length: int, settings: Settings) -> Workload:
  """What one (variant, length) measures in the settings' mode."""
  if settings.mode == "train":
    return train_step.train_workload(name, length, settings)
  return attention.attention_workload(name, length, settings)


def compile_program(program: Program):
  """-> (compiled, device.Facts)."""
  compiled = program.compile()
  return compiled, device.compile_facts(compiled)


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
  started = time.perf_counter()
  try:
    measured = workload(name, length, settings)
    row.update(options=json.dumps(measured.options, sort_keys=True, default=str),
               resident_bytes=measured.resident_bytes)
    what = "parameters" + (" and optimizer state" if settings.mode == "train" else "")
    refused = memory_status(measured.resident_bytes, device_memory=device_memory,
                            memory_limit=memory_limit, what=what)
    if refused:
      row.update(status=refused[0], note=refused[1])
      return row, timings
    start = time.perf_counter()
    row["setup_s"] = round(start - started, 2)   # the model built abstractly, its pairs counted
    facts = {}
    for key, program in measured.programs.items():
      compiled[key], facts[key] = compile_program(program)
    row["compile_s"] = round(time.perf_counter() - start, 2)
    main = facts[measured.main]
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
    start = time.perf_counter()
    inputs = measured.create()
    for key in measured.programs:
      ms, first_ms, inputs = time_calls(
          measured, key, compiled[key], inputs, warmup=settings.warmup,
          repeats=settings.repeats, budget_s=settings.time_budget_s,
          predicted_call_s=_predict_call_s(previous, key, facts[key], length))
      timings[key] = (ms, facts[key].flops, facts[key].flops_in_loops)
    del inputs
    row["run_s"] = round(time.perf_counter() - start, 2)
    # ms, first_ms: of the last program timed, the main one
    row.update(step_ms=ms, steps_per_s=1e3 / ms, first_call_ms=first_ms)
    if "fwd" in timings:
      row["fwd_ms"] = timings["fwd"][0]
    if settings.mode == "attention" and measured.exact:
      _add_rate(row, measured, ms, matmul_gflops)
    stats = device.memory_stats()
    if stats and "peak_bytes_in_use" in stats:
      row["device_peak_bytes"] = int(stats["peak_bytes_in_use"])
  except OverBudget as error:
    row.update(status=Status.OVER_TIME_BUDGET, note=str(error))
  except Exception as error:  # XLA reports running out of memory as a runtime error
    if device.is_out_of_memory(error):
      row.update(status=Status.OOM_RUNTIME if running else Status.OOM_COMPILED,
                 note=first_line(error))
    else:
      logging.exception("%s at length %d failed", name, length)
      row.update(status=Status.ERROR, note=f"{type(error).__name__}: {first_line(error)}")
  finally:
    compiled.clear()
    gc.collect()
  return row, timings


def _add_rate(row: dict, measured: Workload, ms: float, matmul_gflops) -> None:
  """GFLOP/s of forward+backward of an exact variant, and its fraction of the matmul limit:
  FLOPs counted nominally (attention_flops) over the pairs the pattern keeps (n² for dense
  attention, the engine's block masks for a sparse one: pairs.py), the same convention for all.
  XLA's cost analysis (`flops`) stays a cross-check column: it counts a loop's body once."""
  if measured.nominal_flops is None:
    return
  counted, source = measured.nominal_flops
  gflops = counted / (ms / 1e3) / 1e9
  row.update(rate_flops=counted, flops_source=source, gflops_per_s=gflops,
             fraction_of_matmul=gflops / matmul_gflops if matmul_gflops else None)


def _predict_call_s(previous, key, facts: device.Facts, length):
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

def run(settings: Settings, *, progress: Callable | None = None,
        on_row: Callable[[list[dict]], None] | None = None) -> list[dict]:
  """Measures every (variant, length), the baselines first; returns the rows with speed-ups,
  exponents and the run's facts. `on_row(rows so far)` after each measurement (the command
  rewrites its outputs with it, so a run that is killed keeps what it measured)."""
  names = settings.names()
  memory_limit = settings.memory_limit_bytes or default_memory_limit_bytes()
  device_memory = device.device_memory_bytes()
  env = run_environment()
  if settings.mode == "attention" and settings.matmul_size:
    env["matmul_gflops"] = device.matmul_gflops(settings.matmul_size, settings.dtype)
  logging.info("benchmark: %s mode, %s, remat %s, batch %d on %s, jax %s; device memory %.3g GB, "
               "memory limit %.3g GB, time budget %g s for each program's timed calls (warmup + "
               "repeats; compiling is not counted)", settings.mode, settings.dtype,
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
  """The row's log line: setup, compile and run times apart (the time budget covers the runs
  only), the time a step, its temporary memory, the note."""
  parts = [f"{what} {row[key]:.1f} s" for what, key in (
      ("setup", "setup_s"), ("compile", "compile_s"), ("run", "run_s")) if key in row]
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


def add_exponents(rows: list[dict]) -> None:
  """time_exponent over the lengths that ran; memory_exponent over those that compiled."""
  for name in dict.fromkeys(r["attention"] for r in rows):
    mine = [r for r in rows if r["attention"] == name]
    ran = [r for r in mine if r["status"] is Status.OK]
    time_exp = fit_exponent([r["length"] for r in ran], [r.get("step_ms") for r in ran])
    mem_exp = fit_exponent([r["length"] for r in mine], [r.get("temp_bytes") for r in mine])
    for row in mine:
      row["time_exponent"], row["memory_exponent"] = time_exp, mem_exp


# -- the command's train and attention modes -----------------------------------------------------

def run_and_write(settings: Settings, out: str, *, command: str, progress=None) -> list[dict]:
  """Measures, rewriting the tables after every measurement (a run that dies keeps what it
  measured), then writes every output with the plots; the rows."""
  write = lambda rows, plots: outputs.write_outputs(rows, settings, out, command=command,
                                                    plots=plots)
  rows = run(settings, progress=progress, on_row=lambda rows: write(rows, plots=False))
  for kind, path in write(rows, plots=True).items():
    logging.info("wrote %s: %s", kind, path)
  return rows


def plan_lines(settings: Settings, out: str) -> list[str]:
  """A dry run's line per variant of the train and attention modes, as the config resolves."""
  lines = []
  for name in settings.names():
    options = settings.config(name, min(settings.lengths)).model.attention_options
    lines.append(f"{settings.mode} {name}: lengths {lengths_text(settings.lengths)}, "
                 f"{settings.dtype}, remat {settings.remat}, batch {settings.batch_size}, "
                 f"{dry_run.count(settings.repeats, 'repeat')}, "
                 f"{dry_run.options_text(name, options)}")
  return lines + [f"then {out}/benchmark_{settings.mode}.csv, .md, .json and plots"]


def run_mode(values, command: str) -> int:
  """`--mode=train|attention` from the parsed flags (the mode's defaults filled in)."""
  try:
    settings = settings_from_flags(values)
  except ValueError as e:       # unknown attention or option, bad lengths: one line, no traceback
    raise HarnessError(str(e)) from e
  dry_run.plan(lambda: plan_lines(settings, values.out))
  rows = run_and_write(settings, values.out, command=command,
                       progress=lambda total: tqdm(total=total, unit="run", file=sys.stderr))
  failed = [f"{r['attention']}@{r['length']}" for r in rows if r["status"] is Status.ERROR]
  if failed:
    logging.error("measurements that failed (see the log and the CSV notes): %s",
                  ", ".join(failed))
    return 1
  return 0
