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
from experiments import cli, provenance, report, reproduce
from lra.fileio import atomic_write

FLAGS = flags.FLAGS
METRIC = "test_accuracy_final"


def run(*, task: str, preset: str, field: str, values: list[str], attentions: list[str],
        seeds: list[int], out, overrides=()) -> list[str]:
  """Trains every missing run; returns a line per failed run."""
  failures = []
  for grid in grids(task=task, preset=preset, field=field, values=values,
                    attentions=attentions, seeds=seeds, out=out, overrides=overrides):
    failures += reproduce.run_grid(**grid)
  return failures


def grids(*, task: str, preset: str, field: str, values: list[str], attentions: list[str],
          seeds: list[int], out, overrides=()) -> list[dict]:
  """reproduce.run_grid's arguments for each value: its grid under OUT/<field>=<value>/."""
  return [dict(preset=preset, tasks=[task], attentions=attentions, seeds=seeds,
               out=Path(out) / f"{field}={value}", overrides=[*overrides, f"{field}={value}"])
          for value in values]


def plan_lines(**sweep) -> list[str]:
  """A dry run's lines: every run of every value's grid (see reproduce.plan_lines)."""
  lines = []
  for grid in grids(**sweep):
    out = grid.pop("out")
    lines += reproduce.plan_lines(reproduce.grid_with_own_options(**grid), out)
  return lines


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


def state_size(model: dict) -> int:
  """Recurrent state floats per layer of a run's resolved model (results.json's "model")."""
  qkv_dim = model["qkv_dim"] or model["emb_dim"]
  return az.state_size(model["attention"], emb_dim=model["emb_dim"],
                       num_heads=model["num_heads"], num_kv_heads=model["num_kv_heads"],
                       head_dim=qkv_dim // model["num_heads"], seq_len=model["max_len"],
                       options=model["attention_options"])


def write(table: dict, states: dict, out, field: str, values: list[str], task: str,
          x: str = "value") -> str:
  """sweep.md (accuracy, and each run's state size with x="state_size"), sweep.csv, sweep.png."""
  out = Path(out)
  header = ["variant"] + [f"{field}={v}" for v in values]
  accuracy = lambda x: "—" if x is None else (x if isinstance(x, str) else report.rounded(x, 1))
  if x == "state_size":
    cell = lambda a, v: (accuracy(table[a].get(v)) if v not in states.get(a, {})
                         else f"{accuracy(table[a][v])} ({states[a][v]:,})")
  else:
    cell = lambda a, v: accuracy(table[a].get(v))
  what = " (recurrent state floats per layer)" if x == "state_size" else ""
  lines = [f"### {task}: test accuracy (%) of the final model against {field}{what}", "",
           "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join([a] + [cell(a, v) for v in values]) + " |" for a in table]
  text = "\n".join(lines) + "\n"
  provenance.write_text(out / "sweep.md", text)
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
  plt = provenance.pyplot()
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
  provenance.legend_beside(ax, fontsize="small")
  provenance.save_figure(fig, path)


def main(argv):
  if len(argv) > 1:
    raise cli.HarnessError(f"unexpected arguments: {' '.join(argv[1:])}")
  started = time.time()
  attentions = cli.split_names(FLAGS.attentions)
  seeds = cli.parse_seeds(FLAGS.seeds)
  sweep = dict(task=FLAGS.task, preset=FLAGS.preset, field=FLAGS.field, values=FLAGS.values,
               attentions=attentions, seeds=seeds, out=FLAGS.out, overrides=FLAGS.override)
  cli.plan(lambda: [*plan_lines(**sweep), f"then {FLAGS.out}/sweep.md, sweep.csv and sweep.png "
                                          f"(x: {FLAGS.x})"])
  failures = run(**sweep)
  table, states = collect(FLAGS.out, FLAGS.field, FLAGS.values)
  print(write(table, states, FLAGS.out, FLAGS.field, FLAGS.values, FLAGS.task, FLAGS.x))
  print(f"wrote {FLAGS.out}/sweep.md, sweep.csv and sweep.png; wall time "
        f"{time.time() - started:.0f} s")
  if failures:
    raise cli.HarnessError(f"{len(failures)} run(s) failed: " + "; ".join(failures))


if __name__ == "__main__":
  flags.DEFINE_string("task", "mqar", "The task to sweep.")
  flags.DEFINE_enum("preset", "tiny", PRESETS, "The task config's preset.")
  flags.DEFINE_string("field", "data.num_pairs", "The config field to sweep (dotted).")
  flags.DEFINE_list("values", ["4", "8", "16", "32"], "Its values.")
  flags.DEFINE_list("attentions", ["full", "sliding_window", "linear_transformer"],
                    "Attention variants.")
  flags.DEFINE_list("seeds", ["0"], "Seeds; the plot shows the mean over them.")
  flags.DEFINE_enum("x", "value", ["value", "state_size"],
                    "The plot's x axis: the swept value, or each run's recurrent state size.")
  flags.DEFINE_multi_string("override", [], "field=value applied to every config.")
  flags.DEFINE_string("out", "results/mqar_sweep", "Output folder.")
  flags.DEFINE_list("plugins", [], "Modules to import first; they may register attention variants.")
  cli.run(main)
