"""Every task the harness runs, by name: the LRA tasks (the package `lra`, read from files) and
the synthetic ones (the package `synthetic`, generated in memory). Each package knows only its
own tasks; the harness asks the one that holds the name."""
from __future__ import annotations

import difflib

import lra
import synthetic
from lra.loader import resolve_options as resolve_lra_options


def available_tasks() -> tuple[str, ...]:
  """The LRA tasks, then the synthetic ones."""
  return lra.available_tasks() + synthetic.available_tasks()


def is_synthetic(task: str) -> bool:
  return task in synthetic.TASKS


def task_spec(task: str) -> lra.TaskSpec:
  """The task's default spec; an unknown name -> ValueError listing every task."""
  if task in synthetic.TASKS:
    return synthetic.task_spec(task)
  if task in lra.available_tasks():
    return lra.task_spec(task)
  known = available_tasks()
  close = difflib.get_close_matches(task, known, n=1)
  hint = f" (did you mean {close[0]!r}?)" if close else ""
  raise ValueError(f"unknown task {task!r}{hint}; available tasks: {', '.join(known)}")


def resolve_options(task: str, max_len=None, **options) -> lra.TaskSpec:
  """Checks the load options of `task` (what its load would check before reading anything) and
  returns its spec as loaded; ValueError naming a bad option."""
  if is_synthetic(task):
    return synthetic.resolve_options(task, max_len, **options)[0]
  task_spec(task)   # an unknown name lists every task
  return resolve_lra_options(task, max_len, **options)[0]


def load(task: str, split: str, *, data_dir=None, max_len=None, **options) -> lra.Dataset:
  """One split: `synthetic.load` (no data_dir) or `lra.load`."""
  if is_synthetic(task):
    return synthetic.load(task, split, max_len=max_len, **options)
  return lra.load(task, split, data_dir=data_dir, max_len=max_len, **options)


def provenance(task: str, data_dir=None, *, max_len=None, **options) -> dict:
  """Where the task's data came from: `synthetic.provenance` or `lra.provenance`."""
  if is_synthetic(task):
    return synthetic.provenance(task, max_len=max_len, **options)
  return lra.provenance(task, data_dir, max_len=max_len, **options)


def scaled_accuracies(task: str, **accuracies: float) -> dict:
  """{"scaled_<name>": (accuracy - chance) / (1 - chance)} for each accuracy given, for a task
  whose protocol scales accuracy by its chance level (the formal languages); else {}."""
  if not is_synthetic(task) or synthetic.TASKS[task].chance is None:
    return {}
  return {f"scaled_{name}": synthetic.TASKS[task].scaled_accuracy(accuracy)
          for name, accuracy in accuracies.items()}
