"""experiments.benchmark --mode=approximation measures against the right exact attention."""
import pytest

from experiments.benchmark.approximation import relative_error

SMALL = dict(length=24, num_heads=2, head_dim=8, std=1.0, seed=0)


@pytest.mark.parametrize("causal", [False, True])
def test_exact_variant_has_no_error(causal):
  assert relative_error("full", causal=causal, **SMALL) < 1e-5


@pytest.mark.parametrize("causal", [False, True])
def test_reformer_with_one_bucket_and_one_chunk_matches_shared_qk_softmax(causal):
  """One bucket, one chunk: Reformer is exact shared-QK attention without self, the reference
  here."""
  assert relative_error("reformer", causal=causal, n_buckets=1, chunk_len=24, **SMALL) < 1e-5


def test_approximation_is_measured_not_zero():
  errors = [relative_error("performer", nb_features=m, **SMALL) for m in (4, 512)]
  assert errors[0] > errors[1] > 0, errors
