"""The state-tracking table: runs with and without negative eigenvalues kept apart in the report
and in state_tracking_<preset>.csv, and the tasks trained through the harness."""
import csv
import json

import pytest

from experiments import report
from helpers import tiny_run_overrides

NEG = "model.attention_options.allow_neg_eigval=True"


CPU = {"git_commit": "252baedb961b", "device": "1 x cpu (cpu)", "versions": {"jax": "0.10.2"},
       "date": "2026-12-04T20:00:00+00:00"}
GPU = {"git_commit": "daeaceb00000+dirty", "device": "1 x NVIDIA H200 (gpu)",
       "versions": {"jax": "0.11.2"}, "date": "2026-12-05T01:00:00+00:00"}


def plant(root, task, attention, seed, accuracy, *, negative=None, environment=CPU):
  """A results.json of a finished run (best-validation accuracy `accuracy`)."""
  options = {} if negative is None else {"allow_neg_eigval": negative}
  workdir = root / f"{task}-{attention}-{negative}-{seed}"
  workdir.mkdir(parents=True)
  (workdir / "results.json").write_text(json.dumps({
      "task": task, "attention": attention, "preset": "tiny", "seed": seed,
      "test_accuracy_final": 0.5, "test_accuracy_best_validation": accuracy,
      "majority_accuracy": 0.5, "model": {"attention_options": options},
      "environment": environment}))


def test_csv_has_a_row_per_variant_and_eigenvalue_range(tmp_path):
  runs = tmp_path / "runs"
  plant(runs, "parity", "deltanet", 0, 0.5)
  plant(runs, "parity", "deltanet", 1, 0.6, negative=False)   # the default, set explicitly
  plant(runs, "parity", "deltanet", 0, 1.0, negative=True)
  plant(runs, "parity", "deltanet", 1, 0.9, negative=True, environment=GPU)
  plant(runs, "parity", "full", 0, 0.52)
  plant(runs, "s3", "full", 0, 0.2)
  plant(runs, "mqar", "full", 0, 0.9)   # not a state-tracking task: not in the CSV
  found = report.read_runs(runs)
  (path,) = report.write_state_tracking_csvs(found, tmp_path)
  assert path.name == "state_tracking_tiny.csv"
  rows = list(csv.reader(path.open()))
  cpu = ["1 x cpu (cpu)", "252baed", "0.10.2", "2026-12-04"]
  assert rows == [["task", "variant", "allow_neg_eigval", "seeds", "test_mean", "test_std",
                   "device", "commit", "jax", "date"],
                  ["parity", "full", "n/a", "1", "52.00", "", *cpu],   # LRA's rows first
                  ["parity", "deltanet", "False", "2", "55.00", "7.07", *cpu],
                  # One seed on a GPU: the row names both machines, commits and versions.
                  ["parity", "deltanet", "True", "2", "95.00", "7.07",
                   "1 x NVIDIA H200 (gpu) + 1 x cpu (cpu)", "252baed + daeaceb+dirty",
                   "0.10.2 + 0.11.2", "2026-12-04..2026-12-05"],
                  ["s3", "full", "n/a", "1", "20.00", "", *cpu]]
  text = report.markdown(report.summarize(found))
  assert "### State tracking, preset `tiny`, best validation step" in text
  assert "| deltanet | 55.00 ± 7.07 | — |" in text
  assert "| deltanet (allow_neg_eigval) | 95.00 ± 7.07 | — |" in text


@pytest.mark.slow
def test_parity_trains_through_the_harness_with_and_without_negative_eigenvalues(tmp_path):
  from experiments import reproduce

  overrides = tiny_run_overrides(examples=(32, 8, 8))
  for out, extra in ((tmp_path / "base", []), (tmp_path / "neg", [NEG])):
    failures = reproduce.run_grid(preset="tiny", tasks=["parity"], attentions=["deltanet"],
                                  seeds=[0], out=out, overrides=[*overrides, *extra])
    assert failures == []
  runs = report.read_runs(tmp_path)
  assert sorted(r["model"]["attention_options"].get("allow_neg_eigval", False)
                for r in runs) == [False, True]
  assert all(r["num_examples"] == {"train": 32, "validation": 8, "test": 8} for r in runs)
  report.write_report(tmp_path, tmp_path / "report")
  rows = list(csv.reader((tmp_path / "report" / "state_tracking_tiny.csv").open()))
  assert [row[:4] for row in rows[1:]] == [["parity", "deltanet", "False", "1"],
                                           ["parity", "deltanet", "True", "1"]]
