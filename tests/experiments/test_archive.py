"""experiments.archive: the finished runs of a grid into one file and back."""
import json
import subprocess
import sys

import pytest

from experiments import archive
from experiments.common.errors import HarnessError

RUNS = {"tune/schedule.base_learning_rate=0.01/runs/mqar/full/seed0": {"seed": 0, "acc": 0.5},
        "tune/schedule.base_learning_rate=0.01/runs/mqar/full/seed1": {"seed": 1, "acc": 0.75},
        "runs/mad/compression/gla/seed0": {"not_applicable": "why"}}


@pytest.fixture
def out(tmp_path):
  out = tmp_path / "out"
  for run, results in RUNS.items():
    (out / run).mkdir(parents=True)
    (out / run / "results.json").write_text(json.dumps(results))
  (out / "runs/mad/compression/gla/seed0/metrics.jsonl").write_text("{}\n")   # not archived
  (out / "runs/mqar/deltanet/seed0").mkdir(parents=True)   # an unfinished run: no results.json
  return out


def test_a_restored_archive_holds_every_finished_run_and_nothing_else(out, tmp_path):
  assert archive.save(out, tmp_path / "docs/a.jsonl") == (3, 3)
  lines = [json.loads(line) for line in (tmp_path / "docs/a.jsonl").read_text().splitlines()]
  assert [line["run"] for line in lines] == sorted(RUNS)
  restored = tmp_path / "restored"
  assert archive.restore(tmp_path / "docs/a.jsonl", restored) == (3, 0)
  assert sorted(p.relative_to(restored).as_posix() for p in restored.rglob("*") if p.is_file()) \
      == sorted(f"{run}/results.json" for run in RUNS)
  for run, results in RUNS.items():
    assert json.loads((restored / run / "results.json").read_text()) == results
  # Again into the same folder: every run is there already, and equal.
  assert archive.restore(tmp_path / "docs/a.jsonl", restored) == (0, 3)


def test_an_archive_only_grows_and_never_replaces_other_results(out, tmp_path):
  archive.save(out, tmp_path / "a.jsonl")
  # Saved from a folder that holds one of its runs and a new one: the others are kept.
  other = tmp_path / "other"
  run = sorted(RUNS)[0]
  (other / run).mkdir(parents=True)
  (other / run / "results.json").write_text((out / run / "results.json").read_text())
  (other / "runs/mqar/gla/seed0").mkdir(parents=True)
  (other / "runs/mqar/gla/seed0/results.json").write_text(json.dumps({"acc": 0.5}))
  assert archive.save(other, tmp_path / "a.jsonl") == (4, 1)
  assert sorted(archive.read(tmp_path / "a.jsonl")) == sorted([*RUNS, "runs/mqar/gla/seed0"])
  # Other results for an archived run: refused both ways, nothing written.
  before = (tmp_path / "a.jsonl").read_text()
  (out / run / "results.json").write_text(json.dumps({"acc": 0.25}))
  different = rf"{out / run}/results.json holds other results than {tmp_path}/a.jsonl for {run}"
  with pytest.raises(HarnessError, match=different + ": remove that run's line"):
    archive.save(out, tmp_path / "a.jsonl")
  assert (tmp_path / "a.jsonl").read_text() == before
  with pytest.raises(HarnessError, match=different + ": restore into a new folder"):
    archive.restore(tmp_path / "a.jsonl", out)
  assert json.loads((out / run / "results.json").read_text())["acc"] == 0.25


def test_bad_archives_and_empty_folders_are_named(tmp_path):
  with pytest.raises(HarnessError, match=r"no finished run under .*empty"):
    archive.save(tmp_path / "empty", tmp_path / "a.jsonl")
  with pytest.raises(HarnessError, match=r"missing.jsonl does not exist: `--save"):
    archive.restore(tmp_path / "missing.jsonl", tmp_path / "out")
  (tmp_path / "evil.jsonl").write_text(json.dumps({"run": "../elsewhere", "results": {}}) + "\n")
  with pytest.raises(HarnessError, match=r"line 1: the run \.\./elsewhere is not a folder inside"):
    archive.restore(tmp_path / "evil.jsonl", tmp_path / "out")
  assert not (tmp_path / "elsewhere").exists()


def test_the_command_line_saves_and_restores(out, tmp_path):
  def command(*flags):
    return subprocess.run([sys.executable, "-m", "experiments.archive", *flags],
                          capture_output=True, text=True, timeout=120)
  planned = command("--save", f"--out={out}", f"--archive={tmp_path}/a.jsonl", "--dry_run")
  assert planned.stdout.strip() == (f"would add the 3 finished runs under {out} to "
                                    f"{tmp_path}/a.jsonl")
  assert not (tmp_path / "a.jsonl").exists()
  saved = command("--save", f"--out={out}", f"--archive={tmp_path}/a.jsonl")
  assert saved.returncode == 0 and saved.stdout.strip() == (
      f"{tmp_path}/a.jsonl: 3 finished runs, 3 of them added from {out}")
  restored = command("--restore", f"--out={tmp_path}/b", f"--archive={tmp_path}/a.jsonl")
  assert restored.stdout.strip() == (f"{tmp_path}/b: 3 runs restored from {tmp_path}/a.jsonl, "
                                     "0 already there")
  both = command("--save", "--restore", f"--out={out}", f"--archive={tmp_path}/a.jsonl")
  assert both.returncode == 1 and both.stderr.strip() == (
      "error: give one of --save (OUT -> archive), --restore (archive -> OUT) and --tables "
      "(docs' tables <- docs/runs)")
  unnamed = command("--save", f"--out={out}")
  assert unnamed.returncode == 1 and unnamed.stderr.strip() == (
      "error: --save and --restore take --out=OUT and --archive=FILE.jsonl")
  # The check itself: test_tables_recompute.py.
  planned = command("--tables", "--dry_run")
  assert planned.returncode == 0 and planned.stdout.splitlines()[0].endswith(
      "docs/mqar_tuned.csv against mqar_tuned_2025.jsonl")
  misplaced = command("--save", "--write", f"--out={out}", f"--archive={tmp_path}/a.jsonl")
  assert misplaced.stderr.strip() == (
      "error: --write rewrites the docs' tables: it goes with --tables")
