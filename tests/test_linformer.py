"""Oracles for `linformer`: identity projections with k = n give full attention; the rest of its
contract (padding zeroed before the projection, slicing, refusals; long inputs and memory: test_scaling.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attention_zoo as az
from attention_zoo import reference
from attention_zoo.conformance import apply


def make_inputs(seed, *, batch=2, q_len=12, kv_len=12, num_heads=4, num_kv_heads=2, head_dim=8):
  rng = np.random.default_rng(seed)
  draw = lambda length, heads: jnp.asarray(rng.standard_normal((batch, length, heads, head_dim)), jnp.float32)
  return draw(q_len, num_heads), draw(kv_len, num_kv_heads), draw(kv_len, num_kv_heads)


def build(*, max_len=12, seed=0, **options):
  return az.create("linformer", num_heads=4, head_dim=8, num_kv_heads=2, max_len=max_len,
                   rngs=nnx.Rngs(seed), **options)


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("share", ["none", "kv"])
def test_identity_projections_with_k_equal_n_give_full_attention(share):
  """E = F = I (k = n = max_len): softmax(Q Kᵀ s) V exactly, output and gradients, with GQA."""
  n = 12
  attn = build(max_len=n, k=n, share=share)
  attn.key_projection[...] = jnp.eye(n)
  if share == "none":
    attn.value_projection[...] = jnp.eye(n)
  full = az.create("full", num_heads=4, head_dim=8, num_kv_heads=2, rngs=nnx.Rngs(0))
  q, k, v = make_inputs(0, q_len=n, kv_len=n)
  cotangent = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)

  @jax.jit
  def output_and_grads(q, k, v):
    results = []
    for module in (attn, full):
      fn = lambda q, k, v: module(q, k, v)
      grads = jax.grad(lambda *x: jnp.sum(fn(*x) * cotangent), argnums=(0, 1, 2))(q, k, v)
      results.append((fn(q, k, v), *grads))
    return results

  got, expected = output_and_grads(q, k, v)
  for g, e in zip(got, expected):   # output, dq, dk, dv
    assert rel_err(g, e) < 1e-5


def test_padding_is_zeroed_before_the_projection():
  """Linformer attends over the k projections of the zero-padded K and V, written out here."""
  attn = build(max_len=16, k=5, share="none")
  q, k, v = make_inputs(2, q_len=7, kv_len=12)                   # cross-attention, kv_len < max_len
  kv_mask = np.ones((2, 12), bool)
  kv_mask[1, 8:] = kv_mask[1, 3] = False
  e = np.asarray(attn.key_projection[...])[:12]                   # the first kv_len rows
  f = np.asarray(attn.value_projection[...])[:12]
  real = kv_mask[:, :, None, None]
  k_proj = np.einsum("bnhd,nr->brhd", np.where(real, k, 0), e)   # [b, k, kvh, d]
  v_proj = np.einsum("bnhd,nr->brhd", np.where(real, v, 0), f)
  expected = reference.dense_attention(q, jnp.asarray(k_proj), jnp.asarray(v_proj), True)
  assert rel_err(apply(attn, q, k, v, kv_mask=jnp.asarray(kv_mask)), expected) < 1e-5


def test_share_kv_uses_one_matrix():
  shared, separate = build(k=4, share="kv"), build(k=4, share="none")
  count = lambda m: sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
  assert count(shared) == 12 * 4 and count(separate) == 2 * 12 * 4


def test_refusals():
  with pytest.raises(ValueError, match="future"):
    az.create("linformer", num_heads=4, head_dim=8, causal=True, max_len=12, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="max_len"):
    az.create("linformer", num_heads=4, head_dim=8, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="share"):
    build(share="layer")
  with pytest.raises(ValueError, match="positive int"):
    build(k=0)
  q, k, v = make_inputs(3, q_len=4, kv_len=13)
  with pytest.raises(ValueError, match="exceeds max_len 12"):
    build(k=4)(q, k, v)
