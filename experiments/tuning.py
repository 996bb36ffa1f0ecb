"""Tuning on validation: `--tune=FIELD=V1,V2,...` in experiments.reproduce and experiments.sweep.

    python -m experiments.reproduce --preset=tiny --tasks=mqar --attentions=full,gated_deltanet \
        --tune=schedule.base_learning_rate=1e-4,5e-4,1e-3 --tune=optimizer.weight_decay=0,0.1

Several --tune flags make a grid: every combination of their values, the first flag's field
changing slowest. Each point of it is a grid of experiments.reproduce in a folder of its own,
OUT/tune/<field>=<value>,<field>=<value>/ (runs/<task>/<attention>/seed<seed> there: finished
runs are skipped, interrupted ones resume). For every task and variant (and swept value) the
point whose runs have the best mean validation accuracy over the seeds is chosen (of equals, the
first), the validation accuracy of the very models whose test accuracy is reported (`TESTED`: the
best-validation checkpoint; the final model in a sweep); the test split never enters the choice.
A point missing a seed's run (it failed, e.g. diverged) is left out of the choice. The report:

  OUT/tuning.json   a record per task and variant (and swept value): {"task", "attention",
                    ["swept": {field: value},] "tested", "chosen": {field: value}, "validation":
                    [{"values": {field: value}, "mean"}, ...] (every point, in grid order;
                    "mean": null and "missing_seeds" for a point left out), "test_mean",
                    "test_std" (at the chosen point, over the seeds), "seeds", "provenance":
                    the device, commit, jax and date of the chosen runs (records.provenance)};
                    accuracies in %.
                    A variant that cannot run the task: {"task", "attention", "not_applicable"}.
  OUT/tuning.md     (reproduce) the table: per task and variant the test accuracy at the chosen
                    point, its validation accuracy and the chosen values; then the same runs
                    in the layout of experiments.report (a task per column, MAD's average);
                    then every point's mean validation / test accuracy.
  OUT/tuning.csv    the same, a row per task and variant (and swept value): variant, task, (the
                    swept field and the state size,) the chosen value of each tuned field, seeds,
                    test_mean, test_std (%), device, commit, jax, date (records.PROVENANCE).
"""
from __future__ import annotations

import csv
import io
import itertools
import statistics
from pathlib import Path

from absl import logging

from experiments import report
from experiments.report import POLICIES, rounded
from experiments.common.errors import HarnessError
from experiments.common.overrides import field_value
from experiments.common.records import PROVENANCE, provenance, write_json, write_text

HELP = ("FIELD=V1,V2,...: train every value of a config field (parsed as its type) and report, "
        "per task and variant, the value of best mean validation accuracy; several --tune flags "
        "make a grid of every combination.")
# What the reproduce table reports: test accuracy at the best-validation checkpoint.
TESTED = "test_accuracy_best_validation"
# results.json: the validation accuracy of the model whose test accuracy each key holds.
VALIDATION_OF = {"test_accuracy_final": "validation_accuracy_final",
                 "test_accuracy_best_validation": "best_eval_accuracy"}
# Fields a grid does not tune, and what sets them instead.
NOT_TUNABLE = {"seed": "the seeds are --seeds: each point trains every seed",
               "model.attention": "the variants are --attentions: each is tuned on its own"}


def overridden(overrides) -> dict[str, str]:
  """{field: why it cannot be tuned} for each --override (field=value)."""
  return {item.partition("=")[0]: f"--override sets it ({item})" for item in overrides}


def parse(specs: list[str], config, taken: dict[str, str] | None = None) -> dict[str, list]:
  """--tune flags -> {field: [values]}, each value parsed as the type of config.<field> (`config`:
  one of the grid's, None for an empty grid). HarnessError for an unknown field (naming the
  closest), a value of the wrong type, a field given twice, a repeated value, or a field in
  `taken` ({field: what sets it already}) or NOT_TUNABLE."""
  if specs and config is None:
    raise HarnessError("--tune: the grid is empty (no task, variant or seed to tune)")
  grid, refused = {}, {**NOT_TUNABLE, **(taken or {})}
  for spec in specs:
    field, sep, texts = (part.strip() for part in spec.partition("="))
    items = [text.strip() for text in texts.split(",")]
    if not sep or not field or "" in items:
      raise HarnessError(f"--tune takes FIELD=V1,V2,... (values separated by commas), got "
                             f"{spec!r}")
    if field in refused:
      raise HarnessError(f"--tune {field}: {refused[field]}")
    if field in grid:
      raise HarnessError(f"--tune {field} is given twice: list its values in one flag")
    values = []
    for text in items:
      try:
        value = field_value(config, field, text)
      except HarnessError as e:
        raise HarnessError(f"--tune: {e}") from None
      if value in values:
        raise HarnessError(f"--tune {field}: {text} repeats the value {value_text(value)}")
      if "/" in value_text(value):   # it names the point's folder
        raise HarnessError(f"--tune {field}: a value cannot hold '/', got {text!r}")
      values.append(value)
    grid[field] = values
  return grid


def points(tune: dict[str, list]) -> list[dict]:
  """Every combination of the grid's values as {field: value}, the first field changing slowest
  (the order ties are settled in); [{}] without --tune."""
  return [dict(zip(tune, values)) for values in itertools.product(*tune.values())]


def value_text(value) -> str:
  """A value as the command line writes it (parsed again, it is the same value)."""
  return str(value).lower() if isinstance(value, bool) else str(value)


def overrides(point: dict) -> list[str]:
  return [f"{field}={value_text(value)}" for field, value in point.items()]


def describe(point: dict) -> str:
  return ", ".join(overrides(point))


def point_dir(out, point: dict) -> Path:
  """The folder of a point's grid, OUT/tune/<field>=<value>,...; OUT itself without --tune."""
  return Path(out) / "tune" / ",".join(overrides(point)) if point else Path(out)


def grids(grid: dict, tune: dict[str, list]) -> list[tuple[dict, dict]]:
  """(point, its grid) per point of `tune`: `grid` (reproduce.run_grid's arguments) with the
  point's values among its overrides and its folder as out; [({}, grid)] without --tune."""
  return [(point, {**grid, "out": point_dir(grid["out"], point),
                   "overrides": [*grid.get("overrides", ()), *overrides(point)]})
          for point in points(tune)]


def validation_accuracy(run: dict, tested: str) -> float:
  """The validation accuracy of the model whose test accuracy run[tested] is."""
  key = VALIDATION_OF[tested]
  if run.get(key) is None:
    raise HarnessError(f"{run['workdir']}/results.json records no {key} (it was written "
                           "before that was recorded): delete it to train the run again")
  return run[key]


def choose(task: str, attention: str, candidates: list[tuple[dict, list[dict]]], tested: str,
           seeds: list[int], swept: dict | None = None) -> dict:
  """The record of one task and variant (see the module's docstring) from (point, the
  results.json of its runs) per point, in grid order: among the points with a run for every
  seed, the first of best mean validation accuracy; its runs' test accuracy `tested`."""
  record = {"task": task, "attention": attention, **({"swept": swept} if swept else {})}
  for _, runs in candidates:
    for run in runs:
      if "not_applicable" in run:
        return {**record, "not_applicable": run["not_applicable"]}
  validation, best = [], None
  for point, runs in candidates:
    missing = sorted(set(seeds) - {run["seed"] for run in runs})
    if missing:
      validation.append({"values": point, "mean": None, "missing_seeds": missing})
      continue
    mean = statistics.mean(validation_accuracy(run, tested) for run in runs)
    validation.append({"values": point, "mean": 100 * mean})
    if best is None or mean > best[0]:   # strictly better: of equals the first point stays
      best = mean, point, runs
  test = [100 * run[tested] for run in best[2]] if best else []
  return {**record, "tested": tested, "chosen": best[1] if best else None,
          "validation": validation, "test_mean": statistics.mean(test) if test else None,
          "test_std": statistics.stdev(test) if len(test) > 1 else None, "seeds": list(seeds),
          **({"provenance": provenance(best[2])} if best else {})}


def records(out, tune: dict[str, list], asked: dict, tested: str,
            swept: dict | None = None) -> list[dict]:
  """A record (`choose`) per task and variant of `asked` ({"preset", "task", "attention",
  "seed": [values]}, as report.read_runs takes it), from the runs of every point of `tune`
  under `out`, in the order asked."""
  candidates = {(task, attention): [] for task in asked["task"] for attention in asked["attention"]}
  for number, point in enumerate(points(tune), start=1):
    logging.info("tuning: reading the runs of point %d/%d (%s)", number, len(points(tune)),
                 describe(point))
    runs = report.read_runs(point_dir(out, point) / "runs", only=asked)
    for (task, attention), found in candidates.items():
      found.append((point, [r for r in runs if (r["task"], r["attention"]) == (task, attention)]))
  return [choose(task, attention, found, tested, asked["seed"], swept)
          for (task, attention), found in candidates.items()]


def at_edge(chosen: dict, tune: dict[str, list]) -> list[tuple[str, str]]:
  """(field, "smallest" or "largest") for each numeric field of three values or more whose
  chosen value is an end of its range (two values are both ends: not flagged)."""
  edges = []
  for field, values in tune.items():
    if len(values) >= 3 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                for v in values):
      if chosen[field] == min(values):
        edges.append((field, "smallest"))
      elif chosen[field] == max(values):
        edges.append((field, "largest"))
  return edges


def markdown(records: list[dict], tune: dict[str, list], *, preset: str, tested: str) -> str:
  """The table of reproduce --tune: a row per task and variant with the test accuracy (mean ±
  std over seeds) at the chosen point, its mean validation accuracy and the chosen values; notes
  for the variants that cannot run a task, the points left out, and each chosen value at an end
  of its field's range (`at_edge`)."""
  seeds = sorted({seed for record in records for seed in record.get("seeds", ())})
  grid = " × ".join(f"{field} ∈ {{{', '.join(map(value_text, values))}}}"
                    for field, values in tune.items())
  fields = list(tune)
  lines = [f"### Tuned on validation, preset `{preset}`: test accuracy (%) at the chosen point", "",
           f"Tested: {POLICIES[tested].split(' (')[0]}. Grid: {grid} ({len(points(tune))} "
           f"points), each trained for seeds {', '.join(map(str, seeds))}. Chosen per task and "
           "variant: the point whose models have the best mean validation accuracy (of equals, "
           "the first); the test split never enters the choice. Test: mean ± std over the seeds "
           "at the chosen point; Validation: its mean.", "",
           "| Task | Model | Test | Validation | " + " | ".join(fields) + " |",
           "|" + "---|" * (4 + len(fields))]
  notes = []
  for record in records:
    where = f"{record['attention']} on {record['task']}"
    if "not_applicable" in record:
      cells = ["n/a", ""] + [""] * len(fields)
      notes.append(f"n/a: {where}: {record['not_applicable']}")
    elif record["chosen"] is None:
      cells = ["—", ""] + [""] * len(fields)
    else:
      std = "" if record["test_std"] is None else f" ± {rounded(record['test_std'])}"
      chosen = next(p for p in record["validation"] if p["values"] == record["chosen"])
      cells = [f"{rounded(record['test_mean'])}{std}", rounded(chosen["mean"]),
               *(value_text(record["chosen"][field]) for field in fields)]
      notes += [f"{where}: {field}={value_text(record['chosen'][field])} is the grid's {edge} "
                "value: a better one may lie beyond it" for field, edge in
                at_edge(record["chosen"], tune)]
    notes += [f"{where}: {describe(p['values'])} left out of the choice: no run for seed(s) "
              f"{', '.join(map(str, p['missing_seeds']))} (failed or not run)"
              for p in record.get("validation", ()) if p["mean"] is None]
    lines.append("| " + " | ".join([record["task"], record["attention"], *cells]) + " |")
  if notes:
    lines += [""] + [note + "  " for note in notes]
  return "\n".join(lines) + "\n"


def write_records(records: list[dict], out) -> None:
  write_json(Path(out) / "tuning.json", records)


def csv_text(records: list[dict], tune: dict[str, list], states: dict | None = None) -> str:
  """A row per task and variant (and swept value) tuned: variant, task, the swept value and its
  state size (`states`, {attention: {value: floats}}, of a sweep), each field's chosen value,
  seeds (the count), test_mean, test_std (% at the chosen point), where the chosen runs ran
  (records.PROVENANCE); n/a and untrained ones are left out."""
  buffer = io.StringIO()
  out = csv.writer(buffer, lineterminator="\n")
  swept = list(records[0].get("swept", {})) if records else []
  out.writerow(["variant", "task", *swept, *(["state_size"] if states else []), *tune, "seeds",
                "test_mean", "test_std", *PROVENANCE])
  for record in records:
    if not record.get("chosen"):
      continue
    std, values = record["test_std"], [record["swept"][field] for field in swept]
    out.writerow([record["attention"], record["task"], *values,
                  *([states[record["attention"]][values[0]]] if states else []),
                  *(value_text(record["chosen"][field]) for field in tune), len(record["seeds"]),
                  f"{record['test_mean']:.2f}", "" if std is None else f"{std:.2f}",
                  *(record["provenance"][column] for column in PROVENANCE)])
  return buffer.getvalue()


def point_runs(out, point: dict, record: dict, preset: str) -> list[dict]:
  """The runs (results.json, as report.read_runs gives them) of a record's task, variant and
  seeds at one point."""
  return report.read_runs(point_dir(out, point) / "runs", only={
      "preset": [preset], "task": [record["task"]], "attention": [record["attention"]],
      "seed": record["seeds"]})


def chosen_runs(out, records: list[dict], preset: str) -> list[dict]:
  """The runs at each record's chosen point."""
  return [run for record in records if record.get("chosen")
          for run in point_runs(out, record["chosen"], record, preset)]


def layout_markdown(out, records: list[dict], preset: str) -> str:
  """The chosen points' runs in the tables of experiments.report (tested on TESTED): a task per
  column as the published tables have them, MAD's and LRA's with their average."""
  tables = report.summarize(chosen_runs(out, records, preset))
  return report.markdown({key: table for key, table in tables.items() if key[1] == TESTED})


def every_point_markdown(out, records: list[dict], tune: dict[str, list], preset: str) -> str:
  """A row per task and variant tuned, a column per point: the mean validation / test accuracy
  (%) over the seeds of its runs (tested on TESTED), the chosen point in bold, "—" for a point
  left out. For reading the grid (how flat it is, where it peaks); the choice saw validation
  only."""
  tuned = [record for record in records if record.get("chosen")]
  if not tuned or len(points(tune)) < 2:
    return ""
  lines = ["| Task | Model | " + " | ".join(map(describe, points(tune))) + " |",
           "|" + "---|" * (2 + len(points(tune)))]
  for record in tuned:
    cells = []
    for entry in record["validation"]:
      if entry["mean"] is None:
        cells.append("—")
        continue
      test = statistics.mean(100 * run[TESTED]
                             for run in point_runs(out, entry["values"], record, preset))
      cell = f"{rounded(entry['mean'])} / {rounded(test)}"
      cells.append(f"**{cell}**" if entry["values"] == record["chosen"] else cell)
    lines.append("| " + " | ".join([record["task"], record["attention"], *cells]) + " |")
  return "\n".join(lines) + "\n"


def write_report(records: list[dict], tune: dict[str, list], out, *, preset: str) -> str:
  """OUT/tuning.json, tuning.md and tuning.csv (reproduce's records, tested on TESTED); the
  markdown: the chosen points, their runs in the published tables' layout, then every point."""
  text = markdown(records, tune, preset=preset, tested=TESTED)
  if layout := layout_markdown(out, records, preset):
    text += ("\nThe same, a task per column (the chosen point may differ from cell to cell):\n\n"
             + layout)
  if grid := every_point_markdown(out, records, tune, preset):
    text += ("\nEvery point: validation / test accuracy (%), means over the seeds (the chosen "
             "point in bold; the choice saw validation only):\n\n" + grid)
  write_records(records, out)
  write_text(Path(out) / "tuning.md", text)
  write_text(Path(out) / "tuning.csv", csv_text(records, tune))
  return text
