"""MoBA against a float64 oracle written from its definition: the blocks each query sees chosen
in numpy (block means of the real keys, a ranking by q·mean with ties to the lower block, the
own block), then softmax attention over them in float64 (output and gradients, f32 within
1e-5; the choice itself has no gradient). Also: the edge rules (fewer past blocks than top_k:
all of them, i.e. causal `full`; top_k=0: `local`), ties, and no n x n array. The contract
(causality, padding, GQA, bf16, dropout) is the conformance suite's; compiled memory linear in
the length, test_scaling.py's."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_zoo.variants.moba import choose_blocks
from helpers import (attention64, create_variant, largest_backward_array, normal, out_and_grads,
                     padding_mask, random_qkv)


def build(causal, num_kv_heads=2, **options):
  return create_variant("moba", num_kv_heads=num_kv_heads, causal=causal, **options)


def oracle_pattern(q, k, kv_mask, *, block, top_k, causal):
  """bool [b, h, n, n]: which keys each query sees, from the definition, query by query."""
  q, k, kv_mask = np.asarray(q, np.float64), np.asarray(k, np.float64), np.asarray(kv_mask)
  batch, n, heads, _ = q.shape
  group = heads // k.shape[2]
  block_of = np.arange(n) // block
  allowed = np.zeros((batch, heads, n, n), bool)
  for b in range(batch):
    for h in range(heads):
      keys = k[b, :, h // group]
      means = {j: keys[(block_of == j) & kv_mask[b]].mean(0)
               for j in range(block_of[-1] + 1) if ((block_of == j) & kv_mask[b]).any()}
      for i in range(n):
        c = block_of[i]
        candidates = [j for j in means if (j < c if causal else j != c)]
        ranked = sorted(candidates, key=lambda j: (-(q[b, i, h] @ means[j]), j))
        own = (block_of == c) & ((np.arange(n) <= i) if causal else True)
        allowed[b, h, i] = kv_mask[b] & (np.isin(block_of, ranked[:top_k]) | own)
  return allowed


def assert_matches_oracle(causal, num_kv_heads, n, block, top_k, padded, seed=0):
  attn = build(causal, num_kv_heads=num_kv_heads, block_size=block, top_k=top_k)
  q, k, v = random_qkv(seed, q_len=n, num_kv_heads=num_kv_heads)
  mask = padding_mask(2, n, hole=5, tail=3) if padded else jnp.ones((2, n), bool)
  allowed = oracle_pattern(q, k, mask, block=block, top_k=top_k, causal=causal)
  cotangent = normal(seed + 7, q.shape)
  got = jax.jit(out_and_grads, static_argnums=0)(
      lambda q, k, v: attn(q, k, v, q_mask=mask, kv_mask=mask), q, k, v, cotangent)
  with jax.enable_x64(True):
    want = out_and_grads(lambda q, k, v: attention64(q, k, v, allowed, mask), q, k, v, cotangent)
  for what, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    assert g.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(g))), what
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=0, err_msg=what)
  return allowed


# causal, kv heads, length, block, top_k, padded: lengths not multiples of the block
@pytest.mark.parametrize("causal, num_kv_heads, n, block, top_k, padded", [
    (True, 2, 23, 4, 2, False),      # GQA: each query head chooses for itself
    (True, 2, 23, 4, 2, True),       # a hole and a padded tail: out of the means and the softmax
    (False, 2, 23, 4, 2, True),      # bidirectional: every other block a candidate
    pytest.param(True, 1, 30, 3, 3, False, marks=pytest.mark.slow),      # MQA
    pytest.param(False, 4, 17, 5, 1, False, marks=pytest.mark.slow),     # MHA
])
def test_forward_and_gradients_equal_the_float64_oracle(causal, num_kv_heads, n, block, top_k,
                                                        padded):
  allowed = assert_matches_oracle(causal, num_kv_heads, n, block, top_k, padded)
  # the case is not degenerate: queries of one block see different blocks
  assert (allowed[:, :, -1] != allowed[:, :, -2]).any()


def test_fewer_past_blocks_than_top_k_sees_them_all_which_is_full_attention():
  q, k, v = random_qkv(1, q_len=21, num_kv_heads=2)
  mask = padding_mask(2, 21, hole=4, tail=2)
  for causal in (True, False):
    moba = build(causal, block_size=4, top_k=5)     # 6 blocks: at most 5 others
    full = create_variant("full", causal=causal)
    np.testing.assert_allclose(moba(q, k, v, q_mask=mask, kv_mask=mask),
                               full(q, k, v, q_mask=mask, kv_mask=mask), atol=1e-6)


@pytest.mark.slow
def test_top_k_zero_is_local_attention_in_blocks():
  q, k, v = random_qkv(2, q_len=21, num_kv_heads=2)
  for causal in (True, False):
    np.testing.assert_allclose(build(causal, block_size=4, top_k=0)(q, k, v),
                               create_variant("local", causal=causal, block_size=4)(q, k, v),
                               atol=1e-6)


def test_ties_go_to_the_lower_block():
  """Blocks 0 and 1 have the same keys (equal gate scores) and different values; a query of block
  3 choosing one past block takes block 0."""
  block, n = 4, 16
  q, k, v = random_qkv(3, q_len=n, num_kv_heads=2)
  k = k.at[:, 4:8].set(k[:, 0:4])
  mask = jnp.ones((2, n), bool)
  chosen = choose_blocks(q[0, :, :2], k[0, :, 0], mask[0], mask[0], block=block, top_k=1,
                         causal=True)
  q_block_1, past_0_or_1 = chosen[4:8, :, 1], chosen[12:, :, 1]
  assert (q_block_1 == 0).all()                            # its only past block
  # block 2's mean differs; wherever the tied pair wins, block 0 is the one taken
  assert set(np.unique(past_0_or_1).tolist()) <= {0, 2} and (past_0_or_1 == 0).any()
  allowed = oracle_pattern(q, k, mask, block=block, top_k=1, causal=True)
  out = build(True, block_size=block, top_k=1)(q, k, v)
  np.testing.assert_allclose(out, attention64(q, k, v, allowed, mask), atol=1e-5)


def test_chosen_blocks_are_indices_per_query_and_head():
  q, k, _ = random_qkv(4, q_len=24, num_kv_heads=2)
  real = jnp.ones(24, bool).at[20:].set(False)
  chosen = choose_blocks(q[0, :, :2], k[0, :, 0], real, real, block=4, top_k=3, causal=True)
  assert chosen.shape == (24, 2, 4) and chosen.dtype == jnp.int32
  own = np.broadcast_to(np.arange(20)[:, None] // 4, (20, 2))
  np.testing.assert_array_equal(chosen[:20, :, 0], own)                               # own block
  past = np.asarray(chosen[:20, :, 1:])
  assert ((past < np.arange(20)[:, None, None] // 4) | (past == -1)).all()          # past only
  # block c has min(c, 3) past blocks: the rest of its slots are empty
  np.testing.assert_array_equal((past >= 0).sum(-1), np.minimum(own, 3))
  assert (chosen[20:] == -1).all()                          # padded queries choose nothing


def test_no_n_by_n_array_forward_or_backward():
  n = 512
  attn = build(True, num_kv_heads=1, block_size=16, top_k=2)
  biggest = largest_backward_array(attn, n, 4, 8)
  assert biggest < n * n // 4, f"an intermediate has {biggest} elements (n² = {n * n})"
