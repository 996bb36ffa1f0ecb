"""Positions (sinusoidal, RoPE, ALiBi) and the MultiHeadAttention layer."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attention_zoo import positions
from attention_zoo.layers import MultiHeadAttention


def test_sinusoidal_values():
  table = np.asarray(positions.sinusoidal(np.arange(4), 6))
  np.testing.assert_allclose(table[:, 0], np.sin(np.arange(4)), atol=1e-6)
  np.testing.assert_allclose(table[:, 1], np.cos(np.arange(4)), atol=1e-6)
  np.testing.assert_allclose(table[2, 4], np.sin(2 / 10000 ** (4 / 6)), atol=1e-6)


def test_rope_scores_depend_only_on_relative_position():
  kq, kk = jax.random.split(jax.random.key(0))
  q = jax.random.normal(kq, (1, 1, 1, 16))
  k = jax.random.normal(kk, (1, 1, 1, 16))
  score = lambda m, n: float(jnp.sum(positions.rope(q, jnp.array([m]))
                                     * positions.rope(k, jnp.array([n]))))
  assert score(5, 2) == pytest.approx(score(105, 102), abs=1e-4)
  assert score(5, 2) == pytest.approx(score(3, 0), abs=1e-4)
  assert abs(score(5, 2) - score(5, 4)) > 1e-3          # and it does depend on the offset
  # position 0: identity
  np.testing.assert_allclose(positions.rope(q, jnp.array([0])), q, atol=1e-6)


@pytest.mark.parametrize("num_heads, expected", [
    (8, [2.0 ** -(i + 1) for i in range(8)]),
    (6, [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3]),  # 4 of 2^(-2i), then odd ones of 8
    (1, [2 ** -8]),
])
def test_alibi_slopes(num_heads, expected):
  np.testing.assert_allclose(positions.alibi_slopes(num_heads), expected, rtol=1e-6)


def test_unknown_position_kind():
  with pytest.raises(ValueError, match="choose one of sinusoidal, learned, rope, alibi, none"):
    positions.check_kind("relative")


def _param_count(module):
  return sum(x.size for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


def test_gqa_and_mqa_shrink_the_kv_projections():
  counts = {kvh: _param_count(MultiHeadAttention(64, 8, num_kv_heads=kvh, rngs=nnx.Rngs(0)))
            for kvh in (8, 2, 1)}
  head_dim = 8
  # q and out: 2 · (64·64 + 64); k and v: 2 · (64·kvh·head_dim + kvh·head_dim)
  for kvh, count in counts.items():
    assert count == 2 * (64 * 64 + 64) + 2 * (64 * kvh * head_dim + kvh * head_dim)


@pytest.mark.parametrize("position_kind", ["rope", "alibi", "none"])
def test_one_token_decoding_equals_the_causal_forward(position_kind):
  mha = MultiHeadAttention(16, 4, num_kv_heads=2, causal=True, position_kind=position_kind,
                           rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 6, 16))
  full = mha(x)
  mha.init_cache(2, 9)
  step = nnx.jit(lambda m, x: m(x, decode=True))
  steps = jnp.concatenate([step(mha, x[:, t:t + 1]) for t in range(6)], axis=1)
  np.testing.assert_allclose(steps, full, atol=1e-5)


def test_alibi_needs_a_variant_that_accepts_a_bias(monkeypatch):
  from attention_zoo import registry
  import dataclasses
  full_cls = registry.get("full")
  monkeypatch.setattr(full_cls, "spec", dataclasses.replace(full_cls.spec, supports_alibi=False))
  with pytest.raises(ValueError, match="does not accept a score bias"):
    MultiHeadAttention(16, 4, position_kind="alibi", rngs=nnx.Rngs(0))


def test_cross_attention_shapes_and_masks():
  mha = MultiHeadAttention(16, 4, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(2), (2, 3, 16))
  context = jax.random.normal(jax.random.key(3), (2, 7, 16))
  context_mask = jnp.ones((2, 7), bool).at[:, 5:].set(False)
  out = mha(x, context, context_mask=context_mask)
  changed = mha(x, context.at[:, 5:].add(10.0), context_mask=context_mask)
  assert out.shape == (2, 3, 16)
  np.testing.assert_allclose(out, changed, atol=1e-6)


@pytest.mark.parametrize("position_kind", ["none", "rope"])
def test_decode_needs_a_cache(position_kind):
  mha = MultiHeadAttention(16, 4, causal=True, position_kind=position_kind, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="init_cache"):
    mha(jnp.zeros((1, 1, 16)), decode=True)
