"""Sparse Sinkhorn attention: hard sorts against dense oracles, and the learned sort at work."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attention_zoo import reference
from attention_zoo.variants.sinkhorn import sinkhorn
from helpers import create_variant, padding_mask, random_qkv

B, H, KVH, D, BS = 2, 4, 2, 8, 4


def make(causal=False, seed=0, **options):
  return create_variant("sinkhorn", num_heads=H, head_dim=D, num_kv_heads=KVH, causal=causal,
                        model_seed=seed, **{"block_size": BS, **options})


def qkv(n, seed=0):
  return random_qkv(seed, batch=B, q_len=n, num_heads=H, num_kv_heads=KVH, head_dim=D)


def padding(n):
  """Row 1: one padded position inside block 0, and its last block and a half padded."""
  return padding_mask(B, n, hole=1, tail=BS + 2)


def hard_sort(targets, n):
  """Permutation-like sort [1, 1, 1, nb, nb]: block i sorted onto block targets[i] (-1: none)."""
  nb = n // BS
  sort = np.zeros((nb, nb), np.float32)
  for i, j in enumerate(targets):
    if j >= 0:
      sort[i, j] = 1.0
  return jnp.asarray(sort)[None, None, None]


def block_pattern(targets, n, causal):
  """Own block (causal inside it if causal) ∪ the sorted block, as a dense [n, n] pattern."""
  block = np.arange(n) // BS
  allowed = block[:, None] == block[None, :]
  if causal:
    allowed &= np.tril(np.ones((n, n), bool))
  sorted_onto = np.asarray(targets)[block]
  return allowed | (block[None, :] == sorted_onto[:, None])


@nnx.jit
def sorted_and_grads(attn, q, k, v, sort, mask, ct):
  def f(q, k, v):
    out = attn.attend_sorted(q, k, v, sort, q_mask=mask, kv_mask=mask, deterministic=True)
    return jnp.where(mask[:, :, None, None], out, 0)
  out, vjp = jax.vjp(f, q, k, v)
  return out, vjp(ct)


@jax.jit
def oracle_and_grads(q, k, v, allowed, mask, ct):
  def f(q, k, v):
    allowed_all = allowed & mask[:, None, None, :]
    return jnp.where(mask[:, :, None, None], reference.dense_attention(q, k, v, allowed_all), 0)
  out, vjp = jax.vjp(f, q, k, v)
  return out, vjp(ct)


def check_hard_sort(causal, targets, n=24, seed=0):
  attn = make(causal)
  q, k, v = qkv(n, seed)
  mask = padding(n)
  ct = jax.random.normal(jax.random.key(seed + 100), q.shape)
  out, grads = sorted_and_grads(attn, q, k, v, hard_sort(targets, n), mask, ct)
  allowed = jnp.asarray(block_pattern(targets, n, causal))
  ref_out, ref_grads = oracle_and_grads(q, k, v, allowed, mask, ct)
  np.testing.assert_allclose(out, ref_out, atol=1e-5)
  for g, rg in zip(grads, ref_grads):
    np.testing.assert_allclose(g, rg, atol=1e-5)


def test_identity_sort_is_local_block_attention():
  """Sorted onto itself, each block attends to its own block twice over: the same softmax as
  attending to it once, i.e. local block attention."""
  check_hard_sort(False, targets=list(range(6)))


def test_hard_permutation_adds_the_sorted_block():
  check_hard_sort(False, targets=[3, 0, 5, 1, 2, 4], seed=1)


def test_causal_shift_sort_sees_own_block_causally_and_the_previous_block():
  check_hard_sort(True, targets=[-1, 0, 1, 2, 3, 4], seed=2)


@nnx.jit
def forward_and_sort(attn, q, k, v, mask):
  out = attn(q, k, v, q_mask=mask, kv_mask=mask)
  return out, attn.sort_matrix(q, k, q_mask=mask, kv_mask=mask)


def test_learned_sort_is_a_balanced_soft_permutation_far_from_identity():
  n = 32
  q, k, v = qkv(n, seed=3)
  mask = jnp.ones((B, n), bool)
  _, sort = forward_and_sort(make(), q, k, v, mask)
  nb = n // BS
  np.testing.assert_allclose(sort.sum(-2), 1.0, atol=1e-5)   # columns: the last normalisation
  np.testing.assert_allclose(sort.sum(-1), 1.0, atol=0.1)    # rows: balanced after 5 iterations
  assert float(jnp.mean(jnp.trace(sort, axis1=-2, axis2=-1))) / nb < 0.5


def routed_inputs(n, targets, seed):
  """Keys of block j point along e_j and the queries of block i along e_targets[i] (plus noise):
  a content-based sort with W_q = W_k = I sends block i onto block targets[i]."""
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  block = np.arange(n) // BS
  basis = 5.0 * jnp.eye(D)
  q = (basis[np.asarray(targets)[block]][None, :, None, :]
       + 0.3 * jax.random.normal(kq, (B, n, H, D)))
  k = basis[block][None, :, None, :] + 0.3 * jax.random.normal(kk, (B, n, KVH, D))
  return q, k, jax.random.normal(kv, (B, n, KVH, D))


def routed_oracle(q, k, v, targets, n):
  return reference.dense_attention(q, k, v, block_pattern(targets, n, causal=False))


def test_sorting_network_routes_blocks_and_its_parameters_choose_the_route():
  """The sorting network really permutes blocks: with content that routes block i to π(i) the
  output equals the dense oracle over own block ∪ block π(i); changing the sorting parameters
  (W_k ← a cyclic permutation of the key directions) sends block i to another block, and the
  output follows that oracle instead."""
  n, pi = 24, [3, 0, 5, 1, 2, 4]
  attn = make(seed=5)
  attn.sort_query[...] = jnp.broadcast_to(3.0 * jnp.eye(D), attn.sort_query.shape)
  attn.sort_key[...] = jnp.broadcast_to(3.0 * jnp.eye(D), attn.sort_key.shape)
  q, k, v = routed_inputs(n, pi, seed=5)
  mask = jnp.ones((B, n), bool)
  out, sort = forward_and_sort(attn, q, k, v, mask)
  np.testing.assert_allclose(sort, jnp.broadcast_to(hard_sort(pi, n), sort.shape), atol=1e-4)
  np.testing.assert_allclose(out, routed_oracle(q, k, v, pi, n), atol=1e-4)

  nb = n // BS
  cycle = np.eye(D)
  # e_j -> e_(j+1 mod nb): key block j looks like j+1
  cycle[:nb, :nb] = np.roll(np.eye(nb), 1, axis=1)
  attn.sort_key[...] = jnp.broadcast_to(3.0 * jnp.asarray(cycle, jnp.float32), attn.sort_key.shape)
  out2, sort2 = forward_and_sort(attn, q, k, v, mask)
  rerouted = [(t - 1) % nb for t in pi]                   # so block i now matches block π(i) - 1
  np.testing.assert_allclose(sort2, jnp.broadcast_to(hard_sort(rerouted, n), sort2.shape),
                             atol=1e-4)
  assert float(jnp.abs(out2 - out).max()) > 0.5
  np.testing.assert_allclose(out2, routed_oracle(q, k, v, rerouted, n), atol=1e-4)


@nnx.jit
def sort_gradients(attn, q, k, v):
  return nnx.grad(lambda m: jnp.sum(m(q, k, v) ** 2))(attn)


@pytest.mark.slow
def test_learned_sort_gets_gradients_and_changes_the_output():
  n = 24
  attn = make(seed=6)
  q, k, v = qkv(n, seed=6)
  mask = jnp.ones((B, n), bool)
  out, sort = forward_and_sort(attn, q, k, v, mask)
  identity = jnp.eye(n // BS)[None, None, None]
  local = nnx.jit(lambda m, q, k, v: m.attend_sorted(q, k, v, identity, q_mask=mask, kv_mask=mask,
                                                     deterministic=True))(attn, q, k, v)
  assert float(jnp.abs(out - local).max()) > 0.05       # the sorted block brings other blocks in
  grads = sort_gradients(attn, q, k, v)
  assert float(jnp.abs(grads.sort_query[...]).sum()) > 0
  assert float(jnp.abs(grads.sort_key[...]).sum()) > 0


def test_more_sinkhorn_iterations_balance_rows_and_columns():
  logits = jax.random.normal(jax.random.key(6), (3, 8, 8)) * 2.0
  valid = jnp.ones((1, 8, 8), bool)
  row_error = [float(jnp.abs(sinkhorn(logits, valid, iters, False).sum(-1) - 1).max())
               for iters in (1, 5, 50)]
  assert row_error[0] > row_error[1] > row_error[2] and row_error[2] < 1e-3, row_error


def test_causal_sort_uses_only_the_past():
  """Causal: the sort is strictly lower-triangular, and changing later tokens (queries, keys and
  values, including later positions of the same block) changes no earlier output."""
  n = 24
  attn = make(causal=True, seed=7)
  q, k, v = qkv(n, seed=7)
  mask = jnp.ones((B, n), bool)
  out, sort = forward_and_sort(attn, q, k, v, mask)
  assert float(jnp.abs(jnp.triu(sort)).max()) == 0.0
  assert float(jnp.tril(sort, -1).sum()) > 0
  cut = 10   # inside block 2
  later = jnp.arange(n)[None, :, None, None] >= cut
  noise = qkv(n, seed=8)
  changed = [jnp.where(later, x + 2 * e, x) for x, e in zip((q, k, v), noise)]
  out2, sort2 = forward_and_sort(attn, *changed, mask)
  np.testing.assert_allclose(out2[:, :cut], out[:, :cut], atol=1e-6)
  np.testing.assert_allclose(sort2[..., :cut // BS + 1, :], sort[..., :cut // BS + 1, :], atol=1e-6)
  assert float(jnp.abs(out2[:, cut:] - out[:, cut:]).max()) > 1e-3


@nnx.jit(static_argnames=("deterministic",))
def run(attn, q, k, v, mask, deterministic):
  return attn(q, k, v, q_mask=mask, kv_mask=mask, deterministic=deterministic)


def max_diff(a, b):
  return float(jnp.abs(a - b).max())


@pytest.mark.slow
def test_gumbel_noise_only_in_training():
  """Gumbel-Sinkhorn: evaluation is deterministic and the same with the noise switched off;
  each training call draws fresh noise (outputs differ from call to call and from evaluation);
  without the noise a training call equals evaluation (no dropout here)."""
  n = 24
  q, k, v = qkv(n, seed=9)
  mask = padding(n)
  noisy, plain = make(seed=9), make(seed=9, gumbel_noise=False)
  evaluation = run(noisy, q, k, v, mask, True)
  np.testing.assert_array_equal(run(noisy, q, k, v, mask, True), evaluation)
  np.testing.assert_array_equal(run(plain, q, k, v, mask, True), evaluation)
  train_a, train_b = run(noisy, q, k, v, mask, False), run(noisy, q, k, v, mask, False)
  assert max_diff(train_a, train_b) > 1e-3 and max_diff(train_a, evaluation) > 1e-3
  np.testing.assert_allclose(run(plain, q, k, v, mask, False), evaluation, atol=1e-6)
  noisy_sort = lambda: noisy.sort_matrix(q, k, q_mask=mask, kv_mask=mask, deterministic=False)
  assert max_diff(noisy_sort(), noisy_sort()) > 1e-2           # the noise reaches the sort


@pytest.mark.slow
def test_causal_sort_with_noise_uses_only_the_past():
  """Training noise is drawn per block pair, independently of the tokens: with the same draw
  (two modules from one seed), changing later tokens changes no earlier output."""
  n, cut = 24, 10
  q, k, v = qkv(n, seed=7)
  mask = jnp.ones((B, n), bool)
  later = jnp.arange(n)[None, :, None, None] >= cut
  changed = [jnp.where(later, x + 2 * e, x) for x, e in zip((q, k, v), qkv(n, seed=8))]
  out = run(make(causal=True, seed=7), q, k, v, mask, False)
  out2 = run(make(causal=True, seed=7), *changed, mask, False)
  np.testing.assert_allclose(out2[:, :cut], out[:, :cut], atol=1e-6)
  assert max_diff(out2[:, cut:], out[:, cut:]) > 1e-3
  assert max_diff(out, run(make(causal=True, seed=7), q, k, v, mask, True)) > 1e-3   # noise is on


def test_bad_options():
  for options, what in [(dict(block_size=0), "block_size"),
                        (dict(sinkhorn_iters=0), "sinkhorn_iters"),
                        (dict(temperature=0.0), "temperature"),
                        (dict(gumbel_noise=1), "gumbel_noise")]:
    with pytest.raises(ValueError, match=what):
      make(**options)
  q, k, v = qkv(8)
  with pytest.raises(ValueError, match="self-attention"):
    make()(q[:, :4], k, v)
