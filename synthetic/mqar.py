"""Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology", arXiv:2312.04927): a
diagnostic that tells attention variants apart at CPU scale.

A sequence opens with `num_pairs` key-value pairs, k1 v1 k2 v2 ..., keys drawn without
repetition from the lower half of the vocabulary (id 0 excluded) and values from the upper
half. Later, at positions at least `min_gap` tokens after the last pair, `num_queries` of the
keys appear again, each once; every other position holds the filler id 0. A causal language
model must emit, at each query position, the value paired with that key: the target there is
the value, and IGNORED (-1) everywhere else, so loss and accuracy count the queried values
only. The values never occur in the inputs after the pairs, so the only way to the answer is to
recall the pair.

    Query positions: uniform over the allowed positions, or, with `power_a`, a power law over
    the offset g = 1, 2, ...: P(g) ∝ g^(power_a - 1) (the paper's 0.01 puts most queries soon
    after the pairs, with a long tail).

Softmax attention recalls every pair; a sliding window shorter than the distance between a
pair and its query cannot see the pair; a fixed-size recurrent state (linear / kernel
attention) loses recall as the number of pairs outgrows it.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from synthetic.base import IGNORED, SPLIT_SEEDS, register_task

RULES_VERSION = 1   # bump when the generator's output for given settings changes


@dataclasses.dataclass(frozen=True)
class Settings:
  """The generator's parameters (seq_len is the task's max_len)."""
  vocab_size: int = 512
  num_pairs: int = 8
  num_queries: int | None = None    # None = every key is queried
  min_gap: int = 0                  # queries start this many positions after the last pair
  power_a: float | None = None      # None = uniform query positions
  num_train: int = 20_000
  num_validation: int = 1_000
  num_test: int = 1_000
  seed: int = 0

  task = "mqar"   # not a field: every task's settings name it (synthetic/base.py)

  def check(self, seq_len: int) -> None:
    queries = self.queries
    for name in ("vocab_size", "num_pairs", "num_train", "num_validation", "num_test"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"mqar: {name} must be a positive integer, got {value!r}")
    if not 1 <= queries <= self.num_pairs:
      raise ValueError(f"mqar: num_queries must be in [1, num_pairs={self.num_pairs}], got "
                       f"{self.num_queries!r}")
    if isinstance(self.min_gap, bool) or not isinstance(self.min_gap, int) or self.min_gap < 0:
      raise ValueError(f"mqar: min_gap must be an integer >= 0, got {self.min_gap!r}")
    if self.power_a is not None and not self.power_a > 0:
      raise ValueError(f"mqar: power_a must be > 0 or None (uniform), got {self.power_a!r}")
    if self.vocab_size // 2 - 1 < self.num_pairs:
      raise ValueError(f"mqar: vocab_size={self.vocab_size} has {self.vocab_size // 2 - 1} key "
                       f"ids (1 .. vocab_size/2 - 1), fewer than num_pairs={self.num_pairs}")
    slots = seq_len - 2 * self.num_pairs - self.min_gap
    if slots < queries:
      raise ValueError(f"mqar: a sequence of {seq_len} tokens has {max(slots, 0)} query "
                       f"positions after {self.num_pairs} pairs and min_gap={self.min_gap}, "
                       f"fewer than the {queries} queries; use a longer max_len or fewer pairs")

  @property
  def queries(self) -> int:
    return self.num_pairs if self.num_queries is None else self.num_queries

  def num_examples(self, split: str) -> int:
    return {"train": self.num_train, "validation": self.num_validation,
            "test": self.num_test}[split]

  def generate(self, seq_len: int, split: str) -> dict[str, np.ndarray]:
    """`generate(self, seq_len, split)`, as every task's settings generate a split."""
    return generate(self, seq_len, split)


def generate(settings: Settings, seq_len: int, split: str) -> dict[str, np.ndarray]:
  """One split: {"tokens": uint16 [N, seq_len], "lengths": int32 [N], "targets": int32
  [N, seq_len]}, deterministic for (settings, split); the three splits use unrelated streams."""
  settings.check(seq_len)
  n, pairs, queries = settings.num_examples(split), settings.num_pairs, settings.queries
  rng = np.random.default_rng([settings.seed, SPLIT_SEEDS[split], RULES_VERSION])
  half = settings.vocab_size // 2
  # Distinct keys in [1, half) and distinct values in [half, vocab): the first `pairs` of a
  # random order of each range, per example.
  keys = 1 + np.argsort(rng.random((n, half - 1)), axis=1)[:, :pairs]
  values = half + np.argsort(rng.random((n, settings.vocab_size - half)), axis=1)[:, :pairs]
  tokens = np.zeros((n, seq_len), np.int64)
  tokens[:, 0:2 * pairs:2], tokens[:, 1:2 * pairs:2] = keys, values
  targets = np.full((n, seq_len), IGNORED, np.int64)

  first = 2 * pairs + settings.min_gap
  offsets = np.arange(1, seq_len - first + 1)              # g = 1 is the first allowed position
  log_weight = (np.zeros(len(offsets)) if settings.power_a is None
                else (settings.power_a - 1) * np.log(offsets))
  # `queries` distinct positions per example, drawn in proportion to the weights (Gumbel top-k).
  scores = log_weight - np.log(-np.log(rng.random((n, len(offsets)))))
  positions = first + np.argsort(-scores, axis=1)[:, :queries]
  asked = np.argsort(rng.random((n, pairs)), axis=1)[:, :queries]   # which pairs are queried
  rows = np.arange(n)[:, None]
  tokens[rows, positions] = keys[rows, asked]
  targets[rows, positions] = values[rows, asked]
  return {"tokens": tokens.astype(np.uint16), "lengths": np.full(n, seq_len, np.int32),
          "targets": targets.astype(np.int32)}


register_task(Settings, family="diagnostics", max_len=64)
