"""What a task feeds a model: its classes, length, vocabulary and objective."""
from __future__ import annotations

import dataclasses

# A token task's target where nothing is asked (objective "next_token"): not scored.
IGNORED = -1


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
