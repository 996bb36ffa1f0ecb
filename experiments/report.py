"""LRA Table 1 from finished runs: markdown, CSV, bar charts and training curves.

    python -m experiments.report --runs=results/tiny/runs --out=results/tiny

Reads every `results.json` (and `metrics.jsonl`) under --runs. The LRA tasks, the MAD tasks (one
column per task and their average, as MAD's table), the state-tracking tasks and the other
diagnostics get a table each; a run that allows negative eigenvalues (the mixer option
`allow_neg_eigval`) is a row of its own, and the state-tracking runs also go to
state_tracking_<preset>.csv (write_state_tracking_csvs).
Each cell is a test accuracy (%),
mean ± std over seeds, with the LRA paper's number and our difference beside it; a "majority
class" row gives each task's chance level (the most frequent class of its test split). Two
tables per preset, each saying which model it tests: the final step's (what the released LRA
code reported, so the one to set beside the paper) and the best-validation step's (the model
chosen on validation data only; no number is ever chosen on the test set).
"""
from __future__ import annotations

import csv
import json
import statistics
from decimal import ROUND_HALF_UP, Decimal
from collections import defaultdict
from pathlib import Path

from absl import flags, logging

import attention_zoo as az
import lra
import synthetic
from configs.lra.paper_tables import NYSTROMFORMER_TABLE1
from configs.lra.paper_tables import TABLE1 as LRA_TABLE1
from experiments.common import command_line, dry_run
from experiments.common.errors import HarnessError
from experiments.common.plots import legend_beside, pyplot, save_figure
from experiments.common.records import PROVENANCE, provenance, read_metrics, rotate, write_text
from lra.fileio import atomic_write

FLAGS = flags.FLAGS
MAJORITY = "majority class"
# results.json key -> what the table's cells are.
POLICIES = {
    "test_accuracy_final": "the model at the final training step (the released LRA code's "
                           "policy: compare these with the paper)",
    "test_accuracy_best_validation": "the model at the step of best validation accuracy",
}


def read_runs(runs_dir, *, only: dict | None = None) -> list[dict]:
  """Every results.json under runs_dir, with `workdir` added; with `only` ({field: the values
  to keep}, e.g. {"attention": ["full"]}), those whose fields all hold one of the values."""
  runs = []
  for path in sorted(Path(runs_dir).rglob("results.json")):
    result = json.loads(path.read_text(encoding="utf-8"))
    if all(result.get(field) in values for field, values in (only or {}).items()):
      result["workdir"] = str(path.parent)
      runs.append(result)
  return runs


# The published table a preset's runs are set beside: the LRA paper's, or for the light
# protocol the Nyströmformer paper's.
PUBLISHED = {"light": NYSTROMFORMER_TABLE1, "light_fair": NYSTROMFORMER_TABLE1}
# Where such a table was published, and which model its authors tested.
PUBLISHED_SOURCE = "Xiong et al. 2021 (arXiv:2102.03902) Table 1"
PUBLISHED_TESTED = "test_accuracy_best_validation"


def published_table(preset: str) -> dict:
  return PUBLISHED.get(preset, LRA_TABLE1)


def paper_accuracy(attention: str, task: str, preset: str = "paper") -> float | str | None:
  """The published Table 1 number for the preset (published_table), "FAIL" for Path-X, None
  if the paper has no such cell."""
  table = published_table(preset)
  if attention not in table or task not in lra.available_tasks():
    return None
  if task == "pathx":
    return "FAIL" if table is LRA_TABLE1 else None
  return table[attention][task]


NEG_EIGVAL = "allow_neg_eigval"


def variant(run: dict) -> str:
  """A run's row in the tables: its attention, marked when it allows negative eigenvalues
  (NEG_EIGVAL, set in the run's model options), so that runs with and without stay apart."""
  options = run.get("model", {}).get("attention_options", {})
  return f"{run['attention']} ({NEG_EIGVAL})" if options.get(NEG_EIGVAL) else run["attention"]


def _order(attentions, preset: str) -> list[str]:
  """The published table's row order first, then the rest alphabetically."""
  known = [a for a in published_table(preset) if a in attentions]
  return known + sorted(set(attentions) - set(known))


def kinds() -> tuple[tuple[str, tuple[str, ...]], ...]:
  """(kind, its tasks): "lra" (LRA Table 1), then each family of synthetic tasks
  (synthetic.FAMILIES: the MAD suite, state tracking, ..., "diagnostics" the rest)."""
  return (("lra", lra.available_tasks()),
          *((family, synthetic.family_tasks(family)) for family in synthetic.FAMILIES))


def summarize(runs: list[dict]) -> dict:
  """{(preset, policy, kind): {"tasks", "attentions", "cells": {(attention, task): _stats},
  "majority", "not_applicable": {(attention, task): reason}}} for each preset, each policy in
  POLICIES and each kind of task (see `kinds`)."""
  by_preset = defaultdict(list)
  for run in runs:
    by_preset[run["preset"]].append(run)
  tables = {}
  for preset, group in sorted(by_preset.items()):
    for kind, known in kinds():
      runs_here = [run for run in group if run["task"] in known]
      finished = [run for run in runs_here if "not_applicable" not in run]
      majority = defaultdict(list)
      for run in finished:
        majority[run["task"]].append(100 * run["majority_accuracy"])
      tasks = [t for t in known if t in majority]
      not_applicable = {(variant(run), run["task"]): run["not_applicable"]
                        for run in runs_here if "not_applicable" in run}
      cell_runs = defaultdict(list)
      for run in finished:
        cell_runs[variant(run), run["task"]].append(run)
      for policy in POLICIES if tasks else ():
        tables[preset, policy, kind] = {
            "tasks": tasks,
            "cells": {key: _stats(found, policy) for key, found in cell_runs.items()},
            "attentions": _order({a for a, _ in cell_runs} | {a for a, _ in not_applicable},
                                 preset),
            "majority": {t: statistics.mean(v) for t, v in majority.items()},
            "not_applicable": not_applicable,
        }
  return tables


def _stats(runs: list[dict], policy: str) -> dict:
  """Mean, std and count of the runs' test accuracy `policy` (%), and where they ran."""
  values = [100 * run[policy] for run in runs]
  return {"mean": statistics.mean(values), "num_seeds": len(values),
          "std": statistics.stdev(values) if len(values) > 1 else None,
          "provenance": provenance(runs)}


def _average(table: dict, attention: str, preset: str):
  """(our mean, paper mean) over the table's tasks except Path-X, if the row has them all."""
  tasks = [t for t in table["tasks"] if t != "pathx"]
  ours = [table["cells"].get((attention, t)) for t in tasks]
  if not tasks or None in ours:
    return None
  papers = [paper_accuracy(attention, t, preset) for t in tasks]
  paper = statistics.mean(papers) if None not in papers else None
  return statistics.mean(c["mean"] for c in ours), paper


def rounded(percent: float, decimals: int = 2) -> str:
  """A percentage as text, rounded half up from its shortest decimal form, as a reader rounds a
  printed number, so that every table (this one, the sweep's, the tuning's) rounds one accuracy
  alike: 1,132 of 8,000 is 14.15%, which 100 * 0.1415 gives as 14.149999999999999; format()
  would show it as 14.1 at one decimal."""
  shortest = Decimal(repr(round(percent, 9)))
  return str(shortest.quantize(Decimal(1).scaleb(-decimals), rounding=ROUND_HALF_UP))


def _cell(mean: float, std: float | None, paper) -> str:
  text = rounded(mean) + (f" ± {rounded(std)}" if std is not None else "")
  if paper == "FAIL":
    return f"{text} (FAIL)"
  if paper is not None:
    return f"{text} ({paper:.2f}, {mean - paper:+.2f})"
  return text


def markdown(tables: dict) -> str:
  lines = []
  for (preset, policy, kind), table in tables.items():
    tasks = table["tasks"]
    seeds = sorted({c["num_seeds"] for c in table["cells"].values()})
    which = "final step" if policy == "test_accuracy_final" else "best validation step"
    if kind == "lra":
      light = preset in PUBLISHED
      lines += [f"### LRA Table 1, preset `{preset}`, {which}: test accuracy (%)", "",
                f"Tested: {POLICIES[policy]}. Each cell: mean ± std over seeds ("
                + ("the Nyströmformer paper's number" if light else "paper's number")
                + f", our difference). Seeds per cell: {', '.join(map(str, seeds))}."
                + (" The tiny preset is a CPU-sized run: its numbers are not comparable with the "
                   "paper's." if preset == "tiny" else "")
                + (" The light protocol's authors tested the best-validation model: compare "
                   "that table with theirs." if light else ""), ""]
    elif kind == "mad":
      lines += [f"### MAD, preset `{preset}`, {which}: test accuracy on the asked tokens (%)", "",
                f"Tested: {POLICIES[policy].split(' (')[0]}. Each cell: mean ± std over seeds. "
                f"Seeds per cell: {', '.join(map(str, seeds))}. The six tasks of Poli et al. "
                "2024 (docs/mad.md); Avg: the mean over the tasks of the row."
                + (" The tiny preset is a CPU-sized run: its numbers are not comparable with "
                   "the paper's." if preset == "tiny" else ""), ""]
    elif kind == "state_tracking":
      lines += [f"### State tracking, preset `{preset}`, {which}: test accuracy on the prefixes "
                "longer than the training sequences (%)", "",
                f"Tested: {POLICIES[policy].split(' (')[0]}. Each cell: mean ± std over seeds. "
                f"Seeds per cell: {', '.join(map(str, seeds))}. The running parity (parity) and "
                "permutation product (s3, s5) at every test position past the longest training "
                f"sequence (docs/state_tracking.md); ({NEG_EIGVAL}): the mixer's transition "
                "eigenvalues reach -1.", ""]
    elif kind == "formal_language":
      lines += [f"### Formal languages, preset `{preset}`, {which}: test accuracy on the "
                "answers (%)", "",
                f"Tested: {POLICIES[policy].split(' (')[0]}. Each cell: mean ± std over seeds. "
                f"Seeds per cell: {', '.join(map(str, seeds))}. Grazzi et al.'s parity and "
                "modular arithmetic w/o and w/ brackets (docs/formal_languages.md), tested at "
                "lengths 40..256; their scaled accuracy is in each run's results.json; "
                f"({NEG_EIGVAL}): the mixer's transition eigenvalues reach -1.", ""]
    else:
      lines += [f"### Diagnostics, preset `{preset}`, {which}: test accuracy on the asked "
                "tokens (%)", "",
                f"Tested: {POLICIES[policy].split(' (')[0]}. Each cell: mean ± std over seeds. "
                f"Seeds per cell: {', '.join(map(str, seeds))}. mqar: multi-query associative "
                "recall, the share of queried values a causal model emits exactly.", ""]
    has_avg = kind in ("lra", "mad") and sum(t != "pathx" for t in tasks) > 1
    header = ["Model"] + tasks + (["Avg"] if has_avg else [])
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for attention in table["attentions"]:
      row = [attention]
      for task in tasks:
        cell = table["cells"].get((attention, task))
        if (attention, task) in table["not_applicable"]:
          row.append("n/a")
        else:
          row.append("—" if cell is None else
                     _cell(cell["mean"], cell["std"], paper_accuracy(attention, task, preset)))
      if has_avg:
        average = _average(table, attention, preset)
        not_applicable = all((attention, t) in table["not_applicable"] for t in tasks)
        row.append("n/a" if not_applicable else
                   "—" if average is None else _cell(average[0], None, average[1]))
      lines.append("| " + " | ".join(row) + " |")
    majority = [rounded(table["majority"][t]) for t in tasks]
    lines.append("| " + " | ".join([f"*{MAJORITY}*"] + majority + ([""] if has_avg else [])) + " |")
    reasons = sorted(set(table["not_applicable"].items()))
    if reasons:
      lines += [""] + [f"n/a: {attention} on {task}: {reason}" + "  "
                       for (attention, task), reason in reasons]
    lines.append("")
  return "\n".join(lines)


def write_csv(tables: dict, path: Path) -> None:
  with atomic_write(path, "w", newline="", encoding="utf-8") as f:
    out = csv.writer(f)
    out.writerow(["preset", "tested", "attention", "task", "num_seeds", "mean", "std", "paper",
                  "difference"])
    for (preset, policy, _), table in tables.items():
      for attention in table["attentions"]:
        for task in table["tasks"]:
          cell = table["cells"].get((attention, task))
          if cell is None:
            continue
          paper = paper_accuracy(attention, task, preset)
          difference = cell["mean"] - paper if isinstance(paper, float) else ""
          out.writerow([preset, policy, attention, task, cell["num_seeds"], f"{cell['mean']:.4f}",
                        "" if cell["std"] is None else f"{cell['std']:.4f}",
                        "" if paper is None else paper,
                        difference if difference == "" else f"{difference:.4f}"])
      for task in table["tasks"]:
        out.writerow([preset, policy, MAJORITY, task, "", f"{table['majority'][task]:.4f}", "",
                      "", ""])


def write_published_csvs(tables: dict, out: Path) -> list[Path]:
  """For a preset with its own published table (light): <preset>_<task>.csv per task, a row per
  variant: variant, seeds, test_mean, test_std (the model its authors tested), published,
  source (%), and where the runs ran (records.PROVENANCE)."""
  written = []
  for (preset, policy, kind), table in tables.items():
    if preset not in PUBLISHED or policy != PUBLISHED_TESTED or kind != "lra":
      continue
    for task in table["tasks"]:
      path = out / f"{preset}_{task}.csv"
      with atomic_write(path, "w", newline="", encoding="utf-8") as f:
        rows = csv.writer(f, lineterminator="\n")
        rows.writerow(["variant", "seeds", "test_mean", "test_std", "published", "source",
                       *PROVENANCE])
        for attention in table["attentions"]:
          cell = table["cells"].get((attention, task))
          if cell is None:
            continue
          published = paper_accuracy(attention, task, preset)
          rows.writerow([attention, cell["num_seeds"], f"{cell['mean']:.2f}",
                         "" if cell["std"] is None else f"{cell['std']:.2f}",
                         "" if published is None else f"{published:.2f}",
                         "" if published is None else PUBLISHED_SOURCE,
                         *(cell["provenance"][column] for column in PROVENANCE)])
      written.append(path)
  return written


# What the state-tracking CSV reports: the model chosen on validation (drawn at the test lengths).
STATE_TRACKING_TESTED = "test_accuracy_best_validation"


def write_state_tracking_csvs(runs: list[dict], out: Path) -> list[Path]:
  """state_tracking_<preset>.csv per preset with state-tracking runs: a row per task, variant and
  allow_neg_eigval (True / False, "n/a" for a variant without the option): seeds, test_mean,
  test_std (% of the asked positions, STATE_TRACKING_TESTED), and where the runs ran
  (records.PROVENANCE)."""
  groups = defaultdict(list)
  for run in runs:
    if run["task"] in synthetic.family_tasks("state_tracking") and "not_applicable" not in run:
      options = run.get("model", {}).get("attention_options", {})
      has_option = NEG_EIGVAL in az.spec(run["attention"]).options
      negative = str(bool(options.get(NEG_EIGVAL))) if has_option else "n/a"
      groups[run["preset"], run["task"], run["attention"], negative].append(run)
  written = []
  for preset in sorted({preset for preset, *_ in groups}):
    here = {key[1:]: values for key, values in groups.items() if key[0] == preset}
    order = _order({attention for _, attention, _ in here}, preset)
    path = out / f"state_tracking_{preset}.csv"
    with atomic_write(path, "w", newline="", encoding="utf-8") as f:
      rows = csv.writer(f, lineterminator="\n")
      rows.writerow(["task", "variant", NEG_EIGVAL, "seeds", "test_mean", "test_std",
                     *PROVENANCE])
      for task, attention, negative in sorted(here, key=lambda key: (
          synthetic.family_tasks("state_tracking").index(key[0]), order.index(key[1]), key[2])):
        cell = _stats(here[task, attention, negative], STATE_TRACKING_TESTED)
        rows.writerow([task, attention, negative, cell["num_seeds"], f"{cell['mean']:.2f}",
                       "" if cell["std"] is None else f"{cell['std']:.2f}",
                       *(cell["provenance"][column] for column in PROVENANCE)])
    written.append(path)
  return written


# The variants' colours in one chart: tab10 without its cyan, which reads as a second blue beside
# tab:blue; from the tenth variant on the hues repeat, the bars hatched and the curves dashed.
HUES = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
        "tab:gray", "tab:olive")


def variant_style(index: int) -> tuple[str, bool]:
  """(colour, whether the hue repeats an earlier variant's) of the index-th variant of a chart."""
  return HUES[index % len(HUES)], index >= len(HUES)


def error_bars(cells) -> list[float]:
  """The std of each cell, NaN where there is none (one seed): no error bar is drawn there,
  where a zero-length one would draw its caps as a line at the bar's top."""
  return [c["std"] if c and c["std"] is not None else float("nan") for c in cells]


def plot(tables: dict, runs: list[dict], out: Path) -> list[Path]:
  """Per preset and task: a bar chart of test accuracy (bars: final step, error bars the std
  over seeds; dots: best validation step; diamonds: the paper) and the training curves (PNG)."""
  plt = pyplot()
  written = []
  charts = sum(len(table["tasks"]) for (_, policy, _), table in tables.items()
               if policy == "test_accuracy_final")
  for (preset, policy, kind), table in tables.items():
    if policy != "test_accuracy_final":
      continue
    best = tables[preset, "test_accuracy_best_validation", kind]
    for task in table["tasks"]:
      logging.info("report: plots %d/%d: %s (%s), its bars and training curves",
                   len(written) // 2 + 1, charts, task, preset)
      attentions = [a for a in table["attentions"] if (a, task) in table["cells"]]
      cells = [table["cells"][a, task] for a in attentions]
      fig, ax = plt.subplots(figsize=(max(5, 0.6 * len(attentions) + 2), 4))
      ax.bar(attentions, [c["mean"] for c in cells], yerr=error_bars(cells),
             color="tab:blue", capsize=3, label="ours, final step")
      ax.scatter(range(len(attentions)), [best["cells"][a, task]["mean"] for a in attentions],
                 color="tab:orange", zorder=3, label="ours, best validation step")
      papers = [(i, paper_accuracy(a, task, preset)) for i, a in enumerate(attentions)]
      papers = [(i, p) for i, p in papers if isinstance(p, float)]
      if papers:
        ax.scatter(*zip(*papers), facecolors="none", edgecolors="black", marker="D", s=60,
                   zorder=3, label="paper")
      ax.axhline(table["majority"][task], color="tab:red", linestyle="--", label=MAJORITY)
      ax.set(ylabel="test accuracy (%)", title=f"{task} ({preset})")
      ax.tick_params(axis="x", rotation=45)
      legend_beside(ax, fontsize="small")
      written.append(save_figure(fig, out / f"bars_{preset}_{task}.png"))

      fig, (acc_ax, loss_ax) = plt.subplots(1, 2, figsize=(11, 4))
      styles = {a: variant_style(i) for i, a in enumerate(attentions)}
      labelled = set()
      for run in runs:
        if run["preset"] != preset or run["task"] != task or "not_applicable" in run:
          continue
        events = read_metrics(run["workdir"])
        row = variant(run)
        label = None if row in labelled else row   # one per row
        labelled.add(row)
        for ax, key in ((acc_ax, "eval_accuracy"), (loss_ax, "train_loss")):
          points = [(e["step"], e[key]) for e in events if isinstance(e.get(key), float)]
          if points:
            color, repeated = styles[row]
            ax.plot(*zip(*points), color=color, linestyle="--" if repeated else "-",
                    label=label)
      acc_ax.set(xlabel="step", ylabel="validation accuracy", title=f"{task} ({preset})")
      loss_ax.set(xlabel="step", ylabel="training loss")
      legend_beside(loss_ax, *acc_ax.get_legend_handles_labels(), fontsize="x-small")
      written.append(save_figure(fig, out / f"curves_{preset}_{task}.png"))
    if kind == "mad":
      written.append(plot_profile(table, out / f"mad_{preset}.png", f"MAD ({preset})", preset))
  return written


def plot_profile(table: dict, path: Path, title: str, preset: str) -> Path:
  """One group of bars per task (and the average), one bar per variant: the table as a chart,
  error bars the std over seeds; n/a variants are left out."""
  import numpy as np

  plt = pyplot()
  tasks = table["tasks"]
  attentions = [a for a in table["attentions"] if any((a, t) in table["cells"] for t in tasks)]
  width = 0.8 / max(len(attentions), 1)
  fig, ax = plt.subplots(figsize=(max(7, 1.2 * (len(tasks) + 1) + 2), 4))
  for i, attention in enumerate(attentions):
    cells = [table["cells"].get((attention, t)) for t in tasks]
    average = _average(table, attention, preset)
    means = [c["mean"] if c else np.nan for c in cells] + [average[0] if average else np.nan]
    color, repeated = variant_style(i)
    ax.bar(np.arange(len(tasks) + 1) + (i - (len(attentions) - 1) / 2) * width, means, width,
           yerr=error_bars(cells + [None]), capsize=2, color=color,
           hatch="//" if repeated else None, label=attention)
  ax.scatter(np.arange(len(tasks)), [table["majority"][t] for t in tasks], color="black",
             marker="_", s=200, zorder=3, label=MAJORITY)
  ax.set_xticks(np.arange(len(tasks) + 1), [t.replace("_", "\n") for t in tasks] + ["average"],
                fontsize="small")
  ax.set(ylabel="test accuracy (%)", ylim=(0, 100), title=title)
  legend_beside(ax, fontsize="x-small")
  return save_figure(fig, path)


# What a report writes into its folder, besides table.md.
REPORT_FILES = ("table.csv", *(f"{preset}_*.csv" for preset in PUBLISHED),
                "state_tracking_*.csv", "bars_*.png",
                "curves_*.png", "mad_*.png")


def write_report(runs_dir, out_dir, *, only: dict | None = None) -> str:
  """Writes table.md, table.csv (and write_published_csvs's and write_state_tracking_csvs's) and
  the PNGs of the runs under runs_dir (those `only` keeps: see read_runs) into out_dir (each
  atomically); returns the markdown. A report of other runs already there is kept, not
  overwritten: its files are renamed <name>.1 (older ones shift to .2, ...), with a warning."""
  logging.info("report: reading the runs under %s", runs_dir)
  runs = read_runs(runs_dir, only=only)
  if not runs:
    raise HarnessError(f"no results.json under {runs_dir}; run experiments.train or "
                           "experiments.reproduce first")
  logging.info("report: %d run(s) read; writing the tables into %s", len(runs), out_dir)
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  tables = summarize(runs)
  text = markdown(tables)
  earlier = out / "table.md"
  if earlier.exists() and earlier.read_text(encoding="utf-8") != text:
    kept = rotate([earlier, *(path for pattern in REPORT_FILES
                              for path in sorted(out.glob(pattern)))])
    logging.warning("%s held a report of other runs: kept as %s", out, kept)
  write_text(out / "table.md", text)
  write_csv(tables, out / "table.csv")
  write_published_csvs(tables, out)
  write_state_tracking_csvs(runs, out)
  plot(tables, runs, out)
  return text


def plan_lines(runs_dir, out_dir) -> list[str]:
  """A dry run's lines: each run the report would read, and what it would write. No runs yet is
  not an error here: a pipeline is checked before its runs exist."""
  runs = read_runs(runs_dir)
  if not runs:
    return [f"no results.json under {runs_dir} yet: the report would stop there"]
  return [*(f"{r['task']} / {r['attention']} / seed {r['seed']} ({r['preset']}): {r['workdir']}"
            for r in runs), f"then {out_dir}/table.md, table.csv and plots"]


def main(argv):
  if len(argv) > 1:
    raise HarnessError(f"unexpected arguments: {' '.join(argv[1:])}")
  dry_run.plan(lambda: plan_lines(FLAGS.runs, FLAGS.out))
  print(write_report(FLAGS.runs, FLAGS.out))
  print(f"wrote {FLAGS.out}/table.md, table.csv and plots")


if __name__ == "__main__":
  flags.DEFINE_string("runs", "results/tiny/runs",
                      "Folder holding run workdirs (searched recursively).")
  flags.DEFINE_string("out", "results/tiny", "Folder for table.md, table.csv and the PNGs.")
  command_line.run(main)
