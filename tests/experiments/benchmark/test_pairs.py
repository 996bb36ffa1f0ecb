"""The benchmark's FLOP count of an exact sparse variant: the pairs of the engine's block masks
equal those of the variant's dense `pattern()` (at a length that is no multiple of the blocks,
so padded and partial tiles are counted too)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attention_zoo as az
from attention_zoo import flex
from experiments.benchmark import pairs
from experiments.benchmark.attention import attention_flops, pair_flops

LENGTH, HEADS, HEAD_DIM, BATCH = 70, 2, 8, 2


def counted_and_pattern(name: str, **options) -> tuple[int | None, int]:
  attention = az.create(name, num_heads=HEADS, head_dim=HEAD_DIM, max_len=LENGTH,
                        rngs=nnx.Rngs(0), **options)
  forward = lambda q, k, v, mask: attention(q, k, v, q_mask=mask, kv_mask=mask)
  x = jax.ShapeDtypeStruct((BATCH, LENGTH, HEADS, HEAD_DIM), jnp.float32)
  counted = pairs.kept_pairs(forward, x, x, x, jax.ShapeDtypeStruct((BATCH, LENGTH), bool),
                             batch=BATCH, heads=HEADS)
  pattern = np.broadcast_to(attention.pattern(LENGTH, LENGTH), (HEADS, LENGTH, LENGTH))
  return counted, BATCH * int(pattern.sum())


# The fast lane: a window and per-head random blocks; the slow lane the rest.
@pytest.mark.parametrize("name,options", [
    ("sliding_window", dict(window=5)),
    ("bigbird", dict(block_size=4, num_window_blocks=3, num_random_blocks=2)),   # per head
    pytest.param("local", dict(block_size=6), marks=pytest.mark.slow),
    pytest.param("sparse_transformer", dict(block_size=6, num_summary=2, query_chunk=16),
                 marks=pytest.mark.slow),                                        # key copies
    pytest.param("longformer", dict(window=3, dilation=2, num_global_tokens=0),
                 marks=pytest.mark.slow),                                        # reordered
])
def test_the_block_masks_keep_the_pairs_of_the_pattern(name, options):
  counted, pattern = counted_and_pattern(name, **options)
  assert counted == pattern and 0 < pattern < BATCH * HEADS * LENGTH ** 2


def test_dense_attention_has_no_block_mask_and_counts_n_squared():
  assert counted_and_pattern("full")[0] is None
  assert pair_flops(BATCH * HEADS * LENGTH ** 2, HEAD_DIM) == attention_flops(
      BATCH, HEADS, LENGTH, HEAD_DIM, causal=False, backward=True) == 3.5 * 4 * 2 * 2 * 70 ** 2 * 8


def test_a_call_through_the_face_is_counted_and_one_without_the_engine_is_none():
  """A causal block mask through attention_zoo.flex (the face variant authors use): n(n+1)/2
  pairs a row and head; a forward that calls no engine has no count."""
  x = jax.ShapeDtypeStruct((BATCH, LENGTH, HEADS, HEAD_DIM), jnp.float32)
  causal = lambda q, k, v: flex.flex_attention(
      q, k, v, block_mask=flex.create_block_mask(flex.causal_mask(LENGTH, LENGTH), None, None,
                                                 LENGTH, LENGTH, block_q=32, block_k=16))
  assert pairs.kept_pairs(causal, x, x, x, batch=BATCH, heads=HEADS) == (
      BATCH * HEADS * LENGTH * (LENGTH + 1) // 2)
  assert pairs.kept_pairs(lambda q, k, v: q + k + v, x, x, x, batch=BATCH, heads=HEADS) is None
