"""The table of synthetic tasks and what their generators share.

A task is a frozen settings dataclass whose fields are its load options, with a class attribute
`task` (its name), a `vocab_size` (field or property), `check(seq_len)` and
`generate(seq_len, split)` -> {"tokens", "lengths", "targets"}; its module has a RULES_VERSION
(bumped when the generator's output for given settings changes). `register_task` enters it in
TASKS once, with its spec and family; `synthetic.load`, `synthetic.provenance` and the harness
find it there.
"""
from __future__ import annotations

import dataclasses
import sys

import numpy as np

from lra.spec import IGNORED, TaskSpec

SPLIT_SEEDS = {"train": 0, "validation": 1, "test": 2}

# The families, in the order the reports list their tables; a task belongs to one.
FAMILIES = {
    "mad": "the six tasks of the MAD suite (synthetic/mad.py)",
    "state_tracking": "running products of group elements (synthetic/state_tracking.py)",
    "formal_language": "Grazzi et al.'s formal-language tasks (synthetic/formal_languages.py)",
    "diagnostics": "the other diagnostics (multi-query associative recall)",
}


@dataclasses.dataclass(frozen=True)
class SyntheticTask:
  """A registered task: its spec (defaults; the load options change vocabulary and length), its
  settings class, its family, the generator (module name, RULES_VERSION) that provenance
  records, and where the task defines one, the accuracy of guessing (`chance`), which scales
  its accuracy (scaled_accuracy)."""
  spec: TaskSpec
  settings: type
  family: str
  generator: str
  rules_version: int
  chance: float | None = None

  def scaled_accuracy(self, accuracy: float) -> float:
    """(accuracy - chance) / (1 - chance): 1 for every answer right, 0 for guessing."""
    if self.chance is None:
      raise ValueError(f"{self.spec.name} defines no chance level; the tasks that do: "
                       f"{', '.join(name for name, t in TASKS.items() if t.chance is not None)}")
    return (accuracy - self.chance) / (1 - self.chance)


TASKS: dict[str, SyntheticTask] = {}


def register_task(settings: type, *, family: str, max_len: int, has_padding: bool = False,
                  readout: str = "every_position", chance: float | None = None) -> type:
  """Enters `settings` (a task's settings class) in TASKS under `settings.task`; its default
  vocabulary is the default settings' vocab_size; `chance`, the accuracy of guessing the asked
  tokens, where the task's protocol scales accuracy by it. Returns the class."""
  if family not in FAMILIES:
    raise ValueError(f"{settings.task}: unknown family {family!r}; families: "
                     f"{', '.join(FAMILIES)}")
  if settings.task in TASKS:
    raise ValueError(f"synthetic task {settings.task!r} is registered twice "
                     f"({TASKS[settings.task].generator} and {settings.__module__})")
  vocab_size = settings().vocab_size
  spec = TaskSpec(settings.task, num_classes=vocab_size, max_len=max_len, vocab_size=vocab_size,
                  dual=False, has_padding=has_padding, objective="next_token", readout=readout)
  module = settings.__module__
  TASKS[settings.task] = SyntheticTask(spec, settings, family, module,
                                       sys.modules[module].RULES_VERSION, chance)
  return settings


def check_integer_fields(settings, may_be_zero=("seed",)) -> None:
  """ValueError naming the first `int` field of a task's settings (a dataclass) that is not an
  integer >= 1 (>= 0 for those in may_be_zero)."""
  for field in dataclasses.fields(settings):
    value, least = getattr(settings, field.name), 0 if field.name in may_be_zero else 1
    if field.type == "int" and (isinstance(value, bool) or
                                not isinstance(value, (int, np.integer)) or value < least):
      raise ValueError(f"{settings.task}: {field.name} must be an integer >= {least}, got "
                       f"{value!r}")


__all__ = ["FAMILIES", "IGNORED", "SPLIT_SEEDS", "SyntheticTask", "TASKS",
           "check_integer_fields", "register_task"]
