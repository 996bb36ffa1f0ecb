"""The six Long Range Arena tasks, and the diagnostic tasks beside them: what each one feeds a
model.

Lengths, classes and vocabularies follow the released LRA configs (Tay et al., 2021).
`max_len` here is the default and can be changed per load.
"""
from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import NamedTuple

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


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  """What a task feeds a model.

  name: task name.
  num_classes: number of target classes.
  max_len: default number of tokens per input (per document for dual tasks).
  vocab_size: token ids are in [0, vocab_size).
  dual: two inputs per example (`inputs2`, `masks2`), classified as a pair.
  has_padding: examples shorter than `max_len` exist at the default length; padding is
      given only by `masks` (for pixel tasks id 0 is a real black pixel).
  pad_id: the id written at padded positions (always masked out).
  image_size: side of the square image for pixel tasks, else None.
  objective: "classification": targets int32 [N], one class per example (the LRA tasks);
      "next_token": targets int32 [N, L], the token a causal model must emit at each position,
      IGNORED (-1) where nothing is asked (num_classes = vocab_size).
  readout: for a token task, where the logits of each position are read: "every_position" (a
      causal language model: position t's own representation) or "last_position" (every
      position's logits from the last position's representation alone, the bottleneck of MAD's
      compression task).
  """

  name: str
  num_classes: int
  max_len: int
  vocab_size: int
  dual: bool
  has_padding: bool
  pad_id: int = 0
  image_size: int | None = None
  objective: str = "classification"
  readout: str = "every_position"


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



def _token_task(name: str, vocab_size: int, max_len: int, **fields) -> TaskSpec:
  return TaskSpec(name, num_classes=vocab_size, max_len=max_len, vocab_size=vocab_size,
                  dual=False, has_padding=False, objective="next_token", **fields)


# The MAD suite (lra.mad), in the column order of its published table; vocabularies and lengths
# are MAD's baseline settings.
MAD = {
    "compression": _token_task("compression", 16, 32, readout="last_position"),
    "fuzzy_in_context_recall": _token_task("fuzzy_in_context_recall", 16, 128),
    "in_context_recall": _token_task("in_context_recall", 16, 128),
    "memorization": _token_task("memorization", 256, 32),
    "noisy_in_context_recall": _token_task("noisy_in_context_recall", 32, 128),
    "selective_copying": _token_task("selective_copying", 16, 256),
}
# Diagnostics: generated in memory (lra.mqar, lra.mad), loaded like the LRA tasks. The vocabulary
# and lengths here are defaults, changed by the load options.
DIAGNOSTICS = {"mqar": _token_task("mqar", 512, 64), **MAD}


def available_tasks() -> tuple[str, ...]:
  """The LRA task names, in the order of the LRA paper."""
  return tuple(TASKS)


def diagnostic_tasks() -> tuple[str, ...]:
  """The diagnostic task names (associative recall, and the MAD suite)."""
  return tuple(DIAGNOSTICS)


def mad_tasks() -> tuple[str, ...]:
  """The six MAD task names, in the column order of the MAD table."""
  return tuple(MAD)


def task_spec(name: str) -> TaskSpec:
  """The `TaskSpec` of a task; an unknown name raises ValueError listing the known ones."""
  known = {**TASKS, **DIAGNOSTICS}
  if name not in known:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"unknown task {name!r}{hint}; available tasks: {', '.join(known)}")
  return known[name]


def check_split(split: str) -> str:
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; available splits: {', '.join(SPLITS)}")
  return split
