"""The counter-based dropout mask (ops.softmax.keep_mask) behaves as i.i.d. Bernoulli draws:
its keep rate, its independence across entries, rows and keys, and the Dropout module on it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attention_zoo.dropout import Dropout
from attention_zoo.ops import softmax

SHAPE = (4, 3, 96, 256)   # 294,912 entries


def mask(seed, rate, shape=SHAPE):
  return np.asarray(softmax.keep_mask(jax.random.key(seed), shape, rate))


def within(observed, expected, count, sigmas=5.0):
  """|observed - expected| inside `sigmas` binomial standard errors of a mean of `count` draws."""
  return abs(observed - expected) <= sigmas * np.sqrt(expected * (1 - expected) / count)


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_keep_rate_is_one_minus_rate(rate):
  kept = mask(0, rate)
  assert within(kept.mean(), 1 - rate, kept.size)
  per_row = kept.mean(axis=-1).ravel()   # no row is off: every row draws fresh bits
  assert np.all(np.abs(per_row - (1 - rate)) < 6 * np.sqrt(rate * (1 - rate) / SHAPE[-1]))


def test_entries_rows_and_keys_are_independent():
  rate = 0.3
  a, b = mask(0, rate), mask(1, rate)
  n = a.size
  agree = 1 - 2 * rate * (1 - rate)            # P(two independent draws agree)
  assert within((a == b).mean(), agree, n)      # two keys
  x = a.astype(float) - a.mean()
  for neighbour in (np.roll(x, 1, axis=-1), np.roll(x, 1, axis=-2), np.roll(x, 1, axis=0)):
    correlation = (x * neighbour).mean() / x.var()
    assert abs(correlation) < 5 / np.sqrt(n), correlation   # columns, rows, leading dims
  assert (mask(0, rate) == a).all()              # the same key, the same mask


def test_folded_keys_give_other_masks():
  key = jax.random.key(3)
  masks = [np.asarray(softmax.keep_mask(jax.random.fold_in(key, i), (64, 64), 0.5))
           for i in range(3)]
  assert all(within((masks[i] == masks[j]).mean(), 0.5, 64 * 64)
             for i in range(3) for j in range(i + 1, 3))


def test_dropout_module_scales_kept_entries_and_is_identity_when_off():
  layer = Dropout(0.25, rngs=nnx.Rngs(0))
  x = jnp.ones((8, 512))
  assert (layer(x, deterministic=True) == x).all()
  assert (Dropout(0.0, rngs=nnx.Rngs(0))(x, deterministic=False) == x).all()
  first, second = layer(x, deterministic=False), layer(x, deterministic=False)
  np.testing.assert_allclose(np.unique(np.asarray(first)), [0.0, 1 / 0.75], rtol=1e-6)
  assert not (first == second).all()             # a fresh key at every call
  assert within(float((first > 0).mean()), 0.75, x.size)
  with pytest.raises(ValueError, match=r"rate must be in \[0, 1\)"):
    Dropout(1.0, rngs=nnx.Rngs(0))
