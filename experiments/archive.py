"""Finished runs in one file that travels with the repository, and back into an output folder;
the docs' result tables (docs/<table>.csv) recomputed from those files in docs/runs/.

    python -m experiments.archive --save --out=OUT --archive=docs/runs/mad_tuned.jsonl
    python -m experiments.archive --restore --out=OUT --archive=docs/runs/mad_tuned.jsonl
    python -m experiments.archive --tables            # a line per table row its runs contradict
    python -m experiments.archive --tables --write    # its archived rows rewritten from the runs

A long grid (a `--tune` table: hundreds of runs, CPU-hours) outlives the machine it ran on only
through what is committed. `--save` adds a line per finished run under OUT to the archive,
sorted by folder: {"run": its folder relative to OUT, "results": its results.json}; checkpoints
and curves stay behind. `--restore` writes each archived results.json back into OUT, so that the
command that made the grid, run again on another machine, skips those runs
(experiments.reproduce, sweep), trains what is missing and reports over all of them. An archive
only grows: `--save` keeps the runs it holds, and neither way replaces results that differ
(HarnessError naming the run).

`--tables`: each result table of the docs (TABLES) is what a harness command wrote from its
runs (reproduce's and sweep's tuning.csv: the choice on validation; the report's
light_listops.csv and state_tracking_<preset>.csv: mean ± std over the seeds; each row with
where its runs ran, records.PROVENANCE), and one column more, `runs`: the archive in docs/runs/
that holds the row's runs, or NOT_ARCHIVED for a row whose runs were not kept (its device,
commit, jax and date then come from the page that reports it, or are empty). Recomputing
restores the archive into a temporary folder and runs the same generator over it, with the
arguments of the command in docs/runs/README.md.
"""
from __future__ import annotations

import csv
import io
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from absl import flags

import synthetic
from experiments import report, sweep, tuning
from experiments.common import command_line, dry_run
from experiments.common.errors import HarnessError
from experiments.common.records import PROVENANCE, write_json, write_text

FLAGS = flags.FLAGS
RESULTS = "results.json"


def read(archive) -> dict[str, dict]:
  """{run folder: results} of an archive; {} when it does not exist yet."""
  archive = Path(archive)
  if not archive.exists():
    return {}
  runs = {}
  for number, line in enumerate(archive.read_text().splitlines(), start=1):
    record = json.loads(line)
    run = Path(record["run"])
    if run.is_absolute() or ".." in run.parts:
      raise HarnessError(f"{archive}, line {number}: the run {run} is not a folder inside OUT")
    runs[run.as_posix()] = record["results"]
  return runs


def save(out, archive) -> tuple[int, int]:
  """Adds every finished run under `out` to the archive, which keeps the runs it holds already
  (an archive only grows: saving a folder that lacks them loses nothing); returns (runs it
  holds, runs added). HarnessError for a run whose results differ from the archived ones."""
  out = Path(out)
  found = sorted(out.rglob(RESULTS))
  if not found:
    raise HarnessError(f"no finished run under {out} (no {RESULTS} there): nothing to archive")
  runs = read(archive)
  added = 0
  for path in found:
    run, results = path.parent.relative_to(out).as_posix(), json.loads(path.read_text())
    if run not in runs:
      runs[run], added = results, added + 1
    elif runs[run] != results:
      raise HarnessError(f"{path} holds other results than {archive} for {run}: remove that "
                         "run's line from the archive to keep these, or this run to keep those")
  Path(archive).parent.mkdir(parents=True, exist_ok=True)
  write_text(archive, "".join(json.dumps({"run": run, "results": runs[run]}, sort_keys=True)
                              + "\n" for run in sorted(runs)))
  return len(runs), added


def restore(archive, out) -> tuple[int, int]:
  """Writes each archived run's results.json into `out`; returns (written, already there)."""
  archive = Path(archive)
  if not archive.exists():
    raise HarnessError(f"{archive} does not exist: `--save --out=OUT --archive={archive}` "
                       "writes it from a grid's output folder")
  written = present = 0
  for run, results in read(archive).items():
    path = Path(out) / run / RESULTS
    if path.exists():
      if json.loads(path.read_text()) != results:
        raise HarnessError(f"{path} holds other results than {archive} for {run}: restore "
                           "into a new folder, or remove that run to take the archived one")
      present += 1
      continue
    write_json(path, results)
    written += 1
  return written, present


def plan_lines(save_asked: bool, out, archive) -> list[str]:
  """A dry run's line. No runs or no archive yet is not an error here: a pipeline is checked
  before its runs exist."""
  if save_asked:
    found = len(list(Path(out).rglob(RESULTS)))
    return [f"would add the {found} finished runs under {out} to {archive}" if found else
            f"no {RESULTS} under {out} yet: the archive would stop there"]
  if not Path(archive).exists():
    return [f"{archive} does not exist yet: the restore would stop there"]
  return [f"would write the {len(read(archive))} runs of {archive} into {out}, none over other "
          "results"]


DOCS = Path(__file__).resolve().parents[1] / "docs"
RUNS = "runs"   # the column naming a row's archive
NOT_ARCHIVED = "not archived"
LR = "schedule.base_learning_rate"
ZOOLOGY_RATES = [0.001, 0.0031622777, 0.01, 0.031622777]


def tuned(tasks, attentions, tune: dict, seeds=(0, 1)) -> Callable[[Path], str]:
  """reproduce --preset=tiny --tune's tuning.csv of the runs under a folder."""
  asked = {"preset": ["tiny"], "task": list(tasks), "attention": list(attentions),
           "seed": list(seeds)}
  return lambda out: tuning.csv_text(tuning.records(out, tune, asked, tuning.TESTED), tune)


def swept_tuned(field: str, values, attentions, tune: dict) -> Callable[[Path], str]:
  """sweep --task=mqar --preset=tiny --seeds=0 --tune's tuning.csv of the runs under a folder."""
  asked = {"preset": ["tiny"], "task": ["mqar"], "attention": list(attentions), "seed": [0]}
  def generate(out: Path) -> str:
    _, states, _, records = sweep.collect_tuned(out, field, list(values), tune, asked)
    return tuning.csv_text(records, tune, states)
  return generate


def reported(write: Callable[[list[dict], Path], list[Path]], name: str
             ) -> Callable[[Path], str]:
  """One CSV (`name`) that a report writer (`write`: runs, folder) makes of the runs under a
  folder."""
  def generate(out: Path) -> str:
    runs = report.read_runs(out)
    with tempfile.TemporaryDirectory() as written:
      write(runs, Path(written))
      path = Path(written) / name
      if not path.exists():
        raise HarnessError(f"the runs give no {name}: none of them is of its table")
      return path.read_text(encoding="utf-8")
  return generate


def published(runs: list[dict], out: Path) -> list[Path]:
  return report.write_published_csvs(report.summarize(runs), out)


@dataclass(frozen=True)
class Table:
  generate: Callable[[Path], str]   # the generator's CSV text from the runs under a folder
  key: tuple[str, ...]              # the columns that name a row
  archive: str | None = None        # its file in docs/runs/; None: no row is archived


MQAR_FIRST = ("full", "sliding_window", "linear_transformer", "deltanet", "gated_deltanet", "gla",
              "retnet", "mamba2", "fox")
MQAR_2025 = ("kda", "gated_deltaproduct", "mamba", "rwkv7", "hgrn2", "lightning", "based", "mla",
             "nsa", "moba")
# mad_tuned.jsonl also holds two runs of mamba, whose grid was not finished: no row of the table.
MAD_VARIANTS = ("full", "deltanet", "gated_deltanet", "mamba2", "gla")
FRONTIER = ("full", "sliding_window", "linear_transformer", "performer", "retnet", "mamba2", "gla",
            "deltanet", "gated_deltanet", "fox")

TABLES = {
    "mqar_tuned.csv": Table(tuned(["mqar"], MQAR_FIRST + MQAR_2025, {LR: ZOOLOGY_RATES}),
                            ("variant", "task"), "mqar_tuned_2025.jsonl"),
    "mad_tuned.csv": Table(tuned(synthetic.family_tasks("mad"), MAD_VARIANTS,
                                 {LR: [1e-4, 5e-4, 1e-3], "optimizer.weight_decay": [0.0, 0.1]}),
                           ("variant", "task"), "mad_tuned.jsonl"),
    "mqar_frontier_tuned.csv": Table(
        swept_tuned("model.emb_dim", ("32", "64", "128"), FRONTIER, {LR: ZOOLOGY_RATES}),
        ("variant", "task", "model.emb_dim"), "mqar_frontier_tuned.jsonl"),
    "listops_light.csv": Table(reported(published, "light_listops.csv"), ("variant",),
                               "listops_light.jsonl"),
    "state_tracking.csv": Table(reported(report.write_state_tracking_csvs,
                                         "state_tracking_tiny.csv"),
                                ("task", "variant", report.NEG_EIGVAL)),
}


def csv_rows(text: str) -> tuple[list[str], list[dict]]:
  reader = csv.DictReader(io.StringIO(text))
  return list(reader.fieldnames or []), list(reader)


def recompute_table(name: str, docs=DOCS) -> tuple[list[str] | None, list[dict]]:
  """(the generator's columns, its rows) for a table, from its archive's runs; (None, []) for a
  table without an archive."""
  table = TABLES[name]
  if table.archive is None:
    return None, []
  with tempfile.TemporaryDirectory() as out:
    restore(Path(docs) / "runs" / table.archive, out)
    return csv_rows(table.generate(Path(out)))


def row_label(table: Table, row: dict) -> str:
  return ", ".join(f"{column}={row[column]}" for column in table.key)


def check_table(name: str, docs=DOCS) -> list[str]:
  """A line per problem of docs/<name>: a row that its archive's runs do not give as written, a
  row of the runs that the table lacks, a row marked NOT_ARCHIVED that the archive holds, a
  `runs` cell that names neither, columns other than the generator's and `runs`."""
  table = TABLES[name]
  columns, found = recompute_table(name, docs)
  documented_columns, documented = csv_rows((Path(docs) / name).read_text(encoding="utf-8"))
  if columns is None:   # no runs to write the generator's columns: those it always writes
    columns = [c for c in documented_columns if c != RUNS]
    missing = [c for c in PROVENANCE if c not in columns]
    if missing:
      return [f"{name}: no column {', '.join(missing)}"]
  if documented_columns != [*columns, RUNS]:
    return [f"{name}: columns {documented_columns}, where the generator writes "
            f"{[*columns, RUNS]}"]
  made = {tuple(row[c] for c in table.key): row for row in found}
  problems, seen = [], set()
  for row in documented:
    key, where = tuple(row[c] for c in table.key), f"{name}, {row_label(table, row)}"
    seen.add(key)
    given = {column: row[column] for column in columns}
    if row[RUNS] == NOT_ARCHIVED:
      if key in made:
        problems.append(f"{where}: marked {NOT_ARCHIVED}, but {table.archive} holds its runs")
    elif table.archive is None or row[RUNS] != table.archive:
      problems.append(f"{where}: {RUNS} is {row[RUNS]!r}, where it should be "
                      + (f"{table.archive} or " if table.archive else "") + repr(NOT_ARCHIVED))
    elif key not in made:
      problems.append(f"{where}: {table.archive} holds no runs of it")
    elif made[key] != given:
      problems.append(f"{where}: the runs give " + ", ".join(
          f"{c}={made[key][c]} (not {given[c]})" for c in columns if made[key][c] != given[c]))
  problems += [f"{name}, {row_label(table, row)}: {table.archive} makes this row, the table "
               "lacks it" for key, row in made.items() if key not in seen]
  return problems


def rewritten_table(name: str, docs=DOCS) -> str:
  """docs/<name> with each row its archive's runs make as they make it (in the table's order,
  those it lacks at the end), every other row as written (check_table names what is wrong with it),
  a column it lacks empty."""
  table = TABLES[name]
  columns, found = recompute_table(name, docs)
  documented_columns, documented = csv_rows((Path(docs) / name).read_text(encoding="utf-8"))
  columns = columns or [c for c in documented_columns if c != RUNS]
  made = {tuple(row[c] for c in table.key): {**row, RUNS: table.archive} for row in found}
  kept = [made.pop(tuple(row[c] for c in table.key), row) for row in documented]
  buffer = io.StringIO()
  out = csv.DictWriter(buffer, [*columns, RUNS], restval="", extrasaction="ignore",
                       lineterminator="\n")
  out.writeheader()
  out.writerows(kept + list(made.values()))
  return buffer.getvalue()


def main(argv):
  if len(argv) > 1:
    raise HarnessError(f"unexpected arguments: {' '.join(argv[1:])}")
  if FLAGS.save + FLAGS.restore + FLAGS.tables != 1:
    raise HarnessError("give one of --save (OUT -> archive), --restore (archive -> OUT) and "
                       "--tables (docs' tables <- docs/runs)")
  if FLAGS.tables:
    dry_run.plan(lambda: [f"would {'rewrite and ' * FLAGS.write}check {DOCS / name} against "
                          f"{TABLES[name].archive or 'no archive'}" for name in TABLES])
    problems = []
    for name in TABLES:
      if FLAGS.write:
        write_text(DOCS / name, rewritten_table(name))
      problems += check_table(name)
    print("\n".join(problems) if problems else
          f"every archived row of {', '.join(TABLES)} recomputes from docs/runs/")
    if problems:
      raise HarnessError(f"{len(problems)} table row(s) differ from their runs")
    return
  if FLAGS.write:
    raise HarnessError("--write rewrites the docs' tables: it goes with --tables")
  if not (FLAGS.out and FLAGS.archive):
    raise HarnessError("--save and --restore take --out=OUT and --archive=FILE.jsonl")
  dry_run.plan(lambda: plan_lines(FLAGS.save, FLAGS.out, FLAGS.archive))
  if FLAGS.save:
    held, added = save(FLAGS.out, FLAGS.archive)
    print(f"{FLAGS.archive}: {held} finished runs, {added} of them added from {FLAGS.out}")
  else:
    written, present = restore(FLAGS.archive, FLAGS.out)
    print(f"{FLAGS.out}: {written} runs restored from {FLAGS.archive}, {present} already there")


if __name__ == "__main__":
  flags.DEFINE_bool("save", False, "Write the archive of every finished run under --out.")
  flags.DEFINE_bool("restore", False, "Write the archived runs' results.json into --out.")
  flags.DEFINE_bool("tables", False, "Check every row of the docs' result tables against the "
                                     "runs archived in docs/runs/.")
  flags.DEFINE_bool("write", False, "With --tables: rewrite each table's archived rows from its "
                                    "runs first.")
  flags.DEFINE_string("out", None, "The grid's output folder (--save, --restore).")
  flags.DEFINE_string("archive", None, "The archive file, JSON lines (--save, --restore).")
  command_line.run(main)
