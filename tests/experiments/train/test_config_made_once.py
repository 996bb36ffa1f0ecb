"""get_config makes the whole run (configs/presets.py); the harness checks it once and runs it
as made. Also the workdir lock (experiments/train/workdir_lock.py)."""
import json
import os
import signal
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import synthetic
from configs import mad, presets
from configs.lra import common
from experiments.common import task_configs, tasks
from experiments.common.errors import HarnessError
from experiments.train import build, evaluation, mesh
from experiments.train.workdir_lock import LOCK_FILE, WorkdirLock

# One of each kind: dense, sparse (token-counted options), kernelised, a mixer.
SAMPLE = ("full", "local", "performer", "mamba2")


def task_presets():
  """Every task file (LRA, MAD, MQAR, state tracking, formal languages) x every preset it has."""
  for task in tasks.available_tasks():
    values = task_configs.task_module(task).VALUES
    if values.is_lra:
      yield from ((task, p) for p in common.LRA_PRESETS
                  if values.light is not None or p not in common.LIGHT_PRESETS)
    elif task in synthetic.family_tasks("mad"):
      yield from ((task, p) for p in mad.MAD_PRESETS)
    elif task in synthetic.family_tasks("formal_language"):
      yield task, "grazzi"
    else:
      yield task, "tiny"


@pytest.mark.parametrize("task, preset", list(task_presets()))
def test_get_config_is_the_config_the_run_uses(task, preset):
  for variant in SAMPLE:
    made = task_configs.task_config(task, variant, preset)
    checked, notes = build.check(made)   # the one check step (trainer.check_run's)
    build.model_config(checked)
    assert checked.to_dict() == made.to_dict(), (task, preset, variant)
    assert all("attention_dropout_rate" in note for note in notes)


def test_the_variant_settings_are_in_get_config_and_a_longer_max_len_is_followed():
  config = task_configs.task_config("mqar", "sliding_window", "tiny")
  assert dict(config.model.attention_options) == {"window": 8}
  assert presets.source_of(config, "model.attention_options.window") == "variant settings"
  config.model.max_len = 32
  checked, notes = build.check(config)
  assert checked.model.attention_options.window == 4 and "8 -> 4" in notes[0]
  config.model.attention_options.window = 6   # the user's own value wins
  assert build.check(config)[0].model.attention_options.window == 6
  assert build.overrides(config, task_configs.baseline(config)) == {
      "model.max_len": 32, "model.attention_options.window": 6}


def test_a_variant_swapped_after_get_config_is_refused():
  config = task_configs.task_config("listops", "performer", "tiny")
  config.model.attention = "local"
  with pytest.raises(HarnessError, match="holds performer's settings: name the variant in the "
                                         "config argument"):
    build.check(config)


def test_a_task_with_one_preset_takes_it_and_a_misspelt_preset_reads_one_way():
  mqar = task_configs.task_module("mqar")
  assert mqar.get_config("full").preset == "tiny"
  assert task_configs.task_module("parity").get_config("full").preset == "tiny"
  assert task_configs.task_module("parity_check").get_config("deltanet").preset == "grazzi"
  with pytest.raises(ValueError, match=r"^parity_check has no preset 'tiny'; its presets: grazzi$"):
    task_configs.task_module("parity_check").get_config("full,tiny")
  with pytest.raises(ValueError, match=r"^listops has no preset 'tnyi' \(did you mean 'tiny'"):
    task_configs.task_module("listops").get_config("full,tnyi")
  with pytest.raises(ValueError, match=r"^mqar has no preset 'paper'; its presets: tiny$"):
    mqar.get_config("full,paper")


HOLD = textwrap.dedent("""
    import sys, time
    from experiments.train.workdir_lock import WorkdirLock
    with WorkdirLock(sys.argv[1]):
      print("held", flush=True)
      time.sleep(60)
""")


def hold_lock(workdir) -> subprocess.Popen:
  """A child process holding `workdir`'s lock (once it has printed "held")."""
  child = subprocess.Popen([sys.executable, "-c", HOLD, str(workdir)], stdout=subprocess.PIPE,
                           text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
  assert child.stdout.readline().strip() == "held"
  return child


@pytest.mark.slow   # the train command imports JAX in a child
def test_the_train_command_refuses_a_locked_workdir_in_one_line(tmp_path):
  child = hold_lock(tmp_path)
  try:
    second = subprocess.run([sys.executable, "-m", "experiments.train",
                             "--config=configs/mqar.py:full", f"--workdir={tmp_path}"],
                            capture_output=True, text=True, timeout=300)
  finally:
    child.kill()
    child.wait()
  assert second.returncode == 1
  assert second.stderr.splitlines()[-1].startswith(
      f"error: {tmp_path} is in use by another training (pid {child.pid} on ")


def test_a_second_run_in_a_locked_workdir_is_refused_and_a_dead_holders_lock_taken(tmp_path):
  child = hold_lock(tmp_path)
  try:
    with pytest.raises(HarnessError, match=rf"in use by another training \(pid {child.pid} on "):
      with WorkdirLock(tmp_path):
        pass
  finally:
    child.send_signal(signal.SIGKILL)
    child.wait()
  assert f"pid {child.pid}" in (tmp_path / LOCK_FILE).read_text()   # left by the killed run
  with WorkdirLock(tmp_path):
    assert f"pid {os.getpid()}" in (tmp_path / LOCK_FILE).read_text()
    with WorkdirLock(tmp_path):   # nested in the holder: nothing to do
      pass
    assert f"pid {os.getpid()}" in (tmp_path / LOCK_FILE).read_text()
  with WorkdirLock(tmp_path):   # released on exit
    pass
  assert json.dumps((tmp_path / LOCK_FILE).read_text()) == '""'


def test_an_evaluation_shows_its_progress(capsys):
  batches = [{"targets": np.ones(2)} for _ in range(3)]
  step = lambda state, batch: {"loss": 1.0, "correct": 1, "count": 2}
  layout = mesh.Layout({"data": jax.device_count()})
  result = evaluation.evaluate(step, None, batches, layout=layout, before_batch=lambda: None,
                               description="test (final)", total=3, show=True)
  assert result == {"loss": 0.5, "accuracy": 0.5, "examples": 6}
  shown = capsys.readouterr().err
  assert "test (final): 100%|" in shown and "3/3" in shown
