"""`synthetic.load` and `synthetic.provenance`: a synthetic task's split, generated in memory
from its settings, as an `lra.Dataset`, and the record of where it came from."""
from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path

import numpy as np

from lra import cache as cache_lib
from lra.checks import check_dataset
from lra.dataset import Dataset
from lra.spec import TaskSpec
from lra.tasks import check_split
from synthetic.base import TASKS

SPLIT_RULE = "three independent random streams of the generator, one per split"


def registered(name: str):
  """The registered task `name` (synthetic.base.SyntheticTask); ValueError listing them."""
  if name not in TASKS:
    close = difflib.get_close_matches(name, TASKS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"unknown synthetic task {name!r}{hint}; synthetic tasks: "
                     f"{', '.join(TASKS)}")
  return TASKS[name]


def task_spec(name: str) -> TaskSpec:
  """The default `TaskSpec` of synthetic task `name` (the load options change it)."""
  return registered(name).spec


def resolve_options(name: str, max_len=None, **options) -> tuple[TaskSpec, dict, object]:
  """Checks `synthetic.load`'s options for task `name`; returns the spec as loaded, the load
  parameters (the settings' fields and max_len: what the fingerprint hashes) and the settings."""
  entry = registered(name)
  try:
    settings = entry.settings(**options)
  except TypeError:
    fields = ", ".join(f.name for f in dataclasses.fields(entry.settings))
    raise ValueError(f"{name}: unknown option(s) {', '.join(sorted(options))}; its "
                     f"options: {fields}") from None
  spec = entry.spec
  max_len = spec.max_len if max_len is None else max_len
  if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len < 1:
    raise ValueError(f"max_len must be a positive integer, got {max_len!r}")
  settings.check(int(max_len))
  params = {**dataclasses.asdict(settings), "max_len": int(max_len)}
  spec = dataclasses.replace(spec, vocab_size=settings.vocab_size,
                             num_classes=settings.vocab_size, max_len=int(max_len))
  return spec, params, settings


def load(name: str, split: str, max_len: int | None = None, **options) -> Dataset:
  """One split of synthetic task `name`, generated in memory (deterministic for the options).

  max_len: tokens per sequence (the test length of a task that trains shorter); default the
    task's spec. options: the fields of the task's settings (`synthetic.TASKS[name].settings`),
    e.g. MQAR's vocab_size, num_pairs, num_train, seed.
  Returns a Dataset with targets int32 [N, L], the token to emit at each position, IGNORED (-1)
  where nothing is asked; it has passed `lra.check_dataset`.
  """
  spec, _, settings = resolve_options(name, max_len, **options)
  check_split(split)
  arrays = settings.generate(spec.max_len, split)
  ds = Dataset(spec=spec, split=split,
               source=f"synthetic {name} generator ({split}, seed {settings.seed})",
               **arrays)
  check_dataset(ds, max_skipped_fraction=None)
  return ds


def provenance(name: str, *, max_len: int | None = None, **options) -> dict:
  """Where `synthetic.load(name, split, max_len, **options)` takes all three splits from, in the
  form of `lra.provenance`'s record: kind "generated", no files, the generator (module name,
  rules_version, parameters) and a fingerprint of the load parameters."""
  _, params, settings = resolve_options(name, max_len, **options)
  entry = TASKS[name]
  generator = {"generator": entry.generator, "rules_version": entry.rules_version,
               "parameters": dataclasses.asdict(settings)}
  return {"task": name, "data_dir": None, "load_options": params, "splits": SPLIT_RULE,
          "generator": generator, "tfds": None, "kind": "generated", "files": {},
          "num_files": 0,
          "fingerprint": cache_lib.fingerprint([], Path("."), {"task": name, **params})}
