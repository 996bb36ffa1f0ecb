"""One split of one task, held compactly in memory."""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from lra.spec import TaskSpec


def lengths_to_masks(lengths: np.ndarray, max_len: int) -> np.ndarray:
  """bool [N, max_len]: True on the first `lengths[i]` positions of row i."""
  return np.arange(max_len) < np.asarray(lengths)[:, None]


@dataclasses.dataclass(eq=False)
class Dataset:
  """Examples of one split. Every example has `max_len` positions; padding is at the end.

  Tokens are stored in the smallest unsigned dtype that holds the vocabulary (Path-X train
  would take 10 GB as int32), and `inputs` / `masks` are built from them on first access.
  `batch(indices)` (used by `lra.iterate`) converts only the rows it returns.

  inputs: int32 [N, L] token ids (pad id 0 where masks is False).
  masks: bool [N, L], True = real token. Padding is defined only by masks.
  targets: int32 [N].
  inputs2, masks2: the second document of a dual task (retrieval).
  source: where the examples were read from (a file, folder or TFDS split), for messages.
  num_truncated: examples with an input longer than max_len, cut to fit.
  num_skipped: unreadable source examples left out (Pathfinder's empty or corrupt images);
      skipped_examples names the first few, relative to data_dir.
  `lra.check_dataset(ds)` checks a split before training and reports these counts.
  """

  spec: TaskSpec        # the task as loaded: spec.max_len is this dataset's L
  split: str
  tokens: np.ndarray    # unsigned [N, L]
  lengths: np.ndarray   # int32 [N], real tokens per example
  targets: np.ndarray   # int32 [N]
  tokens2: np.ndarray | None = None
  lengths2: np.ndarray | None = None
  source: str = ""
  num_truncated: int = 0
  num_skipped: int = 0
  skipped_examples: tuple[str, ...] = ()

  @property
  def task(self) -> str:
    return self.spec.name

  @property
  def max_len(self) -> int:
    return self.tokens.shape[1]

  @property
  def dual(self) -> bool:
    return self.tokens2 is not None

  def __len__(self) -> int:
    return len(self.targets)

  def __repr__(self) -> str:
    return (f"Dataset(task={self.task!r}, split={self.split!r}, num_examples={len(self)}, "
            f"max_len={self.max_len}, dual={self.dual})")

  @functools.cached_property
  def inputs(self) -> np.ndarray:
    return self.tokens.astype(np.int32)

  @functools.cached_property
  def masks(self) -> np.ndarray:
    return lengths_to_masks(self.lengths, self.max_len)

  @functools.cached_property
  def inputs2(self) -> np.ndarray:
    return self._second().tokens2.astype(np.int32)

  @functools.cached_property
  def masks2(self) -> np.ndarray:
    return lengths_to_masks(self._second().lengths2, self.max_len)

  def _second(self) -> Dataset:
    if not self.dual:
      raise AttributeError(f"task {self.task!r} has a single input; inputs2 and masks2 "
                           "exist only for a dual task (retrieval)")
    return self

  def batch(self, indices) -> dict[str, np.ndarray]:
    """The examples at `indices` as a dict of arrays (`inputs`, `masks`, `targets`, and
    `inputs2`, `masks2` for a dual task)."""
    indices = np.asarray(indices)
    out = {
        "inputs": self.tokens[indices].astype(np.int32),
        "masks": lengths_to_masks(self.lengths[indices], self.max_len),
        "targets": self.targets[indices],
    }
    if self.dual:
      out["inputs2"] = self.tokens2[indices].astype(np.int32)
      out["masks2"] = lengths_to_masks(self.lengths2[indices], self.max_len)
    return out
