"""The context_parallel mode: how long a sequence each variant trains on as devices are added.
For every variant and device count (1, 2, 4, 8), the longest power-of-two length whose
Text-model train step (the trainer's, experiments/train/steps.py) fits a memory budget per
device, and the time of a step at one length against one device's.

On d > 1 devices the step runs on a mesh (experiments/train/mesh.py), traced and compiled under
it as the trainer runs it:
  context d      batch 1, the sequence split over d devices: for a variant whose spec has
                 `supports_context_parallel` (its context-parallel form: ring attention, a scan
                 of per-shard states, reduced sums; docs/scaling.md)
  fsdp d         for every other variant, reported "context: not supported": batch d (a
                 sequence per device), parameters and optimiser state split over the d devices;
                 the longest length per device barely moves, which is the point of the
                 comparison
The memory is the compiled program's, per device (`memory_analysis()`: arguments + outputs -
aliased + temporaries), decided from shapes and compiles alone by capacity.py's LengthSearch:
nothing that might not fit is run. The memory column is the claim.

Step time: one step at --lengths' first length (default 4K) on d devices over the step on one
device (batch 1 under context, d under fsdp: the same work per device). On CPU the devices are
simulated (--xla_force_host_platform_device_count, which this mode sets before JAX starts): they
share the host's cores and exchange data through its memory, so these times say nothing about
a network; only the memory column carries over to accelerators.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import os
import time

import jax
from absl import logging

import attention_zoo as az
from experiments.benchmark.capacity import LengthSearch, candidates, time_step
from experiments.benchmark.outputs import table_row, write_csv
from experiments.benchmark.settings import Settings, every_encoder_variant, length_label
from experiments.benchmark.train_step import train_workload
from experiments.common import device, dry_run, provenance, records
from experiments.common.command_line import integers
from experiments.common.errors import HarnessError
from experiments.common.variant_names import check_attention

DEVICE_COUNTS = (1, 2, 4, 8)
COUNT_FLAG = "--xla_force_host_platform_device_count"


@dataclasses.dataclass
class Row:
  attention: str
  devices: int
  mesh: str                          # "one device", "context d", "fsdp d"
  batch_size: int
  longest: int | None = None         # the longest candidate within the budget per device
  longest_bytes: int | None = None   # its compiled memory per device
  complete: bool = True              # False: the time budget stopped the search
  timed_length: int | None = None
  step_s: float | None = None
  note: str = ""


def mesh_for(name: str, devices: int) -> tuple[dict[str, int], int, str]:
  """({axis: size}, batch size, label) of `devices` devices for variant `name`."""
  if devices == 1:
    return {}, 1, "one device"
  if az.spec(name).supports_context_parallel:
    return {"context": devices}, 1, f"context {devices}"
  return {"fsdp": devices}, devices, f"fsdp {devices}"


def measure(name: str, devices: int, lengths, *, budget_bytes: float, timed_length: int | None,
            base: Settings, deadline: float = math.inf, step_budget_s: float = math.inf) -> Row:
  """One variant on `devices` devices: the length search, then one timed step."""
  sizes, batch_size, label = mesh_for(name, devices)
  settings = dataclasses.replace(base, attentions=(name,), lengths=tuple(lengths),
                                 batch_size=batch_size, mode="train")
  workloads, compiled, total_bytes = {}, {}, {}

  def workload(length):
    if length not in workloads:
      workloads[length] = train_workload(name, length, settings, sizes)
    return workloads[length]

  def compiled_bytes(length):
    compiled[length] = workload(length).programs["step"].compile()
    found = device.compiled_memory(compiled[length])
    if found is None:
      raise HarnessError(f"{jax.default_backend()} gives no memory_analysis(): the longest "
                         "length cannot be decided")
    total_bytes[length] = found.total_bytes
    return found.total_bytes

  row = Row(name, devices, label, batch_size)
  search = LengthSearch(lengths, lambda n: workload(n).resident_bytes, compiled_bytes, deadline)
  row.longest, row.complete = search.longest(budget_bytes)
  if row.longest is not None:
    row.longest_bytes = search.compiled[row.longest]
  if timed_length is None:
    return row
  if time.monotonic() > deadline:
    row.note = "not timed: over the time budget"
    return row
  if timed_length not in compiled:
    compiled_bytes(timed_length)
  if total_bytes[timed_length] > budget_bytes:
    row.note = f"not timed: {length_label(timed_length)} exceeds the budget"
    return row
  row.timed_length = timed_length
  row.step_s, _ = time_step(workload(timed_length), compiled[timed_length], step_budget_s)
  return row


def simulate_devices(count: int) -> None:
  """`count` simulated CPU devices, unless XLA_FLAGS sets their number already: read when JAX's
  CPU backend starts, so call it before anything asks JAX for a device (an accelerator's
  devices are what they are)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if COUNT_FLAG not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {COUNT_FLAG}={count}".strip()


def ensure_devices(count: int) -> None:
  """HarnessError unless this process has `count` devices, saying how to get them."""
  if jax.device_count() < count:
    raise HarnessError(
        f"--device_counts asks for {count} devices; this process has {jax.device_count()} "
        f"{jax.default_backend()} devices: use fewer, or on CPU start it with "
        f"XLA_FLAGS={COUNT_FLAG}={count}")


# -- outputs ----------------------------------------------------------------------------------

CSV_COLUMNS = ("attention", "devices", "mesh", "batch_size", "longest", "longest_bytes",
               "complete", "timed_length", "step_s", "note", "device", "budget_bytes",
               "jax_version", "date")


def _gb(n: float) -> str:
  return f"{n / 1e9:.3g} GB"


def _longest_cell(row: Row, lengths) -> str:
  supported = row.devices == 1 or row.mesh.startswith("context")
  where = "" if supported else f"context: not supported; {row.mesh}, batch {row.batch_size}: "
  if row.longest is None:
    return where + (f"< {length_label(lengths[0])}" if row.complete else "not searched")
  cell = ("≥ " if not row.complete else "") + length_label(row.longest)
  if row.longest == lengths[-1] and row.complete:
    cell += " (the longest tried)"
  return f"{where}{cell} ({_gb(row.longest_bytes)})"


def _ratio_cell(row: Row, one: Row | None) -> str:
  if row.step_s is None:
    return row.note
  if one is None or one.step_s is None:
    return f"{row.step_s:.3g} s"
  return f"{row.step_s / one.step_s:.2f} ({row.step_s:.3g} s)"


def markdown(rows: list[Row], facts: dict, *, command: str = "") -> str:
  lengths, counts = facts["lengths"], facts["device_counts"]
  names = list(dict.fromkeys(r.attention for r in rows))
  by_key = {(r.attention, r.devices): r for r in rows}
  header = ["variant"] + [f"{d} device{'s' if d > 1 else ''}" for d in counts]
  lines = [
      "# Context parallelism: the longest LRA Text train step per device count", "",
      f"- Device: {facts['device']}; jax {facts['jax_version']}; {facts['date']}.",
      f"- Model: the trainer's train step of the LRA Text model (configs/lra/text.py, fair "
      f"preset: {facts['model']}, mean pooling, AdamW), lengths {length_label(lengths[0])}–"
      f"{length_label(lengths[-1])} (powers of two).",
      f"- Longest: the longest length whose compiled step fits {_gb(facts['budget_bytes'])} per "
      "device (`memory_analysis()` per device: arguments + outputs - aliased + temporaries), "
      "decided from shapes and compiles alone. context d: batch 1, the sequence split over d "
      "devices; a variant without `supports_context_parallel` is shown on fsdp d instead "
      "(batch d, parameters and optimiser state split).",
      "- Step time: a step at the timed length on d devices over the step on one device (the "
      "same work per device under fsdp). On simulated CPU devices these times say nothing "
      "about a network: the devices share the host's cores and memory. The memory column is "
      "the claim.",
  ]
  if command:
    lines.append(f"- Command: `{command}`")
  lines += ["", "## Longest length within the budget per device", "", table_row(header),
            table_row(["---"] * len(header))]
  for name in names:
    lines.append(table_row([name] + [_longest_cell(by_key[(name, d)], lengths)
                                       if (name, d) in by_key else "" for d in counts]))
  lines += ["", "## Step time against one device", "", table_row(header),
            table_row(["---"] * len(header))]
  for name in names:
    lines.append(table_row([name] + [_ratio_cell(by_key[(name, d)], by_key.get((name, 1)))
                                       if (name, d) in by_key else "" for d in counts]))
  return "\n".join(lines) + "\n"


def write_outputs(rows: list[Row], out_dir: str, *, facts: dict, command: str = "") -> dict:
  paths = {"csv": f"{out_dir}/benchmark_context_parallel.csv",
           "markdown": f"{out_dir}/benchmark_context_parallel.md"}
  plain = {k: v for k, v in facts.items() if k in CSV_COLUMNS}
  write_csv([{**dataclasses.asdict(r), **plain} for r in rows], paths["csv"], CSV_COLUMNS)
  records.write_text(paths["markdown"], markdown(rows, facts, command=command))
  return paths


# -- the command's mode -----------------------------------------------------------------------

def run_mode(values, command: str) -> int:
  """`--mode=context_parallel` from the parsed flags (the mode's defaults filled in)."""
  counts = tuple(integers(values.device_counts, "device_counts"))
  if not counts or min(counts) < 1:
    raise HarnessError(f"--device_counts={','.join(values.device_counts)}: give positive "
                       "device counts, e.g. 1,2,4,8")
  simulate_devices(max(counts))   # first: building the settings may start JAX's backend
  names = tuple(values.attentions) or every_encoder_variant()
  for name in names:
    check_attention(name)
  try:
    lengths = candidates(values.min_length, values.max_length)
    # Mean pooling on every device count: a CLS token would add a position to the
    # sequence that the context shards could not split.
    base = Settings(attentions=names, lengths=lengths, num_layers=values.num_layers,
                    emb_dim=values.emb_dim, num_heads=values.num_heads, mlp_dim=values.mlp_dim,
                    dtype=values.dtype, remat=values.remat, seed=values.seed, pooling="mean")
  except ValueError as e:
    raise HarnessError(str(e)) from None
  timed = integers(values.lengths, "lengths")[0] if values.time_steps else None
  if timed is not None and timed not in lengths:
    raise HarnessError(f"--lengths={timed}: the timed length must be one of the searched "
                       f"lengths {', '.join(map(str, lengths))}")
  dry_run.plan(lambda: [*(f"context_parallel {name}: "
                          + ", ".join(mesh_for(name, d)[2] for d in counts)
                          + f"; lengths {lengths[0]}..{lengths[-1]}" for name in names),
                        f"then {values.out}/benchmark_context_parallel.md and .csv"])
  ensure_devices(max(counts))
  budget = (values.memory_limit_gb * 1e9 if values.memory_limit_gb
            else device.device_memory_bytes() / (jax.local_device_count()
                                                 if jax.default_backend() == "cpu" else 1))
  model = base.config(names[0], lengths[0]).model
  env = provenance.environment()
  facts = {"model": f"{dry_run.count(model.num_layers, 'layer')}, emb {model.emb_dim}, "
                    f"{dry_run.count(model.num_heads, 'head')}, MLP {model.mlp_dim}",
           "device": env["device"], "jax_version": env["versions"]["jax"], "lengths": lengths,
           "device_counts": counts, "budget_bytes": budget,
           "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
  deadline = time.monotonic() + values.time_budget_s
  rows = []
  for name in names:
    for count in counts:
      rows.append(measure(name, count, lengths, budget_bytes=budget, timed_length=timed,
                          base=base, deadline=deadline, step_budget_s=values.step_budget_s))
      r = rows[-1]
      logging.info("%-20s %-10s longest %s (%s bytes), step %s s %s", name, r.mesh, r.longest,
                   r.longest_bytes, r.step_s, r.note)
      write_outputs(rows, values.out, facts=facts, command=command)
  for kind, path in write_outputs(rows, values.out, facts=facts, command=command).items():
    logging.info("wrote %s: %s", kind, path)
  return 0
