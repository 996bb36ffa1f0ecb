"""Finished runs in one file that travels with the repository, and back into an output folder.

    python -m experiments.archive --save --out=OUT --archive=docs/runs/mad_tuned.jsonl
    python -m experiments.archive --restore --out=OUT --archive=docs/runs/mad_tuned.jsonl

A long grid (a `--tune` table: hundreds of runs, CPU-hours) outlives the machine it ran on only
through what is committed. `--save` adds a line per finished run under OUT to the archive,
sorted by folder: {"run": its folder relative to OUT, "results": its results.json}; checkpoints
and curves stay behind. `--restore` writes each archived results.json back into OUT, so that the
command that made the grid, run again on another machine, skips those runs
(experiments.reproduce, sweep), trains what is missing and reports over all of them. An archive
only grows: `--save` keeps the runs it holds, and neither way replaces results that differ
(HarnessError naming the run).
"""
from __future__ import annotations

import json
from pathlib import Path

from absl import flags

from experiments.common import command_line, dry_run
from experiments.common.errors import HarnessError
from experiments.common.records import write_json, write_text

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


def main(argv):
  if len(argv) > 1:
    raise HarnessError(f"unexpected arguments: {' '.join(argv[1:])}")
  if FLAGS.save == FLAGS.restore:
    raise HarnessError("give one of --save (OUT -> archive) and --restore (archive -> OUT)")
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
  flags.DEFINE_string("out", None, "The grid's output folder.", required=True)
  flags.DEFINE_string("archive", None, "The archive file (JSON lines).", required=True)
  command_line.run(main)
