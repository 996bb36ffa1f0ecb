"""The delta-rule mixers (deltanet, gated_deltanet, kda, gated_deltaproduct, gated_deltanet2,
comba) beyond the
registry-wide tests: output and gradients against the same layer with its recurrence replaced
by the paper's, token by token in float64, on the layer's own q, k, v, gates and β (GQA and a
padded row included); decoding one token at a time against the chunked forward, step by step;
allow_neg_eigval; the models on the new names. Each layer against an oracle rebuilt from its
parameters: tests/mixers/test_mixers.py; the contract: tests/testing/test_conformance.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attention_zoo as az
from attention_zoo.mixers import parts
from attention_zoo.models import Decoder, DecoderLM, TransformerConfig
from helpers import assert_decoding_equals_forward
from attention_zoo import ops
from ops_reference import (assert_close, comba_recurrence, delta_product_recurrence,
                           gated_delta_rule2_recurrence, recurrence)
from test_mixers import OPTIONS, ORACLES

DELTA_MIXERS = ["deltanet", "gated_deltanet", "kda", "gated_deltaproduct", "gated_deltanet2",
                "comba"]


def build(name, **options):
  return az.create_mixer(name, emb_dim=16, num_heads=2, num_kv_heads=1, causal=True,
                         rngs=nnx.Rngs(1), **OPTIONS[name], **options)


def inputs(length=9):
  """x [2, length, 16], its mask (the second row's last 3 tokens padded) and weights w like x
  (the loss Σ y·w): float32 whatever the x64 setting."""
  x, w = jax.random.normal(jax.random.key(2), (2, 2, length, 16), jnp.float32)
  mask = jnp.arange(length)[None] < jnp.array([[length], [length - 3]])
  return x, mask, w


def float64_rule(seen):
  """A stand-in for the layer's op `chunk_op` (both forms): the recurrence token by token in
  float64 (tests/ops_reference.py), recording the β (Gated DeltaNet-2: the erase gate) it is
  given in `seen`."""
  def rule(chunk_op, q, k, v, *gates, scale=None, initial_state=None, mask=None,
           chunk_size=None, segment_ids=None):
    if initial_state is None:
      initial_state = jnp.zeros(q.shape[:1] + q.shape[2:] + v.shape[-1:])
    kw = dict(scale=scale or q.shape[-1] ** -0.5, initial_state=initial_state, mask=mask)
    if chunk_op is ops.chunk_gated_delta_rule2:                 # g, b, w
      seen.append(gates[1])
      o, state = gated_delta_rule2_recurrence(q, k, v, *gates, **kw)
    elif chunk_op is ops.chunk_comba:                           # p, g, β
      seen.append(gates[2])
      o, state = comba_recurrence(q, k, v, *gates, **kw)
    else:
      *g, beta = gates
      seen.append(beta)
      step = delta_product_recurrence if k.ndim == 5 else recurrence
      o, state = step(q, k, v, g[0] if g else None, beta, **kw)
    return o.astype(jnp.float32), state.astype(jnp.float32)
  return rule


def output_and_grads(mixer, x, mask, w):
  """y, then the gradients of Σ y·w in x and in every parameter, as (path, array) pairs."""
  loss = lambda mixer, x: jnp.sum(mixer(x, mask=mask) * w)
  y = mixer(x, mask=mask)
  grads, dx = nnx.grad(loss, argnums=(0, 1))(mixer, x)
  flat, _ = jax.tree_util.tree_flatten_with_path(nnx.state(grads, nnx.Param))
  return y, [("x", dx)] + [(jax.tree_util.keystr(path), g) for path, g in flat]


@pytest.mark.slow   # the fast lane has test_mixers.py's float64 oracle of each layer
@pytest.mark.parametrize("allow_neg_eigval", [False, True])
@pytest.mark.parametrize("name", DELTA_MIXERS)
def test_output_and_gradients_equal_the_float64_recurrence(name, allow_neg_eigval, monkeypatch):
  mixer = build(name, allow_neg_eigval=allow_neg_eigval)
  x, mask, w = inputs()
  y, grads = output_and_grads(mixer, x, mask, w)
  seen = []
  rule = float64_rule(seen)
  monkeypatch.setattr(parts, "recurrence",                 # both forms: the float64 rule
                      lambda chunk_op, step_op, *inputs, state, **kw: rule(
                          chunk_op, *inputs, initial_state=state, **kw))
  with jax.enable_x64(True):
    y64, grads64 = output_and_grads(mixer, x, mask, w)
  assert_close(y, y64, 1e-5, "output")                         # measured: errors below 4e-7
  assert [path for path, _ in grads] == [path for path, _ in grads64]
  for (path, got), (_, want) in zip(grads, grads64):
    assert_close(got, want, 1e-5, f"d {path}")
  beta = np.asarray(seen[0])                                   # from the forward
  if allow_neg_eigval:   # 2σ: in (0, 2), above 1 for some tokens
    assert 0 < beta.min() and beta.max() < 2 and beta.max() > 1.2
  else:
    assert 0 < beta.min() and beta.max() < 1


@pytest.mark.parametrize("name", DELTA_MIXERS)
def test_allow_neg_eigval_equals_its_equation(name):
  """β = 2σ(w_βᵀ x) in the oracle rebuilt from the parameters (tests/mixers/test_mixers.py)."""
  mixer = az.create_mixer(name, emb_dim=16, num_heads=2, causal=True, rngs=nnx.Rngs(1),
                          allow_neg_eigval=True, **OPTIONS[name])
  x = jax.random.normal(jax.random.key(2), (1, 11, 16))
  np.testing.assert_allclose(mixer(x)[0], ORACLES[name](mixer, x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", DELTA_MIXERS)
def test_decoding_token_by_token_equals_the_chunked_forward(name):
  """Each decode step (the token form from the carried state) equals the chunked forward at
  that position, and the state after the last step the chunked prefill's."""
  x, mask, _ = inputs()
  assert_decoding_equals_forward(build(name), x, mask)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["kda", "gated_deltaproduct"])
def test_models_take_the_new_names(name):
  config = TransformerConfig(vocab_size=11, max_len=12, num_layers=1, emb_dim=16, num_heads=2,
                             mlp_dim=16, dropout_rate=0.0, attention=name,
                             attention_options=OPTIONS[name])
  tokens = jax.random.randint(jax.random.key(0), (2, 5), 1, 11)
  hidden, _ = Decoder(config, rngs=nnx.Rngs(0))(tokens)
  assert hidden.shape == (2, 5, 16) and np.isfinite(hidden).all()
  lm = DecoderLM(config, rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(lm.generate(tokens[:, :3], 3),
                                lm.generate(tokens[:, :3], 3, use_cache=False))
