"""The six Long Range Arena tasks, and the diagnostic tasks beside them: what each one feeds a
model.

Lengths, classes and vocabularies follow the released LRA configs (Tay et al., 2021).
`max_len` here is the default and can be changed per load.
"""
from __future__ import annotations

import dataclasses

SPLITS = ("train", "validation", "test")

# Pathfinder difficulty -> folder name in the official release (LRA uses "hard").
PATHFINDER_DIFFICULTIES = {
    "easy": "curv_baseline",
    "intermediate": "curv_contour_length_9",
    "hard": "curv_contour_length_14",
}
PATHFINDER_RESOLUTIONS = (32, 64, 128, 256)


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


# Diagnostics: generated in memory (lra.mqar), loaded like the LRA tasks. The vocabulary and
# lengths here are defaults, changed by the load options.
DIAGNOSTICS = {
    "mqar": TaskSpec("mqar", num_classes=512, max_len=64, vocab_size=512, dual=False,
                     has_padding=False, objective="next_token"),
}


def available_tasks() -> tuple[str, ...]:
  """The LRA task names, in the order of the LRA paper."""
  return tuple(TASKS)


def diagnostic_tasks() -> tuple[str, ...]:
  """The diagnostic task names (associative recall)."""
  return tuple(DIAGNOSTICS)


def task_spec(name: str) -> TaskSpec:
  """The `TaskSpec` of a task; an unknown name raises ValueError listing the known ones."""
  known = {**TASKS, **DIAGNOSTICS}
  if name not in known:
    raise ValueError(f"unknown task {name!r}; available tasks: {', '.join(known)}")
  return known[name]


def check_split(split: str) -> str:
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; available splits: {', '.join(SPLITS)}")
  return split
