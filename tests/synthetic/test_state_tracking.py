"""The state-tracking generator (synthetic.state_tracking): its targets against the running
product computed here from the permutations themselves, its splits and its determinism."""
import itertools

import numpy as np
import pytest

import synthetic
from synthetic import IGNORED

SMALL = dict(min_train_len=2, max_train_len=6, num_train=60, num_validation=8, num_test=8)


def load(task, split, max_len=12, **options):
  return synthetic.load(task, split, max_len=max_len, **{**SMALL, **options})


def running_products(task, tokens):
  """The prefix products of each row, composed one element at a time: bits xor-ed for parity;
  for S_n the permutations (lexicographic ids) applied as functions, (p · q)(i) = p(q(i))."""
  if task == "parity":
    return [list(np.cumsum(row) % 2) for row in tokens]
  n = {"s3": 3, "s5": 5}[task]
  perms = sorted(itertools.permutations(range(n)))
  rows = []
  for row in tokens:
    state, states = tuple(range(n)), []
    for token in row:
      state = tuple(state[perms[token][i]] for i in range(n))
      states.append(perms.index(state))
    rows.append(states)
  return rows


@pytest.mark.parametrize("task, order", [("parity", 2), ("s3", 6), ("s5", 120)])
def test_targets_are_the_running_product(task, order):
  train, test = load(task, "train"), load(task, "test")
  assert train.spec.vocab_size == train.spec.num_classes == order
  for ds in (train, test):
    assert 0 <= ds.inputs.min() and ds.inputs.max() < order
    expected = running_products(task, ds.inputs)
    for row in range(len(ds)):
      asked = np.flatnonzero(ds.targets[row] != IGNORED)
      np.testing.assert_array_equal(ds.targets[row, asked], np.asarray(expected[row])[asked])
  if task == "s3":   # non-abelian: the order of composition shows
    perms = sorted(itertools.permutations(range(3)))
    swap01, cycle = perms.index((1, 0, 2)), perms.index((1, 2, 0))
    assert running_products(task, [[swap01, cycle]])[0][1] == perms.index((0, 2, 1))


def test_train_is_short_and_fully_asked_test_is_long_and_asks_only_longer_prefixes():
  train, test = load("s3", "train", num_train=400), load("s3", "test")
  assert train.inputs.shape == (400, SMALL["max_train_len"])   # no wider than its longest
  assert set(train.lengths) == set(range(SMALL["min_train_len"], SMALL["max_train_len"] + 1))
  positions = np.arange(SMALL["max_train_len"])
  padding = positions >= train.lengths[:, None]
  np.testing.assert_array_equal(train.masks, ~padding)
  assert (train.targets[~padding] != IGNORED).all() and (train.targets[padding] == IGNORED).all()
  assert (train.inputs[padding] == 0).all()
  assert test.inputs.shape == (8, 12) and test.masks.all()
  asked = test.targets != IGNORED
  assert not asked[:, :SMALL["max_train_len"]].any() and asked[:, SMALL["max_train_len"]:].all()


def test_deterministic_per_seed_and_split():
  a, b = load("s5", "train"), load("s5", "train")
  np.testing.assert_array_equal(a.inputs, b.inputs)
  np.testing.assert_array_equal(a.targets, b.targets)
  assert not np.array_equal(load("s5", "test").inputs, load("s5", "validation").inputs)
  assert not np.array_equal(load("s5", "train", seed=1).inputs, a.inputs)
  assert synthetic.provenance("parity", max_len=12, **SMALL)["generator"]["rules_version"] == 1


def test_bad_settings_name_what_is_wrong():
  with pytest.raises(ValueError, match="max_len=6 is the test length and must exceed "
                                       "max_train_len=6"):
    load("parity", "test", max_len=6)
  with pytest.raises(ValueError, match="min_train_len=7 exceeds max_train_len=6"):
    load("parity", "train", min_train_len=7)
  with pytest.raises(ValueError, match="num_test must be an integer >= 1, got 0"):
    load("s3", "test", num_test=0)
  with pytest.raises(ValueError, match="unknown option.*vocab_size"):
    load("s3", "test", vocab_size=6)   # the group fixes the vocabulary
