"""A task's config file, found by the task's name (configs/lra/<task>.py, configs/mad/<task>.py,
configs/<task>.py), its config for a variant and preset with command-line overrides, and the
values it declares (configs/task_values.py)."""
from __future__ import annotations

import importlib

import lra
import synthetic
from configs.task_values import TaskValues
from experiments.common import tasks
from experiments.common.errors import HarnessError, did_you_mean
from experiments.common.overrides import set_field

TASK_CONFIGS = "configs/lra/<task>.py"


def task_module(task: str):
  """The config file of a task: configs/lra/<task>.py, configs/mad/<task>.py for a MAD task,
  or configs/<task>.py for another synthetic task."""
  known = tasks.available_tasks()
  if task not in known:
    raise HarnessError(f"unknown task {task!r}{did_you_mean(task, known)}; tasks: "
                       f"{', '.join(known)}")
  package = ("configs.lra" if task in lra.available_tasks() else
             "configs.mad" if task in synthetic.family_tasks("mad") else "configs")
  return importlib.import_module(f"{package}.{task}")


def task_values(task: str) -> TaskValues:
  """The values the task's config file declares (its VALUES)."""
  return task_module(task).VALUES


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
