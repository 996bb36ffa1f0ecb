"""Sweep one config field over values for several variants, and plot accuracy against it: the
capacity plot of associative recall (accuracy against the number of key-value pairs, or
against the model width).

    python -m experiments.sweep --task=mqar --field=data.num_pairs --values=4,8,16,32 \
        --attentions=full,sliding_window,linear_transformer --override=model.max_len=128 \
        --out=results/mqar_sweep

Each value is a grid of experiments.reproduce under OUT/<field>=<value>/ (finished runs are
skipped, interrupted ones resume); then OUT/sweep.md, sweep.csv and sweep.png show the test
accuracy of the final model (mean over seeds) per variant and value.

`--x=state_size` plots the same accuracies against each run's recurrent state instead (Zoology's
recall-memory frontier): the floats one layer keeps per sequence to continue it
(`attention_zoo.state_size` of the run's resolved model: the KV cache of softmax attention, the
window's cache of sliding_window, the fixed state of kernelised attention and of the recurrent
mixers). Swept over the width, each variant traces its own curve:

    python -m experiments.sweep --task=mqar --field=model.emb_dim --values=32,64,128 \
        --x=state_size --attentions=full,sliding_window,linear_transformer,gated_deltanet \
        --out=results/frontier

`--tune=FIELD=V1,V2,...` (repeatable: a grid; experiments/tuning.py) trains every value of the
sweep at every point of the grid, in OUT/<field>=<value>/tune/<point>/, and each cell is the
test accuracy of the final model at the point of best mean validation accuracy of those same
models, for that variant and value; sweep.md names the chosen values, OUT/tuning.json has every
point's validation accuracy, OUT/tuning.csv a row per variant and value (tuning.csv_text:
the chosen values, the state size, where the chosen runs ran). Zoology's learning rates
(log-spaced from 1e-3 to 10^-1.5):

    python -m experiments.sweep --task=mqar --field=model.emb_dim --values=64,128 \
        --attentions=full,gated_deltanet --x=state_size --out=results/frontier_tuned \
        --tune=schedule.base_learning_rate=0.001,0.0031622777,0.01,0.031622777
"""
from __future__ import annotations

import csv
import statistics
import time
from collections import defaultdict
from pathlib import Path

from absl import flags

import attention_zoo as az
from configs.lra.common import PRESETS
from experiments import report, reproduce, tuning
from experiments.common import command_line, dry_run
from experiments.common.errors import HarnessError
from experiments.common.plots import legend_beside, pyplot, save_figure
from experiments.common.records import write_text
from lra.fileio import atomic_write

FLAGS = flags.FLAGS
METRIC = "test_accuracy_final"


def run(*, tune: dict | None = None, **sweep) -> list[str]:
  """Trains every missing run (of every point of `tune`, tuning.parse's grid); returns a line
  per failed run."""
  return reproduce.run_points(point_grids(sweep, tune))


def point_grids(sweep: dict, tune: dict | None) -> list[tuple[dict, dict]]:
  """(point, reproduce.run_grid's arguments) for each value and point of `tune`."""
  return [pair for grid in grids(**sweep) for pair in tuning.grids(grid, tune or {})]


def grids(*, task: str, preset: str, field: str, values: list[str], attentions: list[str],
          seeds: list[int], out, overrides=()) -> list[dict]:
  """reproduce.run_grid's arguments for each value: its grid under OUT/<field>=<value>/."""
  return [dict(preset=preset, tasks=[task], attentions=attentions, seeds=seeds,
               out=Path(out) / f"{field}={value}", overrides=[*overrides, f"{field}={value}"])
          for value in values]


def plan_lines(*, tune: dict | None = None, **sweep) -> list[str]:
  """A dry run's lines: every run of every value's grid, at every point of `tune` (see
  reproduce.plan_points)."""
  return reproduce.plan_points(point_grids(sweep, tune))


def collect(out, field: str, values: list[str]) -> tuple[dict, dict]:
  """({attention: {value: mean accuracy (%) or a "n/a: reason"}},
  {attention: {value: recurrent state floats per layer}}) over the finished runs."""
  table, states = defaultdict(dict), defaultdict(dict)
  for value in values:
    scores = defaultdict(list)
    for result in report.read_runs(Path(out) / f"{field}={value}" / "runs"):
      if "not_applicable" in result:
        table[result["attention"]][value] = f"n/a: {result['not_applicable']}"
      else:
        scores[result["attention"]].append(100 * result[METRIC])
        states[result["attention"]][value] = state_size(result["model"])
    for attention, accuracies in scores.items():
      table[attention][value] = statistics.mean(accuracies)
  return dict(table), dict(states)


def collect_tuned(out, field: str, values: list[str], tune: dict, asked: dict
                  ) -> tuple[dict, dict, dict, list[dict]]:
  """collect's (table, states) under --tune, each cell at the chosen point of its variant and
  value; {attention: {value: the chosen point}}; and tuning.records' records, each with the
  swept value. `asked`: the runs to read (report.read_runs' `only`)."""
  table, states, chosen, records = defaultdict(dict), defaultdict(dict), defaultdict(dict), []
  for value in values:
    folder = Path(out) / f"{field}={value}"
    for record in tuning.records(folder, tune, asked, METRIC, swept={field: value}):
      records.append(record)
      attention = record["attention"]
      if "not_applicable" in record:
        table[attention][value] = f"n/a: {record['not_applicable']}"
      elif record["chosen"] is not None:
        table[attention][value] = record["test_mean"]
        chosen[attention][value] = record["chosen"]
        runs = report.read_runs(tuning.point_dir(folder, record["chosen"]) / "runs",
                                only={**asked, "attention": [attention]})
        states[attention][value] = state_size(runs[0]["model"])
  return dict(table), dict(states), dict(chosen), records


def state_size(model: dict) -> int:
  """Recurrent state floats per layer of a run's resolved model (results.json's "model")."""
  qkv_dim = model["qkv_dim"] or model["emb_dim"]
  return az.state_size(model["attention"], emb_dim=model["emb_dim"],
                       num_heads=model["num_heads"], num_kv_heads=model["num_kv_heads"],
                       head_dim=qkv_dim // model["num_heads"], seq_len=model["max_len"],
                       options=model["attention_options"])


def write(table: dict, states: dict, out, field: str, values: list[str], task: str,
          x: str = "value", chosen: dict | None = None) -> str:
  """sweep.md (accuracy, and each run's state size with x="state_size"; under --tune the chosen
  values, `chosen` of collect_tuned), sweep.csv, sweep.png."""
  out = Path(out)
  chosen = chosen or {}
  header = ["variant"] + [f"{field}={v}" for v in values]
  accuracy = lambda x: "—" if x is None else (x if isinstance(x, str) else report.rounded(x, 1))
  if x == "state_size":
    measured = lambda a, v: (accuracy(table[a].get(v)) if v not in states.get(a, {})
                             else f"{accuracy(table[a][v])} ({states[a][v]:,})")
  else:
    measured = lambda a, v: accuracy(table[a].get(v))
  cell = lambda a, v: (f"{measured(a, v)} at {tuning.describe(chosen[a][v])}"
                       if v in chosen.get(a, {}) else measured(a, v))
  what = " (recurrent state floats per layer)" if x == "state_size" else ""
  if chosen:
    what += (", each at the values of best mean validation accuracy (of the same models) for "
             "its variant and value")
  lines = [f"### {task}: test accuracy (%) of the final model against {field}{what}", "",
           "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join([a] + [cell(a, v) for v in values]) + " |" for a in table]
  text = "\n".join(lines) + "\n"
  write_text(out / "sweep.md", text)
  with atomic_write(out / "sweep.csv", "w", newline="", encoding="utf-8") as f:
    writer = csv.writer(f)
    writer.writerow(["attention", field, "accuracy", "state_size"])
    for attention, row in table.items():
      writer.writerows([attention, v, row[v], states.get(attention, {}).get(v, "")]
                       for v in values if v in row)
  _plot(table, states, out / "sweep.png", field, values, task, x)
  return text


def _plot(table: dict, states: dict, path: Path, field: str, values: list[str], task: str,
          x: str) -> None:
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(7, 4))
  for attention, row in table.items():
    at = (lambda v: float(v)) if x == "value" else states.get(attention, {}).get
    points = sorted((at(v), row[v]) for v in values
                    if isinstance(row.get(v), float) and at(v) is not None)
    if points:
      ax.plot(*zip(*points), marker="o", label=attention)
  ax.set_xscale("log", base=2)
  xlabel = field if x == "value" else f"recurrent state per layer (floats), over {field}"
  ax.set(xlabel=xlabel, ylabel="test accuracy (%)", ylim=(0, 102), title=task)
  legend_beside(ax, fontsize="small")
  save_figure(fig, path)


def main(argv):
  if len(argv) > 1:
    raise HarnessError(f"unexpected arguments: {' '.join(argv[1:])}")
  started = time.time()
  attentions = command_line.split_names(FLAGS.attentions)
  seeds = command_line.integers(FLAGS.seeds, "seeds")
  sweep = dict(task=FLAGS.task, preset=FLAGS.preset, field=FLAGS.field, values=FLAGS.values,
               attentions=attentions, seeds=seeds, out=FLAGS.out, overrides=FLAGS.override)
  configs = reproduce.grid_configs(preset=FLAGS.preset, tasks=[FLAGS.task],
                                   attentions=attentions[:1], seeds=seeds[:1])
  tune = tuning.parse(FLAGS.tune, next(iter(configs.values()), None),
                      {**tuning.overridden(FLAGS.override),
                       FLAGS.field: "it is the swept field (--field)"})
  then = f"then {FLAGS.out}/sweep.md, sweep.csv and sweep.png (x: {FLAGS.x})"
  dry_run.plan(lambda: [*plan_lines(tune=tune, **sweep),
                    then + (", the chosen values in tuning.json and tuning.csv" if tune else "")])
  failures = run(tune=tune, **sweep)
  if tune:
    asked = {"preset": [FLAGS.preset], "task": [FLAGS.task], "attention": attentions,
             "seed": seeds}
    table, states, chosen, records = collect_tuned(FLAGS.out, FLAGS.field, FLAGS.values, tune,
                                                   asked)
    tuning.write_records(records, FLAGS.out)
    write_text(Path(FLAGS.out) / "tuning.csv", tuning.csv_text(records, tune, states))
  else:
    (table, states), chosen = collect(FLAGS.out, FLAGS.field, FLAGS.values), {}
  print(write(table, states, FLAGS.out, FLAGS.field, FLAGS.values, FLAGS.task, FLAGS.x, chosen))
  print(f"wrote {FLAGS.out}/sweep.md, sweep.csv, sweep.png"
        f"{', tuning.json, tuning.csv' if tune else ''}; "
        f"wall time {time.time() - started:.0f} s")
  if failures:
    raise HarnessError(f"{len(failures)} run(s) failed: " + "; ".join(failures))


if __name__ == "__main__":
  flags.DEFINE_string("task", "mqar", "The task to sweep.")
  # A string: the task's get_config refuses a misspelt one, as experiments.train does.
  flags.DEFINE_string("preset", "tiny", f"The task config's preset ({', '.join(PRESETS)}).")
  flags.DEFINE_string("field", "data.num_pairs", "The config field to sweep (dotted).")
  flags.DEFINE_list("values", ["4", "8", "16", "32"], "Its values.")
  flags.DEFINE_list("attentions", ["full", "sliding_window", "linear_transformer"],
                    "Attention variants.")
  flags.DEFINE_list("seeds", ["0"], "Seeds; the plot shows the mean over them.")
  flags.DEFINE_enum("x", "value", ["value", "state_size"],
                    "The plot's x axis: the swept value, or each run's recurrent state size.")
  flags.DEFINE_multi_string("override", [], "field=value applied to every config.")
  flags.DEFINE_multi_string("tune", [], tuning.HELP)
  flags.DEFINE_string("out", "results/mqar_sweep", "Output folder.")
  flags.DEFINE_list("plugins", [], "Modules to import first; they may register attention variants.")
  command_line.run(main)
