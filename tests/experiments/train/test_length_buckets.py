"""Length buckets (experiments/train/steps.py): rows sorted by real length into micro-batches,
each cut to the shortest bucketed length that holds its longest row."""
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.common import task_configs
from experiments.common.errors import HarnessError
from experiments.train import trainer
from experiments.train.steps import bucket_lengths, by_length, truncated


def test_bucket_lengths_end_at_the_padded_length():
  assert bucket_lengths(32, 8) == (8, 16, 24, 32)
  assert bucket_lengths(30, 8) == (8, 16, 24, 30)
  assert bucket_lengths(8, 16) == (8,)


def test_by_length_sorts_rows_and_picks_each_micro_batch_its_length():
  real = np.array([30, 3, 17, 0, 9, 8])      # row 3 is filler: no real token
  masks = jnp.arange(32)[None] < real[:, None]
  masks = masks.at[2, 5].set(False)          # a hole: the length is the last real token + 1
  batch = {"inputs": jnp.arange(6)[:, None] * jnp.ones((6, 32), int), "masks": masks,
           "targets": jnp.arange(6)}
  micro, index = by_length(batch, 3, 8)
  np.testing.assert_array_equal(micro["targets"], [[3, 1], [5, 4], [2, 0]])
  np.testing.assert_array_equal(micro["inputs"][:, :, 0], micro["targets"])
  # longest rows 3, 9, 30 -> lengths 8, 16, 32 of (8, 16, 24, 32)
  np.testing.assert_array_equal(index, [0, 1, 3])


def test_by_length_refuses_a_batch_it_cannot_cut():
  batch = {"inputs": jnp.zeros((2, 8), int), "masks": jnp.ones((2, 8), bool),
           "targets": jnp.zeros((2, 8), int)}
  with pytest.raises(ValueError, match="a target per token; use 0"):
    by_length(batch, 1, 4)


def test_truncated_cuts_inputs_and_masks_only():
  batch = {"inputs": jnp.ones((2, 8), int), "masks": jnp.ones((2, 8), bool),
           "targets": jnp.zeros(2, int)}
  shapes = truncated(lambda scale, b: {k: v.shape for k, v in b.items()}, 3)(1.0, batch)
  assert shapes == {"inputs": (2, 3), "masks": (2, 3), "targets": (2,)}


def test_length_buckets_are_refused_for_a_dual_encoder():
  config = task_configs.task_config("retrieval", "full", "tiny", 0, ["length_bucket=8"])
  with pytest.raises(HarnessError, match="classifier of one input; retrieval trains a "
                                         "DualEncoderClassifier: use 0"):
    trainer.check_run(config)
