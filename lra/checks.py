"""Checks a trainer runs on a split before training: fail fast, with the file named."""
from __future__ import annotations

import numpy as np

from lra.dataset import Dataset
from lra.spec import IGNORED


def _where(ds: Dataset) -> str:
  return f"the {ds.split} split of {ds.task} read from {ds.source or 'memory'}"


def _check_fraction(value) -> None:
  if value is None:
    return
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
    raise ValueError(f"max_skipped_fraction must be a number in [0, 1] or None, got {value!r}")


def _check_tokens(ds: Dataset, name: str, tokens: np.ndarray) -> None:
  """Every token id in [0, vocab_size): ids are unsigned, so only the top needs a look."""
  vocab_size = ds.spec.vocab_size
  if np.iinfo(tokens.dtype).max < vocab_size or not tokens.size or tokens.max() < vocab_size:
    return
  row, position = np.argwhere(tokens >= vocab_size)[0]
  raise ValueError(f"{_where(ds)}: example {row} has token id {tokens[row, position]} at "
                   f"position {position} of {name}, outside the vocabulary [0, {vocab_size}) "
                   f"of {ds.task}")


def check_generated_count(ds: Dataset, expected: int, manifest) -> None:
  """ValueError naming the split's source, its count and the generator's, when the split does
  not hold the `expected` examples (read and skipped) that the generator's `manifest` says it
  wrote: a file cut short, say at a line boundary, would otherwise train on part of the data."""
  found = len(ds) + ds.num_skipped
  if found != expected:
    raise ValueError(
        f"{ds.source} holds {found:,} {ds.split} examples, but {manifest} says the generator "
        f"wrote {expected:,}: the data was cut short or changed after it was generated; "
        f"generate it again (or delete {manifest} if the change is meant)")


def check_dataset(ds: Dataset, *, max_skipped_fraction: float | None = 0.01) -> dict:
  """Checks one split before training; returns what a run should log and record.

  Raises ValueError, naming where the split was read from, when the split is empty, a target
  is outside [0, num_classes), a token id outside [0, vocab_size), a length outside
  [0, max_len], or when more than `max_skipped_fraction` of the source examples were skipped
  as unreadable (None: no ceiling; `lra.load` checks everything else by itself).

  Returns {"task", "split", "source", "num_examples", "max_len", "num_truncated" (examples cut
  to max_len), "num_skipped", "skipped_examples" (the first few, relative to data_dir)}.
  """
  _check_fraction(max_skipped_fraction)
  num = len(ds)
  if num == 0:
    raise ValueError(f"{_where(ds)} has no examples: nothing to train or evaluate on")
  num_classes = ds.spec.num_classes
  targets = ds.targets.reshape(num, -1)   # [N, 1] per example, or [N, L] per token
  asked = targets != IGNORED if ds.spec.objective == "next_token" else np.ones_like(targets, bool)
  outside = asked & ((targets < 0) | (targets >= num_classes))
  bad = np.flatnonzero(outside.any(axis=1))
  if len(bad):
    value = targets[bad[0]][outside[bad[0]]][0]
    raise ValueError(f"{_where(ds)}: example {bad[0]} has target {value}, outside "
                     f"[0, {num_classes}) ({len(bad)} such examples)")
  if not asked.any():
    raise ValueError(f"{_where(ds)} asks for no target at any position")
  inputs = [("inputs", ds.tokens, ds.lengths)]
  if ds.dual:
    inputs.append(("inputs2", ds.tokens2, ds.lengths2))
  for name, tokens, lengths in inputs:
    _check_tokens(ds, name, tokens)
    bad = np.flatnonzero((lengths < 0) | (lengths > ds.max_len))
    if len(bad):
      raise ValueError(f"{_where(ds)}: example {bad[0]} has length {lengths[bad[0]]} in "
                       f"{name}, outside [0, max_len={ds.max_len}]")
  total = num + ds.num_skipped
  if max_skipped_fraction is not None and ds.num_skipped > max_skipped_fraction * total:
    raise ValueError(
        f"{_where(ds)}: {ds.num_skipped} of {total} examples "
        f"({100 * ds.num_skipped / total:.2f}%) were skipped as empty or unreadable, more than "
        f"max_skipped_fraction={max_skipped_fraction}; e.g. {', '.join(ds.skipped_examples)}. "
        "Replace those files (or generate the data again), or raise the ceiling.")
  return {"task": ds.task, "split": ds.split, "source": ds.source, "num_examples": num,
          "max_len": ds.max_len, "num_truncated": ds.num_truncated,
          "num_skipped": ds.num_skipped, "skipped_examples": list(ds.skipped_examples)}
