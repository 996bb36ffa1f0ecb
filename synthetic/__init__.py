"""The synthetic tasks: token tasks for a causal model, generated in memory from their settings
(no data files) and loaded as the LRA tasks are, into an `lra.Dataset`:

    import synthetic
    synthetic.available_tasks()                  # every registered task
    ds = synthetic.load("mqar", "train", max_len=64, num_pairs=8)
    ds.inputs, ds.targets                        # int32 [N, L]; targets IGNORED (-1) where
                                                 # nothing is asked
    record = synthetic.provenance("mqar", max_len=64, num_pairs=8)

  mqar               multi-query associative recall (Zoology)        synthetic/mqar.py
  MAD                the six tasks of the MAD suite                  synthetic/mad.py
  parity, s3, s5     state tracking: running parity and permutation  synthetic/state_tracking.py
                     products, tested at longer lengths

A new task is one file here: its settings class (synthetic/base.py says what it holds) and one
`register_task(...)` call; importing this package imports every module in it, so no list names
it. The package uses lra's TaskSpec, Dataset and checks; lra knows nothing of it.
"""
import importlib
import pkgutil

from lra.spec import IGNORED
from synthetic.base import FAMILIES, TASKS, SyntheticTask, register_task
from synthetic.loading import load, provenance, resolve_options, task_spec

for _module in pkgutil.iter_modules(__path__):
  importlib.import_module(f"{__name__}.{_module.name}")


def available_tasks() -> tuple[str, ...]:
  """Every synthetic task, by family (in FAMILIES' order), each family in registration order."""
  order = list(FAMILIES)
  return tuple(sorted(TASKS, key=lambda name: order.index(TASKS[name].family)))


def family_tasks(family: str) -> tuple[str, ...]:
  """The tasks of one family (FAMILIES), e.g. "mad": the six MAD tasks in its table's order."""
  if family not in FAMILIES:
    raise ValueError(f"unknown family {family!r}; families: {', '.join(FAMILIES)}")
  return tuple(name for name in available_tasks() if TASKS[name].family == family)


__all__ = ["FAMILIES", "IGNORED", "SyntheticTask", "TASKS", "available_tasks", "family_tasks",
           "load", "provenance", "register_task", "resolve_options", "task_spec"]
