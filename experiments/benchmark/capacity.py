"""The capacity mode, how long a sequence each variant can train on: for every variant and
setting (remat policy, dtype), the longest power-of-two length whose Text-model train step (the
trainer's, batch 1) fits the device's memory, and the time of one step.

Decided from memory figures alone, never by running what might not fit: the parameters and
the optimiser state from shapes (nnx.eval_shape, before anything is created), then the
compiled step's memory (arguments + outputs - aliased + temporaries,
experiments/common/device.py).

The search. Memory grows monotonically with length, so the answer is where the candidates
switch from fitting to not fitting. A length whose parameters and optimiser state alone do not
fit is ruled out from its shapes, without compiling (synthesizer's max_len² parameters per
head). The first compile is at the longest candidate whose parameters fit; every next one is
predicted from the compiled lengths so far (a power law through the nearest known fit and
misfit, or linear growth from a single point), kept strictly between the longest known fit and
the shortest known misfit: so no length at or beyond one known not to fit is ever compiled, and
none twice. A prediction that does not halve the bracket is followed by a plain bisection step,
so at most 2·log2(candidates) + 1 compiles decide it. Compiling takes about as long at 128K as
at 1K (8 s for the Text model on 2 CPU cores), so the number of compiles is the cost.

Timing. The longest length that fits the device may not fit beside everything else on the
host: the step is timed at the longest length that fits the memory limit (on CPU, by default,
half the free host memory), found by the same search from the figures already known. First the
step is timed at two short probe lengths (2K and 4K), and a power law through them (exponent
at least 1) predicts the step at the timed length: a variant's own growth, whatever its FLOPs
(XLA's cost analysis counts a loop's body once, so FLOPs hide the growth of the blockwise
variants). A step predicted over the step budget is not run, and the prediction is reported as
one; otherwise it runs twice, the second call timed (once, when the first took longer than the
budget).
"""
from __future__ import annotations

import dataclasses
import datetime
import itertools
import math
import time
from typing import Callable

import jax
import numpy as np
from absl import logging

import attention_zoo as az
from experiments.benchmark.outputs import table_row, write_csv
from experiments.benchmark.programs import Workload
from experiments.benchmark.settings import (DTYPES, REMATS, Settings, default_memory_limit_bytes,
                                            every_encoder_variant, length_label)
from experiments.benchmark.train_step import train_workload
from experiments.common import device, dry_run, provenance, records
from experiments.common.errors import HarnessError
from experiments.common.plots import legend_beside, pyplot, save_figure
from experiments.common.variant_names import check_attention

SETTINGS = (("none", "float32"), ("block", "float32"), ("none", "bfloat16"), ("block", "bfloat16"))
# Where a step is timed to predict the step at the timed length: long enough for attention's
# share of the step to show its growth, short enough to take seconds on a CPU.
PROBE_LENGTHS = (2048, 4096)


def candidates(min_length: int, max_length: int) -> tuple[int, ...]:
  """The powers of two from min_length to max_length."""
  if min_length < 1 or max_length < min_length:
    raise ValueError(f"need 1 <= min_length <= max_length, got {min_length}, {max_length}")
  first = 1 << math.ceil(math.log2(min_length))
  return tuple(1 << p for p in range(first.bit_length() - 1, int(math.log2(max_length)) + 1))


class LengthSearch:
  """The longest candidate under a memory threshold, compiling as few lengths as it can.

  resident_bytes(length): the parameters and optimiser state, from shapes (cheap);
  compiled_bytes(length): the compiled step's total memory (a compile).
  """

  def __init__(self, lengths, resident_bytes: Callable[[int], int],
               compiled_bytes: Callable[[int], int], deadline: float = math.inf):
    self.lengths = tuple(sorted(lengths))
    self.resident_of, self.compile_of = resident_bytes, compiled_bytes
    self.deadline = deadline
    self.resident: dict[int, int] = {}
    self.compiled: dict[int, int] = {}   # in the order compiled

  def fits(self, length: int, threshold: float) -> bool | None:
    """Known to fit (True), known not to (False), or unknown without a compile (None)."""
    if length not in self.resident:
      self.resident[length] = self.resident_of(length)
    if self.resident[length] > threshold:
      return False
    if length in self.compiled:
      return self.compiled[length] <= threshold
    return None

  def longest(self, threshold: float) -> tuple[int | None, bool]:
    """(the longest candidate that fits, or None; whether the search finished: False when the
    deadline stopped it, and the length is only a lower bound)."""
    known = [self.fits(n, threshold) for n in self.lengths]
    fit = max((i for i, k in enumerate(known) if k), default=-1)
    misfit = min((i for i, k in enumerate(known) if k is False and i > fit),
                 default=len(self.lengths))
    bisect = False   # the last predicted probe did not halve the bracket: bisect once
    while misfit - fit > 1:
      if time.monotonic() > self.deadline:
        return (self.lengths[fit] if fit >= 0 else None), False
      width = misfit - fit
      i = (fit + misfit) // 2 if bisect else self._next_probe(fit, misfit, threshold)
      self.compiled[self.lengths[i]] = self.compile_of(self.lengths[i])
      if self.compiled[self.lengths[i]] <= threshold:
        fit = i
      else:
        misfit = i
      bisect = not bisect and 2 * (misfit - fit) > width
    return (self.lengths[fit] if fit >= 0 else None), True

  def _next_probe(self, fit: int, misfit: int, threshold: float) -> int:
    """The index to compile next, strictly between `fit` and `misfit`."""
    lo, hi = fit + 1, misfit - 1
    points = sorted(self.compiled.items())
    if not points:
      return hi   # the longest length whose parameters fit: it may fit at once
    below = [(n, m) for n, m in points if m <= threshold]
    above = [(n, m) for n, m in points if m > threshold]
    if below and above:
      (n0, m0), (n1, m1) = below[-1], above[0]
      exponent = math.log(m1 / m0) / math.log(n1 / n0) if m1 > m0 and n1 > n0 else 1.0
    else:
      (n0, m0), exponent = (below[-1] if below else above[0]), 1.0
    predicted = n0 * (threshold / m0) ** (1 / max(exponent, 1e-3))
    index = int(np.searchsorted(self.lengths, predicted, side="right")) - 1
    return min(max(index, lo), hi)


@dataclasses.dataclass
class Capacity:
  attention: str
  remat: str
  dtype: str
  longest: int | None = None        # the longest candidate that fits the device
  longest_bytes: int | None = None  # its compiled memory
  limit: str = ""                   # what the next candidate exceeds: parameters or compiled
  complete: bool = True             # False: the time budget stopped the search (a lower bound)
  timed_length: int | None = None   # the longest that fits the memory limit
  step_s: float | None = None       # measured there
  calls: int = 0
  predicted_s: float | None = None  # extrapolated there from the probe steps
  exponent: float | None = None     # of that extrapolation
  probes: tuple[int, ...] = ()      # the shorter lengths timed to predict it
  compiled: tuple[int, ...] = ()    # the lengths compiled for the search, in order: its cost
  note: str = ""


def extrapolate(times: dict[int, float], length: int) -> tuple[float, float]:
  """(seconds at `length`, exponent): the power law through the two longest timed lengths, its
  exponent at least 1 (no step grows slower than its length)."""
  (n0, t0), (n1, t1) = sorted(times.items())[-2:]
  exponent = max(1.0, math.log(t1 / t0) / math.log(n1 / n0))
  return t1 * (length / n1) ** exponent, exponent


def measure_capacity(name: str, remat: str, dtype: str, lengths, *, device_memory: float,
                     memory_limit: float, deadline: float = math.inf, time_steps: bool = True,
                     step_budget_s: float = math.inf, probe_lengths=PROBE_LENGTHS,
                     base: Settings | None = None) -> Capacity:
  """One variant in one setting: the search, then (with time_steps) one timed step. `base`:
  settings whose model sizes and seed to use (default: the Text model's, batch 1)."""
  settings = dataclasses.replace(base or Settings(attentions=(name,), lengths=tuple(lengths)),
                                 attentions=(name,), lengths=tuple(lengths), dtype=dtype,
                                 remat=remat, mode="train")
  timing_limit = min(memory_limit, device_memory)
  shapes = {}   # length -> Workload (shapes only: nothing created)
  kept = {}     # the longest compiled step within the memory limit: the one timed

  def workload(length):
    if length not in shapes:
      shapes[length] = train_workload(name, length, settings)
    return shapes[length]

  def compiled_bytes(length):
    compiled = workload(length).programs["step"].compile()
    found = device.compiled_memory(compiled)
    if found is None:
      raise RuntimeError(f"{jax.default_backend()} gives no memory_analysis(): capacity "
                         "cannot be decided")
    if found.total_bytes <= timing_limit and length > max(kept, default=0):
      kept.clear()
      kept[length] = compiled
    return found.total_bytes

  search = LengthSearch(lengths, lambda n: workload(n).resident_bytes, compiled_bytes, deadline)
  result = Capacity(name, remat, dtype)
  result.longest, result.complete = search.longest(device_memory)
  if result.longest is not None:
    result.longest_bytes = search.compiled[result.longest]
  longer = [n for n in search.lengths if result.longest is None or n > result.longest]
  if longer and result.complete:
    over = longer[0]
    result.limit = ("parameters" if search.resident[over] > device_memory else "compiled") + \
        f" {_gb(search.compiled.get(over, search.resident[over]))} at {length_label(over)}"
  if not time_steps:
    result.compiled = tuple(search.compiled)
    return result
  timed, timed_complete = search.longest(timing_limit)
  result.compiled = tuple(search.compiled)
  result.timed_length = timed
  if not timed_complete or time.monotonic() > deadline:
    result.note = "not timed: over the time budget"
  elif timed is None:
    result.note = "nothing fits the memory limit"
  else:
    # Shorter than `timed`, so within the memory limit too (memory grows with length).
    result.probes = tuple(n for n in sorted(probe_lengths) if n < timed)[-2:]
    if len(result.probes) == 2:
      times = {n: time_step(workload(n), workload(n).programs["step"].compile(), step_budget_s)[0]
               for n in result.probes}
      result.predicted_s, result.exponent = extrapolate(times, timed)
    if result.predicted_s is not None and result.predicted_s > step_budget_s:
      result.note = (f"not timed: predicted {result.predicted_s:.3g} s @ {length_label(timed)} "
                     f"> step budget {step_budget_s:g} s")
    else:
      result.step_s, result.calls = time_step(workload(timed), kept[timed], step_budget_s)
  return result


def time_step(workload: Workload, compiled, budget_s: float) -> tuple[float, int]:
  """(seconds of one step, calls made): the second call's time, or the first's when it took
  longer than the step budget."""
  inputs = workload.create()
  times = []
  for _ in range(2):
    start = time.perf_counter()
    result, inputs = workload.step("step", compiled, inputs)
    jax.block_until_ready((result, inputs))
    times.append(time.perf_counter() - start)
    if times[0] > budget_s:
      break
  return times[-1], len(times)


def run_capacity(attentions, lengths, *, settings=SETTINGS, time_budget_s: float = math.inf,
                 memory_limit: float | None = None, time_steps: bool = True,
                 timed_dtypes=None, step_budget_s: float = math.inf,
                 probe_lengths=PROBE_LENGTHS, base: Settings | None = None,
                 on_result: Callable | None = None) -> list[Capacity]:
  """Every variant in every (remat, dtype) setting, within one time budget; steps are timed
  in `timed_dtypes` (default: all) when predicted within `step_budget_s` each."""
  device_memory = device.device_memory_bytes()
  memory_limit = memory_limit or default_memory_limit_bytes()
  deadline = time.monotonic() + time_budget_s
  results = []
  for name in attentions:
    for remat, dtype in settings:
      timed = time_steps and (timed_dtypes is None or dtype in timed_dtypes)
      results.append(measure_capacity(name, remat, dtype, lengths, device_memory=device_memory,
                                      memory_limit=memory_limit, deadline=deadline,
                                      time_steps=timed, step_budget_s=step_budget_s,
                                      probe_lengths=probe_lengths, base=base))
      if on_result is not None:
        on_result(results)
  return results


def _gb(n: float) -> str:
  return f"{n / 1e9:.3g} GB"


# -- outputs --------------------------------------------------------------------------------

CSV_COLUMNS = ("attention", "remat", "dtype", "longest", "longest_bytes", "limit", "complete",
               "timed_length", "step_s", "calls", "predicted_s", "exponent", "probes",
               "compiled", "note", "device",
               "device_memory_bytes", "memory_limit_bytes", "jax_version", "date")


def output_paths(out_dir: str) -> dict[str, str]:
  return {kind: f"{out_dir}/capacity.{ext}"
          for kind, ext in (("csv", "csv"), ("markdown", "md"), ("plot", "png"))}


def write_outputs(results: list[Capacity], out_dir: str, *, facts: dict, command: str = "",
                  plots: bool = True) -> dict[str, str]:
  """capacity.csv, capacity.md and (with `plots`) capacity.png; the paths by kind.
  facts: device, device_memory_bytes, memory_limit_bytes, jax_version, date, lengths and
  (optional) model, the model's sizes in words."""
  paths = output_paths(out_dir)
  rows = [{**dataclasses.asdict(r), "compiled": " ".join(map(str, r.compiled)),
           "probes": " ".join(map(str, r.probes)), **facts} for r in results]
  write_csv(rows, paths["csv"], CSV_COLUMNS)
  records.write_text(paths["markdown"], markdown(results, facts, command=command))
  if not plots:
    return {k: v for k, v in paths.items() if k != "plot"}
  plot(results, paths["plot"], facts)
  return paths


def _longest_cell(r: Capacity, lengths) -> str:
  if r.longest is None:
    return f"< {length_label(lengths[0])}" if r.complete else "not searched (time budget)"
  cell = ("≥ " if not r.complete else "") + length_label(r.longest)
  if r.longest == lengths[-1] and r.complete:
    cell += " (the longest tried)"
  return cell + f" ({_gb(r.longest_bytes)})"


def _time_cell(r: Capacity) -> str:
  if r.step_s is None:
    return r.note
  per_1k = r.step_s / (r.timed_length / 1024)
  return (f"{r.step_s:.3g} s @ {length_label(r.timed_length)} ({per_1k:.3g} s per 1K tokens"
          + (", 1 call)" if r.calls == 1 else ")"))


def _growth_cell(r: Capacity) -> str:
  if r.exponent is None:
    return ""
  return (f"n^{r.exponent:.2f} (from {', '.join(map(length_label, r.probes))}), "
          f"predicted {r.predicted_s:.3g} s @ {length_label(r.timed_length)}")


def markdown(results: list[Capacity], facts: dict, *, command: str = "") -> str:
  lengths = facts["lengths"]
  names = list(dict.fromkeys(r.attention for r in results))
  settings = list(dict.fromkeys((r.remat, r.dtype) for r in results))
  by_key = {(r.attention, r.remat, r.dtype): r for r in results}
  header = ["variant"] + [f"remat {remat}, {dtype}" for remat, dtype in settings]
  lines = [
      "# Capacity: the longest LRA Text train step that fits", "",
      f"- Device: {facts['device']}; jax {facts['jax_version']}; {facts['date']}.",
      f"- Model: the trainer's train step of the LRA Text model (configs/lra/text.py, fair "
      f"preset: {facts.get('model', '4 layers, emb 256, 4 heads, MLP 1024')}, AdamW), batch 1, "
      "lengths "
      f"{length_label(lengths[0])}–{length_label(lengths[-1])} (powers of two).",
      f"- Longest: the longest length whose compiled step (arguments + outputs - aliased + "
      f"temporaries, `memory_analysis()`) fits the device's {_gb(facts['device_memory_bytes'])}"
      " (the trainer's memory check), with its compiled memory; decided from shapes and "
      "compiled memory, never by running. ≥: the time budget stopped the search.",
      f"- Step time: one train step at the longest length within the memory limit "
      f"({_gb(facts['memory_limit_bytes'])}), the second of two calls (1 call: the first, "
      "when it took longer than the step budget); not run when predicted over that budget. "
      "The prediction: a power law through the steps timed at two short probe lengths "
      "(exponent at least 1), extrapolated to that length.",
  ]
  if command:
    lines.append(f"- Command: `{command}`")
  lines += ["", "## Longest length that fits", "", table_row(header),
            table_row(["---"] * len(header))]
  for name in names:
    lines.append(table_row([name] + [_longest_cell(by_key[(name, *s)], lengths)
                                       if (name, *s) in by_key else "" for s in settings]))
  lines += ["", "## Step time", "", table_row(header),
            table_row(["---"] * len(header))]
  for name in names:
    lines.append(table_row([name] + [_time_cell(by_key[(name, *s)])
                                       if (name, *s) in by_key else "" for s in settings]))
  lines += ["", "## Growth of the step time", "",
            "The exponent of the power law through the steps timed at the probe lengths, and "
            "the step time it predicts at the timed length (the step is run only when that is "
            "within the step budget).", "", table_row(header),
            table_row(["---"] * len(header))]
  for name in names:
    lines.append(table_row([name] + [_growth_cell(by_key[(name, *s)])
                                       if (name, *s) in by_key else "" for s in settings]))
  by_parameters = [name for name in names
                   if any(r.limit.startswith("parameters") for r in results if r.attention == name)]
  lines += ["", "Seconds per 1K tokens compare variants timed at different lengths: a variant "
            "whose time is linear in length has the same figure at every length, one whose "
            "figure is far above the others' grows faster (e.g. sparse_transformer's n·(b + "
            "c·n/b): every query also reads the summaries of every block)."]
  if by_parameters:
    lines += ["", "Stopped by their parameters before their activations: "
              + ", ".join(f"{name} ({az.spec(name).complexity})" for name in by_parameters)
              + ". Their parameters and AdamW state alone exceed the device at the next length "
              "(synthesizer holds a max_len x max_len matrix per head, so it fails early however "
              "little its activations take; remat cannot help)."]
  lines += ["", "## What stops each at the next length", "",
            "What the next power of two exceeds the device's memory with: its parameters and "
            "AdamW state alone (known from shapes; not compiled), or its compiled step.", ""]
  for name in names:
    limits = [f"remat {r.remat}, {r.dtype}: {r.limit}" for r in results
              if r.attention == name and r.limit]
    if limits:
      lines.append(f"- {name}: " + "; ".join(limits))
  return "\n".join(lines) + "\n"


def plot(results: list[Capacity], path: str, facts: dict) -> None:
  """Horizontal bars: the longest length per variant, one bar per setting (log2 axis)."""
  plt = pyplot()
  names = list(dict.fromkeys(r.attention for r in results))
  settings = list(dict.fromkeys((r.remat, r.dtype) for r in results))
  by_key = {(r.attention, r.remat, r.dtype): r for r in results}
  fig, ax = plt.subplots(figsize=(9, 0.5 + 0.45 * len(names) * max(1, len(settings)) / 2))
  height = 0.8 / len(settings)
  for j, (remat, dtype) in enumerate(settings):
    ys, widths = [], []
    for i, name in enumerate(names):
      r = by_key.get((name, remat, dtype))
      if r is not None and r.longest:
        ys.append(i + (j - (len(settings) - 1) / 2) * height)
        widths.append(r.longest)
    ax.barh(ys, widths, height=height, label=f"remat {remat}, {dtype}",
            color=plt.cm.tab10(j % 10))
  lengths = facts["lengths"]
  ax.set_xscale("log", base=2)
  ax.set_xlim(lengths[0] / 2, lengths[-1] * 1.5)
  ax.set_xticks(lengths, [length_label(n) for n in lengths])
  ax.minorticks_off()
  ax.set_yticks(range(len(names)), names)
  ax.invert_yaxis()
  ax.set_xlabel("longest sequence whose train step fits (batch 1)")
  ax.set_title(f"LRA Text train step in {_gb(facts['device_memory_bytes'])}: "
               f"{facts['device']}, jax {facts['jax_version']}", fontsize=9)
  ax.grid(True, axis="x", alpha=0.3)
  legend_beside(ax, fontsize=8)
  save_figure(fig, path)


# -- the command's mode ---------------------------------------------------------------------

def run_mode(values, command: str) -> int:
  """`--mode=capacity` from the parsed flags (the mode's defaults filled in)."""
  names = tuple(values.attentions) or every_encoder_variant()
  for name in names:
    check_attention(name)
  for flag, given, choices in (("remats", values.remats, REMATS),
                               ("dtypes", values.dtypes, DTYPES)):
    unknown = [v for v in given if v not in choices]
    if unknown or not given:
      raise HarnessError(f"--{flag}={','.join(given)}: choose from {', '.join(choices)}")
  try:
    lengths = candidates(values.min_length, values.max_length)
  except ValueError as e:
    raise HarnessError(str(e)) from None
  try:
    probe_lengths = tuple(int(n) for n in values.probe_lengths)
  except ValueError:
    probe_lengths = ()
  if len(probe_lengths) != 2 or min(probe_lengths) < 1 or len(set(probe_lengths)) != 2:
    raise HarnessError(f"--probe_lengths={','.join(values.probe_lengths)}: give two "
                       f"different positive lengths, e.g. 2048,4096")
  memory_limit = (values.memory_limit_gb * 1e9 if values.memory_limit_gb
                  else default_memory_limit_bytes())
  try:
    base = Settings(attentions=names, lengths=lengths, num_layers=values.num_layers,
                    emb_dim=values.emb_dim, num_heads=values.num_heads, mlp_dim=values.mlp_dim)
  except ValueError as e:
    raise HarnessError(str(e)) from None
  model = base.config(names[0], lengths[0]).model
  time_budget_s = values.time_budget_s
  dry_run.plan(lambda: [*(f"capacity {name}: lengths {lengths[0]}..{lengths[-1]}, remat "
                          f"{','.join(values.remats)}, {','.join(values.dtypes)}, steps timed: "
                          f"{values.time_steps}" for name in names),
                        f"then {values.out}/capacity.md, .csv and .png (time budget "
                        f"{time_budget_s:g} s)"])
  env = provenance.environment()
  facts = {"model": f"{dry_run.count(model.num_layers, 'layer')}, emb {model.emb_dim}, "
                    f"{dry_run.count(model.num_heads, 'head')}, MLP {model.mlp_dim}",
           "device": env["device"], "jax_version": env["versions"]["jax"], "lengths": lengths,
           "device_memory_bytes": device.device_memory_bytes(),
           "memory_limit_bytes": memory_limit,
           "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
  logging.info("capacity of %d variants on %s: device memory %.3g GB, memory limit for timing "
               "%.3g GB, lengths %d..%d, time budget %g s", len(names), env["device"],
               facts["device_memory_bytes"] / 1e9, memory_limit / 1e9, lengths[0], lengths[-1],
               time_budget_s)

  def progress(results):
    r = results[-1]
    logging.info("%-20s remat %-5s %-8s longest %s, compiled %s, step %s s at %s %s",
                 r.attention, r.remat, r.dtype, r.longest, r.compiled, r.step_s, r.timed_length,
                 r.note)
    write_outputs(results, values.out, facts=facts, command=command, plots=False)

  results = run_capacity(
      names, lengths, settings=tuple(itertools.product(values.remats, values.dtypes)),
      time_budget_s=time_budget_s, memory_limit=memory_limit,
      time_steps=values.time_steps, timed_dtypes=tuple(values.timed_dtypes or values.dtypes),
      step_budget_s=values.step_budget_s, probe_lengths=probe_lengths, base=base,
      on_result=progress)
  for kind, path in write_outputs(results, values.out, facts=facts, command=command).items():
    logging.info("wrote %s: %s", kind, path)
  return 0
