"""Registry, base class and reference: the public contract every variant and plug-in relies on."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attention_zoo as az
from attention_zoo import reference, registry


def _qkv(b=2, q_len=6, kv_len=None, h=4, kvh=2, d=8, seed=0):
  kv_len = q_len if kv_len is None else kv_len
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kq, (b, q_len, h, d)), jax.random.normal(kk, (b, kv_len, kvh, d)),
          jax.random.normal(kv, (b, kv_len, kvh, d)))


@pytest.fixture
def scratch_registry():
  """Lets a test register variants and removes them afterwards."""
  before = dict(registry._REGISTRY)
  yield
  registry._REGISTRY.clear()
  registry._REGISTRY.update(before)


def test_available_is_sorted_and_has_full():
  names = az.available()
  assert list(names) == sorted(names) and "full" in names


def test_unknown_name_lists_available():
  with pytest.raises(ValueError, match="unknown attention 'nope'.*full"):
    az.create("nope", num_heads=2, head_dim=4, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="available: .*full"):
    az.spec("nope")


def test_unknown_option_names_it_and_the_accepted_ones():
  with pytest.raises(ValueError, match=r"unknown option\(s\) bogus; accepted: dropout_rate=0.0, impl='xla', scale=None"):
    az.create("full", num_heads=2, head_dim=4, rngs=nnx.Rngs(0), bogus=3)


def test_spec_fields():
  spec = az.spec("full")
  assert spec.exact and spec.supports_causal and spec.supports_cross and spec.can_decode
  assert spec.options == {"scale": None, "dropout_rate": 0.0, "impl": "xla"}
  assert "Vaswani" in spec.paper and spec.complexity == "O(n²)"


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_heads=6, num_kv_heads=4), "multiple of num_kv_heads"),
    (dict(num_heads=0), "positive"),
    (dict(num_heads=2, dropout_rate=1.0), "dropout_rate"),
])
def test_bad_construction(kwargs, message):
  with pytest.raises(ValueError, match=message):
    az.create("full", head_dim=4, rngs=nnx.Rngs(0), **kwargs)


def test_bad_call_shapes_are_named():
  attn = az.create("full", num_heads=4, head_dim=8, num_kv_heads=2, rngs=nnx.Rngs(0))
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="expected q"):
    attn(q, k[:, :, :1], v)
  with pytest.raises(ValueError, match=r"kv_mask must be bool \[batch, len\]"):
    attn(q, k, v, kv_mask=jnp.ones((2, 5), bool))
  with pytest.raises(ValueError, match=r"\[batch, len, heads, head_dim\]"):
    attn(q[0], k, v)


def test_cudnn_needs_a_gpu():
  if jax.default_backend() == "gpu":
    pytest.skip("a GPU is present")
  with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
    az.create("full", num_heads=2, head_dim=4, rngs=nnx.Rngs(0), impl="cudnn")


def test_register_rejects_non_attention_and_duplicates(scratch_registry):
  with pytest.raises(TypeError, match="subclass of attention_zoo.Attention"):
    az.register("thing", exact=False, supports_causal=False, supports_cross=False, complexity="", paper="")(object)

  class Other(az.Attention):
    pass

  with pytest.raises(ValueError, match="already registered"):
    az.register("full", exact=False, supports_causal=False, supports_cross=False, complexity="", paper="")(Other)


def test_unregistered_subclass_is_refused():
  class Loose(az.Attention):
    pass

  with pytest.raises(TypeError, match="not registered"):
    Loose(num_heads=1, head_dim=2, rngs=nnx.Rngs(0))


def test_plugin_variant_follows_the_contract(scratch_registry):
  """The extension contract (README: Adding a variant), used as a plug-in would use it."""
  @az.register("plain", exact=True, supports_causal=True, supports_cross=True, complexity="O(n^2)", paper="-")
  class Plain(az.Attention):
    OPTIONS = {"temperature": 1.0}

    def attend(self, q, k, v, *, q_mask, kv_mask, deterministic):
      return az.reference.masked_softmax_attention(
          q, k, v, q_mask=q_mask, kv_mask=kv_mask, causal=self.causal,
          scale=self.scale / self.options["temperature"])

    def pattern(self, q_len, kv_len):
      return np.ones((1, q_len, kv_len), bool)

  assert "plain" in az.available() and az.spec("plain").options["temperature"] == 1.0
  attn = az.create("plain", num_heads=4, head_dim=8, num_kv_heads=2, rngs=nnx.Rngs(0), temperature=2.0)
  q, k, v = _qkv()
  q_mask = jnp.ones((2, 6), bool).at[1, 2].set(False)
  out = attn(q, k, v, q_mask=q_mask)
  assert float(jnp.abs(out[1, 2]).max()) == 0.0        # the base zeroes masked query rows
  expected = reference.dense_attention(q, k, v, True, scale=8 ** -0.5 / 2)
  np.testing.assert_allclose(out[0], expected[0], atol=1e-5)


def test_dense_attention_rows_without_keys_are_zero_with_finite_gradients():
  q, k, v = _qkv()
  allowed = jnp.ones((2, 1, 6, 6), bool).at[1].set(False)

  def loss(q, k, v):
    return reference.dense_attention(q, k, v, allowed).sum()

  out = reference.dense_attention(q, k, v, allowed)
  grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  assert float(jnp.abs(out[1]).max()) == 0.0
  assert all(bool(jnp.isfinite(g).all()) for g in grads)


def test_masked_softmax_attention_matches_dense_oracle():
  q, k, v = _qkv(q_len=5, kv_len=9)
  kv_mask = jnp.ones((2, 9), bool).at[0, 7:].set(False)
  out = reference.masked_softmax_attention(q, k, v, kv_mask=kv_mask, causal=True)
  allowed = reference.causal_allowed(jnp.arange(5)[:, None], jnp.arange(9)[None, :], 5, 9) & kv_mask[:, None, None, :]
  np.testing.assert_allclose(out, reference.dense_attention(q, k, v, allowed), atol=1e-5)


def test_causal_alignment_is_bottom_right():
  allowed = np.asarray(reference.causal_allowed(np.arange(2)[:, None], np.arange(5)[None, :], 2, 5))
  np.testing.assert_array_equal(allowed, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
