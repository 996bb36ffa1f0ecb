"""Sweep one config field over values for several variants, and plot accuracy against it: the
capacity plot of associative recall (accuracy against the number of key-value pairs, or
against the model width).

    python -m experiments.sweep --task=mqar --field=data.num_pairs --values=4,8,16,32 \
        --attentions=full,sliding_window,linear_transformer --override=model.max_len=128 \
        --out=results/mqar_sweep

Each value is a grid of experiments.reproduce under OUT/<field>=<value>/ (finished runs are
skipped, interrupted ones resume); then OUT/sweep.md, sweep.csv and sweep.png show the test
accuracy of the final model (mean over seeds) per variant and value.
"""
from __future__ import annotations

import csv
import statistics
import time
from collections import defaultdict
from pathlib import Path

from absl import flags

from configs.lra.common import PRESETS
from experiments import cli, plugins, provenance, report, reproduce

FLAGS = flags.FLAGS
METRIC = "test_accuracy_final"


def run(*, task: str, preset: str, field: str, values: list[str], attentions: list[str],
        seeds: list[int], out, overrides=()) -> list[str]:
  """Trains every missing run; returns a line per failed run."""
  failures = []
  for value in values:
    failures += reproduce.run_grid(preset=preset, tasks=[task], attentions=attentions,
                                   seeds=seeds, out=Path(out) / f"{field}={value}",
                                   overrides=[*overrides, f"{field}={value}"])
  return failures


def collect(out, field: str, values: list[str]) -> dict:
  """{attention: {value: mean accuracy (%) or a "n/a: reason"}} over the finished runs."""
  table = defaultdict(dict)
  for value in values:
    scores = defaultdict(list)
    for result in report.read_runs(Path(out) / f"{field}={value}" / "runs"):
      if "not_applicable" in result:
        table[result["attention"]][value] = f"n/a: {result['not_applicable']}"
      else:
        scores[result["attention"]].append(100 * result[METRIC])
    for attention, accuracies in scores.items():
      table[attention][value] = statistics.mean(accuracies)
  return dict(table)


def write(table: dict, out, field: str, values: list[str], task: str) -> str:
  out = Path(out)
  header = ["variant"] + [f"{field}={v}" for v in values]
  cell = lambda x: "—" if x is None else (x if isinstance(x, str) else f"{x:.1f}")
  lines = [f"### {task}: test accuracy (%) of the final model against {field}", "",
           "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join([a] + [cell(row.get(v)) for v in values]) + " |"
            for a, row in table.items()]
  text = "\n".join(lines) + "\n"
  provenance.write_text(out / "sweep.md", text)
  with provenance.atomic_file(out / "sweep.csv", "w", newline="", encoding="utf-8") as f:
    writer = csv.writer(f)
    writer.writerow(["attention", field, "accuracy"])
    for attention, row in table.items():
      writer.writerows([attention, v, row[v]] for v in values if v in row)
  _plot(table, out / "sweep.png", field, values, task)
  return text


def _plot(table: dict, path: Path, field: str, values: list[str], task: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 4))
  for attention, row in table.items():
    points = [(float(v), row[v]) for v in values if isinstance(row.get(v), float)]
    if points:
      ax.plot(*zip(*points), marker="o", label=attention)
  ax.set_xscale("log", base=2)
  ax.set(xlabel=field, ylabel="test accuracy (%)", ylim=(0, 102), title=task)
  ax.legend(fontsize="small")
  report.save_figure(fig, path)


def main(argv):
  if len(argv) > 1:
    raise cli.HarnessError(f"unexpected arguments: {' '.join(argv[1:])}")
  started = time.time()
  attentions = plugins.split_modules(FLAGS.attentions)
  try:
    seeds = [int(s) for s in FLAGS.seeds]
  except ValueError:
    raise cli.HarnessError(f"--seeds takes integers, got {','.join(FLAGS.seeds)}") from None
  failures = run(task=FLAGS.task, preset=FLAGS.preset, field=FLAGS.field, values=FLAGS.values,
                 attentions=attentions, seeds=seeds, out=FLAGS.out, overrides=FLAGS.override)
  print(write(collect(FLAGS.out, FLAGS.field, FLAGS.values), FLAGS.out, FLAGS.field,
              FLAGS.values, FLAGS.task))
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
  flags.DEFINE_multi_string("override", [], "field=value applied to every config.")
  flags.DEFINE_string("out", "results/mqar_sweep", "Output folder.")
  flags.DEFINE_list("plugins", [], "Modules to import first; they may register attention variants.")
  cli.run(main)
