"""softpick against a float64 oracle written from the definition without any shift:
w_ij = ReLU(e^{z_ij} − 1) / (Σ_l |e^{z_il} − 1| + ε) over the real (and, causal, past) keys;
output and gradients in f32 within 1e-5, causal and not, with GQA/MQA, padding, cross lengths
(bottom-right) and blocks that do not divide the length; rows of very large and very negative
scores (the running shift); one-token decoding equals the forward; no n x n array. The contract
is the conformance suite's; linear compiled memory, test_scaling.py's."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (array_shapes, assert_attention_equals_float64, create_variant,
                     decode_token_by_token, normal, padding_mask, random_qkv)


def build(causal, num_kv_heads=2, **options):
  return create_variant("softpick", num_kv_heads=num_kv_heads, causal=causal, **options)


def oracle(q, k, v, kv_mask, *, causal, scale, eps=1e-6):
  """float64 [b, q_len, h, d] from the definition."""
  q, k, v = (jnp.asarray(x, jnp.float64) for x in (q, k, v))
  q_len, kv_len, group = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  lifted = jnp.expm1(jnp.einsum("bihd,bjhd->bhij", q, k) * scale)       # e^z − 1
  sees = kv_mask[:, None, None, :]
  if causal:
    sees = sees & (np.arange(kv_len)[None] <= np.arange(q_len)[:, None] + kv_len - q_len)
  denominator = jnp.where(sees, jnp.abs(lifted), 0).sum(-1, keepdims=True) + eps
  weights = jnp.where(sees, jnp.maximum(lifted, 0), 0) / denominator
  return jnp.einsum("bhij,bjhd->bihd", weights, v)


def assert_matches_oracle(causal, *, q_len=13, kv_len=None, num_kv_heads=2, padded=True, seed=0,
                          std=1.0, **options):
  kv_len = q_len if kv_len is None else kv_len
  attn = build(causal, num_kv_heads, block_q=4, block_k=3, **options)
  q, k, v = random_qkv(seed, q_len=q_len, kv_len=kv_len, num_kv_heads=num_kv_heads, std=std)
  kv_mask = padding_mask(2, kv_len, hole=5, tail=3) if padded else jnp.ones((2, kv_len), bool)
  cotangent = normal(seed + 7, q.shape)
  q_mask = kv_mask if q_len == kv_len else None      # padded query rows: zero output
  definition = dict(causal=causal, scale=attn.scale, **options)
  assert_attention_equals_float64(attn, lambda q, k, v: oracle(q, k, v, kv_mask, **definition),
                                  q, k, v, cotangent, q_mask, kv_mask)


@pytest.mark.parametrize("causal, num_kv_heads, padded", [
    (False, 2, True), (True, 2, True), pytest.param(True, 1, False, marks=pytest.mark.slow),
    pytest.param(False, 4, False, marks=pytest.mark.slow)])
def test_equals_the_definition_in_float64(causal, num_kv_heads, padded):
  assert_matches_oracle(causal, num_kv_heads=num_kv_heads, padded=padded)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_cross_lengths(causal):
  assert_matches_oracle(causal, q_len=5, kv_len=14, seed=2)


@pytest.mark.slow
def test_eps_is_in_the_units_of_the_definition():
  assert_matches_oracle(True, seed=3, eps=0.5)


@pytest.mark.parametrize("std", [0.05, pytest.param(6.0, marks=pytest.mark.slow)])
def test_scores_near_zero_and_far_beyond_the_f32_exponent(std):
  """std 0.05: e^z − 1 near 0, where a plain difference of exponentials loses digits; std 6:
  |z| up to ~100, e^z beyond f32 (the shift keeps every exponential <= 1)."""
  assert_matches_oracle(True, seed=4, std=std)


def test_a_row_of_very_negative_scores_and_a_row_that_sees_no_key():
  attn = build(False, block_q=4, block_k=3)
  q, k, v = random_qkv(5, q_len=7)
  q = q.at[0].set(-30 * jnp.abs(q[0]))
  k = jnp.abs(k) * 10                                                      # z << -88 in row 0
  mask = jnp.ones((2, 7), bool).at[1].set(False)
  out = attn(q, k, v, kv_mask=mask)
  grads = jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v, kv_mask=mask)), (0, 1, 2))(q, k, v)
  assert bool(jnp.all(jnp.isfinite(out))) and all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
  with jax.enable_x64(True):
    want = oracle(q, k, v, mask, causal=False, scale=attn.scale)
  np.testing.assert_allclose(out, want, atol=1e-6, rtol=0)
  assert float(jnp.abs(out[1]).max()) == 0.0


def test_one_token_decoding_equals_the_forward():
  attn = build(True, block_q=4, block_k=3)
  steps = 9
  q, k, v = random_qkv(6, q_len=steps)
  decoded, _ = decode_token_by_token(attn, q, k, v, attn.init_cache(2, steps + 2))
  np.testing.assert_allclose(decoded, attn(q, k, v), atol=1e-6, rtol=0)


@pytest.mark.parametrize("causal", [pytest.param(False, marks=pytest.mark.slow), True])
def test_no_n_by_n_array_forward_or_backward(causal):
  n = 96
  attn = build(causal, block_q=16, block_k=16)
  q, k, v = random_qkv(7, q_len=n)
  loss = lambda q, k, v: jnp.sum(attn(q, k, v) ** 2)
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
  assert not [s for s in array_shapes(jaxpr) if sum(d >= n for d in s) >= 2]
