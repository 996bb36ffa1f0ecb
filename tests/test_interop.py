"""attention_zoo.interop: the zoo inside Flax's attention layers and built NNX models.

Oracle: Flax's own `nnx.dot_product_attention` (independent of the zoo), under the same mask,
or under the mask combined with an exact variant's pattern. Rows of queries that see no key
are compared apart: the zoo gives 0, Flax the mean of all values.
"""
import re
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import attention_zoo as az
from attention_zoo.interop import attention_fn, swap_attention
from examples import flax_interop

B, N, H, D = 2, 12, 2, 8


def qkv(q_len=N, kv_len=N, num_kv_heads=H, batch=(B,), seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (*batch, q_len, H, D))
  k = jax.random.normal(keys[1], (*batch, kv_len, num_kv_heads, D))
  v = jax.random.normal(keys[2], (*batch, kv_len, num_kv_heads, D))
  return q, k, v


def lengths_mask(lengths, n):
  return jnp.arange(n)[None, :] < jnp.asarray(lengths)[:, None]        # [b, n]


def flax_mask(kind, q_len=N, kv_len=N):
  """A mask as Flax's helpers make it: [B, 1, q_len, kv_len], float32."""
  q_pad = lengths_mask([q_len, q_len - 3], q_len)
  kv_pad = lengths_mask([kv_len - 4, kv_len], kv_len)
  padding = nnx.make_attention_mask(q_pad, kv_pad)
  causal = nnx.make_causal_mask(jnp.ones((B, q_len)))
  return {"padding": padding, "causal": causal, "both": nnx.combine_masks(padding, causal)}[kind]


def compare(zoo, flax, q, k, v, mask):
  """Outputs and gradients (of a loss over the rows that see a key) agree to 1e-5; the rows
  that see none are 0 from the zoo."""
  sees = jnp.ones(q.shape[:-2], bool) if mask is None else jnp.any(mask != 0, axis=(-3, -1))
  weights = jax.random.normal(jax.random.key(9), q.shape) * sees[..., None, None]
  loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v) * weights)
  out_zoo, out_flax = jax.jit(zoo)(q, k, v), jax.jit(flax)(q, k, v)
  np.testing.assert_allclose(out_zoo * sees[..., None, None], out_flax * sees[..., None, None],
                             atol=1e-5, rtol=1e-5)
  assert not np.any(np.asarray(out_zoo)[~np.asarray(sees)])
  for g_zoo, g_flax in zip(jax.jit(jax.grad(loss(zoo), (0, 1, 2)))(q, k, v),
                           jax.jit(jax.grad(loss(flax), (0, 1, 2)))(q, k, v)):
    np.testing.assert_allclose(g_zoo, g_flax, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["padding", "causal", "both"])
def test_full_equals_flax_attention(kind):
  q, k, v = qkv()
  mask = flax_mask(kind)
  fn = attention_fn("full", causal=kind != "padding")
  compare(lambda q, k, v: fn(q, k, v, mask=mask),
          lambda q, k, v: nnx.dot_product_attention(q, k, v, mask=mask), q, k, v, mask)


def test_full_cross_attention_gqa_and_two_batch_dims():
  q, k, v = qkv(q_len=5, kv_len=N, num_kv_heads=1, batch=(2, 3))
  kv_pad = jnp.arange(N) < jnp.array([[N, 7, 1], [2, N, 9]])[..., None]   # [2, 3, kv]
  mask = nnx.make_attention_mask(jnp.ones((2, 3, 5)), kv_pad)             # [2, 3, 1, 5, kv]
  fn = attention_fn("full")
  # Flax's own function repeats k/v heads for GQA only on its weights path: give it copies.
  repeat = lambda x: jnp.repeat(x, H, axis=-2)
  compare(lambda q, k, v: fn(q, k, v, mask=mask),
          lambda q, k, v: nnx.dot_product_attention(q, repeat(k), repeat(v), mask=mask),
          q, k, v, mask)


def test_is_causal_from_the_layer_and_no_mask():
  q, k, v = qkv()
  out = attention_fn("full")(q, k, v, is_causal=True)
  np.testing.assert_allclose(out, nnx.dot_product_attention(q, k, v, mask=flax_mask("causal")),
                             atol=1e-5)


@pytest.mark.parametrize("kind", ["padding", "both"])
def test_sliding_window_equals_flax_under_its_dense_mask(kind):
  q, k, v = qkv()
  causal = kind == "both"
  mask = flax_mask(kind)
  pattern = az.create("sliding_window", num_heads=H, head_dim=D, causal=causal, window=3,
                      rngs=nnx.Rngs(0)).pattern(N, N)                     # [1, q, kv]
  dense = mask * pattern[None]
  fn = attention_fn("sliding_window", causal=causal, window=3)
  compare(lambda q, k, v: fn(q, k, v, mask=mask),
          lambda q, k, v: nnx.dot_product_attention(q, k, v, mask=dense), q, k, v, dense)


def test_nnx_layer_with_the_zoo_keeps_flax_results():
  x = jax.random.normal(jax.random.key(3), (B, N, 16))
  mask = flax_mask("both")
  layer = lambda fn: nnx.MultiHeadAttention(H, 16, attention_fn=fn, decode=False,
                                             rngs=nnx.Rngs(0))
  ours = layer(attention_fn("full", causal=True))(x, mask=mask)
  theirs = layer(nnx.dot_product_attention)(x, mask=mask)
  sees = np.asarray(jnp.any(mask != 0, axis=(1, 3)))
  np.testing.assert_allclose(np.asarray(ours)[sees], np.asarray(theirs)[sees], atol=1e-5)
  window = nnx.jit(lambda m, x: m(x, mask=mask))(
      layer(attention_fn("sliding_window", causal=True, window=2)), x)
  assert window.shape == x.shape and np.isfinite(window).all()


def test_linen_layer_init_and_apply():
  x = jax.random.normal(jax.random.key(3), (B, N, 16))
  mask = flax_mask("both")
  pattern = az.create("sliding_window", num_heads=H, head_dim=D, causal=True, window=3,
                      rngs=nnx.Rngs(0)).pattern(N, N)
  dense_fn = lambda q, k, v, mask=None: nn.dot_product_attention(q, k, v, mask=mask * pattern)
  layers = [nn.MultiHeadDotProductAttention(num_heads=H, attention_fn=fn)
            for fn in (attention_fn("sliding_window", causal=True, window=3), dense_fn)]
  params = layers[0].init(jax.random.key(0), x, x, mask=mask)
  ours, theirs = (jax.jit(layer.apply)(params, x, x, mask=mask) for layer in layers)
  sees = np.asarray(jnp.any(mask * pattern != 0, axis=(1, 3)))   # the window can see only padding
  np.testing.assert_allclose(np.asarray(ours)[sees], np.asarray(theirs)[sees], atol=1e-5)


def test_stochastic_variants_draw_from_the_layers_dropout_key():
  q, k, v = qkv()
  reformer = attention_fn("reformer", chunk_len=4)
  hashed = jax.jit(lambda seed: reformer(q, q, v, dropout_rng=jax.random.key(seed),
                                         dropout_rate=0.1, deterministic=False))
  np.testing.assert_array_equal(hashed(0), hashed(0))
  assert not np.allclose(hashed(0), hashed(1))
  performer = attention_fn("performer", nb_features=16, dropout_rate=0.0)   # redraws, no dropout
  redraw = jax.jit(lambda seed, deterministic: performer(
      q, k, v, dropout_rng=jax.random.key(seed), dropout_rate=0.1, deterministic=deterministic),
      static_argnums=1)
  assert not np.allclose(redraw(0, False), redraw(1, False))
  np.testing.assert_array_equal(redraw(0, True), redraw(1, True))   # evaluation: fixed features
  linen = nn.MultiHeadDotProductAttention(num_heads=H, dropout_rate=0.1, attention_fn=performer)
  x = jax.random.normal(jax.random.key(3), (B, N, 16))
  params = linen.init(jax.random.key(0), x, x, deterministic=True)
  train = jax.jit(lambda seed: linen.apply(params, x, x, deterministic=False,
                                           rngs={"dropout": jax.random.key(seed)}))
  assert not np.allclose(train(0), train(1))


@pytest.mark.parametrize("name", ["full", "performer"])
def test_flax_cache_decoding_through_attention_fn(name):
  """Flax decodes one query against its left-aligned cache (later slots masked): exact for a
  variant whose single query sees every key."""
  fn = attention_fn(name, causal=True, **({"nb_features": 16} if name == "performer" else {}))
  layer = nnx.MultiHeadAttention(H, 16, attention_fn=fn, decode=False, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(3), (1, 6, 16))
  whole = layer(x, mask=nnx.make_causal_mask(jnp.ones((1, 6))))
  layer.init_cache((1, 6, 16))
  step = nnx.jit(lambda layer, token: layer(token, decode=True))
  steps = jnp.concatenate([step(layer, x[:, t:t + 1]) for t in range(6)], axis=1)
  np.testing.assert_allclose(steps, whole, atol=1e-5)


# -- swap_attention ------------------------------------------------------------------------

def tiny_decoder():
  return flax_interop.Decoder(vocab_size=32, max_len=16, emb_dim=16, num_heads=2, mlp_dim=32,
                              num_layers=2, rngs=nnx.Rngs(0))


def tokens_with_padding():
  tokens = jax.random.randint(jax.random.key(1), (B, 16), 1, 32)
  return tokens.at[1, 11:].set(0)


def test_swap_to_full_keeps_the_models_outputs():
  model, tokens = tiny_decoder(), tokens_with_padding()
  run = nnx.jit(lambda model, tokens: model(tokens))
  expected = run(model, tokens)
  swapped = swap_attention(nnx.clone(model), "full", causal=True)
  assert all(type(b.attention).__name__ == "ZooMultiHeadAttention" for b in swapped.blocks)
  real = np.asarray(tokens > 0)
  np.testing.assert_allclose(np.asarray(run(swapped, tokens))[real], np.asarray(expected)[real],
                             atol=1e-5)
  assert swapped.blocks[0].attention.query.kernel is not model.blocks[0].attention.query.kernel
  np.testing.assert_array_equal(swapped.blocks[0].attention.query.kernel[...],
                                model.blocks[0].attention.query.kernel[...])


@pytest.mark.parametrize("name, options", [
    ("sliding_window", {"window": 4}), ("performer", {"nb_features": 16}),
    pytest.param("synthesizer", {"max_len": 16}, marks=pytest.mark.slow)])
def test_swapped_model_trains_under_nnx_jit(name, options):
  model = swap_attention(tiny_decoder(), name, causal=True, rngs=nnx.Rngs(5), **options)
  own = nnx.state(model.blocks[0].attention.attention, nnx.Param)
  assert bool(own) == (name == "synthesizer")   # a variant's own parameters are model state
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  tokens = tokens_with_padding()

  @nnx.jit
  def step(model, optimizer, tokens):
    loss, grads = nnx.value_and_grad(flax_interop.loss_fn)(model, tokens)
    optimizer.update(model, grads)
    return loss

  before = nnx.state(model, nnx.Param)
  before = jax.tree.map(np.array, before)
  losses = [float(step(model, optimizer, tokens)) for _ in range(3)]
  assert np.isfinite(losses).all() and losses[-1] < losses[0]
  after = nnx.state(model, nnx.Param)
  changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), before, after)
  assert all(jax.tree.leaves(changed))


@pytest.mark.parametrize("name, options", [("sliding_window", {"window": 2}),
                                           ("performer", {"nb_features": 16})])
def test_swapped_layer_decodes_with_the_variants_cache(name, options):
  flax_layer = nnx.MultiHeadAttention(H, 16, decode=False, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(3), (1, 6, 16))
  (swapped,) = swap_attention(nnx.List([nnx.clone(flax_layer)]), name, causal=True, **options)
  if name == "sliding_window":   # exact: Flax's layer under the causal window's dense mask
    pattern = swapped.attention.pattern(6, 6)
    whole = flax_layer(x, mask=nnx.make_causal_mask(jnp.ones((1, 6))) * pattern)
  else:                          # approximate: the same variant over the whole sequence
    whole = swapped(x)
  decoder = nnx.view(swapped, decode=True, batch_size=1, max_length=6)   # Flax's way, or
  step = nnx.jit(lambda layer, token: layer(token))                        # init_cache(shape)
  steps = jnp.concatenate([step(decoder, x[:, t:t + 1]) for t in range(6)], axis=1)
  np.testing.assert_allclose(steps, whole, atol=1e-5)


def test_swap_selects_layers_with_where():
  model = swap_attention(tiny_decoder(), "full", causal=True, where=lambda path, _: 0 in path)
  kinds = [type(b.attention).__name__ for b in model.blocks]
  assert kinds == ["ZooMultiHeadAttention", "MultiHeadAttention"]


# -- errors --------------------------------------------------------------------------------

def test_unknown_name_lists_the_available_ones():
  with pytest.raises(ValueError, match="available: .*sliding_window"):
    attention_fn("sliding_windows")


@pytest.mark.parametrize("name", ["linformer", "synthesizer", "sinkhorn"])
def test_variants_with_parameters_point_to_swap_attention(name):
  with pytest.raises(ValueError, match="parameters of its own.*swap_attention.*sliding_window"):
    attention_fn(name)


def test_a_mask_that_does_not_factor_is_refused():
  q, k, v = qkv()
  segments = jnp.array([[0] * 6 + [1] * 6] * B)
  packed = nnx.make_attention_mask(segments, segments, jnp.equal)          # block-diagonal
  fn = attention_fn("sliding_window", window=4)
  with pytest.raises(ValueError, match="not q_pad ⊗ kv_pad.*dot_product_attention"):
    fn(q, k, v, mask=packed)
  with pytest.raises(ValueError, match="causal=True"):
    fn(q, k, v, mask=flax_mask("causal"))             # a causal mask, the variant not causal
  with pytest.raises(jax.errors.JaxRuntimeError, match="not q_pad ⊗ kv_pad"):
    jax.block_until_ready(jax.jit(lambda m: fn(q, k, v, mask=m))(packed))
  assert np.isfinite(attention_fn("full", check_mask=False)(q, k, v, mask=packed)).all()


def test_unsupported_arguments_are_refused():
  q, k, v = qkv()
  fn = attention_fn("full")
  with pytest.raises(ValueError, match="no arbitrary score bias"):
    fn(q, k, v, bias=jnp.zeros((B, H, N, N)))
  layer = nnx.MultiHeadAttention(H, 16, attention_fn=fn, decode=False, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="sow_weights"):
    layer(jnp.ones((B, N, 16)), sow_weights=True)
  with pytest.raises(ValueError, match="cannot apply.*dropout_rate=0"):
    attention_fn("performer")(q, k, v, dropout_rng=jax.random.key(0), dropout_rate=0.1)
  with pytest.raises(ValueError, match="nystromformer cannot be causal"):
    attention_fn("nystromformer", causal=True)
  with pytest.raises(ValueError, match="measure its pattern from the last slot"):
    attention_fn("sliding_window", causal=True, window=2)(q[:, :1], k, v)


def test_swap_refusals():
  with pytest.raises(ValueError, match="no nnx.MultiHeadAttention"):
    swap_attention(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "full")
  model = swap_attention(tiny_decoder(), "sliding_window", window=4)     # not causal
  with pytest.raises(ValueError, match="causal=True"):
    model(tokens_with_padding())
  with pytest.raises(ValueError, match="needs init_cache"):
    model.blocks[0].attention(jnp.ones((1, 1, 16)), decode=True)
  with pytest.raises(ValueError, match="decoding needs causal=True"):
    model.blocks[0].attention.init_cache((1, 8, 16))
  lm1b_like = nnx.MultiHeadAttention(H, 16, dropout_rate=0.1, rngs=nnx.Rngs(0))
  holder = nnx.List([lm1b_like])
  with pytest.raises(ValueError, match="pass dropout_rate=0.0"):
    swap_attention(holder, "performer")
  assert type(swap_attention(holder, "performer", dropout_rate=0.0)[0]).__name__ == \
      "ZooMultiHeadAttention"


@pytest.mark.slow
def test_the_docs_first_snippet_runs():
  """docs/interop.md's first example, as written: every name it uses is defined there."""
  page = (Path(__file__).resolve().parents[1] / "docs" / "interop.md").read_text()
  snippet = re.search(r"```python\n(.*?)```", page, flags=re.S).group(1)
  namespace = {}
  exec(compile(snippet, "docs/interop.md", "exec"), namespace)   # noqa: S102 - our own docs
  assert namespace["model"](jnp.ones((1, 8, 512))).shape == (1, 8, 512)


def test_example_runs_at_a_tiny_length(capsys):
  rows = flax_interop.main(["--length=16", "--repeats=1", "--num_layers=1", "--emb_dim=16"])
  assert set(rows) == set(flax_interop.VARIANTS)
  assert all(ms > 0 and mb >= 0 for ms, mb in rows.values())
  assert "| sliding_window |" in capsys.readouterr().out
