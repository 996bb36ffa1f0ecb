"""State tracking: the running product of group elements, trained at short lengths and tested at
longer ones (Merrill et al. 2024, "The Illusion of State in State-Space Models",
arXiv:2404.08819; Grazzi et al. 2024, "Unlocking State-Tracking in Linear RNNs Through Negative
Eigenvalues", arXiv:2411.12537).

A sequence is x_1 .. x_T, elements of a finite group G drawn uniformly; the target at position t
is the prefix product s_t = x_1 · x_2 · ... · x_t (a token classification at every position, as
Merrill et al.'s and Grazzi et al.'s sequence-to-sequence word problems). Tokens and targets share
one vocabulary, the element ids [0, |G|):

  parity   Z_2: bits, s_t = x_1 xor ... xor x_t (the running parity)             |G| = 2
  s3, s5   the symmetric group S_n of the permutations of (0, ..., n-1),          |G| = 6, 120
           element id = the permutation's index in lexicographic order
           (id 0 the identity); (p · q)(i) = p(q(i)): s_t = s_{t-1} ∘ x_t

Train sequences have a length drawn uniformly from [min_train_len, max_train_len] (padded at the
end, IGNORED there) and every position asked. Validation and test sequences have the task's
max_len and ask only the positions whose prefix is longer than any training sequence,
t > max_train_len: their accuracy is that on prefixes of length max_train_len + 1 .. max_len,
the length generalisation Grazzi et al. measure on parity (train 3..40, test 40..256).

A linear RNN whose state transitions have only eigenvalues in [0, 1] cannot track parity at
every length in finite precision; with eigenvalues in [-1, 1] (DeltaNet's β in (0, 2)) it can
(Grazzi et al., Theorems 1 and 3). S5 is not solvable in one layer of such diagonal models or by
a constant-depth transformer (Merrill et al.).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np

from synthetic.base import IGNORED, SPLIT_SEEDS, check_integer_fields, register_task

RULES_VERSION = 1   # bump when the generator's output for given settings changes


@functools.cache
def symmetric_group(n: int) -> np.ndarray:
  """int [n!, n!]: product[a, b] = the id of p_a ∘ p_b, (p_a ∘ p_b)(i) = p_a(p_b(i)), ids the
  permutations' indices in lexicographic order."""
  perms = np.array(list(itertools.permutations(range(n))))   # [n!, n], in lexicographic order
  composed = perms[:, perms]                                  # [n!, n!, n]: p_a(p_b(i))
  # A permutation's digits in base n: an integer as ordered as the permutations themselves.
  code = lambda p: p @ n ** np.arange(n - 1, -1, -1)
  return np.searchsorted(code(perms), code(composed))


@dataclasses.dataclass(frozen=True)
class _Settings:
  """What every state-tracking task takes (seq_len, the task's max_len, is the test length)."""
  min_train_len: int = 3
  max_train_len: int = 40
  num_train: int = 20_000
  num_validation: int = 256
  num_test: int = 1_024
  seed: int = 0

  task = ""

  @property
  def vocab_size(self) -> int:
    """The group's order: its elements are both the tokens and the classes."""
    return len(self.product_table())

  def product_table(self) -> np.ndarray:
    raise NotImplementedError

  def check(self, seq_len: int) -> None:
    check_integer_fields(self)
    if self.min_train_len > self.max_train_len:
      raise ValueError(f"{self.task}: min_train_len={self.min_train_len} exceeds "
                       f"max_train_len={self.max_train_len}")
    if seq_len <= self.max_train_len:
      raise ValueError(f"{self.task}: max_len={seq_len} is the test length and must exceed "
                       f"max_train_len={self.max_train_len} (the test asks the longer prefixes)")

  def num_examples(self, split: str) -> int:
    return {"train": self.num_train, "validation": self.num_validation,
            "test": self.num_test}[split]

  def generate(self, seq_len: int, split: str) -> dict[str, np.ndarray]:
    """One split: {"tokens": uint16 [N, L], "lengths": int32 [N], "targets": int32 [N, L]}, L =
    max_train_len for train (shorter sequences padded at the end), seq_len otherwise;
    deterministic for (settings, split), the splits from unrelated streams."""
    self.check(seq_len)
    n = self.num_examples(split)
    rng = np.random.default_rng([self.seed, SPLIT_SEEDS[split], RULES_VERSION])
    table = self.product_table()
    if split == "train":
      width = self.max_train_len
      lengths = rng.integers(self.min_train_len, self.max_train_len + 1, n)
    else:
      width, lengths = seq_len, np.full(n, seq_len)
    tokens = rng.integers(0, len(table), (n, width))
    states = np.empty_like(tokens)
    states[:, 0] = tokens[:, 0]
    for t in range(1, width):   # s_t = s_{t-1} · x_t
      states[:, t] = table[states[:, t - 1], tokens[:, t]]
    position = np.arange(width)
    padding = position >= lengths[:, None]
    tokens[padding] = 0
    asked = ~padding if split == "train" else np.broadcast_to(
        position >= self.max_train_len, padding.shape)
    return {"tokens": tokens.astype(np.uint16), "lengths": lengths.astype(np.int32),
            "targets": np.where(asked, states, IGNORED).astype(np.int32)}


@dataclasses.dataclass(frozen=True)
class Parity(_Settings):
  """Z_2: bits; the target is the parity of the bits so far."""
  task = "parity"

  def product_table(self) -> np.ndarray:
    return np.array([[0, 1], [1, 0]])


@dataclasses.dataclass(frozen=True)
class S3(_Settings):
  """S_3: the 6 permutations of three items."""
  task = "s3"

  def product_table(self) -> np.ndarray:
    return symmetric_group(3)


@dataclasses.dataclass(frozen=True)
class S5(_Settings):
  """S_5: the 120 permutations of five items."""
  task = "s5"

  def product_table(self) -> np.ndarray:
    return symmetric_group(5)


# max_len is the test length, Grazzi et al.'s 256; the train split is shorter, padded.
for _settings in (Parity, S3, S5):
  register_task(_settings, family="state_tracking", max_len=256, has_padding=True)
