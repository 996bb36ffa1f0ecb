"""Batches for the trainer, resumable at any step without replaying the ones before it.

With `repeat=True` the examples form an endless stream, epoch after epoch, each epoch in
its own order (a permutation drawn from (seed, epoch) when shuffling); step s is stream
positions [s * batch_size, (s + 1) * batch_size), so a batch may span two epochs and no
example is dropped. With `repeat=False` one epoch is cut into ceil(N / batch_size) batches
of the same shape, the last one filled up with copies of real examples whose `weights` are
0, so summing weighted metrics counts every example exactly once.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from lra.dataset import Dataset


def epoch_order(num_examples: int, epoch: int, *, shuffle: bool, seed: int) -> np.ndarray:
  """The example indices of one epoch, in the order they are served."""
  if not shuffle:
    return np.arange(num_examples)
  return np.random.default_rng([seed, epoch]).permutation(num_examples)


def _check(name: str, value, minimum: int) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def iterate(ds: Dataset, batch_size: int, *, shuffle: bool, seed: int = 0, start_step: int = 0,
            repeat: bool = True) -> Iterator[dict[str, np.ndarray]]:
  """Yield batches of `ds` as dicts of numpy arrays.

  Keys: `inputs` int32 [B, L], `masks` bool [B, L], `targets` int32 [B], `weights`
  float32 [B] (1 = real example, 0 = filler in the last batch of a `repeat=False` pass),
  plus `inputs2`, `masks2` for a dual task. `start_step=s` starts at the batch that step s
  would be: the same batches as skipping s of them, computed directly.
  """
  _check("batch_size", batch_size, 1)
  _check("seed", seed, 0)
  _check("start_step", start_step, 0)
  num_examples = len(ds)
  if num_examples == 0:
    raise ValueError(f"cannot iterate over an empty dataset ({ds!r})")
  if repeat:
    return _repeating(ds, batch_size, shuffle, seed, start_step)
  return _one_pass(ds, batch_size, shuffle, seed, start_step)


def _repeating(ds, batch_size, shuffle, seed, step):
  num_examples = len(ds)
  orders = {}  # epoch -> order, for the epochs the current batch touches
  ones = np.ones(batch_size, np.float32)
  while True:
    epochs, offsets = np.divmod(np.arange(step * batch_size, (step + 1) * batch_size),
                                num_examples)
    orders = {e: orders[e] if e in orders else
              epoch_order(num_examples, e, shuffle=shuffle, seed=seed)
              for e in np.unique(epochs).tolist()}
    indices = np.empty(batch_size, np.int64)
    for epoch, order in orders.items():
      here = epochs == epoch
      indices[here] = order[offsets[here]]
    yield {**ds.batch(indices), "weights": ones.copy()}
    step += 1


def _one_pass(ds, batch_size, shuffle, seed, start_step):
  num_examples = len(ds)
  order = epoch_order(num_examples, 0, shuffle=shuffle, seed=seed)
  num_batches = -(-num_examples // batch_size)
  for step in range(start_step, num_batches):
    indices = order[step * batch_size:(step + 1) * batch_size]
    num_real = len(indices)
    if num_real < batch_size:  # fill with real examples so the batch is well-formed
      indices = np.concatenate([indices, np.resize(order, batch_size - num_real)])
    weights = (np.arange(batch_size) < num_real).astype(np.float32)
    yield {**ds.batch(indices), "weights": weights}
