"""The shared Transformer: shapes, training on fake data, cached generation, padding, GQA."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from attention_zoo.models import (Classifier, DecoderLM, DualEncoderClassifier, EncoderDecoder,
                                  TransformerConfig, num_params, pool)

TINY = TransformerConfig(vocab_size=24, max_len=32, num_layers=2, emb_dim=32, num_heads=4,
                         mlp_dim=64, num_classes=3, dropout_rate=0.0)


def _tokens(shape, seed=0, vocab=24):
  return jax.random.randint(jax.random.key(seed), shape, 0, vocab)


# A model's forward pass compiled as one program (test_output_shapes, run alone, took a third of
# the time it took op by op).
apply = nnx.jit(lambda model, *args: model(*args))


def test_output_shapes():
  tokens = _tokens((2, 10))
  mask = jnp.ones((2, 10), bool)
  assert apply(Classifier(TINY, rngs=nnx.Rngs(0)), tokens, mask).shape == (2, 3)
  dual = DualEncoderClassifier(TINY, rngs=nnx.Rngs(0))
  assert apply(dual, tokens, mask, tokens, mask).shape == (2, 3)
  assert apply(DecoderLM(TINY, rngs=nnx.Rngs(0)), tokens).shape == (2, 10, 24)
  assert apply(EncoderDecoder(TINY, rngs=nnx.Rngs(0)), tokens, tokens[:, :4]).shape == (2, 4, 24)


@pytest.mark.slow
def test_a_few_train_steps_lower_the_loss():
  config = dataclasses.replace(TINY, pooling="mean")
  model = Classifier(config, rngs=nnx.Rngs(0))
  tokens = _tokens((16, 12), seed=1)
  labels = (tokens[:, 0] % 3).astype(jnp.int32)      # learnable from the first token
  optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    def loss_fn(model):
      logits = model(tokens, deterministic=False)
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer)) for _ in range(40)]
  assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("position_kind", [pytest.param(kind, marks=pytest.mark.slow)
                                           for kind in ("sinusoidal", "learned", "alibi")]
                         + ["rope"])
def test_cached_greedy_generation_equals_full_recomputation(position_kind):
  config = dataclasses.replace(TINY, positions=position_kind, num_kv_heads=2)
  model = DecoderLM(config, rngs=nnx.Rngs(3))
  prompt = _tokens((2, 4), seed=2)
  cached = model.generate(prompt, 8)
  recomputed = model.generate(prompt, 8, use_cache=False)
  np.testing.assert_array_equal(cached, recomputed)
  np.testing.assert_array_equal(cached[:, :4], prompt)
  # greedy: each new token is the argmax of the model's own logits on the prefix
  logits = model(cached)
  np.testing.assert_array_equal(cached[:, 4:], jnp.argmax(logits[:, 3:-1], axis=-1))


def test_decode_step_before_init_cache_says_to_call_it():
  model = DecoderLM(TINY, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"init_cache\(batch_size, max_len\) first"):
    model.decode_step(_tokens((2, 1)))
  model.init_cache(2, 4)
  assert model.decode_step(_tokens((2, 1))).shape == (2, 24)


@pytest.mark.slow
def test_sampling_needs_an_rng_and_uses_it():
  model = DecoderLM(TINY, rngs=nnx.Rngs(0))
  prompt = _tokens((1, 2))
  with pytest.raises(ValueError, match="needs rng"):
    model.generate(prompt, 3, temperature=1.0)
  a = model.generate(prompt, 12, temperature=5.0, rng=jax.random.key(0))
  b = model.generate(prompt, 12, temperature=5.0, rng=jax.random.key(1))
  assert not np.array_equal(a, b)


@pytest.mark.slow
def test_encoder_decoder_generation_with_and_without_cache():
  model = EncoderDecoder(dataclasses.replace(TINY, positions="rope"), rngs=nnx.Rngs(4))
  source = _tokens((2, 9), seed=5)
  source_mask = jnp.ones((2, 9), bool).at[1, 6:].set(False)
  start = jnp.zeros((2, 1), jnp.int32)
  cached = model.generate(source, start, 6, source_mask=source_mask)
  recomputed = model.generate(source, start, 6, source_mask=source_mask, use_cache=False)
  np.testing.assert_array_equal(cached, recomputed)


@pytest.mark.parametrize("pooling", [pytest.param("cls", marks=pytest.mark.slow), "mean"])
def test_classifier_logits_do_not_change_when_padding_is_appended(pooling):
  model = Classifier(dataclasses.replace(TINY, pooling=pooling), rngs=nnx.Rngs(0))
  tokens = _tokens((2, 10), seed=6)
  short = apply(model, tokens, jnp.ones((2, 10), bool))
  padded_tokens = jnp.concatenate([tokens, _tokens((2, 7), seed=7)], axis=1)  # padding: not token 0
  padded_mask = jnp.arange(17)[None].repeat(2, 0) < 10
  np.testing.assert_allclose(apply(model, padded_tokens, padded_mask), short, atol=1e-5)


@pytest.mark.slow
def test_dual_encoder_pads_each_tower_independently():
  model = DualEncoderClassifier(TINY, rngs=nnx.Rngs(0))
  a, b = _tokens((2, 8), seed=8), _tokens((2, 5), seed=9)
  ones = lambda t: jnp.ones(t.shape, bool)
  logits = model(a, ones(a), b, ones(b))
  b_padded = jnp.concatenate([b, _tokens((2, 3), seed=10)], axis=1)
  b_padded_mask = jnp.arange(8)[None].repeat(2, 0) < 5
  np.testing.assert_allclose(model(a, ones(a), b_padded, b_padded_mask), logits, atol=1e-5)


def test_gqa_reduces_parameters_by_the_kv_projections():
  mha = num_params(Classifier(TINY, rngs=nnx.Rngs(0)))
  mqa = num_params(Classifier(dataclasses.replace(TINY, num_kv_heads=1), rngs=nnx.Rngs(0)))
  head_dim = TINY.emb_dim // TINY.num_heads
  saved_per_layer = 2 * (TINY.emb_dim + 1) * (TINY.num_heads - 1) * head_dim
  assert mha - mqa == TINY.num_layers * saved_per_layer


@pytest.mark.slow
def test_bfloat16_compute_and_post_ln():
  model = Classifier(dataclasses.replace(TINY, dtype="bfloat16", pre_ln=False), rngs=nnx.Rngs(0))
  logits = model(_tokens((2, 10)))
  assert logits.dtype == jnp.float32 and bool(jnp.isfinite(logits).all())


def test_mean_pooling_of_bf16_activations_is_exact_in_f32():
  """257 real tokens: a bf16 count would round to 256."""
  hidden = jax.random.normal(jax.random.key(0), (1, 300, 8)).astype(jnp.bfloat16)
  mask = jnp.arange(300)[None] < 257
  pooled = pool(hidden, mask, "mean", 300)
  expected = np.asarray(hidden, np.float64)[0, :257].mean(0)
  assert pooled.dtype == jnp.float32
  np.testing.assert_allclose(pooled[0], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("field, value, message", [
    ("attention", "nope", "unknown attention or mixer 'nope'"),
    ("pooling", "max", "pooling='max'; choose one of cls, mean, padded_mean"),
    ("positions", "relative", "unknown position kind"),
    ("remat", "all", "remat='all'; choose one of none, block, dots"),
])
def test_config_errors_name_the_field(field, value, message):
  with pytest.raises(ValueError, match=message):
    dataclasses.replace(TINY, **{field: value})


def test_too_long_input_is_refused_with_the_limit():
  with pytest.raises(ValueError, match="exceeds config.max_len=32"):
    Classifier(TINY, rngs=nnx.Rngs(0))(_tokens((1, 40)))


# -- the switches that recreate the released LRA encoders ----------------------------------

def _pair(**flags):
  """The same classifier (same parameters) without and with `flags`."""
  config = TransformerConfig(vocab_size=24, max_len=16, num_layers=2, emb_dim=16, num_heads=2,
                             mlp_dim=32, num_classes=3, pooling="cls", dropout_rate=0.0)
  return (Classifier(config, rngs=nnx.Rngs(0)),
          Classifier(dataclasses.replace(config, **flags), rngs=nnx.Rngs(0)))


@pytest.mark.slow
def test_zero_token_is_padding_masks_id_zero_in_attention_only():
  plain, quirky = _pair(zero_token_is_padding=True)
  tokens = _tokens((2, 12)).at[:, ::3].set(0)
  mask = jnp.ones((2, 12), bool).at[1, 9:].set(False)
  np.testing.assert_allclose(quirky(tokens, mask), plain(tokens, mask & (tokens != 0)), atol=1e-6)
  assert not np.allclose(quirky(tokens, mask), plain(tokens, mask), atol=1e-4)
  _, pool_mask = quirky.encoder(tokens, mask)
  assert bool(pool_mask[:, 1:].sum() == mask.sum())   # pooling still sees every real token


def test_attention_ignores_padding_drops_the_masks():
  plain, quirky = _pair(attention_ignores_padding=True)
  tokens, mask = _tokens((2, 12)), jnp.ones((2, 12), bool).at[0, 6:].set(False)
  np.testing.assert_allclose(apply(quirky, tokens, mask), apply(plain, tokens), atol=1e-6)
  assert not np.allclose(apply(quirky, tokens, mask), apply(plain, tokens, mask), atol=1e-4)


def test_embed_init_std():
  default, unit = _pair(embed_init_std=1.0)
  assert float(jnp.std(unit.encoder.embed.embedding[...])) == pytest.approx(1.0, rel=0.15)
  assert float(jnp.std(default.encoder.embed.embedding[...])) < 0.5   # ~ 1 / sqrt(16)


def test_padded_mean_divides_the_real_tokens_sum_by_the_padded_length():
  hidden = jax.random.normal(jax.random.key(1), (2, 6, 4))
  mask = jnp.arange(6)[None] < jnp.array([[6], [2]])
  expected = np.asarray(hidden).copy()
  expected[1, 2:] = 0
  np.testing.assert_allclose(pool(hidden, mask, "padded_mean", 6), expected.sum(1) / 6, rtol=1e-6)


def test_padded_mean_classifier_gives_a_batch_cut_short_of_its_padding_the_padded_logits():
  """Its divisor is max_len, not the batch's length: the harness's length buckets need this."""
  _, model = _pair(pooling="padded_mean")
  tokens = _tokens((2, 16))
  mask = jnp.arange(16)[None] < jnp.array([[9], [4]])
  np.testing.assert_allclose(model(tokens[:, :9], mask[:, :9]), model(tokens, mask), rtol=1e-5,
                             atol=1e-6)


def test_exact_gelu_and_layer_norm_epsilon_reach_every_block():
  _, released = _pair(gelu_approximate=False, layer_norm_epsilon=1e-5)
  mlp = released.encoder.blocks[1].mlp
  x = jax.random.normal(jax.random.key(2), (3, 16)) * 3
  hidden = mlp.up(x)
  np.testing.assert_allclose(mlp(x), mlp.down(0.5 * hidden * (1 + jax.scipy.special.erf(
      hidden / np.sqrt(2)))), rtol=1e-5, atol=1e-6)
  norms = [n for b in released.encoder.blocks for n in (b.self_norm, b.mlp_norm)]
  assert {n.epsilon for n in norms + [released.encoder.final_norm]} == {1e-5}


@pytest.mark.slow
def test_shared_attention_parameters_are_one_parameter_whose_gradient_sums_the_layers():
  config = dataclasses.replace(TINY, attention="linformer", attention_options={"k": 4})
  separate = Classifier(config, rngs=nnx.Rngs(0))
  shared = Classifier(dataclasses.replace(config, share_attention_across_layers=True),
                      rngs=nnx.Rngs(0))
  first, second = (b.self_attention.attention for b in shared.encoder.blocks)
  assert first.key_projection is second.key_projection
  per_layer = first.key_projection.size + first.value_projection.size
  assert num_params(separate) - num_params(shared) == per_layer
  # the same parameters in both layers of `separate`: equal outputs, and the shared gradient is
  # the sum of the two layers' gradients
  for name in ("key_projection", "value_projection"):
    for block in separate.encoder.blocks:
      getattr(block.self_attention.attention, name)[...] = getattr(first, name)[...]
  tokens, mask = _tokens((2, 10)), jnp.ones((2, 10), bool).at[1, 6:].set(False)
  loss = lambda model: model(tokens, mask).sum()
  np.testing.assert_allclose(loss(shared), loss(separate), rtol=1e-5)
  grad_shared, grad_separate = nnx.grad(loss)(shared), nnx.grad(loss)(separate)
  layers = grad_separate["encoder"]["blocks"]
  np.testing.assert_allclose(
      grad_shared["encoder"]["blocks"][0]["self_attention"]["attention"]["key_projection"][...],
      sum(layers[i]["self_attention"]["attention"]["key_projection"][...] for i in (0, 1)),
      rtol=1e-4, atol=1e-7)
  with pytest.raises(ValueError, match="'full' has no parameters of its own to share"):
    Classifier(dataclasses.replace(TINY, share_attention_across_layers=True), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="'deltanet' is a sequence mixer"):
    Classifier(dataclasses.replace(TINY, attention="deltanet", share_attention_across_layers=True),
               rngs=nnx.Rngs(0))


def test_short_conv_is_a_causal_depthwise_convolution():
  from attention_zoo.convolution import ShortConv

  conv = ShortConv(4, 3, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 7, 4))
  w, b = np.asarray(conv.weight[...]), np.asarray(conv.bias[...])
  xs = np.asarray(x)
  expected = np.stack([b + sum(w[i] * xs[:, t - i] for i in range(3) if t - i >= 0)
                       for t in range(7)], axis=1)
  np.testing.assert_allclose(conv(x), expected, atol=1e-6)
  conv.init_cache(2)
  stepped = jnp.concatenate([conv(x[:, t:t + 1], decode=True) for t in range(7)], axis=1)
  np.testing.assert_allclose(stepped, expected, atol=1e-6)   # one token at a time, same result
  config = dataclasses.replace(TINY, short_conv=3, positions="rope")
  lm = DecoderLM(config, rngs=nnx.Rngs(0))
  prompt = _tokens((1, 4))
  np.testing.assert_array_equal(lm.generate(prompt, 6, use_cache=True),
                                lm.generate(prompt, 6, use_cache=False))


def _model_and_loss(kind, config):
  """A small model and a scalar loss of its outputs, with dropout on."""
  tokens, mask = _tokens((2, 12), seed=4), jnp.arange(12)[None] < jnp.array([[12], [9]])
  if kind is Classifier:
    model = Classifier(config, rngs=nnx.Rngs(5))
    return model, lambda m: m(tokens, mask, deterministic=False).sum()
  model = EncoderDecoder(config, rngs=nnx.Rngs(5))   # encoder, causal decoder, cross-attention
  return model, lambda m: m(tokens, tokens[:, :5], mask, deterministic=False).std()


@pytest.mark.slow
@pytest.mark.parametrize("kind, remats", [(Classifier, ("block", "dots")),
                                          (EncoderDecoder, ("block",))])
def test_remat_keeps_outputs_gradients_and_dropout_masks(kind, remats):
  """Recomputing blocks in the backward pass changes no gradient (f32, 1e-6), with dropout and
  attention dropout on: the recomputation draws the same random masks."""
  base = dataclasses.replace(TINY, dropout_rate=0.1, attention_dropout_rate=0.1, num_kv_heads=2)
  results = {}
  for remat in ("none", *remats):
    model, loss_of = _model_and_loss(kind, dataclasses.replace(base, remat=remat))
    loss, grads = nnx.jit(nnx.value_and_grad(loss_of))(model)
    results[remat] = (loss, jax.tree.leaves(nnx.state(grads, nnx.Param)))
  loss, grads = results.pop("none")
  for remat, (remat_loss, remat_grads) in results.items():
    np.testing.assert_allclose(remat_loss, loss, atol=1e-6, err_msg=remat)
    for got, want in zip(remat_grads, grads, strict=True):
      np.testing.assert_allclose(got, want, atol=1e-6, err_msg=remat)


@pytest.mark.parametrize("attention", ["full", pytest.param("retnet", marks=pytest.mark.slow)])
def test_remat_model_differentiates_under_plain_jax_transforms(attention):
  """jax.jit(jax.grad) over nnx.split / nnx.merge, as functional training loops do: the remat
  wrapper writes no RNG state it did not draw from (it once raised TraceContextError), and
  passes through the plain arrays a layer holds as constants (RetNet's decays)."""
  tokens = _tokens((2, 12), seed=4)
  grads = {}
  for remat in ("none", "block"):
    config = dataclasses.replace(TINY, remat=remat, attention=attention)
    model = Classifier(config, rngs=nnx.Rngs(5))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss = lambda params, rest: nnx.merge(graphdef, params, rest)(tokens).sum()
    grads[remat] = jax.tree.leaves(jax.jit(jax.grad(loss))(params, rest))
  for got, want in zip(grads["block"], grads["none"], strict=True):
    np.testing.assert_allclose(got, want, atol=1e-6)



def test_remat_model_differentiates_in_forward_mode():
  """jax.jvp and a Hessian-vector product (jax.jvp of jax.grad) in the parameters: the remat
  wrapper is a custom VJP, which JAX refuses to differentiate forward, so forward mode runs the
  plain block (it saves nothing to recompute); both equal the model without remat."""
  tokens = _tokens((2, 12), seed=4)
  derivatives = {}
  for remat in ("none", "block"):
    config = dataclasses.replace(TINY, remat=remat)
    graphdef, params, rest = nnx.split(Classifier(config, rngs=nnx.Rngs(5)), nnx.Param, ...)
    loss = lambda params: jnp.sum(nnx.merge(graphdef, params, rest)(tokens) ** 2)
    tangent = jax.tree.map(lambda p: jnp.full_like(p, 0.01), params)
    derivatives[remat] = jax.tree.leaves(jax.jit(lambda params, tangent: jax.jvp(
        lambda params: (loss(params), jax.grad(loss)(params)), (params,), (tangent,))[1])(
            params, tangent))
  for got, want in zip(derivatives["block"], derivatives["none"], strict=True):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_remat_model_still_decodes_with_its_cache():
  model = DecoderLM(dataclasses.replace(TINY, remat="block"), rngs=nnx.Rngs(3))
  prompt = _tokens((2, 4), seed=2)
  cached = model.generate(prompt, 6)
  np.testing.assert_array_equal(cached, model.generate(prompt, 6, use_cache=False))


@pytest.mark.slow
def test_remat_halves_the_compiled_memory_of_an_lra_text_train_step_at_16k():
  """The LRA Text model (4 layers, emb 256, 4 heads, MLP 1024, batch 1) with a linear attention:
  forward+backward compiled (not run) at 16K tokens needs at most half the temporary memory
  when each block is recomputed in the backward pass."""
  length = 16384

  def temp_bytes(remat):
    config = TransformerConfig(vocab_size=257, max_len=length, num_layers=4, emb_dim=256,
                               num_heads=4, mlp_dim=1024, num_classes=2,
                               attention="linear_transformer", remat=remat)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Classifier(config, rngs=nnx.Rngs(0))))
    tokens = jax.ShapeDtypeStruct((1, length), jnp.int32)
    labels = jax.ShapeDtypeStruct((1,), jnp.int32)

    def train_grads(state, tokens, labels):
      def loss_of(model):
        logits = model(tokens, deterministic=False)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
      return nnx.grad(loss_of)(nnx.merge(graphdef, state))

    compiled = jax.jit(train_grads).lower(state, tokens, labels).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  assert temp_bytes("block") <= 0.5 * temp_bytes("none")
