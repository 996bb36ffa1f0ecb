"""stick_breaking against a float64 oracle written from the definition as a product (no logs):
A_ij = β_ij ∏_{j<l<i'} (1 − β_il) over the real keys, the stick left going to the query's own
value; output and gradients in f32 within 1e-5, with GQA/MQA, padding, the diagonal option,
cross lengths (bottom-right) and blocks that do not divide the length. Also: left padding
changes nothing, one-token decoding equals the forward, causal=False is refused, and no n x n
array is formed. The contract is the conformance suite's; linear compiled memory,
test_scaling.py's."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (array_shapes, assert_attention_equals_float64, create_variant,
                     decode_token_by_token, normal, padding_mask, random_qkv)


def build(num_kv_heads=2, **options):
  return create_variant("stick_breaking", num_kv_heads=num_kv_heads, causal=True, **options)


def oracle(q, k, v, kv_mask, *, attend_current=False, remainder="current"):
  """float64 [b, q_len, h, d] from the definition, query by query in one dense product."""
  q, k, v = (jnp.asarray(x, jnp.float64) for x in (q, k, v))
  q_len, kv_len, group = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  beta = jax.nn.sigmoid(jnp.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(q.shape[-1]))
  own = np.arange(q_len)[:, None] + kv_len - q_len                       # i', [q, 1]
  keys = np.arange(kv_len)
  sees = (keys[None] <= own) if attend_current else (keys[None] < own)   # [q, kv]
  sees = jnp.asarray(sees)[None, None] & kv_mask[:, None, None, :]        # [b, 1, q, kv]
  # between[i, j, l]: l breaks the stick before j does (j < l, l seen by i)
  between = (keys[None, :, None] < keys[None, None, :]) & sees[..., None, :]
  keep = jnp.where(between, 1 - beta[..., None, :], 1.0).prod(axis=-1)   # [b, h, q, kv]
  weights = jnp.where(sees, beta * keep, 0.0)
  out = jnp.einsum("bhij,bjhd->bihd", weights, v)
  if remainder == "current":
    left = 1 - weights.sum(-1)                                            # [b, h, q]
    own_v = jnp.where(kv_mask[:, kv_len - q_len:, None, None], v[:, kv_len - q_len:], 0)
    out = out + left.transpose(0, 2, 1)[..., None] * own_v
  return out


def assert_matches_oracle(*, q_len=13, kv_len=None, num_kv_heads=2, padded=True, seed=0,
                          **options):
  kv_len = q_len if kv_len is None else kv_len
  attn = build(num_kv_heads, block_q=4, block_k=3, **options)
  q, k, v = random_qkv(seed, q_len=q_len, kv_len=kv_len, num_kv_heads=num_kv_heads)
  kv_mask = padding_mask(2, kv_len, hole=5, tail=3) if padded else jnp.ones((2, kv_len), bool)
  cotangent = normal(seed + 7, q.shape)
  q_mask = kv_mask if q_len == kv_len else None      # padded query rows: zero output
  definition = {name: options[name] for name in ("attend_current", "remainder") if name in options}
  assert_attention_equals_float64(attn, lambda q, k, v: oracle(q, k, v, kv_mask, **definition),
                                  q, k, v, cotangent, q_mask, kv_mask, relative=False)


@pytest.mark.parametrize("num_kv_heads, padded", [
    (2, True), pytest.param(1, False, marks=pytest.mark.slow),
    pytest.param(4, True, marks=pytest.mark.slow)])
def test_equals_the_definition_in_float64(num_kv_heads, padded):
  assert_matches_oracle(num_kv_heads=num_kv_heads, padded=padded)


@pytest.mark.parametrize("options", [
    dict(attend_current=True), pytest.param(dict(remainder="none"), marks=pytest.mark.slow),
    pytest.param(dict(attend_current=True, remainder="none"), marks=pytest.mark.slow)])
def test_options_equal_their_definition(options):
  assert_matches_oracle(seed=1, **options)


@pytest.mark.slow
def test_cross_lengths_are_bottom_right_aligned():
  assert_matches_oracle(q_len=5, kv_len=14, seed=2)


@pytest.mark.slow
def test_left_padding_breaks_no_stick():
  attn = build(block_q=4, block_k=3)
  q, k, v = random_qkv(3, q_len=10)
  extra = random_qkv(4, q_len=3)
  padded = [jnp.concatenate([e, x], axis=1) for x, e in zip((q, k, v), extra)]
  mask = jnp.arange(13)[None].repeat(2, 0) >= 3
  np.testing.assert_allclose(attn(*padded, q_mask=mask, kv_mask=mask)[:, 3:], attn(q, k, v),
                             atol=1e-6, rtol=0)


def test_one_token_decoding_equals_the_forward():
  attn = build(block_q=4, block_k=3)
  steps = 9
  q, k, v = random_qkv(5, q_len=steps)
  decoded, _ = decode_token_by_token(attn, q, k, v, attn.init_cache(2, steps + 2))
  np.testing.assert_allclose(decoded, attn(q, k, v), atol=1e-6, rtol=0)


def test_refuses_causal_false_naming_causal():
  with pytest.raises(ValueError, match="stick_breaking is causal only .*causal=True.*backwards"):
    create_variant("stick_breaking", causal=False)


def test_no_n_by_n_array_forward_or_backward():
  n = 96
  attn = build(block_q=16, block_k=16)
  q, k, v = random_qkv(6, q_len=n)
  loss = lambda q, k, v: jnp.sum(attn(q, k, v) ** 2)
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
  assert not [s for s in array_shapes(jaxpr) if sum(d >= n for d in s) >= 2]
