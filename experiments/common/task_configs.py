"""A task's config file, found by the task's name (configs/lra/<task>.py, configs/mad/<task>.py,
configs/<task>.py) and loaded by its path as config_flags loads --config, its config for a
variant and preset with command-line overrides, and the values it declares
(configs/task_values.py). The harness never uses it to fill in a config: get_config makes the
whole run (configs/presets.py); commands load a task's file here to make their configs, and
the trainer to know which values the user changed (results.json's overrides)."""
from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import lra
import synthetic
from configs.task_values import TaskValues
from experiments.common import tasks
from experiments.common.errors import HarnessError, did_you_mean
from experiments.common.overrides import set_field

TASK_CONFIGS = "configs/lra/<task>.py"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def config_file(task: str) -> Path:
  """The config file of a task: configs/lra/<task>.py, configs/mad/<task>.py for a MAD task,
  or configs/<task>.py for another synthetic task."""
  known = tasks.available_tasks()
  if task not in known:
    raise HarnessError(f"unknown task {task!r}{did_you_mean(task, known)}; tasks: "
                       f"{', '.join(known)}")
  folder = ("lra" if task in lra.available_tasks() else
            "mad" if task in synthetic.family_tasks("mad") else "")
  return CONFIGS / folder / f"{task}.py"


@functools.cache
def task_module(task: str):
  """The task's config file (config_file), loaded by its path once per process."""
  path = config_file(task)
  spec = importlib.util.spec_from_file_location(f"_task_config_{task}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def task_values(task: str) -> TaskValues:
  """The values the task's config file declares (its VALUES)."""
  return task_module(task).VALUES


def baseline(config):
  """get_config of `config`'s task file for its variant and preset, as made before any
  override: what the user's changes are measured from."""
  return task_config(config.task, config.made.variant, config.preset)


def task_config(task: str, attention: str, preset: str, seed: int | None = None,
                overrides=()):
  """get_config("<attention>,<preset>") of the task's config file (see task_module), with the
  seed and overrides ("field=value", parsed as the field's type) when given; a bad argument ->
  HarnessError."""
  try:
    config = task_module(task).get_config(f"{attention},{preset}")
  except ValueError as e:
    raise HarnessError(str(e)) from None
  if seed is None and not overrides:
    return config
  if seed is not None:
    config.seed = seed
  config.lock()
  for override in overrides:
    field, sep, value = override.partition("=")
    if not sep:
      raise HarnessError(f"--override takes field=value, got {override!r}")
    set_field(config, field, value)
  return config
