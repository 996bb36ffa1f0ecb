"""The six synthetic tasks of the Mechanistic Architecture Design suite (MAD; Poli et al. 2024,
"Mechanistic Design and Scaling of Hybrid Architectures", arXiv:2403.17844), generated in memory.

Every task is a token task for a causal model: tokens [N, L] and targets [N, L], the token the
model must emit at each position, IGNORED (-1) where nothing is asked. The asked positions are
the ones MAD scores; accuracy is the share of them emitted exactly. docs/mad.md has one worked
example per task and every difference from MAD's released generators.

  in_context_recall        key-value pairs, keys repeating with the same value; every value of a
                           key seen before is asked (MAD's multi-query recall).
  noisy_in_context_recall  the same with a share of the pairs replaced by noise tokens.
  fuzzy_in_context_recall  keys and values of 1..k and 1..v tokens; test keys have k tokens.
  selective_copying        data tokens scattered among blanks, a copy token, then the data tokens
                           in order at the blank positions after it.
  compression              random tokens and a compression token; the model must reconstruct
                           every token from the compression token's representation alone.
  memorization             key, insert-token pairs; at each insert token the value that a fixed
                           key-value map (the same in every split, seeded) gives the key.

Train targets of the three recall tasks are every next token (MAD trains them as language
models); their validation and test targets are the recalled values only. The other tasks ask
the same positions in every split.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from synthetic.base import IGNORED, SPLIT_SEEDS, check_integer_fields, register_task

RULES_VERSION = 1   # bump when a generator's output for given settings changes
_MAY_BE_ZERO = ("seed", "map_seed", "noise_vocab_size")


@dataclasses.dataclass(frozen=True)
class _Settings:
  """What every MAD task takes (seq_len is the task's max_len)."""
  vocab_size: int = 16
  num_train: int = 12_800
  num_validation: int = 1_280
  num_test: int = 1_280
  seed: int = 0

  task = ""

  def check(self, seq_len: int) -> None:
    check_integer_fields(self, _MAY_BE_ZERO)
    self._check(seq_len)

  def _check(self, seq_len: int) -> None:
    raise NotImplementedError

  def num_examples(self, split: str) -> int:
    return {"train": self.num_train, "validation": self.num_validation,
            "test": self.num_test}[split]

  def rng(self, split: str) -> np.random.Generator:
    return np.random.default_rng([self.seed, SPLIT_SEEDS[split], RULES_VERSION])

  def generate(self, seq_len: int, split: str) -> dict[str, np.ndarray]:
    """One split: {"tokens": uint16 [N, seq_len], "lengths": int32 [N], "targets": int32
    [N, seq_len]}, deterministic for (settings, split); the splits use unrelated streams."""
    self.check(seq_len)
    tokens, targets = self._generate(seq_len, split, self.rng(split))
    return {"tokens": tokens.astype(np.uint16), "lengths": np.full(len(tokens), seq_len, np.int32),
            "targets": targets.astype(np.int32)}

  def _generate(self, seq_len: int, split: str, rng) -> tuple[np.ndarray, np.ndarray]:
    raise NotImplementedError


def _next_token_targets(stream: np.ndarray) -> np.ndarray:
  """[N, L] -> the next token at every position, IGNORED at the last."""
  targets = np.full(stream.shape, IGNORED, np.int64)
  targets[:, :-1] = stream[:, 1:]
  return targets


def _even(task: str, seq_len: int) -> None:
  if seq_len % 2 or seq_len < 4:
    raise ValueError(f"{task}: the sequence is key-value pairs, so max_len must be even and >= 4, "
                     f"got {seq_len}")


# ----------------------------------------------------------------------- in-context recall

@dataclasses.dataclass(frozen=True)
class InContextRecall(_Settings):
  """Keys in [0, K), values in [K, 2K) with K = (vocab_size - noise_vocab_size) // 2, noise
  tokens in [vocab_size - noise_vocab_size, vocab_size). A sequence is L/2 slots; each slot is
  a pair (key, its value) or, with probability frac_noise, two noise tokens. A sequence's keys
  repeat and keep their value; the last slot is always a pair whose key was seen before."""
  noise_vocab_size: int = 0
  frac_noise: float = 0.0

  task = "in_context_recall"

  @property
  def num_keys(self) -> int:
    return (self.vocab_size - self.noise_vocab_size) // 2

  def _check(self, seq_len: int) -> None:
    _even(self.task, seq_len)
    if not 0 <= self.frac_noise < 1:
      raise ValueError(f"{self.task}: frac_noise must be in [0, 1), got {self.frac_noise!r}")
    if self.frac_noise > 0 and self.noise_vocab_size < 1:
      raise ValueError(f"{self.task}: frac_noise={self.frac_noise} needs noise_vocab_size >= 1")
    if self.num_keys < 1:
      raise ValueError(f"{self.task}: vocab_size={self.vocab_size} minus noise_vocab_size="
                       f"{self.noise_vocab_size} leaves no key and value ids (needs >= 2)")

  def _generate(self, seq_len, split, rng):
    n, slots, num_keys = self.num_examples(split), seq_len // 2, self.num_keys
    rows = np.arange(n)
    keys = rng.integers(0, num_keys, (n, slots))
    value_of = num_keys + rng.integers(0, num_keys, (n, num_keys))   # each sequence's own map
    noise = rng.random((n, slots)) < self.frac_noise
    noise[rows, rng.integers(0, slots - 1, n)] = False   # at least one pair before the last
    noise[:, -1] = False
    # The last key: that of a random earlier pair (the largest random score among the pairs).
    earlier = np.argmax(np.where(noise[:, :-1], -1.0, rng.random((n, slots - 1))), axis=1)
    keys[:, -1] = keys[rows, earlier]
    stream = np.empty((n, seq_len), np.int64)
    stream[:, 0::2], stream[:, 1::2] = keys, value_of[rows[:, None], keys]
    first_noise_id = self.vocab_size - self.noise_vocab_size
    noise_ids = first_noise_id + rng.integers(0, max(self.noise_vocab_size, 1), (n, seq_len))
    stream = np.where(np.repeat(noise, 2, axis=1), noise_ids, stream)
    if split == "train":
      return stream, _next_token_targets(stream)
    seen = np.zeros((n, num_keys), bool)
    asked = np.zeros((n, slots), bool)   # the pair's key appeared in an earlier pair
    for slot in range(slots):
      asked[:, slot] = seen[rows, keys[:, slot]] & ~noise[:, slot]
      seen[rows, keys[:, slot]] |= ~noise[:, slot]
    targets = np.full((n, seq_len), IGNORED, np.int64)
    key_positions = np.arange(0, seq_len, 2)
    targets[:, key_positions] = np.where(asked, stream[:, key_positions + 1], IGNORED)
    return stream, targets


@dataclasses.dataclass(frozen=True)
class NoisyInContextRecall(InContextRecall):
  """In-context recall with MAD's noise: 16 of 32 ids are noise, 20% of the slots noise pairs."""
  vocab_size: int = 32
  noise_vocab_size: int = 16
  frac_noise: float = 0.2

  task = "noisy_in_context_recall"


# ----------------------------------------------------------------- fuzzy in-context recall

@dataclasses.dataclass(frozen=True)
class FuzzyInContextRecall(_Settings):
  """Keys are 1..k_motif_size distinct tokens of [0, K), values 1..v_motif_size distinct tokens
  of [K, vocab_size - 1), K = (vocab_size - 1) // 2; vocab_size - 1 is the pad token that fills
  the front of a sequence. Pairs (key, its value) follow each other, keys repeating with their
  value; the last pair's key was seen before. Training keys have any length 1..k (a key may
  extend another: the model cannot tell where it ends), validation and test keys have k tokens."""
  k_motif_size: int = 3
  v_motif_size: int = 3

  task = "fuzzy_in_context_recall"

  @property
  def num_keys(self) -> int:
    return (self.vocab_size - 1) // 2

  def _check(self, seq_len: int) -> None:
    num_values = self.vocab_size - 1 - self.num_keys
    if self.num_keys < self.k_motif_size or num_values < self.v_motif_size:
      raise ValueError(f"{self.task}: vocab_size={self.vocab_size} has {self.num_keys} key and "
                       f"{num_values} value ids, fewer than k_motif_size={self.k_motif_size} or "
                       f"v_motif_size={self.v_motif_size}")
    longest = self.k_motif_size + self.v_motif_size
    if seq_len < 2 * longest:
      raise ValueError(f"{self.task}: max_len={seq_len} cannot hold two pairs of up to "
                       f"{longest} tokens; use max_len >= {2 * longest}")

  def _generate(self, seq_len, split, rng):
    n, num_keys, pad = self.num_examples(split), self.num_keys, self.vocab_size - 1
    key_sizes = np.arange(1, self.k_motif_size + 1) if split == "train" else [self.k_motif_size]
    stream = np.full((n, seq_len), pad, np.int64)
    asked = np.zeros((n, seq_len), bool)   # the position holds a value token of a repeated key
    num_values, longest = pad - num_keys, self.k_motif_size + self.v_motif_size
    # Drawn up front for at most `slots` pairs per sequence: each pair's key (the first
    # k_size ids of a random order of the key ids) and, if the key is new, its value.
    slots = seq_len // 2
    key_orders = np.argsort(rng.random((n, slots, num_keys)), axis=-1)
    key_lengths = rng.choice(key_sizes, (n, slots))
    value_orders = num_keys + np.argsort(rng.random((n, slots, num_values)), axis=-1)
    value_lengths = rng.integers(1, self.v_motif_size + 1, (n, slots))
    last_pick = rng.random(n)
    for row in range(n):
      value_of, tokens, is_asked = {}, [], []

      def add(key, pair):   # a pair; its value is asked when the key was seen before
        repeated = key in value_of
        if not repeated:
          value_of[key] = tuple(value_orders[row, pair, :value_lengths[row, pair]].tolist())
        tokens.extend([*key, *value_of[key]])
        is_asked.extend([False] * len(key) + [repeated] * len(value_of[key]))

      pair = 0
      while len(tokens) + 2 * longest <= seq_len:   # room for this pair and the last one
        add(tuple(key_orders[row, pair, :key_lengths[row, pair]].tolist()), pair)
        pair += 1
      add(list(value_of)[int(last_pick[row] * len(value_of))], pair)   # a key seen before
      stream[row, seq_len - len(tokens):] = tokens
      asked[row, seq_len - len(tokens):] = is_asked
    if split == "train":
      return stream, _next_token_targets(stream)
    targets = np.full((n, seq_len), IGNORED, np.int64)
    targets[:, :-1] = np.where(asked[:, 1:], stream[:, 1:], IGNORED)
    return stream, targets


# ---------------------------------------------------------------------- selective copying

@dataclasses.dataclass(frozen=True)
class SelectiveCopying(_Settings):
  """num_tokens_to_copy data tokens of [0, vocab_size - 2) at random positions (in order) among
  blanks (vocab_size - 2) in the first L - num_tokens_to_copy - 1 positions, then the copy token
  (vocab_size - 1), then num_tokens_to_copy blanks; at those blanks the model must emit the data
  tokens in order."""
  num_tokens_to_copy: int = 16

  task = "selective_copying"

  def _check(self, seq_len: int) -> None:
    if self.vocab_size < 3:
      raise ValueError(f"{self.task}: vocab_size must be >= 3 (data, blank and copy tokens), "
                       f"got {self.vocab_size}")
    if seq_len <= 2 * self.num_tokens_to_copy + 1:
      raise ValueError(f"{self.task}: max_len={seq_len} must exceed 2 * num_tokens_to_copy + 1 "
                       f"= {2 * self.num_tokens_to_copy + 1}")

  def _generate(self, seq_len, split, rng):
    n, copies = self.num_examples(split), self.num_tokens_to_copy
    blank, copy = self.vocab_size - 2, self.vocab_size - 1
    prefix = seq_len - copies - 1
    data = rng.integers(0, blank, (n, copies))
    # `copies` distinct positions of the prefix, in increasing order.
    positions = np.sort(np.argsort(rng.random((n, prefix)), axis=1)[:, :copies], axis=1)
    tokens = np.full((n, seq_len), blank, np.int64)
    tokens[np.arange(n)[:, None], positions] = data
    tokens[:, prefix] = copy
    targets = np.full((n, seq_len), IGNORED, np.int64)
    targets[:, prefix + 1:] = data
    return tokens, targets


# ---------------------------------------------------------------------------- compression

@dataclasses.dataclass(frozen=True)
class Compression(_Settings):
  """L - 1 random tokens of [0, vocab_size - 1), then the compression token (vocab_size - 1).
  Target at position i is token i: a model whose logits at every position are read from the
  compression token's representation alone (experiments/train/build.py picks such a model by the
  task spec's `readout`) must reconstruct the whole sequence from one vector."""

  task = "compression"

  def _check(self, seq_len: int) -> None:
    if self.vocab_size < 2 or seq_len < 2:
      raise ValueError(f"{self.task}: needs vocab_size >= 2 and max_len >= 2, got "
                       f"{self.vocab_size} and {seq_len}")

  def _generate(self, seq_len, split, rng):
    n = self.num_examples(split)
    tokens = np.full((n, seq_len), self.vocab_size - 1, np.int64)
    tokens[:, :-1] = rng.integers(0, self.vocab_size - 1, (n, seq_len - 1))
    targets = tokens.copy()
    targets[:, -1] = IGNORED   # the compression token itself is not asked
    return tokens, targets


# --------------------------------------------------------------------------- memorization

@dataclasses.dataclass(frozen=True)
class Memorization(_Settings):
  """A fixed bijection from the keys [0, K) to the values [K, 2K), K = (vocab_size - 1) // 2,
  drawn from `map_seed` alone, so every split and every run seed share it. A sequence is L/2
  pairs (key, insert token vocab_size - 1); at each insert token the key's value is asked."""
  vocab_size: int = 256
  num_train: int = 256
  map_seed: int = 12345

  task = "memorization"

  @property
  def num_keys(self) -> int:
    return (self.vocab_size - 1) // 2

  def value_of(self) -> np.ndarray:
    """int [K]: the value of each key."""
    return self.num_keys + np.random.default_rng(self.map_seed).permutation(self.num_keys)

  def _check(self, seq_len: int) -> None:
    _even(self.task, seq_len)
    if self.num_keys < 1:
      raise ValueError(f"{self.task}: vocab_size must be >= 3, got {self.vocab_size}")

  def _generate(self, seq_len, split, rng):
    n, insert = self.num_examples(split), self.vocab_size - 1
    keys = rng.integers(0, self.num_keys, (n, seq_len // 2))
    tokens = np.full((n, seq_len), insert, np.int64)
    tokens[:, 0::2] = keys
    targets = np.full((n, seq_len), IGNORED, np.int64)
    targets[:, 1::2] = self.value_of()[keys]
    return tokens, targets


# The MAD suite in the column order of its published table; lengths are MAD's baseline settings.
register_task(Compression, family="mad", max_len=32, readout="last_position")
register_task(FuzzyInContextRecall, family="mad", max_len=128)
register_task(InContextRecall, family="mad", max_len=128)
register_task(Memorization, family="mad", max_len=32)
register_task(NoisyInContextRecall, family="mad", max_len=128)
register_task(SelectiveCopying, family="mad", max_len=256)
