"""The formal-language tasks of Grazzi et al. 2025 ("Unlocking State-Tracking in Linear RNNs
Through Negative Eigenvalues", ICLR 2025, arXiv:2411.12537), three tasks of Deletang et al.'s
Chomsky hierarchy as the released code (github.com/adankow/unlocking_state_tracking,
xlstm/experiments/data/formal_language/) generates them, sequence by sequence from the same
random streams: for a seed, our splits are the first sequences of the released ones.

A released sequence holds `length` tokens, the answer among them; the model reads it shifted by
one (the released `shift: 1`) and is scored at one position only: where the next token is the
answer (`enable_mask`). Here a split holds what the model reads, tokens [N, W] and targets
[N, W] with the answer at that position and IGNORED elsewhere; `lengths` counts the tokens read
up to it (the rest is padding, as the tokens after the answer cannot reach it in a causal model).
W is max_train_len for train and the task's max_len (the released context_length 256, minus the
shift: 255) for validation and test.

  parity_check                 vocab 3: bits 1, 2 (0 pads); length-1 bits, then the answer: 1
                               for an even number of 2s, 2 for an odd one. Chance 1/2.
  modular_arithmetic           vocab 10: 0 pad, 1 + 2 - 3 * 4 =, 5..9 the numbers 0..4;
                               n op n op ... n = r, r the value mod 5 (* before + and -), length
                               odd. Chance 1/5.
  modular_arithmetic_brackets  vocab 12: 0..4 the numbers, 5 + 6 - 7 * 8 ( 9 ) 10 = 11 pad; a
                               random bracketed expression of length - 3 tokens (unary minus
                               allowed), = r [pad]. Chance 1/5.

Lengths (the released yaml files): train 3..40, validation and test 40..256, 8,192 each. Every
split draws sequence i from numpy's default_rng(base + i), base drawn from the split's seed, the
split seeds from Python's random.Random(seed), as the released OnlineTaskGenerate and
FormLangDatasetGenerator do; `base` depends on the released split size (STREAM_SIZES), so a
smaller split is a prefix of the released one.
"""
from __future__ import annotations

import dataclasses
import random

import numpy as np

from synthetic.base import IGNORED, check_integer_fields, register_task

RULES_VERSION = 1   # bump when a generator's output for given settings changes

SPLITS = ("train", "validation", "test")   # the released generator draws their seeds in order
MODULUS = 5   # both arithmetic tasks: the released vocab_size 10 (10 - 5) and 12 (12 - 7)
# Mod. arithmetic w/ brackets: the numbers are their own ids, then these.
BRACKET_IDS = {"+": 5, "-": 6, "*": 7, "(": 8, ")": 9, "=": 10, "pad": 11}


@dataclasses.dataclass(frozen=True)
class _Settings:
  """What every formal-language task takes. seq_len (the task's max_len) is what the model reads
  of the longest sequence: the released context_length less the shift of one."""
  min_train_len: int = 3        # released min_sequence_length
  max_train_len: int = 40       # released max_sequence_length
  min_test_len: int = 40        # released subpar.validation/test.min_sequence_length
  num_train: int = 256_000      # released count.train: 5,120,000 (parity), see STREAM_SIZES
  num_validation: int = 8_192
  num_test: int = 8_192
  seed: int = 42                # released dataset.kwargs.seed (main.py sets it to --seed)

  task = ""
  vocab_size = 0
  chance = 0.0
  # The released split sizes (count.*), which place each split's stream: see module doc.
  stream_sizes = {"train": 5_120_000, "validation": 8_192, "test": 8_192}

  def check(self, seq_len: int) -> None:
    check_integer_fields(self, may_be_zero=("seed",))
    if self.min_train_len > self.max_train_len:
      raise ValueError(f"{self.task}: min_train_len={self.min_train_len} exceeds "
                       f"max_train_len={self.max_train_len}")
    if not self.max_train_len <= seq_len or not self.min_test_len <= seq_len + 1:
      raise ValueError(f"{self.task}: max_len={seq_len} reads sequences of up to "
                       f"{seq_len + 1} tokens (the answer is not read); it must hold "
                       f"max_train_len={self.max_train_len} and reach "
                       f"min_test_len={self.min_test_len}")
    for split in SPLITS:
      if self.num_examples(split) > self.stream_sizes[split]:
        raise ValueError(f"{self.task}: num_{split}={self.num_examples(split)} exceeds the "
                         f"released split of {self.stream_sizes[split]:,} sequences")

  def num_examples(self, split: str) -> int:
    return {"train": self.num_train, "validation": self.num_validation,
            "test": self.num_test}[split]

  def sequence_seeds(self, split: str) -> np.ndarray:
    """The seed of each sequence of `split`: the released base + index."""
    split_seeds = random.Random(self.seed)
    seeds = {name: split_seeds.randint(0, 1 << 32) for name in SPLITS}
    count = self.stream_sizes[split]
    base = int(np.random.default_rng(seeds[split]).integers((1 << 32) - count))
    return base + np.arange(self.num_examples(split))

  def generate(self, seq_len: int, split: str) -> dict[str, np.ndarray]:
    """One split: {"tokens": uint8 [N, W], "lengths": int32 [N], "targets": int32 [N, W]}."""
    self.check(seq_len)
    low, high = ((self.min_train_len, self.max_train_len) if split == "train"
                 else (self.min_test_len, seq_len + 1))
    width = self.max_train_len if split == "train" else seq_len
    seeds = self.sequence_seeds(split)
    tokens = np.zeros((len(seeds), width), np.uint8)
    targets = np.full((len(seeds), width), IGNORED, np.int32)
    lengths = np.zeros(len(seeds), np.int32)
    for row, seed in enumerate(seeds):
      read, answer = self.sequence(np.random.default_rng(int(seed)), low, high, seq_len + 1)
      tokens[row, :len(read)] = read
      targets[row, len(read) - 1] = answer
      lengths[row] = len(read)
    return {"tokens": tokens, "lengths": lengths, "targets": targets}

  def sequence(self, rng, low: int, high: int, context: int) -> tuple[list[int], int]:
    """(the tokens read before the answer, the answer) of one released sequence of
    `low`..`high` tokens in a context of `context`, drawn from `rng` as the released code
    draws it."""
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class ParityCheck(_Settings):
  """The released tasks/parity.py at vocab_size 3."""
  task = "parity_check"
  vocab_size = 3
  chance = 1 / 2

  def sequence(self, rng, low, high, context):
    bits = rng.integers(1, 3, size=[1, context - 1])[0]
    length = int(rng.integers(low, high + 1, size=[1])[0])
    read = bits[:length - 1]
    return read.tolist(), int(np.sum(read == 2) % 2) + 1


def _arithmetic_value(tokens) -> int:
  """n op n ... n (ids of modular_arithmetic) evaluated, * before + and -, mod MODULUS."""
  total, term, sign = 0, tokens[0] - 5, 1
  for op, number in zip(tokens[1::2], tokens[2::2]):
    if op == 3:    # '*'
      term *= number - 5
    else:
      total, term, sign = total + sign * term, number - 5, (-1 if op == 2 else 1)
  return (total + sign * term) % MODULUS


@dataclasses.dataclass(frozen=True)
class ModularArithmetic(_Settings):
  """The released tasks/modular_arithmetic.py at vocab_size 10."""
  task = "modular_arithmetic"
  vocab_size = 10
  chance = 1 / MODULUS
  stream_sizes = {"train": 102_400_000, "validation": 8_192, "test": 8_192}

  def sequence(self, rng, low, high, context):
    tokens = rng.integers(MODULUS, size=[1, context])[0] + 5
    tokens[1::2] = rng.integers(3, size=[1, context // 2])[0] + 1
    shortest = min((low + 1) // 2, (high + 1) // 2)
    length = int(2 * rng.integers(shortest, (high + 1) // 2 + 1, size=[1])[0] - 1)
    expression = tokens[:length - 2].tolist()
    return expression + [4], _arithmetic_value(expression) + 5


@dataclasses.dataclass(frozen=True)
class ModularArithmeticBrackets(_Settings):
  """The released tasks/modular_arithmetic_with_brackets.py at vocab_size 12 (with '*')."""
  task = "modular_arithmetic_brackets"
  vocab_size = 12
  chance = 1 / MODULUS
  stream_sizes = {"train": 102_400_000, "validation": 8_192, "test": 8_192}

  def sequence(self, rng, low, high, context):
    length = max(int(rng.integers(low, high + 1)), 5)
    expression, value = _bracketed(rng, length - 3)
    return [BRACKET_IDS.get(token, token) for token in expression] + [BRACKET_IDS["="]], value


def _bracketed(rng, length: int) -> tuple[list, int]:
  """A random expression of `length` tokens (numbers as ints, the rest as strings) and its
  value mod MODULUS, drawn in the released order: below 5 tokens a number, -n, (n) or (-n);
  else the left part's length, the left part, the right part, then the operator."""
  if length < 5:
    number = int(rng.integers(MODULUS))
    negative = length in (2, 4)
    inner = ["-", number] if negative else [number]
    value = -number % MODULUS if negative else number
    return (["(", *inner, ")"] if length > 2 else inner), value
  left_length = int(rng.integers(1, length - 3))
  left, left_value = _bracketed(rng, left_length)
  right, right_value = _bracketed(rng, length - left_length - 3)
  op = "+-*"[int(rng.integers(0, 3))]
  value = {"+": left_value + right_value, "-": left_value - right_value,
           "*": left_value * right_value}[op] % MODULUS
  return ["(", *left, op, *right, ")"], value


for _settings in (ParityCheck, ModularArithmetic, ModularArithmeticBrackets):
  # max_len: the released context_length 256 less the shift; the answer is the one asked token.
  register_task(_settings, family="formal_language", max_len=255, has_padding=True,
                chance=_settings.chance)
