"""Orbax checkpoints of a training run: every `checkpoint_every` steps, the last few kept, each
verified before it is used.

A checkpoint holds the whole training state (parameters, optimiser, the model's RNG state,
the step, which also fixes the data position) and the best-so-far model by validation
accuracy, plus a small JSON record (best step and accuracy, wall time). Typed PRNG keys are
stored as their raw key data.

Verification. Orbax checks the structure of what it reads but not the bytes of the arrays: a
checkpoint whose data was overwritten in place restores without complaint. So once orbax has
finished writing a checkpoint, process 0 adds `checksums.json` to it: the size and SHA-256 of
every file in it. `restore_latest` tries the checkpoints newest first, and uses one only if
  1. its files match their checksums,
  2. orbax restores it, and
  3. every restored value is finite.
One that fails is moved to `corrupt_checkpoints/<step>` with a warning naming it and the reason,
and the one before it is tried. A checkpoint without checksums (written before they existed,
or by a run stopped between orbax's save and the checksums) cannot be verified: it is used
only if it passes 2 and 3, with a warning that it was not verified. A checkpoint of another
model is not corrupt: the trainer compares the model in its record (`latest_record`) with its
own before restoring anything.
"""
from __future__ import annotations

import hashlib
import json
import logging as std_logging
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import logging

from experiments.common.errors import first_line
from experiments.common.records import write_json

CHECKSUMS = "checksums.json"
FOLDERS = ("checkpoints", "corrupt_checkpoints")   # under the workdir
_CHUNK_BYTES = 1 << 22


def _is_key(x) -> bool:
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _storable(tree):
  return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      _storable(tree))


def _unstorable(tree, template):
  return jax.tree.map(
      lambda x, t: jax.random.wrap_key_data(x, impl=jax.random.key_impl(t)) if _is_key(t) else x,
      tree, template)


@jax.jit
def _finite_leaves(tree):
  """One boolean per leaf: all of its values are finite (integer leaves always are)."""
  return [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]


def _first_non_finite(tree) -> str | None:
  """The path of the first leaf holding a NaN or an infinity, e.g. "['train'].opt_state..."."""
  paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]
  flags = jax.device_get(_finite_leaves(tree))
  return next((path for path, finite in zip(paths, flags) if not finite), None)


def readable(error: BaseException) -> str:
  """The innermost cause of an error as "Type: its first line": orbax wraps TensorStore's errors
  in exceptions whose own text is a printed method object."""
  while error.__cause__ is not None or error.__context__ is not None:
    error = error.__cause__ or error.__context__
  return f"{type(error).__name__}: {first_line(error) if str(error).strip() else '(no message)'}"


def file_checksums(folder: Path) -> dict[str, dict]:
  """{relative path: {"bytes", "sha256"}} of every file under `folder` but CHECKSUMS."""
  sums = {}
  for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != CHECKSUMS):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
      while chunk := f.read(_CHUNK_BYTES):
        digest.update(chunk)
    sums[path.relative_to(folder).as_posix()] = {"bytes": path.stat().st_size,
                                                 "sha256": digest.hexdigest()}
  return sums


def barrier(name: str) -> None:
  """Waits until every process gets here (one process: returns): after process 0 has moved
  files, before the others read the folder."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def _latest_record(manager: ocp.CheckpointManager) -> tuple[int, dict] | None:
  for step in sorted(manager.all_steps(), reverse=True):
    try:
      restored = manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore()))
    except Exception:  # noqa: BLE001 - unreadable: restore_latest sets it aside with the reason
      continue
    return step, dict(restored.record)
  return None


def latest_saved_record(workdir) -> tuple[int, dict] | None:
  """`Checkpoints.latest_record` of a workdir, read without writing anything (a dry run's
  look); None when it holds no checkpoint whose record reads."""
  directory = Path(workdir).absolute() / FOLDERS[0]
  if not directory.is_dir():
    return None
  # Orbax warns that a read-only manager is read-only: that is what is asked here.
  orbax_logger = std_logging.getLogger("absl")
  level = orbax_logger.level
  orbax_logger.setLevel(std_logging.ERROR)
  try:
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
        read_only=True, create=False, save_interval_steps=0))
  finally:
    orbax_logger.setLevel(level)
  try:
    return _latest_record(manager)
  finally:
    manager.close()


class ChecksumMismatch(ValueError):
  """A checkpoint's files differ from the checksums written when it was saved."""


def verify_checksums(folder: Path) -> bool:
  """True if the files in `folder` match its checksums, False if it has none; ChecksumMismatch
  naming the first file that is missing or differs."""
  manifest = folder / CHECKSUMS
  if not manifest.exists():
    return False
  try:
    expected = json.loads(manifest.read_text(encoding="utf-8"))["files"]
  except (ValueError, KeyError, TypeError) as e:
    raise ChecksumMismatch(f"{CHECKSUMS} is unreadable ({type(e).__name__}: {e})") from None
  actual = file_checksums(folder)
  for name, want in expected.items():
    have = actual.get(name)
    if have is None:
      raise ChecksumMismatch(f"file {name} is missing")
    if have["bytes"] != want["bytes"]:
      raise ChecksumMismatch(f"file {name} has {have['bytes']} bytes, {want['bytes']} when saved")
    if have["sha256"] != want["sha256"]:
      raise ChecksumMismatch(f"file {name} differs from its checksum (changed after it was saved)")
  return True


class Checkpoints:
  """`save(step, tree, record)`; `restore_latest(template) -> (step, tree, record) | None`;
  `poll()` between saves and `finish()` at the end write the checksums of finished saves."""

  def __init__(self, workdir, *, keep: int):
    self.directory, self.corrupt_directory = (Path(workdir).absolute() / name for name in FOLDERS)
    # cleanup_tmp_directories: a save cut short (Ctrl-C during `save`) leaves a `<step>.orbax-
    # checkpoint-tmp` folder; it is never a checkpoint, so the next run removes it.
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                             cleanup_tmp_directories=True))
    self.set_aside: list[int] = []      # steps moved to corrupt_directory by restore_latest
    self._without_checksums: list[int] = []
    self._is_writer = jax.process_index() == 0

  def save(self, step: int, tree, record: dict) -> None:
    self.finish()   # orbax would wait for the previous save here anyway
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(_storable(tree)), record=ocp.args.JsonSave(record)))
    self._without_checksums.append(step)

  def poll(self) -> None:
    """Writes the checksums of a save that orbax finished in the background (cheap if none)."""
    if self._without_checksums and not self.manager.is_saving_in_progress():
      self._write_checksums()

  def finish(self) -> None:
    """Waits for the last save, then writes its checksums."""
    self.manager.wait_until_finished()
    self._write_checksums()

  def _write_checksums(self) -> None:
    for step in self._without_checksums:
      folder = self.directory / str(step)
      if self._is_writer and folder.is_dir():   # else: already removed (keep_checkpoints)
        write_json(folder / CHECKSUMS, {"step": step, "files": file_checksums(folder)})
    self._without_checksums = []

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def restore(self, step: int, template):
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(_abstract(template)), record=ocp.args.JsonRestore()))
    return _unstorable(restored.state, template), dict(restored.record)

  def latest_record(self) -> tuple[int, dict] | None:
    """(step, record) of the newest checkpoint whose record reads, without its state; None if
    none does."""
    self.finish()
    return _latest_record(self.manager)

  def restore_latest(self, template):
    """The newest checkpoint that passes verification, as (step, tree, record); None if none
    does (those that failed are in `set_aside`)."""
    self.finish()
    steps = self.all_steps()
    for i in range(len(steps) - 1, -1, -1):
      step, previous = steps[i], steps[i - 1] if i else None
      try:
        verified = verify_checksums(self.directory / str(step))
      except ChecksumMismatch as e:
        self._set_aside(step, previous, str(e))
        continue
      try:
        tree, record = self.restore(step, template)
      except Exception as e:  # noqa: BLE001 - any failure to read means a broken checkpoint
        self._set_aside(step, previous, f"orbax cannot restore it ({readable(e)})")
        continue
      bad = _first_non_finite(_storable(tree))
      if bad is not None:
        self._set_aside(step, previous, f"{bad} holds NaN or infinite values")
        continue
      if not verified:
        logging.warning(
            "checkpoint %s/%d has no %s (written by an older version, or the run stopped "
            "before they were written), so its files cannot be verified; using it because it "
            "restores and its values are finite", self.directory, step, CHECKSUMS)
      return step, tree, record
    return None

  def _set_aside(self, step: int, previous: int | None, reason: str) -> None:
    target = self.corrupt_directory / str(step)
    then = f"trying step {previous}" if previous is not None else "no older checkpoint is left"
    logging.warning("checkpoint %s/%d is unusable: %s; moved to %s; %s", self.directory, step,
                    reason, target, then)
    if self._is_writer:
      target.parent.mkdir(parents=True, exist_ok=True)
      if target.exists():
        shutil.rmtree(target)
      shutil.move(str(self.directory / str(step)), str(target))
    barrier(f"checkpoint {step} set aside")   # every process sees the move before it lists
    self.set_aside.append(step)
    self.manager.reload()

  def close(self) -> None:
    self.finish()
    self.manager.close()
