"""The table of synthetic tasks (synthetic/base.py): each task registered once with its spec,
settings and generator; the harness finds every task through it; the move out of lra/ kept the
data and its provenance."""
import dataclasses
import json
from pathlib import Path

import pytest

import lra
import synthetic
from experiments.common import tasks
from synthetic import base

REPO = Path(__file__).resolve().parents[2]


def test_every_task_is_registered_once_with_its_spec_settings_and_generator():
  assert synthetic.available_tasks()[:6] == synthetic.family_tasks("mad")
  assert synthetic.family_tasks("state_tracking") == ("parity", "s3", "s5")
  assert synthetic.family_tasks("diagnostics") == ("mqar",)
  for name, entry in synthetic.TASKS.items():
    assert entry.spec.name == entry.settings.task == name
    assert entry.spec.objective == "next_token" and entry.family in synthetic.FAMILIES
    assert entry.generator.startswith("synthetic.") and entry.rules_version >= 1
    assert entry.spec.vocab_size == entry.settings().vocab_size
  assert synthetic.task_spec("compression").readout == "last_position"
  assert synthetic.task_spec("s5").vocab_size == 120 and synthetic.task_spec("s5").max_len == 256


def test_the_harness_dispatches_by_name_and_lra_knows_only_lra():
  assert tasks.available_tasks() == lra.available_tasks() + synthetic.available_tasks()
  assert tasks.task_spec("mqar") == synthetic.task_spec("mqar")
  assert tasks.task_spec("listops") == lra.task_spec("listops")
  assert tasks.resolve_options("mqar", 32, num_pairs=4).vocab_size == 512
  assert tasks.load("parity", "test", max_len=48, num_test=3).inputs.shape == (3, 48)
  with pytest.raises(ValueError, match=r"unknown task 'parityy' \(did you mean 'parity'\?\)"):
    tasks.task_spec("parityy")
  with pytest.raises(ValueError, match="unknown LRA task 'mqar'"):
    lra.task_spec("mqar")
  with pytest.raises(ValueError, match="unknown synthetic task 'listops'"):
    synthetic.task_spec("listops")


def test_a_task_is_one_registration_and_a_second_one_is_refused(monkeypatch):
  monkeypatch.setattr(base, "TASKS", dict(base.TASKS))   # the real table stays as it is

  @dataclasses.dataclass(frozen=True)
  class Copy(synthetic.TASKS["mqar"].settings):
    task = "copy_for_test"

  base.register_task(Copy, family="diagnostics", max_len=32)
  assert base.TASKS["copy_for_test"].spec.max_len == 32
  assert base.TASKS["copy_for_test"].generator == __name__
  with pytest.raises(ValueError, match="'copy_for_test' is registered twice"):
    base.register_task(Copy, family="diagnostics", max_len=32)
  with pytest.raises(ValueError, match="unknown family 'recall'; families: mad"):
    base.register_task(Copy, family="recall", max_len=32)


RULES_VERSION = 1   # this module registers a test task above: its generator's version


def test_archived_runs_data_fingerprints_are_unchanged():
  """The runs archived before the tasks left lra/ recorded each split's fingerprint; the same
  load options give the same fingerprint and rules version now (the data are the same)."""
  archives = ["mad_tuned.jsonl", "mqar_tuned_2025.jsonl"]
  for archive in archives:
    with open(REPO / "docs" / "runs" / archive, encoding="utf-8") as lines:
      recorded = json.loads(next(lines))["results"]["data"]
    options = dict(recorded["load_options"])
    record = synthetic.provenance(recorded["task"], max_len=options.pop("max_len"), **options)
    assert record["fingerprint"] == recorded["fingerprint"], archive
    assert record["generator"]["rules_version"] == recorded["generator"]["rules_version"]
    assert record["generator"]["parameters"] == recorded["generator"]["parameters"]
