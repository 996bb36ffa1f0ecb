"""Reformer LSH attention against dense oracles built from its own hash buckets."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attention_zoo import reference
from helpers import create_variant, padding_mask

B, H, KVH, D = 2, 4, 2, 8


def make(causal=False, seed=0, **options):
  return create_variant("reformer", num_heads=H, head_dim=D, num_kv_heads=KVH, causal=causal,
                        model_seed=seed, **options)


def qkv(n, seed=0, q_norm=1.0):
  kq, kv = jax.random.split(jax.random.key(seed))
  q = q_norm * jax.random.normal(kq, (B, n, H, D))
  v = jax.random.normal(kv, (B, n, KVH, D))
  return q, v


def padding(n):
  return padding_mask(B, n, hole=2, tail=5)


def union_pattern(buckets, chunk_len, kv_mask, causal):
  """The set each query attends to, from the buckets [b, h, r, n]: the union over rounds of its
  chunk and the previous chunk in (bucket, position) order, minus itself; itself only if empty."""
  buckets = np.asarray(buckets)
  b, h, rounds, n = buckets.shape
  seen = np.zeros((b, h, n, n), bool)
  for bi in range(b):
    for hi in range(h):
      for r in range(rounds):
        order = np.argsort(buckets[bi, hi, r] * n + np.arange(n), kind="stable")
        chunk_of = np.empty(n, int)
        chunk_of[order] = np.arange(n) // chunk_len
        diff = chunk_of[:, None] - chunk_of[None, :]
        seen[bi, hi] |= (diff == 0) | (diff == 1)
  seen &= np.asarray(kv_mask)[:, None, None, :]
  if causal:
    seen &= np.tril(np.ones((n, n), bool))
  eye = np.eye(n, dtype=bool)
  others = seen & ~eye
  alone = eye & np.asarray(kv_mask)[:, None, None, :]
  return np.where(others.any(-1, keepdims=True), others, alone)


def oracle(q, v, allowed):
  """Dense softmax with keys = unit-normalised queries (shared QK), each query head its own keys."""
  keys = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
  return reference.dense_attention(q, keys, jnp.repeat(v, H // KVH, axis=2), allowed)


# Compiled once per module structure (a module is an argument, so equal configs share a compile).
@nnx.jit(static_argnames=("deterministic",))
def forward(attn, q, v, mask, deterministic=True):
  """-> output, and the evaluation-time buckets [b, h, r, n] (q's length must be a chunk
  multiple)."""
  out = attn(q, v, v, q_mask=mask, kv_mask=mask, deterministic=deterministic)
  return out, attn.hash_buckets(q, mask, attn.num_buckets(q.shape[1]), deterministic=True)


@nnx.jit
def forward_and_grads(attn, q, v, mask, ct):
  out, vjp = jax.vjp(lambda q, v: attn(q, v, v, q_mask=mask, kv_mask=mask), q, v)
  return out, vjp(ct), attn.hash_buckets(q, mask, attn.num_buckets(q.shape[1]), deterministic=True)


@jax.jit
def oracle_and_grads(q, v, mask, allowed, ct):
  out, vjp = jax.vjp(lambda q, v: jnp.where(mask[:, :, None, None], oracle(q, v, allowed), 0), q, v)
  return out, vjp(ct)


def check_against(attn, q, v, mask, allowed):
  """Forward and gradients (q, v) of the variant vs the dense oracle over `allowed` (f32, 1e-5).

  `allowed`: a pattern, or a function of the variant's evaluation-time buckets giving one."""
  ct = jax.random.normal(jax.random.key(7), q.shape)
  out, grads, buckets = forward_and_grads(attn, q, v, mask, ct)
  allowed = allowed(buckets) if callable(allowed) else allowed
  allowed = jnp.broadcast_to(jnp.asarray(allowed), (B, H) + allowed.shape[-2:])
  ref_out, ref_grads = oracle_and_grads(q, v, mask, allowed, ct)
  np.testing.assert_allclose(out, ref_out, atol=1e-5)
  for g, rg in zip(grads, ref_grads):
    np.testing.assert_allclose(g, rg, atol=1e-5)


@pytest.mark.slow
def test_one_bucket_one_chunk_equals_full_without_self():
  """A single bucket and one chunk covering the sequence: every real key but itself."""
  n = 12
  attn = make(chunk_len=n, n_buckets=1)
  q, v = qkv(n, seed=1)
  mask = padding(n)
  allowed = np.ones((B, 1, n, n), bool) & np.asarray(mask)[:, None, None, :]
  eye = np.eye(n, dtype=bool)
  others = allowed & ~eye
  allowed = np.where(others.any(-1, keepdims=True), others, eye & allowed)
  check_against(attn, q, v, mask, allowed)


def test_one_bucket_is_local_attention_on_position_chunks():
  """n_buckets=1 sorts by position: chunk c sees chunks c and c-1 (no wrap-around), minus self.
  (Padding at the end; a padded position in the middle would move the later real tokens up.)"""
  n, cl = 12, 4
  attn = make(chunk_len=cl, n_buckets=1)
  q, v = qkv(n, seed=2)
  mask = jnp.arange(n)[None, :] < jnp.array([[n], [n - 5]])
  block = np.arange(n) // cl
  local = ((block[:, None] - block[None, :]) >= 0) & ((block[:, None] - block[None, :]) <= 1)
  allowed = local & ~np.eye(n, dtype=bool) & np.asarray(mask)[:, None, None, :]
  check_against(attn, q, v, mask, allowed)


UNION_CASES = [(False, 2), (True, 3)]


@pytest.mark.parametrize("causal, n_hashes", [
    UNION_CASES[0], pytest.param(*UNION_CASES[1], marks=pytest.mark.slow)])
def test_equals_softmax_over_the_union_of_hashed_chunks(causal, n_hashes):
  """Random hashing, one or several rounds: equals dense softmax over the union of what each round
  shows (the duplicate correction counts every key once), with causal and padding masks."""
  n = 24
  attn = make(causal, chunk_len=4, n_buckets=4, n_hashes=n_hashes)
  q, v = qkv(n, seed=3)
  mask = padding(n)

  def allowed(buckets):
    pattern = union_pattern(buckets, 4, mask, causal)
    assert (pattern.sum(-1) < n // 2).any(), "the test should exercise a sparse pattern"
    return pattern

  check_against(attn, q, v, mask, allowed)


def test_without_duplicate_correction_a_key_counts_once_per_round():
  """duplicate_correction=False, scale=1 (HuggingFace's LSHSelfAttention: logits q·k̂, rounds
  combined by their log-sum-exp, no - log N_ij): softmax over the multiset of what the rounds
  show, Σ_j N_ij exp(s_ij) v_j / Σ_j N_ij exp(s_ij), in float64 from the evaluation buckets."""
  n, cl = 24, 4
  attn = make(chunk_len=cl, n_buckets=4, n_hashes=2, scale=1.0, duplicate_correction=False)
  q, v = qkv(n, seed=5)
  mask = padding(n)
  out, buckets = forward(attn, q, v, mask)
  counts = sum(union_pattern(buckets[:, :, r:r + 1], cl, mask, False).astype(np.float64)
               for r in range(2))                                          # N [b, h, n, n]
  assert (counts == 2).any() and (counts == 1).any()
  q64 = np.asarray(q, np.float64).transpose(0, 2, 1, 3)                    # [b, h, n, d]
  keys = q64 / np.linalg.norm(q64, axis=-1, keepdims=True)
  values = np.repeat(np.asarray(v, np.float64), H // KVH, axis=2).transpose(0, 2, 1, 3)
  scores = q64 @ keys.swapaxes(-1, -2)
  weights = counts * np.exp(scores - scores.max(-1, keepdims=True))
  expected = (weights @ values / weights.sum(-1, keepdims=True)).transpose(0, 2, 1, 3)
  real = np.asarray(mask)
  np.testing.assert_allclose(np.asarray(out)[real], expected[real], atol=1e-5)
  corrected = forward(make(chunk_len=cl, n_buckets=4, n_hashes=2, scale=1.0), q, v, mask)[0]
  assert float(jnp.abs(corrected - out).max()) > 1e-3


def test_fresh_evaluation_rotations_draw_at_every_call():
  """eval_rotations="fresh" (HuggingFace's hash_seed=None): evaluation calls hash anew."""
  n = 32
  q, v = qkv(n, seed=8)
  mask = jnp.ones((B, n), bool)
  attn = make(seed=3, chunk_len=4, eval_rotations="fresh")
  first, second = forward(attn, q, v, mask)[0], forward(attn, q, v, mask)[0]
  assert float(jnp.abs(first - second).max()) > 1e-3


@pytest.mark.slow
def test_causal_and_padding_under_random_hashing():
  """Several hash rounds: no dependence on future values, on padded tokens, or on appended
  padding."""
  n = 24
  q, v = qkv(n, seed=4)
  mask = padding(n)
  noise_q, noise_v = qkv(n, seed=5)

  def run(q, v, mask, causal):  # the configurations of the union tests (their compiles are reused)
    attn = make(causal, chunk_len=4, n_buckets=4, n_hashes=dict(UNION_CASES)[causal])
    return forward_and_grads(attn, q, v, mask, jnp.zeros_like(q))[0]

  full_mask = jnp.ones((B, n), bool)
  out = run(q, v, full_mask, True)
  future = jnp.arange(n)[None, :, None, None] >= 13
  changed = run(q, jnp.where(future, v + noise_v, v), full_mask, True)
  np.testing.assert_allclose(changed[:, :13], out[:, :13], atol=1e-6)
  assert float(jnp.abs(changed[:, 13:] - out[:, 13:]).max()) > 1e-3

  out = run(q, v, mask, False)
  pad = ~mask[:, :, None, None]
  changed = run(jnp.where(pad, q + 3 * noise_q, q), jnp.where(pad, v + 3 * noise_v, v), mask, False)
  np.testing.assert_allclose(changed, out, atol=1e-6)
  longer = lambda x, extra: jnp.concatenate([x, extra], axis=1)
  q2, v2 = qkv(8, seed=6)
  longer_mask = jnp.concatenate([mask, jnp.zeros((B, 8), bool)], axis=1)
  appended = run(longer(q, q2), longer(v, v2), longer_mask, False)
  np.testing.assert_allclose(appended[:, :n], out, atol=1e-6)


def captured_mass(allowed, q):
  """Share of the exact shared-QK softmax (self excluded) that falls on the attended keys."""
  keys = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, keys) * D ** -0.5
  others = ~np.eye(q.shape[1], dtype=bool)
  weights = reference.masked_softmax(scores, others)
  return float(jnp.mean(jnp.sum(jnp.where(allowed & others, weights, 0), -1)))


@pytest.mark.slow
def test_more_hashes_converge_to_full_attention():
  """More rounds: the union grows and the output (equal to softmax over that union) approaches
  exact shared-QK attention (self excluded)."""
  n = 32
  mask = jnp.ones((B, n), bool)
  dense = jax.jit(oracle)
  errors, sizes = [], []
  for n_hashes in (1, 4, 16):
    err = size = 0.0
    for seed in range(2):
      q, v = qkv(n, seed=seed, q_norm=2.0)
      attn = make(seed=seed, chunk_len=4, n_hashes=n_hashes)
      out, buckets = forward(attn, q, v, mask)
      union = union_pattern(buckets, 4, mask, False)
      np.testing.assert_allclose(out, dense(q, v, jnp.asarray(union)), atol=1e-5)
      not_self = jnp.broadcast_to(~np.eye(n, dtype=bool), union.shape)
      err += float(jnp.mean(jnp.abs(out - dense(q, v, not_self))))
      size += float(union.sum(-1).mean())
    errors.append(err)
    sizes.append(size)
  assert sizes[0] < sizes[1] < sizes[2], sizes
  assert errors[0] > errors[1] > errors[2], errors
  assert errors[2] < 0.25 * errors[0], errors


@pytest.mark.slow
def test_hashing_groups_similar_tokens():
  """With n_buckets = 2·n/chunk_len (the default) the chunks capture more of the exact softmax mass
  than chunks of positions (n_buckets=1) of the same size; the default bucket count is as
  documented."""
  n, cl = 32, 4
  assert make(chunk_len=cl).num_buckets(n) == 2 * n // cl
  assert make(chunk_len=cl).num_buckets(cl) == 2
  mask = jnp.ones((B, n), bool)
  mass = {None: 0.0, 1: 0.0}
  for seed in range(3):
    q, v = qkv(n, seed=seed, q_norm=5.0)
    for n_buckets in mass:
      buckets = forward(make(seed=seed, chunk_len=cl, n_buckets=n_buckets), q, v, mask)[1]
      mass[n_buckets] += captured_mass(union_pattern(buckets, cl, mask, False), q)
  assert mass[None] > 1.3 * mass[1], mass


@pytest.mark.slow
def test_num_chunks_cuts_the_sorted_order_into_that_many_chunks():
  """num_chunks=3: chunks of ceil(n / 3), the same attention as chunk_len = ceil(n / 3), and equal
  to dense softmax over the union of those chunks (the released LRA code cut into 10 chunks)."""
  n = 24
  attn = make(num_chunks=3, n_buckets=4, n_hashes=2)
  assert attn.chunk_length(n) == 8 and attn.chunk_length(22) == 8
  assert make(num_chunks=3).num_buckets(n) == 6                    # default: 2 per chunk
  q, v = qkv(n, seed=9)
  mask = padding(n)
  check_against(attn, q, v, mask, lambda buckets: union_pattern(buckets, 8, mask, False))
  q, v, mask = q[:, :22], v[:, :22], mask[:, :22]                  # 22 = 3 chunks of 8, padded
  run = nnx.jit(lambda m, q, v, mask: m(q, v, v, q_mask=mask, kv_mask=mask))
  by_length = make(chunk_len=8, n_buckets=4, n_hashes=2)
  np.testing.assert_allclose(run(attn, q, v, mask), run(by_length, q, v, mask), atol=1e-6)


def test_rotations_fixed_in_evaluation_fresh_in_training():
  n = 32
  q, v = qkv(n, seed=8)
  mask = jnp.ones((B, n), bool)
  attn = make(seed=3, chunk_len=4)
  first = forward(attn, q, v, mask)[0]
  np.testing.assert_array_equal(forward(attn, q, v, mask)[0], first)
  np.testing.assert_array_equal(forward(make(seed=3, chunk_len=4), q, v, mask)[0], first)
  train = [forward(attn, q, v, mask, deterministic=False)[0] for _ in range(2)]
  assert float(jnp.abs(train[0] - train[1]).max()) > 1e-3
  assert float(jnp.abs(train[0] - first).max()) > 1e-3
  assert isinstance(attn.rotation_key, nnx.Variable)
  assert not isinstance(attn.rotation_key, nnx.Param)
  assert not jax.tree.leaves(nnx.state(attn, nnx.Param))


def test_bad_options():
  for options, what in [(dict(n_buckets=3), "n_buckets"), (dict(n_buckets=0), "n_buckets"),
                        (dict(chunk_len=0), "chunk_len"), (dict(n_hashes=0), "n_hashes"),
                        (dict(num_chunks=0), "num_chunks"),
                        (dict(chunk_len=8, num_chunks=2), "not both"),
                        (dict(eval_rotations="random"), "eval_rotations"),
                        (dict(duplicate_correction=0), "duplicate_correction")]:
    with pytest.raises(ValueError, match=what):
      make(**options)
  q, v = qkv(8)
  with pytest.raises(ValueError, match="self-attention"):
    make()(q[:, :4], v, v)
