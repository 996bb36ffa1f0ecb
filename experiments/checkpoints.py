"""Orbax checkpoints of a training run: every `checkpoint_every` steps, the last few kept.

A checkpoint holds the whole training state (parameters, optimiser, the model's RNG state,
the step, which also fixes the data position) and the best-so-far model by validation
accuracy, plus a small JSON record (best step and accuracy, wall time). Typed PRNG keys are
stored as their raw key data. A latest checkpoint that cannot be restored is moved to
`corrupt_checkpoints/` with a warning, and the one before it is used.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from absl import logging


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


class Checkpoints:
  """`save(step, tree, record)`; `restore_latest(template) -> (step, tree, record) | None`."""

  def __init__(self, workdir, *, keep: int):
    self.directory = Path(workdir).absolute() / "checkpoints"
    self.corrupt_directory = Path(workdir).absolute() / "corrupt_checkpoints"
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

  def save(self, step: int, tree, record: dict) -> None:
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(_storable(tree)), record=ocp.args.JsonSave(record)))

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def restore(self, step: int, template):
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(_abstract(template)), record=ocp.args.JsonRestore()))
    return _unstorable(restored.state, template), dict(restored.record)

  def restore_latest(self, template):
    """The newest checkpoint that restores, as (step, tree, record); None if there is none."""
    self.manager.wait_until_finished()
    for step in reversed(self.all_steps()):
      try:
        tree, record = self.restore(step, template)
      except Exception as e:  # noqa: BLE001 - any failure to read means a broken checkpoint
        self._set_aside(step, e)
        continue
      return step, tree, record
    return None

  def _set_aside(self, step: int, error: Exception) -> None:
    target = self.corrupt_directory / str(step)
    logging.warning("checkpoint %s/%d cannot be restored (%s: %s); moving it to %s and "
                    "trying the previous one", self.directory, step, type(error).__name__,
                    str(error).splitlines()[0] if str(error) else "", target)
    if jax.process_index() == 0:
      target.parent.mkdir(parents=True, exist_ok=True)
      if target.exists():
        shutil.rmtree(target)
      shutil.move(str(self.directory / str(step)), str(target))
    self.manager.reload()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
