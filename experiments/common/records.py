"""The files a run writes, each atomically (the old file or the new one, never a torn one). It
imports no JAX, so that a command can write and read records without starting JAX (where
the results came from, the commit and the device: experiments.common.provenance).

    write_text(path, text); write_json(path, value)
    with atomic_write(path, "wb") as f: ...   # the same for any writer (lra.fileio)
    rotate([path, ...])       # an earlier run's files kept as <name>.1 (older: .2, ...)
    read_metrics(workdir)     # the events of a run's metrics.jsonl
    provenance(results)       # the device, commit, jax and date of runs, as a table's columns
"""
from __future__ import annotations

import json
from pathlib import Path

from absl import logging

from lra.fileio import atomic_write

METRICS = "metrics.jsonl"   # a run's events, one JSON object a line (experiments.train.metrics)
# A table row's columns that say where its runs ran (their results.json `environment`).
PROVENANCE = ("device", "commit", "jax", "date")


def write_text(path, text: str) -> None:
  with atomic_write(path, "w", encoding="utf-8") as f:
    f.write(text)


def write_json(path, value) -> None:
  write_text(path, json.dumps(value, indent=2) + "\n")


def rotate(paths: list[Path]) -> str:
  """Renames each existing path to <name>.1 after shifting <name>.i to <name>.i+1; the same
  suffix for all of them, so that the files of one earlier run keep one number."""
  free = 1
  while any(p.with_name(f"{p.name}.{free}").exists() for p in paths):
    free += 1
  for i in range(free - 1, 0, -1):
    for path in paths:
      older = path.with_name(f"{path.name}.{i}")
      if older.exists():
        older.rename(path.with_name(f"{path.name}.{i + 1}"))
  for path in paths:
    if path.exists():
      path.rename(path.with_name(f"{path.name}.1"))
  return ", ".join(f"{p.name}.1" for p in paths if p.with_name(f"{p.name}.1").exists())


def read_metrics(workdir) -> list[dict]:
  """The events of metrics.jsonl. A last line that is not JSON is the torn end of a write that
  was cut off: it is skipped with a warning. A bad line before it is an error."""
  path = Path(workdir) / METRICS
  if not path.exists():
    return []
  lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
  events = []
  for number, line in enumerate(lines, start=1):
    try:
      events.append(json.loads(line))
    except json.JSONDecodeError as e:
      if number < len(lines):
        raise ValueError(f"{path}: line {number} is not JSON ({e})") from None
      logging.warning("%s: skipping its last line, cut off in the middle of a write: %r", path,
                      line[:80])
  return events


def provenance(results: list[dict]) -> dict[str, str]:
  """{column of PROVENANCE: text} of the runs behind one table row (their results.json): each
  distinct device, commit (short, "+dirty" kept) and jax version, joined by " + " so that mixed
  hardware or code shows in the row; the date, or the first and last as "first..last".
  "unknown" stands for a run whose results.json records no environment (written before it was
  recorded, or planted by a test)."""
  environments = [result.get("environment") for result in results]
  def distinct(read) -> str:
    return " + ".join(sorted({"unknown" if e is None else read(e) for e in environments}))
  def commit(environment) -> str:
    full = environment["git_commit"]
    return "unknown" if full is None else full[:7] + ("+dirty" if full.endswith("+dirty") else "")
  days = sorted(distinct(lambda e: e["date"][:10]).split(" + "))
  return {"device": distinct(lambda e: e["device"]), "commit": distinct(commit),
          "jax": distinct(lambda e: e["versions"]["jax"]),
          "date": days[0] if len(days) == 1 else f"{days[0]}..{days[-1]}"}
