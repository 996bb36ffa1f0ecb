"""The files the harness rewrites are replaced whole: a writer cut off half-way leaves the old
file (or none), never a torn one. metrics.jsonl survives a torn last line; an earlier run's
files are renamed, not deleted."""
import builtins
import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import report, sweep, tuning
from experiments.common import records
from experiments.train.metrics import MetricsWriter, read_metrics


class _HalfThenCrash:
  """A file whose first write stores half of its data, then fails: a process killed
  mid-write."""

  def __init__(self, file):
    self._file = file

  def write(self, data):
    self._file.write(data[:len(data) // 2])
    self._file.flush()
    raise OSError("simulated crash in the middle of a write")

  def __getattr__(self, name):
    return getattr(self._file, name)

  def __iter__(self):
    return iter(self._file)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self._file.close()


@contextlib.contextmanager
def writes_crash_under(folder: Path, at: int = 0):
  """The `at`-th file (from 0) opened for writing under `folder`, by any code (open,
  Path.write_text, PIL), crashes half-way through its first write; yields the list of the
  files opened for writing."""
  real_open, opened = builtins.open, []

  def crashing_open(file, mode="r", *args, **kwargs):
    handle = real_open(file, mode, *args, **kwargs)
    if not (isinstance(file, (str, Path)) and any(m in mode for m in "wax+")
            and Path(file).resolve().is_relative_to(folder.resolve())):
      return handle
    opened.append(Path(file))
    return _HalfThenCrash(handle) if len(opened) - 1 == at else handle

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(builtins, "open", crashing_open)
    patch.setattr(io, "open", crashing_open)
    yield opened


def snapshot(folder: Path) -> dict[str, bytes]:
  """The rewritten files under `folder` (TensorBoard's event files are logs: appended, never
  rewritten)."""
  return {p.relative_to(folder).as_posix(): p.read_bytes()
          for p in sorted(folder.rglob("*")) if p.is_file() and "tensorboard" not in p.parts}


def test_the_crash_simulation_tears_a_plain_write(tmp_path):
  """The oracle's own check: a file written in place is torn by it."""
  (tmp_path / "plain.txt").write_text("the old text")
  with writes_crash_under(tmp_path), pytest.raises(OSError, match="simulated crash"):
    (tmp_path / "plain.txt").write_text("the new text, longer")
  assert (tmp_path / "plain.txt").read_text() == "the new te"


def _results(root: Path, accuracy: float):
  workdir = root / "listops" / "full" / "seed0"
  records.write_json(workdir / "results.json", {
      "task": "listops", "attention": "full", "preset": "tiny", "seed": 0,
      "test_accuracy_final": accuracy, "test_accuracy_best_validation": accuracy,
      "majority_accuracy": 0.17})
  records.write_text(workdir / "metrics.jsonl", "".join(
      json.dumps({"step": s, "train_loss": 2.0 - s * accuracy, "eval_accuracy": accuracy * s})
      + "\n" for s in (1, 2, 3)))
  return root


def _write_report(out: Path, accuracy: float):
  report.write_report(_results(out.parent / f"runs{accuracy}", accuracy), out)


def _write_sweep(out: Path, accuracy: float):
  sweep.write({"full": {"4": 100 * accuracy, "8": 50.0}}, {}, out, "data.num_pairs", ["4", "8"],
              "mqar")


def _write_tuning(out: Path, accuracy: float):
  runs, tune = out.parent / f"tuned{accuracy}", {"schedule.base_learning_rate": [0.1]}
  records.write_json(
      runs / "tune" / "schedule.base_learning_rate=0.1" / "runs" / "listops" / "full" / "seed0"
      / "results.json", {"task": "listops", "attention": "full", "preset": "tiny", "seed": 0,
                         "best_eval_accuracy": accuracy, "test_accuracy_best_validation": accuracy})
  asked = {"preset": ["tiny"], "task": ["listops"], "attention": ["full"], "seed": [0]}
  tuning.write_report(tuning.records(runs, tune, asked, tuning.TESTED), tune, out, preset="tiny")


def _write_results(out: Path, accuracy: float):
  records.write_json(out / "results.json", {"test_accuracy_final": accuracy})


def _rewrite_metrics(out: Path, accuracy: float):
  if accuracy == 0.3:   # the old file: five events
    records.write_text(out / "metrics.jsonl", "".join(
        json.dumps({"step": s, "train_loss": accuracy}) + "\n" for s in range(1, 6)))
  else:                 # a resume at step 3 rewrites it
    writer = MetricsWriter(out)
    try:
      writer.resume(3)
    finally:
      writer.close()


@pytest.mark.parametrize("write", [_write_report, _write_sweep, _write_tuning, _write_results,
                                   _rewrite_metrics],
                         ids=["report", "sweep", "tuning", "results", "metrics"])
def test_a_writer_cut_off_leaves_each_file_old_or_new(write, tmp_path):
  """Cut off in each of its files in turn, a writer leaves every file as it was before or as
  a complete run writes it, never torn, and no temporary file behind."""
  def before(name):
    out = tmp_path / name / "out"
    out.mkdir(parents=True)
    write(out, 0.3)
    return out

  old = snapshot(before("old"))
  out = before("new")
  with writes_crash_under(out, at=-1) as written:   # none crashes: what the writer writes
    write(out, 0.4)
  new = snapshot(out)
  assert [name for name in new if old.get(name) != new[name]]
  for at in range(len(written)):
    out = before(f"crash{at}")
    with writes_crash_under(out, at) as opened, pytest.raises(OSError, match="simulated crash"):
      write(out, 0.4)
    assert len(opened) == at + 1
    after = snapshot(out)
    assert set(after) <= set(new) | set(old)
    for name, content in after.items():
      assert content in (old.get(name), new[name]), f"{name} is torn (crash at file {at})"


def test_a_torn_last_line_of_metrics_is_skipped(tmp_path, caplog):
  events = [{"step": s, "train_loss": 1.0 / s} for s in (1, 2, 3)]
  torn = "".join(json.dumps(e) + "\n" for e in events) + '{"step": 4, "train_lo'
  (tmp_path / "metrics.jsonl").write_text(torn)
  with caplog.at_level("WARNING"):
    assert read_metrics(tmp_path) == events
  assert "skipping its last line, cut off in the middle of a write" in caplog.text
  writer = MetricsWriter(tmp_path)
  writer.resume(3)
  writer.write(4, train_loss=0.25)
  writer.close()
  assert read_metrics(tmp_path) == events + [{"step": 4, "train_loss": 0.25}]
  (tmp_path / "metrics.jsonl").write_text(torn + "\n" + json.dumps(events[0]) + "\n")
  with pytest.raises(ValueError, match="metrics.jsonl: line 4 is not JSON"):
    read_metrics(tmp_path)


def test_a_fresh_start_renames_the_earlier_runs_files(tmp_path):
  for run in (1, 2, 3):
    writer = MetricsWriter(tmp_path)
    kept = writer.start_fresh()
    writer.write(1, train_loss=float(run))
    writer.close()
    records.write_json(tmp_path / "results.json", {"run": run})
    assert kept == (None if run == 1 else "metrics.jsonl.1, tensorboard.1, results.json.1")
  for suffix, run in (("", 3), (".1", 2), (".2", 1)):   # the newest earlier run is .1
    assert json.loads((tmp_path / f"results.json{suffix}").read_text()) == {"run": run}
    lines = (tmp_path / f"metrics.jsonl{suffix}").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 1, "train_loss": float(run)}]
    assert len(list((tmp_path / f"tensorboard{suffix}").glob("events.out.tfevents.*"))) == 1


def test_writing_records_and_reports_starts_no_jax():
  """tuning and report read and write records only: importing them (at the top of the commands)
  must not start JAX before the flags are checked."""
  loaded = subprocess.run(
      [sys.executable, "-c", "import sys, experiments.tuning, experiments.report, "
       "experiments.common.records; print(sorted({'jax', 'flax'} & set(sys.modules)))"],
      capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2], check=True)
  assert loaded.stdout.strip() == "[]", loaded.stdout + loaded.stderr


def test_the_report_says_each_phase(tmp_path, caplog):
  """Reading the runs, writing the tables and each task's plots are logged as they start."""
  with caplog.at_level("INFO"):
    _write_report(tmp_path / "report", 0.5)
  said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("report: ")]
  assert said == [f"report: reading the runs under {tmp_path / 'runs0.5'}",
                  f"report: 1 run(s) read; writing the tables into {tmp_path / 'report'}",
                  "report: plots 1/1: listops (tiny), its bars and training curves"]
