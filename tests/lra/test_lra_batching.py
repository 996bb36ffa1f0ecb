"""lra.iterate: shapes, determinism per (seed, epoch), exact resume, one-pass eval weights."""
import itertools

import numpy as np
import pytest

import lra
from lra.dataset import Dataset


def make_dataset(n=10, max_len=6, dual=False):
  """Example i has targets[i] = i and i % max_len + 1 real tokens, all equal to i + 1."""
  lengths = (np.arange(n) % max_len + 1).astype(np.int32)
  tokens = np.where(np.arange(max_len) < lengths[:, None], np.arange(n)[:, None] + 1, 0)
  extra = {"tokens2": tokens[::-1].astype(np.uint16), "lengths2": lengths[::-1].copy()} \
      if dual else {}
  return Dataset(spec=lra.task_spec("retrieval" if dual else "text"), split="train",
                 tokens=tokens.astype(np.uint16), lengths=lengths,
                 targets=np.arange(n, dtype=np.int32), **extra)


def take(iterator, count):
  return list(itertools.islice(iterator, count))


def test_batch_contents_and_dtypes():
  ds = make_dataset(dual=True)
  batch = next(lra.iterate(ds, 4, shuffle=False))
  assert set(batch) == {"inputs", "masks", "targets", "weights", "inputs2", "masks2"}
  assert batch["inputs"].dtype == np.int32 and batch["masks"].dtype == bool
  assert batch["targets"].dtype == np.int32 and batch["weights"].dtype == np.float32
  assert batch["inputs"].shape == batch["masks"].shape == (4, 6)
  assert batch["targets"].tolist() == [0, 1, 2, 3]
  np.testing.assert_array_equal(batch["inputs"], ds.inputs[:4])
  np.testing.assert_array_equal(batch["masks"], ds.masks[:4])
  np.testing.assert_array_equal(batch["inputs2"], ds.inputs2[:4])
  np.testing.assert_array_equal(batch["masks2"], ds.masks2[:4])
  assert batch["masks"].sum(1).tolist() == [1, 2, 3, 4]
  with pytest.raises(AttributeError, match="dual task"):
    make_dataset().inputs2


def test_epochs_are_permutations_fixed_by_seed_and_epoch():
  ds = make_dataset(n=10)
  stream = np.concatenate([b["targets"] for b in take(lra.iterate(ds, 4, shuffle=True,
                                                                  seed=5), 10)])
  epochs = stream.reshape(4, 10)  # 40 positions = 4 epochs; batches span epoch boundaries
  for epoch, order in enumerate(epochs):
    assert sorted(order) == list(range(10))
    np.testing.assert_array_equal(order, lra.batching.epoch_order(10, epoch, shuffle=True,
                                                                  seed=5))
  assert len({tuple(e) for e in epochs}) == 4  # reshuffled every epoch
  same = np.concatenate([b["targets"] for b in take(lra.iterate(ds, 4, shuffle=True, seed=5),
                                                    10)])
  other = np.concatenate([b["targets"] for b in take(lra.iterate(ds, 4, shuffle=True, seed=6),
                                                     10)])
  np.testing.assert_array_equal(same, stream)
  assert (other != stream).any()
  plain = np.concatenate([b["targets"] for b in take(lra.iterate(ds, 4, shuffle=False), 5)])
  assert plain.tolist() == list(range(10)) * 2


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("start", [1, 3, 7, 12])
def test_resume_equals_skipping(shuffle, start):
  ds = make_dataset(n=11, dual=True)
  full = take(lra.iterate(ds, 4, shuffle=shuffle, seed=2), start + 6)
  resumed = take(lra.iterate(ds, 4, shuffle=shuffle, seed=2, start_step=start), 6)
  for expected, got in zip(full[start:], resumed):
    assert expected.keys() == got.keys()
    for key in expected:
      np.testing.assert_array_equal(expected[key], got[key])


@pytest.mark.parametrize("shuffle", [True, False])
def test_one_pass_counts_each_example_once(shuffle):
  ds = make_dataset(n=10)
  batches = list(lra.iterate(ds, 4, shuffle=shuffle, seed=1, repeat=False))
  assert len(batches) == 3 and all(b["inputs"].shape == (4, 6) for b in batches)
  weights = np.concatenate([b["weights"] for b in batches])
  targets = np.concatenate([b["targets"] for b in batches])
  assert weights.tolist() == [1] * 10 + [0, 0]
  assert sorted(targets[weights == 1]) == list(range(10))
  last = batches[-1]
  assert last["masks"][2:].any(axis=1).all()  # fillers are real examples, not empty rows
  resumed = list(lra.iterate(ds, 4, shuffle=shuffle, seed=1, repeat=False, start_step=2))
  assert len(resumed) == 1
  np.testing.assert_array_equal(resumed[0]["targets"], last["targets"])

  small = list(lra.iterate(make_dataset(n=3), 8, shuffle=shuffle, repeat=False))
  assert len(small) == 1 and small[0]["weights"].tolist() == [1] * 3 + [0] * 5


def test_bad_arguments():
  ds = make_dataset()
  for kwargs in ({"batch_size": 0}, {"batch_size": 2, "start_step": -1},
                 {"batch_size": 2, "seed": -3}):
    with pytest.raises(ValueError, match="must be an integer"):
      lra.iterate(ds, shuffle=True, **kwargs)  # checked at the call, not at next()
