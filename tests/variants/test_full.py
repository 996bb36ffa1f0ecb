"""`full` against jax.nn.dot_product_attention (an implementation we did not write)."""
import unittest.mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attention_zoo as az
from attention_zoo import reference
from attention_zoo.ops import softmax
from attention_zoo.variants import full


@pytest.mark.parametrize("q_len, kv_len, num_kv_heads, causal", [
    (7, 7, 4, False), pytest.param(16, 16, 2, True, marks=pytest.mark.slow),
    pytest.param(3, 11, 1, True, marks=pytest.mark.slow),
    pytest.param(3, 11, 2, False, marks=pytest.mark.slow), (1, 9, 4, True)])
def test_full_equals_jax_dot_product_attention(q_len, kv_len, num_kv_heads, causal):
  kq, kk, kv = jax.random.split(jax.random.key(q_len * 31 + kv_len), 3)
  q = jax.random.normal(kq, (2, q_len, 4, 16))
  k = jax.random.normal(kk, (2, kv_len, num_kv_heads, 16))
  v = jax.random.normal(kv, (2, kv_len, num_kv_heads, 16))
  kv_mask = jnp.ones((2, kv_len), bool).at[1, -2:].set(False)
  attn = az.create("full", num_heads=4, head_dim=16, num_kv_heads=num_kv_heads, causal=causal,
                   rngs=nnx.Rngs(0))
  mask = kv_mask[:, None, None, :]
  if causal:   # jax's is_causal is top-left aligned; spell out our bottom-right rule as a mask
    mask = mask & reference.causal_allowed(jnp.arange(q_len)[:, None], jnp.arange(kv_len)[None],
                                           q_len, kv_len)

  def ours(q, k, v):
    return attn(q, k, v, kv_mask=kv_mask)

  def theirs(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")

  cotangent = jax.random.normal(jax.random.key(7), q.shape)
  out, grads = _forward_and_grads(ours, q, k, v, cotangent)
  expected, expected_grads = _forward_and_grads(theirs, q, k, v, cotangent)
  np.testing.assert_allclose(out, expected, atol=1e-5)
  for g, eg in zip(grads, expected_grads):
    np.testing.assert_allclose(g, eg, atol=1e-5)


def _forward_and_grads(fn, q, k, v, cotangent):
  @jax.jit
  def run(q, k, v):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(cotangent)
  return run(q, k, v)


@pytest.mark.slow
def test_full_scale_option():
  q = jax.random.normal(jax.random.key(0), (1, 5, 2, 8))
  attn = az.create("full", num_heads=2, head_dim=8, rngs=nnx.Rngs(0), scale=0.3)
  np.testing.assert_allclose(attn(q, q, q), jax.nn.dot_product_attention(q, q, q, scale=0.3),
                             atol=1e-5)


def test_full_gqa_does_not_repeat_kv():
  """The grouped einsum reads each K/V head once: no [b, kv_len, num_heads, d] copy of K or V."""
  attn = az.create("full", num_heads=8, head_dim=16, num_kv_heads=1, rngs=nnx.Rngs(0))
  q, kv = jnp.zeros((1, 32, 8, 16)), jnp.zeros((1, 64, 1, 16))
  jaxpr = jax.make_jaxpr(lambda q, k, v: attn(q, k, v))(q, kv, kv).jaxpr
  shapes = {tuple(var.aval.shape) for eqn in jaxpr.eqns for var in eqn.outvars}
  assert (1, 64, 8, 16) not in shapes and (1, 64, 1, 8, 16) not in shapes


@pytest.mark.slow
def test_full_dropout_gradients_equal_autodiff_of_its_forward():
  """The hand-written backward (custom VJP) against JAX's autodiff of the same forward, with
  dropout, GQA, padding (one row with no key), causal cross-attention and ALiBi."""
  q_len, kv_len = 6, 11
  kq, kk, kv, kc = jax.random.split(jax.random.key(3), 4)
  q = jax.random.normal(kq, (2, q_len, 4, 8))
  k = jax.random.normal(kk, (2, kv_len, 2, 8))
  v = jax.random.normal(kv, (2, kv_len, 2, 8))
  kv_mask = jnp.ones((2, kv_len), bool).at[0, 3:].set(False)   # row 0's first queries see no key
  options = dict(kv_mask=kv_mask, causal=True, alibi_slopes=jnp.array([0.5, 0.25, 0.1, 0.05]),
                 dropout_rate=0.3, dropout_rng=jax.random.key(9))

  def by_autodiff(q, k, v):   # the same forward, differentiated by JAX instead of the custom VJP
    with unittest.mock.patch.object(softmax, "_dense_attention",
                                    lambda *args: softmax._dense_forward(*args)[0]):
      return reference.masked_softmax_attention(q, k, v, **options)

  cotangent = jax.random.normal(kc, q.shape)
  ours = lambda q, k, v: reference.masked_softmax_attention(q, k, v, **options)
  out, grads = _forward_and_grads(ours, q, k, v, cotangent)
  expected, expected_grads = _forward_and_grads(by_autodiff, q, k, v, cotangent)
  no_dropout = reference.masked_softmax_attention(q, k, v, **{**options, "dropout_rng": None})
  assert float(jnp.max(jnp.abs(out - no_dropout))) > 1e-2          # dropout did drop weights
  np.testing.assert_allclose(out, expected, atol=1e-6)
  for g, eg in zip(grads, expected_grads):
    assert bool(jnp.all(jnp.isfinite(g)))
    np.testing.assert_allclose(g, eg, atol=1e-5)


def test_full_compiled_memory_at_most_jax_dense_attention():
  """Forward+backward temp memory (compiled, not run) at most jax.nn.dot_product_attention's."""
  q = jnp.zeros((1, 512, 4, 64))
  attn = az.create("full", num_heads=4, head_dim=64, rngs=nnx.Rngs(0))

  def temp_bytes(fn):
    run = lambda q, k, v: jax.vjp(fn, q, k, v)[1](q)
    return jax.jit(run).lower(q, q, q).compile().memory_analysis().temp_size_in_bytes

  ours = temp_bytes(lambda q, k, v: attn(q, k, v))
  theirs = temp_bytes(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla"))
  assert ours <= theirs, (ours, theirs)


@pytest.mark.parametrize("dtype, head_dim, q_len, causal, dropout, picks", [
    (jnp.bfloat16, 64, 8, True, False, True),
    (jnp.float16, 128, 4, False, False, True),
    (jnp.float32, 64, 8, False, False, False),     # cuDNN would round f32 to bf16
    (jnp.bfloat16, 64, 8, False, True, False),     # attention dropout
    (jnp.bfloat16, 64, 4, True, False, False),     # causal cross-attention: cuDNN aligns top-left
    (jnp.bfloat16, 256, 8, False, False, False),   # head_dim over 128
    (jnp.bfloat16, 12, 8, False, False, False),    # head_dim not a multiple of 8
])
def test_auto_takes_cudnn_only_where_it_computes_the_call_as_given(dtype, head_dim, q_len, causal,
                                                                   dropout, picks):
  q, k = jnp.zeros((1, q_len, 2, head_dim), dtype), jnp.zeros((1, 8, 2, head_dim), dtype)
  assert full.auto_picks_cudnn(q, k, causal=causal, dropout=dropout, backend="gpu") is picks
  assert not full.auto_picks_cudnn(q, k, causal=causal, dropout=dropout, backend="cpu")


def test_auto_routes_forward_mode_to_xla_and_cudnn_refuses_it(monkeypatch):
  """JAX's cuDNN attention is a custom VJP, which JAX refuses in forward mode: under jax.jvp
  impl='auto' takes the xla path even for bf16 on a GPU, and impl='cudnn' says why it cannot."""
  attn = az.create("full", num_heads=2, head_dim=8, rngs=nnx.Rngs(0))
  routed = []
  monkeypatch.setattr(full.FullAttention, "_cudnn", lambda self, q, *args: routed.append(q) or q)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  q = jax.random.normal(jax.random.key(0), (1, 8, 2, 8), jnp.bfloat16)
  _, tangent = jax.jvp(lambda q: attn(q, q, q), (q,), (q,))
  assert not routed and bool(jnp.any(tangent != 0))
  reason = full.cudnn_refusal(q, q, causal=False, dropout=False, forward_mode=True)
  assert "forward mode" in reason and "impl='xla'" in reason


def test_auto_routes_a_gpu_call_by_its_dtype(monkeypatch):
  attn = az.create("full", num_heads=2, head_dim=8, rngs=nnx.Rngs(0))
  routed = []
  monkeypatch.setattr(full.FullAttention, "_cudnn", lambda self, q, *args: routed.append(q) or q)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  q = jax.random.normal(jax.random.key(0), (1, 8, 2, 8))
  attn(q.astype(jnp.bfloat16), q.astype(jnp.bfloat16), q.astype(jnp.bfloat16))
  assert len(routed) == 1
  np.testing.assert_array_equal(attn(q, q, q), az.create(
      "full", num_heads=2, head_dim=8, rngs=nnx.Rngs(0), impl="xla")(q, q, q))
  assert len(routed) == 1                                            # f32 stayed on "xla"
