"""The benchmark's outputs, each written atomically (a crash leaves the old file or the new one):
benchmark_<mode>.csv (one row per variant and length), .md (train mode: LRA Table 2's layout
with the paper's published figures beside ours; attention mode: times, memory, speed-ups
against both baselines and the exact variants' FLOP rates), .json, and _time.png /
_memory.png (log-log, with the fitted exponent per variant). Every row carries the run's facts
(ENVIRONMENT); capacity.py and ops.py write their tables with the same helpers."""
from __future__ import annotations

import csv
import dataclasses
import json
import os

import jax
import numpy as np

from configs.lra.paper_tables import TABLE2 as PAPER_TABLE2
from configs.lra.paper_tables import TABLE2_LENGTHS as PAPER_TABLE2_LENGTHS
from configs.lra.paper_tables import TABLE2_SPEEDUPS as PAPER_TABLE2_SPEEDUPS
from experiments.benchmark.settings import BASELINE, JAX_BASELINE, Settings, Status, length_label
from experiments.common import provenance, records
from experiments.common.plots import legend_beside, pyplot, save_figure
from lra.fileio import atomic_write

# The run's facts each benchmark row carries (and the CSVs list).
ENVIRONMENT = ("device", "host", "backend", "jax_version", "xla_flags", "date")

CSV_COLUMNS = (
    "attention", "length", "status", "note", "step_ms", "steps_per_s", "speedup_vs_full",
    "speedup_vs_jax", "speedup_vs_best", "fwd_ms", "fwd_speedup_vs_full", "first_call_ms",
    "temp_bytes", "temp_bytes_fwd", "compiled_total_bytes", "resident_bytes",
    "flops", "flops_fwd", "flops_lower_bound", "rate_flops", "flops_source", "gflops_per_s",
    "fraction_of_matmul", "matmul_gflops",
    "device_peak_bytes", "device_peak_set_here", "time_exponent", "memory_exponent", "setup_s",
    "compile_s", "run_s", "mode", "dtype", "remat", "batch_size", "options", *ENVIRONMENT)


def output_paths(out_dir: str, mode: str) -> dict[str, str]:
  stem = os.path.join(out_dir, f"benchmark_{mode}")
  return {"csv": stem + ".csv", "markdown": stem + ".md", "json": stem + ".json",
          "time_plot": stem + "_time.png", "memory_plot": stem + "_memory.png"}


def write_outputs(rows: list[dict], settings: Settings, out_dir: str, *, command: str = "",
                  plots: bool = True) -> dict[str, str]:
  """CSV, markdown, JSON and (with `plots`) the two PNGs; the paths by kind."""
  paths = output_paths(out_dir, settings.mode)
  write_csv(rows, paths["csv"], CSV_COLUMNS)
  records.write_text(paths["markdown"], markdown(rows, settings, command=command))
  records.write_text(paths["json"], json.dumps(
      {"settings": {**dataclasses.asdict(settings), "command": command},
       "environment": environment_of(rows), "rows": rows}, indent=1, default=str) + "\n")
  if not plots:
    return {kind: path for kind, path in paths.items() if not kind.endswith("_plot")}
  title = (f"{settings.mode} mode, batch {settings.batch_size}, {settings.dtype}, "
           f"remat {settings.remat}")
  time_label = "time per train step (ms)" if settings.mode == "train" else \
      "forward+backward time (ms)"
  plot_lengths(rows, "step_ms", time_label, paths["time_plot"], title)
  plot_lengths(rows, "temp_bytes", "compiled temporary memory (bytes)", paths["memory_plot"],
               title)
  return paths


def run_environment() -> dict:
  """provenance.environment()'s facts a benchmark row carries, with jax's backend and version and
  the XLA flags in use."""
  env = provenance.environment()
  env.update(backend=jax.default_backend(), jax_version=jax.__version__,
             xla_flags=os.environ.get("XLA_FLAGS", ""))
  return {key: env[key] for key in ENVIRONMENT}


def environment_of(rows) -> dict[str, str]:
  return {key: rows[0][key] for key in ENVIRONMENT} if rows else run_environment()


def write_csv(rows: list[dict], path: str, columns) -> None:
  with atomic_write(path, "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    for row in rows:
      writer.writerow({k: _csv_value(row.get(k)) for k in columns})


def _csv_value(value):
  if value is None:
    return ""
  if isinstance(value, Status):
    return value.value
  if isinstance(value, float):
    return f"{value:.6g}"
  return value


def markdown(rows: list[dict], settings: Settings, *, command: str = "") -> str:
  env = environment_of(rows)
  train = settings.mode == "train"
  what = ("a train step of the LRA Text model as the trainer runs it (configs/lra/text.py, "
          "fair preset: forward, backward, AdamW update; dropout on)" if train else
          "the Text model's attention module alone, forward+backward")
  memory = ("the train step's" if train else "forward+backward's")
  lines = [
      f"# Efficiency benchmark ({settings.mode} mode)", "",
      f"- Device: {env['device']}, {env['host']}; jax {env['jax_version']}; {env['date']}"
      + (f"; XLA_FLAGS=`{env['xla_flags']}`" if env["xla_flags"] else ""),
      f"- Measured: {what}; batch {settings.batch_size}, {settings.dtype}, remat "
      f"{settings.remat}; options as in the CSV.",
      f"- Times: median of {settings.repeats} timed calls after {settings.warmup} warm-up "
      "call(s)" + (f"; (Nx) = speed-up vs `{BASELINE}` measured in the same process."
                   if train else "."),
      f"- Memory: {memory} compiled temporary memory (`memory_analysis().temp_size_in_bytes`); "
      "parameters, optimizer state and inputs excluded.",
      "- Exponents: least-squares slope of log(time) and log(memory) against log(length) "
      "(time over the lengths that ran, memory over those that compiled).",
  ]
  if command:
    lines.append(f"- Command: `{command}`")
  lines += _train_tables(rows) if train else _attention_tables(rows, env)
  notes = [r for r in rows if r["status"] is not Status.OK]
  if notes:
    lines += ["", "## Not measured", ""]
    lines += [f"- {r['attention']} @ {length_label(r['length'])}: {r['status'].value}: "
              f"{r.get('note', '')}" for r in notes]
  return "\n".join(lines) + "\n"


def _grid(rows):
  lengths = sorted({r["length"] for r in rows})
  names = list(dict.fromkeys(r["attention"] for r in rows))
  return lengths, names, {(r["attention"], r["length"]): r for r in rows}


def _train_tables(rows) -> list[str]:
  """LRA Table 2 layout: steps/s (speed-up vs full) per length, then memory per length (GB)."""
  lengths, names, by_key = _grid(rows)
  header = (["Model"] + [length_label(n) for n in lengths]
            + [("Mem " if i == 0 else "") + length_label(n) for i, n in enumerate(lengths)]
            + ["time exponent", "memory exponent"])
  lines = ["", "## Ours", "", table_row(header), table_row(["---"] * len(header))]
  for name in names:
    cells = [name]
    for n in lengths:
      cells.append(_speed_cell(by_key.get((name, n)), name, by_key.get((BASELINE, n))))
    for n in lengths:
      cells.append(_memory_cell(by_key.get((name, n), {}), 1e9, ".3g"))
    first = by_key[(name, lengths[0])]
    cells += [_fmt(first.get("time_exponent")), _fmt(first.get("memory_exponent"))]
    lines.append(table_row(cells))
  lines += _peaks(rows)
  lines += ["", "## The paper's Table 2 (published figures, quoted, not measured here)", "",
            "Tay et al. 2021 (arXiv:2011.04006), LRA Text, batch 32, TPU v3: steps/s (speed-up "
            "vs Transformer), then peak memory in GB.", ""]
  paper_header = (["Model (ours = paper)"] + [length_label(n) for n in PAPER_TABLE2_LENGTHS]
                  + [("Mem " if i == 0 else "") + length_label(n)
                     for i, n in enumerate(PAPER_TABLE2_LENGTHS)])
  lines += [table_row(paper_header), table_row(["---"] * len(paper_header))]
  for name in names:
    if name not in PAPER_TABLE2:
      continue
    title, steps, memory = PAPER_TABLE2[name]
    speedups = PAPER_TABLE2_SPEEDUPS.get(name)
    speed = [f"{s:.1f}" + (f" ({speedups[i]:.1f}x)" if speedups else "")
             for i, s in enumerate(steps)]
    lines.append(table_row([f"{name} = {title}"] + speed + [f"{m:.2f}" for m in memory]))
  absent = [n for n in names if n not in PAPER_TABLE2]
  if absent:
    lines += ["", f"Not in the paper's Table 2: {', '.join(absent)}."]
  return lines


def _attention_tables(rows, env) -> list[str]:
  """Times with speed-ups against full and the jax baseline, memory against full's, then the
  exact variants' FLOP rates against the matmul limit."""
  lengths, names, by_key = _grid(rows)
  header = ["variant"]
  for n in lengths:
    header += [f"fwd+bwd ms {length_label(n)}", "vs jax.nn", "speed-up"]
  for n in lengths:
    header += [f"temp MB {length_label(n)}", "% of full"]
  lines = ["", "## Ours", "",
           f"`{JAX_BASELINE}` is jax.nn.dot_product_attention(implementation=\"xla\"), the "
           "same shapes, measured in the same process. vs jax.nn = its time / the variant's "
           f"(`{BASELINE}`'s row: full against jax.nn); speed-up = the faster of `{BASELINE}` "
           "and jax.nn's time / the variant's (above 1: faster than both).", "",
           table_row(header + ["time exponent", "memory exponent"]),
           table_row(["---"] * (len(header) + 2))]
  for name in names:
    cells = [name]
    for n in lengths:
      row = by_key.get((name, n), {})
      if row.get("step_ms") is None:
        cells += [row.get("status", Status.NOT_TRIED).label, "", ""]
      else:
        cells += [f"{row['step_ms']:.4g}", _ratio(row.get("speedup_vs_jax")),
                  _ratio(row.get("speedup_vs_best"))]
    for n in lengths:
      row, full = by_key.get((name, n), {}), by_key.get((BASELINE, n), {})
      cells.append(_memory_cell(row, 1e6, ".1f"))
      share = row.get("temp_bytes") and full.get("temp_bytes") and \
          row["temp_bytes"] / full["temp_bytes"]
      cells.append(f"{100 * share:.1f}%" if share else "")
    first = by_key[(name, lengths[0])]
    lines.append(table_row(cells + [_fmt(first.get("time_exponent")),
                               _fmt(first.get("memory_exponent"))]))
  lines += _peaks(rows)
  rated = [name for name in names if any(by_key.get((name, n), {}).get("gflops_per_s")
                                         for n in lengths)]
  if rated:
    limit = env.get("matmul_gflops") or rows[0].get("matmul_gflops")
    lines += ["", "## FLOP rate of the exact variants", "",
              (f"Matmul limit: {limit:.4g} GFLOP/s (experiments/common/device.py matmul_gflops, a "
               "square matmul in this dtype). " if limit else "")
              + "Every exact variant is counted nominally over the (query, key) pairs it keeps, "
              "3.5 x 4·d FLOPs a pair for forward+backward (the FlashAttention papers' count): "
              "n² pairs a head for dense attention (full, flash, the jax baseline), the pairs "
              "of the engine's block masks for a sparse one (experiments/benchmark/pairs.py). "
              "XLA / nominal: XLA's cost analysis over that count, a cross-check only (it counts "
              "a loop's body once, so the blockwise variants show far below 1).", ""]
    rate_header = ["variant", "FLOPs counted by"]
    for n in lengths:
      rate_header += [f"GFLOP/s {length_label(n)}", "of matmul limit", "XLA / nominal"]
    lines += [table_row(rate_header), table_row(["---"] * len(rate_header))]
    for name in rated:
      measured = [by_key.get((name, n), {}) for n in lengths]
      source = next(r["flops_source"] for r in measured if r.get("flops_source"))
      cells = [name, source]
      for row in measured:
        fraction = row.get("fraction_of_matmul")
        cross_check = row.get("flops") and row.get("rate_flops") and \
            row["flops"] / row["rate_flops"]
        cells += [_fmt(row.get("gflops_per_s"), ".3g"),
                  f"{100 * fraction:.1f}%" if fraction else "", _fmt(cross_check, ".2g")]
      lines.append(table_row(cells))
  return lines


def _peaks(rows) -> list[str]:
  peaks = [r for r in rows if r.get("device_peak_set_here")]
  if not peaks:
    return []
  return ["", "Device peak memory (`memory_stats()['peak_bytes_in_use']`, GB) where a measurement "
          "raised the process's high-water mark (a smaller run's own peak cannot be read back):",
          ""] + [f"- {r['attention']} @ {length_label(r['length'])}: "
                 f"{r['device_peak_bytes'] / 1e9:.3g}" for r in peaks]


def _speed_cell(row, name, baseline) -> str:
  """steps/s, with the speed-up vs full, or why there is none (full did not run here)."""
  if row is None:
    return ""
  if row["status"] is not Status.OK:
    return row["status"].label
  cell = f"{row['steps_per_s']:.3g}"
  if name == BASELINE:
    return cell
  if row.get("speedup_vs_full") is not None:
    return cell + f" ({row['speedup_vs_full']:.1f}x)"
  return cell + f" (full {baseline['status'].label if baseline else 'not measured'})"


def _memory_cell(row, unit: float, spec: str) -> str:
  """The temp memory; with the status when it compiled but did not run."""
  status = row.get("status")
  if row.get("temp_bytes") is None:
    return status.label if status else ""
  cell = format(row["temp_bytes"] / unit, spec)
  return cell if status is Status.OK else f"{cell} ({status.label})"


def _ratio(value) -> str:
  return "" if value is None else f"{value:.2f}x"


def _fmt(value, spec: str = ".2f") -> str:
  return "" if value is None else format(value, spec)


def fit_exponent(lengths, values) -> float | None:
  """Slope of log(value) against log(length), least squares; None with fewer than two
  lengths."""
  points = [(n, v) for n, v in zip(lengths, values) if v is not None and v > 0]
  if len({n for n, _ in points}) < 2:
    return None
  x = np.log([n for n, _ in points])
  y = np.log([v for _, v in points])
  return float(np.polyfit(x, y, 1)[0])


def table_row(cells) -> str:
  return "| " + " | ".join(str(c) for c in cells) + " |"


def plot_lengths(rows: list[dict], key: str, ylabel: str, path: str, title: str) -> None:
  """Log-log `key` against length per variant, the fitted slope in the legend (times only of
  the measurements that ran; memory of all that compiled)."""
  plt = pyplot()
  env = environment_of(rows)
  fig, ax = plt.subplots(figsize=(9, 5))
  markers = "osD^v<>ph*X"   # with 20 colours, no two variants look alike
  for i, name in enumerate(dict.fromkeys(r["attention"] for r in rows)):
    points = [(r["length"], r.get(key)) for r in rows if r["attention"] == name
              and r.get(key) and (r["status"] is Status.OK or key != "step_ms")]
    if not points:
      continue
    slope = fit_exponent(*zip(*points))
    label = name if slope is None else f"{name} (slope {slope:.2f})"
    style = {BASELINE: dict(color="black", linestyle="--", linewidth=2),
             JAX_BASELINE: dict(color="grey", linestyle=":", linewidth=2)}.get(
                 name, dict(color=plt.cm.tab20(i % 20)))
    ax.plot(*zip(*points), marker=markers[i % len(markers)], label=label, **style)
  ax.set_xscale("log", base=2)
  lengths = sorted({r["length"] for r in rows})
  ax.set_xticks(lengths, [length_label(n) for n in lengths])
  ax.minorticks_off()
  ax.set_yscale("log")
  ax.set_xlabel("sequence length")
  ax.set_ylabel(ylabel)
  ax.set_title(f"{title}\n{env['device']}, jax {env['jax_version']}, {env['date'][:10]}",
               fontsize=9)
  ax.grid(True, which="both", alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    legend_beside(ax, fontsize=8)
  save_figure(fig, path)
