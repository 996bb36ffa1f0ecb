"""The trainer's data: the three splits of a task (generated first when ListOps or Pathfinder
data is missing), and batches placed on the device mesh.

Every process loads the whole split and takes its own rows of each global batch, so the
batches (and so the results) do not depend on how many processes share the work.
"""
from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np
from absl import logging

import lra
from experiments.cli import HarnessError

GENERATED_TASKS = ("listops", "pathfinder", "pathx")


def load_splits(config) -> dict[str, lra.Dataset]:
  """{"train", "validation", "test"} -> Dataset at length config.model.max_len.

  Missing data is an error that says how to get it, except under the tiny preset, which
  generates its small ListOps / Pathfinder data (LRA-size data is never generated silently).
  """
  if not config.data_dir and config.task in lra.available_tasks():
    raise HarnessError("config.data_dir is empty; set it to the folder holding (or to receive) "
                       "the LRA data")
  try:
    return {split: _load(config, split) for split in lra.SPLITS}
  except FileNotFoundError as missing:
    if config.task not in GENERATED_TASKS or config.preset != "tiny":
      raise HarnessError(f"{config.task} data for the {config.preset} preset: {missing}"
                         ) from None
  if jax.process_index() == 0:
    generate(config)
  _barrier("lra-data-generated")
  return {split: _load(config, split) for split in lra.SPLITS}


def _load(config, split: str) -> lra.Dataset:
  try:
    return lra.load(config.task, split, data_dir=config.data_dir or None,
                    max_len=config.model.max_len, **config.data)
  except (ImportError, ValueError) as e:  # bad options, malformed files, missing TFDS
    raise HarnessError(f"cannot load {config.task}/{split}: {e}") from None


def generate(config) -> str:
  """Writes the task's data into config.data_dir at the sizes in config.generate."""
  sizes = dict(config.generate)
  if not sizes:
    raise HarnessError(f"{config.task} data is missing from {config.data_dir} and "
                       "config.generate has no sizes to generate it with")
  workers = max(1, os.cpu_count() or 1)
  logging.info("%s data not found in %s: generating %s with %d worker(s)", config.task,
               config.data_dir, sizes, workers)
  Path(config.data_dir).mkdir(parents=True, exist_ok=True)
  try:
    if config.task == "listops":
      return lra.generate_listops(config.data_dir, seed=0, workers=workers, **sizes)
    return lra.generate_pathfinder(config.data_dir, seed=0, workers=workers, **config.data,
                                   **sizes)
  except (TypeError, ValueError) as e:
    raise HarnessError(f"cannot generate {config.task} data with config.generate={sizes}: {e}"
                       ) from None


def check_splits(config, datasets: dict[str, lra.Dataset]) -> dict[str, dict]:
  """lra.check_dataset on every split before the first step: an empty split, labels or token
  ids out of range, or more unreadable source examples than config.max_skipped_fraction stop
  the run (HarnessError naming where the data was read); otherwise what was truncated or
  skipped is logged and returned for results.json."""
  checks = {}
  for split, ds in datasets.items():
    try:
      checks[split] = lra.check_dataset(ds, max_skipped_fraction=config.max_skipped_fraction)
    except ValueError as e:
      raise HarnessError(f"{config.task}/{split}: {e}") from None
    if checks[split]["num_skipped"] or checks[split]["num_truncated"]:
      logging.warning("%s/%s: %d unreadable source examples skipped (e.g. %s); %d examples cut "
                      "to max_len=%d", config.task, split, checks[split]["num_skipped"],
                      ", ".join(checks[split]["skipped_examples"]) or "none",
                      checks[split]["num_truncated"], checks[split]["max_len"])
  return checks


def provenance(config) -> dict:
  """Where the run's data came from (lra.provenance): official files, generated (with the
  generator's settings) or TFDS, and a fingerprint of the files read."""
  return lra.provenance(config.task, config.data_dir or None, max_len=config.model.max_len,
                        **config.data)


def _barrier(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def majority_accuracy(ds: lra.Dataset) -> float:
  """The accuracy of always answering the most frequent target of this split (over the asked
  positions of a token task)."""
  asked = ds.targets[ds.targets != lra.mqar.IGNORED]
  return float(np.bincount(asked).max() / asked.size)


def train_batches(ds: lra.Dataset, batch_size: int, *, seed: int, start_step: int):
  """Endless shuffled batches; the one for step s (counted from 0) is the same however the
  run was interrupted and resumed."""
  return lra.iterate(ds, batch_size, shuffle=True, seed=seed, start_step=start_step)


def eval_batches(ds: lra.Dataset, batch_size: int):
  """One pass in order; the last batch is filled up with weight-0 copies."""
  return lra.iterate(ds, batch_size, shuffle=False, repeat=False)


def batch_spec(ds: lra.Dataset, batch_size: int, sharding) -> dict[str, jax.ShapeDtypeStruct]:
  """The shapes and dtypes of a global batch as `to_device` places it: what a step is compiled
  for ahead of time."""
  batch = next(eval_batches(ds, batch_size))
  return {key: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
          for key, value in batch.items()}


def to_device(batch: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
  """A global numpy batch -> arrays sharded over the mesh's data axis (this process puts
  only its own rows)."""
  rows = len(batch["targets"])
  per_process = rows // jax.process_count()
  start = jax.process_index() * per_process
  return {key: jax.make_array_from_process_local_data(
              sharding, value[start:start + per_process], value.shape)
          for key, value in batch.items()}
