"""additive (Bahdanau) attention against a dense float64 oracle of its formula, output and
gradients (inputs and parameters), and its memory: no intermediate of L_q · L_k entries."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import largest_backward_array, create_variant, normal, random_qkv

HEADS, HEAD_DIM = 4, 8


def build(**options):
  return create_variant("additive", num_heads=HEADS, head_dim=HEAD_DIM, **options)


def oracle(params, q, k, v, q_mask, kv_mask, causal, slopes):
  """e_ij = vᵀ tanh(W_q q_i + W_k k_j) over [b, h, q, k, a] at once, float64 softmax over the
  allowed keys (0 for a row with none), masked queries zeroed."""
  q_len, kv_len = q.shape[1], k.shape[1]
  group = HEADS // k.shape[2]
  query_map, key_map, vector = (jnp.asarray(params[name], jnp.float64)
                                for name in ("query_map", "key_map", "score_vector"))
  q, k, v = (jnp.asarray(x, jnp.float64) for x in (q, k, v))
  pq = jnp.einsum("bqhd,hda->bhqa", q, query_map)
  pk = jnp.repeat(jnp.einsum("bkhd,hda->bhka", k, key_map), group, axis=1)
  scores = jnp.einsum("bhqka,ha->bhqk", jnp.tanh(pq[:, :, :, None] + pk[:, :, None]), vector)
  i, j = np.arange(q_len)[:, None] + kv_len - q_len, np.arange(kv_len)[None]
  if slopes is not None:
    scores = scores - jnp.asarray(slopes, jnp.float64)[:, None, None] * np.abs(i - j)
  allowed = np.asarray(kv_mask)[:, None, None, :] & ((j <= i) if causal else True)
  scores = jnp.where(allowed, scores, -jnp.inf)
  top = jax.lax.stop_gradient(jnp.max(jnp.where(allowed, scores, 0.0), axis=-1, keepdims=True))
  weights = jnp.where(allowed, jnp.exp(scores - top), 0.0)
  weights = weights / jnp.maximum(weights.sum(-1, keepdims=True), 1e-300)
  out = jnp.einsum("bhqk,bkhd->bqhd", weights, jnp.repeat(v, group, axis=2))
  return jnp.where(np.asarray(q_mask)[:, :, None, None], out, 0.0)


# q_len, kv_len, kv_heads, causal, alibi, block_size: lengths not multiples of the block
CASES = [(21, 21, 2, True, False, 8), (9, 26, 1, False, True, 8), (26, 11, 4, True, True, 4)]


@pytest.mark.parametrize("q_len, kv_len, kv_heads, causal, alibi, block", [
    CASES[0], *[pytest.param(*case, marks=pytest.mark.slow) for case in CASES[1:]]])
def test_equals_the_dense_oracle(q_len, kv_len, kv_heads, causal, alibi, block):
  attn = build(causal=causal, num_kv_heads=kv_heads, attention_dim=6, block_size=block)
  q, k, v = random_qkv(0, q_len=q_len, kv_len=kv_len, num_heads=HEADS, num_kv_heads=kv_heads,
                       head_dim=HEAD_DIM)
  q_mask = np.ones((2, q_len), bool)
  q_mask[1, -2:] = False
  kv_mask = np.ones((2, kv_len), bool)
  kv_mask[1, -4:] = False
  kv_mask[0, 1] = False
  slopes = jnp.linspace(0.5, 0.1, HEADS) if alibi else None
  cotangent = normal(3, q.shape)
  graph, params, rest = nnx.split(attn, nnx.Param, ...)

  def ours(params, q, k, v):
    return nnx.merge(graph, params, rest)(q, k, v, q_mask=q_mask, kv_mask=kv_mask,
                                          alibi_slopes=slopes)

  def theirs(params, q, k, v):
    plain = {name: params[name][...] for name in ("query_map", "key_map", "score_vector")}
    return oracle(plain, q, k, v, q_mask, kv_mask, causal, slopes)

  def out_and_grads(f, *args):
    out, back = jax.vjp(f, *args)
    return out, back(cotangent.astype(out.dtype))

  got, got_grads = jax.jit(out_and_grads, static_argnums=0)(ours, params, q, k, v)
  with jax.enable_x64(True):
    want, want_grads = jax.jit(out_and_grads, static_argnums=0)(theirs, params, q, k, v)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
  for path, g, w in zip(jax.tree_util.tree_leaves_with_path(got_grads),
                        jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    assert float(jnp.abs(w).max()) > 0
    np.testing.assert_allclose(g, w, atol=1e-5, rtol=0, err_msg=jax.tree_util.keystr(path[0]))


def test_no_intermediate_grows_with_both_lengths():
  """Forward and backward hold tiles of [rows, block, d_a], never [L_q, L_k, ...]: the largest
  intermediate is below L_q · L_k entries (d_a = 16)."""
  n = 512
  attn = build(causal=True, num_kv_heads=1, attention_dim=16, block_size=32)
  biggest = largest_backward_array(attn, n, HEADS, HEAD_DIM)
  assert biggest < n * n, f"an intermediate has {biggest} >= L_q · L_k = {n * n} entries"
