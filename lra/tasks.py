"""The six Long Range Arena tasks: what each one feeds a model (the synthetic tasks are the
package `synthetic`).

Lengths, classes and vocabularies follow the released LRA configs (Tay et al., 2021).
`max_len` here is the default and can be changed per load.
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import NamedTuple

from lra.spec import TaskSpec

SPLITS = ("train", "validation", "test")


class PathfinderDifficulty(NamedTuple):
  folder: str           # the folder name in the official release
  contour_length: int   # paddles in the path joining the two markers (what the generator draws)


# Pathfinder difficulty -> where the release keeps it and how long its path is (LRA uses "hard").
PATHFINDER_DIFFICULTIES = {
    "easy": PathfinderDifficulty("curv_baseline", 6),
    "intermediate": PathfinderDifficulty("curv_contour_length_9", 9),
    "hard": PathfinderDifficulty("curv_contour_length_14", 14),
}
PATHFINDER_RESOLUTIONS = (32, 64, 128, 256)


def pathfinder_dir(data_dir, resolution: int, difficulty: str) -> Path:
  """`data_dir/pathfinder{resolution}/{difficulty folder}`: where the release keeps one split of
  images and where the generator writes them."""
  return Path(data_dir) / f"pathfinder{resolution}" / PATHFINDER_DIFFICULTIES[difficulty].folder


_BYTE_VOCAB = 257  # byte + 1, 0 = pad

TASKS = {
    # 0 = pad, then the 15 sorted ListOps tokens (see lra.listops.VOCAB).
    "listops": TaskSpec("listops", num_classes=10, max_len=2000, vocab_size=16, dual=False,
                        has_padding=True),
    "text": TaskSpec("text", num_classes=2, max_len=1000, vocab_size=_BYTE_VOCAB, dual=False,
                     has_padding=True),
    "retrieval": TaskSpec("retrieval", num_classes=2, max_len=4000, vocab_size=_BYTE_VOCAB,
                          dual=True, has_padding=True),
    "image": TaskSpec("image", num_classes=10, max_len=32 * 32, vocab_size=256, dual=False,
                      has_padding=False, image_size=32),
    "pathfinder": TaskSpec("pathfinder", num_classes=2, max_len=32 * 32, vocab_size=256,
                           dual=False, has_padding=False, image_size=32),
    "pathx": TaskSpec("pathx", num_classes=2, max_len=128 * 128, vocab_size=256, dual=False,
                      has_padding=False, image_size=128),
}


def available_tasks() -> tuple[str, ...]:
  """The LRA task names, in the order of the LRA paper."""
  return tuple(TASKS)


def task_spec(name: str) -> TaskSpec:
  """The `TaskSpec` of a task; an unknown name raises ValueError listing the known ones."""
  if name not in TASKS:
    close = difflib.get_close_matches(name, TASKS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"unknown LRA task {name!r}{hint}; LRA tasks: {', '.join(TASKS)} (the "
                     "synthetic tasks, e.g. mqar, load with synthetic.load)")
  return TASKS[name]


def check_split(split: str) -> str:
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; available splits: {', '.join(SPLITS)}")
  return split
