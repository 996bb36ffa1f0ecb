"""ListOps: the fixed vocabulary, and a generator writing the official file layout.

An expression is a tree of operators over digits, e.g. `[MAX 2 9 [MIN 4 7 ] 0 ]` = 9:
  MIN, MAX: of the arguments; MED: int(np.median(args)) (the mean of the two middle
  values, truncated, when there is an even number of them); SM: sum(args) % 10.
The official files (Tay et al., 2021, `lra_release/listops-1000/basic_{train,val,test}.tsv`)
hold the expression with every node wrapped in `( ... )` and the answer, tab-separated:
  Source	Target
  ( ( ( [MAX 2 ) 9 ) ] )	9
Generation follows the reference generator: below depth 10 a node is a sub-tree with
probability 0.25, else a digit; an operator takes 2..10 arguments; a sample is kept when
its length (operators, digits and `]`, not parens) is strictly between 500 and 2000, and
only once. `min_length` / `max_length` change those bounds (e.g. short expressions for a
CPU-sized run); the defaults are LRA's.
"""
from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import random
from pathlib import Path

from tqdm import tqdm

from lra.fileio import ignore_interrupts, staged_folder, write_manifest

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
END = "]"
DIGITS = tuple(str(d) for d in range(10))
PAD = "<pad>"
# Sorted, so ids are the same in every process (the reference built it from a set, which
# reorders with PYTHONHASHSEED). Id 0 is padding.
VOCAB = (PAD,) + tuple(sorted(DIGITS + OPERATORS + (END,)))
TOKEN_IDS = {token: i for i, token in enumerate(VOCAB)}

DIR_NAME = "listops-1000"
SPLIT_FILES = {"train": "basic_train.tsv", "validation": "basic_val.tsv", "test": "basic_test.tsv"}
HEADER = "Source\tTarget"

MAX_DEPTH = 10
SUBTREE_P = 0.25
MAX_ARGS = 10
RULES_VERSION = 1  # bump whenever the generation rules change what is written
MIN_LENGTH = 500   # exclusive
MAX_LENGTH = 2000  # exclusive
_CHUNK = 500       # samples per unit of work; fixed so output does not depend on `workers`


def tokenize(source: str) -> list[str]:
  """The reference tokenisation: drop `(` and `)`, split on whitespace."""
  return source.replace("(", "").replace(")", "").split()


def apply_operator(op: str, args: list[int]) -> int:
  if op == "[MIN":
    return min(args)
  if op == "[MAX":
    return max(args)
  if op == "[SM":
    return sum(args) % 10
  if op == "[MED":
    ordered = sorted(args)
    mid = len(ordered) // 2
    if len(ordered) % 2:
      return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) // 2  # int() of a non-negative mean
  raise ValueError(f"unknown ListOps operator {op!r}; expected one of {OPERATORS}")


class _TooLong(Exception):
  """The tree being drawn already has max_length tokens: it will be rejected anyway."""


def _draw_node(rng: random.Random, depth: int, length: list[int],
               max_length: int = MAX_LENGTH) -> tuple[str, int]:
  """Draw one node; returns (its Source text, its value) and adds its tokens to length[0]."""
  if depth < MAX_DEPTH and rng.random() <= SUBTREE_P:
    num_args = rng.randint(2, MAX_ARGS)
    length[0] += 2  # the operator and its `]`
    texts, values = [], []
    for _ in range(num_args):
      text, value = _draw_node(rng, depth + 1, length, max_length)
      texts.append(text)
      values.append(value)
    op = rng.choice(OPERATORS)
    # ((op, a1), a2), ..., ]) written with a paren pair per tuple, as the official files.
    return "( " * (num_args + 1) + op + " " + " ) ".join(texts) + " ) ] )", \
        apply_operator(op, values)
  length[0] += 1
  if length[0] >= max_length:  # stopping early keeps the accepted distribution unchanged
    raise _TooLong
  value = rng.randrange(10)
  return DIGITS[value], value


def draw_sample(rng: random.Random, min_length: int = MIN_LENGTH,
                max_length: int = MAX_LENGTH) -> tuple[str, int] | None:
  """One expression (Source text, answer) with an accepted length, or None if rejected."""
  length = [0]
  try:
    text, value = _draw_node(rng, 1, length, max_length)
  except _TooLong:
    return None
  if not min_length < length[0] < max_length:
    return None
  return text, value


def _generate_chunk(task: tuple[int, int, int, int]) -> list[tuple[str, int]]:
  """`_CHUNK` accepted samples from a stream seeded by (seed, chunk index) alone."""
  seed, chunk, min_length, max_length = task
  rng = random.Random(f"listops/{seed}/{chunk}")  # str seeds hash with sha512: stable
  samples = []
  while len(samples) < _CHUNK:
    sample = draw_sample(rng, min_length, max_length)
    if sample is not None:
      samples.append(sample)
  return samples


def _unique_samples(total: int, seed: int, workers: int, progress: bool,
                    min_length: int = MIN_LENGTH, max_length: int = MAX_LENGTH):
  """Yield `total` distinct samples, the same ones in the same order for any `workers`."""
  seen = set()
  next_chunk = 0
  with contextlib.ExitStack() as stack:
    bar = stack.enter_context(tqdm(total=total, desc="listops", unit="sample",
                                   disable=not progress))
    pool = (stack.enter_context(multiprocessing.get_context("spawn").Pool(
                workers, initializer=ignore_interrupts))
            if workers > 1 else None)
    produced = 0
    while produced < total:
      num_chunks = -(-(total - produced) // _CHUNK)
      tasks = [(seed, c, min_length, max_length)
               for c in range(next_chunk, next_chunk + num_chunks)]
      next_chunk += num_chunks
      results = pool.imap(_generate_chunk, tasks) if pool else map(_generate_chunk, tasks)
      for samples in results:
        for text, value in samples:
          key = hashlib.blake2b(text.encode(), digest_size=16).digest()
          if key in seen:
            continue
          seen.add(key)
          produced += 1
          bar.update()
          yield text, value


def generate_listops(out_dir, *, num_train: int = 96_000, num_val: int = 2_000,
                     num_test: int = 2_000, seed: int = 0, workers: int = 1,
                     progress: bool = True, min_length: int = MIN_LENGTH,
                     max_length: int = MAX_LENGTH) -> str:
  """Write `out_dir/listops-1000/basic_{train,val,test}.tsv` in the official format.

  Expressions have min_length < length < max_length tokens (LRA: 500 and 2000; shorter
  bounds make a CPU-sized task, e.g. 16 and 128). Each value is a digit or an operator
  with its `]`, so a bound below 4 tokens would accept no expression.

  Deterministic for a seed (and independent of `workers`). The files are written into a hidden
  folder beside `listops-1000` and moved into it only once all three are complete (an
  interrupted run leaves nothing behind, not even the folders it would have made); files
  already in it other than these are kept. Returns the `listops-1000` folder;
  `lra.load("listops", split, data_dir=out_dir)` reads it. With `workers > 1` samples are
  drawn in "spawn" worker processes, so a calling script needs the usual
  `if __name__ == "__main__":` guard. A manifest, `generated.json` (generator, version of
  its rules, seed, sizes, parameters, date), is written beside the files once they are
  complete; `lra.provenance` reports it.
  """
  sizes = {"train": num_train, "validation": num_val, "test": num_test}
  for name, size in sizes.items():
    if not isinstance(size, int) or size < 0:
      raise ValueError(f"num_{'val' if name == 'validation' else name} must be an "
                       f"integer >= 0, got {size!r}")
  if sum(sizes.values()) == 0:
    raise ValueError("num_train + num_val + num_test must be > 0")
  if not isinstance(workers, int) or workers < 1:
    raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
  for name, value in (("min_length", min_length), ("max_length", max_length)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
  if max_length - min_length < 2 or max_length < 5:
    # The shortest expression is `[OP d d ]` (4 tokens); bounds are exclusive.
    raise ValueError(f"no ListOps expression has min_length={min_length} < length < "
                     f"max_length={max_length}; use max_length >= 5 and "
                     "max_length - min_length >= 2")
  out = Path(out_dir) / DIR_NAME
  samples = _unique_samples(sum(sizes.values()), seed, workers, progress, min_length,
                            max_length)
  with contextlib.closing(samples), staged_folder(out) as staging:
    for split, size in sizes.items():
      with open(staging / SPLIT_FILES[split], "w", encoding="utf-8", newline="\n") as f:
        f.write(HEADER + "\n")
        for _ in range(size):
          text, value = next(samples)
          f.write(f"{text}\t{value}\n")
    write_manifest(staging, generator="lra.generate_listops", rules_version=RULES_VERSION,
                   seed=seed, sizes=sizes, parameters={
                       "min_length": min_length, "max_length": max_length,
                       "max_depth": MAX_DEPTH, "subtree_p": SUBTREE_P, "max_args": MAX_ARGS,
                       "files": SPLIT_FILES})
  return str(out)


def statistics(path) -> dict:
  """Of a ListOps file (`Source<TAB>Target` rows): the number of examples; percentiles of the
  length in tokens with the closing brackets (operators, digits, `]`) and without them (what
  LRA's pipeline fed before 2021-03-04); percentiles of the depth, the deepest nesting of
  operators; and how many examples have each answer 0-9."""
  import numpy as np

  with_brackets, without, depths, labels = [], [], [], []
  with open(path, encoding="utf-8") as f:
    next(f)   # header
    for line in f:
      source, target = line.rstrip("\n").split("\t")
      tokens = tokenize(source)
      nesting = np.cumsum([1 if t in OPERATORS else -1 if t == END else 0 for t in tokens])
      with_brackets.append(len(tokens))
      without.append(len(tokens) - tokens.count(END))
      depths.append(int(nesting.max()))
      labels.append(int(target))
  quantiles = (0, 5, 25, 50, 75, 95, 100)
  summary = lambda xs: {f"p{q}": float(np.percentile(xs, q)) for q in quantiles} | {
      "mean": float(np.mean(xs))}
  return {"examples": len(labels), "length": summary(with_brackets),
          "length_without_closing_brackets": summary(without), "depth": summary(depths),
          "labels": np.bincount(labels, minlength=10).tolist()}

