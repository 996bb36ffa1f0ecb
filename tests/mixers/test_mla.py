"""MLA (DeepSeek-V2's Multi-head Latent Attention) against a float64 oracle written from the
paper's equations (full per-head keys and values materialised from the latent, RoPE on the
decoupled parts, dense softmax): output and gradients of x and of every parameter, causal and
bidirectional, with padding. Decoding with the up-projections absorbed equals the parallel
forward token by token and never forms a per-head key; the cache holds kv_lora_rank +
rope_head_dim floats per token and layer; GQA and odd RoPE sizes are refused; a DecoderLM trains
and generates with it. The layer's contract (causality, padding, bf16, decode with a prefill
and holes, the one-pass encoder) is the conformance suite's."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import attention_zoo as az
from attention_zoo.models import Classifier, DecoderLM, TransformerConfig
from experiments.train import steps
from helpers import array_shapes, normal, padding_mask

EMB, HEADS = 32, 4
# sizes that differ from each other, so a mixed-up axis fails
SIZES = dict(kv_lora_rank=10, rope_head_dim=4, nope_head_dim=6, v_head_dim=5, block_size=8)


def build(causal=True, **options):
  return az.create_mixer("mla", emb_dim=EMB, num_heads=HEADS, causal=causal, rngs=nnx.Rngs(0),
                         **{**SIZES, **options})


def parameters(mla):
  """The module's weights by the paper's names (None: no query latent)."""
  value = lambda variable: None if variable is None else variable[...]
  return {"W_DQ": value(mla.q_down and mla.q_down.kernel),
          "q_norm": value(mla.q_norm and mla.q_norm.scale), "W_Q": mla.query.kernel[...],
          "W_DKV_KR": mla.kv_down.kernel[...], "kv_norm": mla.kv_norm.scale[...],
          "W_UK_UV": mla.kv_up.kernel[...], "W_O": mla.out.kernel[...]}


def rope64(x, positions):
  """RoPE on the last axis of x [n, ..., d]: the pair (x_k, x_{k + d/2}) turned by the angle
  p · 10000^(-2k/d) at position p."""
  d = x.shape[-1]
  angle = positions[:, None] * 10000.0 ** (-jnp.arange(0, d, 2) / d)         # [n, d/2]
  angle = angle.reshape(angle.shape[:1] + (1,) * (x.ndim - 2) + angle.shape[1:])
  first, second = x[..., :d // 2], x[..., d // 2:]
  return jnp.concatenate([first * jnp.cos(angle) - second * jnp.sin(angle),
                          second * jnp.cos(angle) + first * jnp.sin(angle)], axis=-1)


def mla64(p, x, mask, *, causal, heads, sizes, eps=1e-6, pattern=True):
  """DeepSeek-V2 §2.1 eqs. (9)-(19) for one sequence x [n, emb] with the weights p, dense (in
  float64 under jax.enable_x64): masked keys are not attended, masked query rows are 0. sizes:
  the layer's head and latent sizes (`mla.sizes`); pattern: bool [n, n], the keys each query
  may see besides (DSA's selection, tests/variants/test_dsa.py)."""
  n = x.shape[0]
  nope, rope, v_dim, kv_rank = sizes.nope, sizes.rope, sizes.v, sizes.kv_rank
  rms = lambda a, scale: a / jnp.sqrt(jnp.mean(a * a, -1, keepdims=True) + eps) * scale
  c_q = x if p["W_DQ"] is None else rms(x @ p["W_DQ"], p["q_norm"])            # (12)
  q = (c_q @ p["W_Q"]).reshape(n, heads, nope + rope)
  q_c, q_r = q[..., :nope], rope64(q[..., nope:], jnp.arange(n))              # (13), (14)
  down = x @ p["W_DKV_KR"]
  c_kv = rms(down[:, :kv_rank], p["kv_norm"])                                 # (9)
  k_r = rope64(down[:, kv_rank:], jnp.arange(n))                              # (15)
  up = (c_kv @ p["W_UK_UV"]).reshape(n, heads, nope + v_dim)
  k_c, v_c = up[..., :nope], up[..., nope:]                                   # (10), (11)
  q_full = jnp.concatenate([q_c, q_r], -1)                                    # (16)
  k_full = jnp.concatenate([k_c, jnp.broadcast_to(k_r[:, None], (n, heads, rope))], -1)  # (17)
  scores = jnp.einsum("ihd,jhd->hij", q_full, k_full) / jnp.sqrt(nope + rope)
  allowed = mask[None, None, :] & (jnp.tril(jnp.ones((n, n), bool)) if causal else True) & pattern
  scores = jnp.where(allowed, scores, -jnp.inf)
  top = jax.lax.stop_gradient(jnp.max(jnp.where(allowed, scores, 0.0), -1, keepdims=True))
  weights = jnp.where(allowed, jnp.exp(scores - top), 0.0)
  weights = weights / jnp.maximum(weights.sum(-1, keepdims=True), 1e-300)
  o = jnp.einsum("hij,jhd->ihd", weights, v_c).reshape(n, heads * v_dim)      # (18)
  return jnp.where(mask[:, None], o @ p["W_O"], 0.0)                          # (19)


def causal_mla64(mla, x):
  """The oracle of the causal layer `mla` on x [1, n, emb] -> numpy float64 [n, emb]
  (tests/mixers/test_mixers.py's ORACLES)."""
  with jax.enable_x64(True):
    p = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), parameters(mla))
    x = jnp.asarray(x[0], jnp.float64)
    return np.asarray(mla64(p, x, jnp.ones(x.shape[0], bool), causal=True,
                            heads=mla.num_heads, sizes=mla.sizes))


# The causal form is also checked in the fast lane by tests/mixers/test_mixers.py's float64 check.
@pytest.mark.parametrize("causal, q_lora_rank", [pytest.param(True, 12, marks=pytest.mark.slow),
                                                 (False, 0)])
def test_forward_and_gradients_equal_the_float64_oracle(causal, q_lora_rank):
  mla = build(causal, q_lora_rank=q_lora_rank)
  x = normal(0, (2, 13, EMB))
  mask = padding_mask(2, 13, hole=4, tail=3)
  cotangent = normal(1, x.shape)

  def loss(mla, x):
    return jnp.sum(mla(x, mask=mask) * cotangent)

  out = mla(x, mask=mask)
  grads, dx = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(mla, x)
  got = {"x": dx, **parameters(nnx.merge(nnx.graphdef(mla), grads))}   # grads as a module
  assert (mla.sizes.nope, mla.sizes.rope, mla.sizes.v, mla.sizes.kv_rank) == (6, 4, 5, 10)
  with jax.enable_x64(True):
    to64 = lambda tree: jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), tree)
    p, x64, ct = to64(parameters(mla)), to64(x), to64(cotangent)

    def loss64(p, x):
      rows = [mla64(p, x[b], mask[b], causal=causal, heads=HEADS, sizes=mla.sizes)
              for b in range(2)]
      return jnp.sum(jnp.stack(rows) * ct), jnp.stack(rows)

    (_, want_out), (want_p, want_dx) = jax.tree.map(np.asarray, jax.value_and_grad(
        loss64, argnums=(0, 1), has_aux=True)(p, x64))
  np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=0)
  want = {"x": want_dx, **want_p}
  assert (want["W_DQ"] is None) == (got["W_DQ"] is None) == (q_lora_rank == 0)
  for name, value in want.items():
    if value is not None:
      scale = max(float(np.abs(value).max()), 1.0)
      np.testing.assert_allclose(got[name], value, atol=2e-5 * scale, rtol=0, err_msg=name)
  assert np.abs(want_dx).max() > 0


@pytest.mark.slow
def test_absorbed_decoding_equals_the_parallel_forward_token_by_token():
  """Default sizes (from head_dim 8) and q_lora_rank=0; the decode step's program forms no
  per-head key or value over the cache: scores are against the latent itself."""
  mla = az.create_mixer("mla", emb_dim=EMB, num_heads=HEADS, causal=True, rngs=nnx.Rngs(1))
  x = normal(2, (2, 9, EMB))
  parallel = mla(x)
  cache_len = 12
  mla.init_cache(2, cache_len)
  step = nnx.jit(lambda m, x_t: m(x_t, decode=True))
  tokens = [step(mla, x[:, t:t + 1]) for t in range(9)]
  np.testing.assert_allclose(jnp.concatenate(tokens, 1), parallel, atol=2e-5, rtol=0)
  graph, state = nnx.split(mla)
  jaxpr = jax.make_jaxpr(lambda s, x_t: nnx.merge(graph, s)(x_t, decode=True))(state, x[:, :1])
  per_head_over_cache = [s for s in array_shapes(jaxpr.jaxpr)
                         if len(s) == 4 and s[1] == cache_len and s[2] == HEADS]
  assert not per_head_over_cache


def test_the_cache_holds_the_latent_and_the_shared_rope_key_only():
  r, rope, length = 10, 4, 7
  config = TransformerConfig(vocab_size=11, max_len=16, num_layers=2, emb_dim=EMB,
                             num_heads=HEADS, mlp_dim=16, attention="mla",
                             attention_options={"kv_lora_rank": r, "rope_head_dim": rope})
  lm = DecoderLM(config, rngs=nnx.Rngs(0))
  lm.init_cache(3, length)
  for block in lm.decoder.blocks:
    cache = block.self_attention.cache.get_value()
    floats = {k: a.shape for k, a in cache.items() if jnp.issubdtype(a.dtype, jnp.floating)}
    assert floats == {"latent": (3, length, r), "rope_key": (3, length, rope)}
  size = az.state_size("mla", emb_dim=EMB, num_heads=HEADS, seq_len=length,
                       options={"kv_lora_rank": r, "rope_head_dim": rope})
  assert size == length * (r + rope)
  # defaults from head_dim d = 8: kv_lora_rank 4·d, rope_head_dim d/2; full MHA keeps 2·h·d
  assert az.state_size("mla", emb_dim=EMB, num_heads=HEADS, seq_len=1) == 32 + 4
  assert az.state_size("full", emb_dim=EMB, num_heads=HEADS, seq_len=1) == 2 * 4 * 8


def test_options_that_make_no_sense_are_refused():
  with pytest.raises(ValueError, match=r"mla: num_kv_heads \(2\) must equal num_heads \(4\) or "
                                       r"be None: every head up-projects its own key"):
    az.create_mixer("mla", emb_dim=EMB, num_heads=HEADS, num_kv_heads=2, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="num_kv_heads"):
    DecoderLM(TransformerConfig(attention="mla", num_kv_heads=1), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"rope_head_dim=3 is invalid: expected an even number"):
    build(rope_head_dim=3)
  mla = build()
  mla.init_cache(1, 4)
  with pytest.raises(ValueError, match="5 tokens do not fit a cache of 4"):
    mla(normal(3, (1, 5, EMB)), decode=True)


@pytest.mark.slow
def test_a_decoder_lm_trains_with_the_harness_loss_and_generates_from_its_cache():
  config = TransformerConfig(vocab_size=16, max_len=12, num_layers=1, emb_dim=EMB,
                             num_heads=HEADS, mlp_dim=32, dropout_rate=0.0, attention="mla",
                             attention_options={"q_lora_rank": 8})
  model = DecoderLM(config, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(0), (4, 12), 1, 16)
  batch = {"inputs": tokens, "masks": jnp.ones((4, 12), bool),
           "targets": jnp.roll(tokens, -1, axis=1), "weights": jnp.ones(4)}
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  def mean_loss(model):
    losses, _, weights = steps.score(model, batch, deterministic=True)
    return losses.sum() / weights.sum()

  @nnx.jit
  def step(model, optimizer):
    loss, grads = nnx.value_and_grad(mean_loss)(model)
    optimizer.update(model, grads)
    return loss

  before = step(model, optimizer)
  assert float(nnx.jit(mean_loss)(model)) < float(before)
  prompt = tokens[:2, :3]
  np.testing.assert_array_equal(model.generate(prompt, 4),
                                model.generate(prompt, 4, use_cache=False))


@pytest.mark.slow
def test_a_padded_bidirectional_classifier_ignores_its_padding():
  config = TransformerConfig(vocab_size=16, max_len=16, num_layers=1, emb_dim=EMB,
                             num_heads=HEADS, mlp_dim=32, dropout_rate=0.0, attention="mla",
                             pooling="mean")
  model = Classifier(config, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 10), 1, 16)
  mask = jnp.ones((2, 10), bool)
  padded = jnp.concatenate([tokens, jnp.full((2, 6), 7)], 1)
  padded_mask = jnp.concatenate([mask, jnp.zeros((2, 6), bool)], 1)
  np.testing.assert_allclose(model(padded, padded_mask), model(tokens, mask), atol=1e-5)


@pytest.mark.slow
def test_mla_trains_on_mqar_through_the_harness(tmp_path):
  from experiments import report, reproduce
  from helpers import tiny_run_overrides

  failures = reproduce.run_grid(preset="tiny", tasks=["mqar"], attentions=["mla"], seeds=[0],
                                out=tmp_path, overrides=tiny_run_overrides(steps=1))
  assert failures == []
  (run,) = report.read_runs(tmp_path / "runs")
  assert run["model"]["attention"] == "mla" and 0 <= run["test_accuracy_final"] <= 1
