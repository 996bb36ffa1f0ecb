"""Canon layers (Allen-Zhu 2025): the layer against an independent numpy oracle of the causal
depthwise convolution plus residual (masked tokens entering as zeros), a Block with canon="ABCD"
against the same block assembled by hand in float64, causality, padding, decoding, packed
sequences, the errors, and the harness's dry run with --config.model.canon=ABCD."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attention_zoo.convolution import Canon
from attention_zoo.models import Block, DecoderLM, TransformerConfig
from command_runner import REPO, run_commands
from helpers import packed_vs_apart, padding_mask

CONFIG = TransformerConfig(vocab_size=24, max_len=32, num_layers=2, emb_dim=16, num_heads=4,
                           num_kv_heads=2, mlp_dim=24, dropout_rate=0.0, positions="none",
                           canon="ABCD")
run = nnx.jit(lambda model, *args, **kw: model(*args, **kw))


def canon64(x, weight, mask):
  """y_t = x_t + Σ_{i < 4, i <= t} w_i · x_{t-i} · m_{t-i}, float64: x [b, n, f], w [4, f]."""
  x, weight = np.asarray(x, np.float64), np.asarray(weight, np.float64)
  real = x * np.asarray(mask, np.float64)[..., None]
  out = x.copy()
  for t in range(x.shape[1]):
    for i in range(min(len(weight), t + 1)):
      out[:, t] += weight[i] * real[:, t - i]
  return out


def test_the_layer_is_a_causal_depthwise_convolution_plus_its_input_padding_as_zeros():
  layer = Canon(6, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 9, 6))
  mask = padding_mask(2, 9, hole=3, tail=2)
  want = canon64(x, layer.conv.weight[...], mask)
  np.testing.assert_allclose(layer(x, mask), want, atol=1e-6)
  assert layer.conv.bias is None                    # bias-free, as the authors' default
  layer.init_cache(2)                               # decoding: 2 tokens, then 1 at a time
  stepped = [layer(x[:, :2], mask[:, :2], decode=True)]
  stepped += [layer(x[:, t:t + 1], mask[:, t:t + 1], decode=True) for t in range(2, 9)]
  np.testing.assert_allclose(jnp.concatenate(stepped, 1), want, atol=1e-6)


def layer_norm64(norm, x, eps):
  mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * np.asarray(norm.scale[...]) + np.asarray(norm.bias[...])


def dense64(layer, x):
  return x @ np.asarray(layer.kernel[...], np.float64) + np.asarray(layer.bias[...], np.float64)


def test_a_block_with_canon_abcd_equals_the_block_assembled_by_hand():
  """Pre-LN, causal `full` attention with GQA, a hole and a padded tail: A after the norm
  before attention, B on the q/k/v projections, C after the norm before the MLP, D on the up
  projection before the GELU; each residual around its own convolution."""
  block = Block(CONFIG, causal=True, cross=False, max_len=CONFIG.max_len, rngs=nnx.Rngs(0))
  b, n, heads, kv_heads, d = 2, 11, 4, 2, 4
  x = jax.random.normal(jax.random.key(2), (b, n, CONFIG.emb_dim))
  mask = padding_mask(b, n, hole=4, tail=3)
  got = np.asarray(run(block, x, mask))
  m, eps, attn = np.asarray(mask), CONFIG.layer_norm_epsilon, block.self_attention
  conv = lambda layer, h: canon64(h, layer.conv.weight[...], m)

  h = conv(block.canon_attention, layer_norm64(block.self_norm, np.asarray(x, np.float64), eps))
  qkv = conv(attn.canon, np.concatenate([dense64(p, h) for p in (attn.query, attn.key,
                                                                 attn.value)], -1))
  q, k, v = np.split(qkv, [heads * d, (heads + kv_heads) * d], -1)
  q = q.reshape(b, n, heads, d)
  k, v = (np.repeat(y.reshape(b, n, kv_heads, d), heads // kv_heads, 2) for y in (k, v))
  scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
  seen = np.tril(np.ones((n, n), bool))[None, None] & m[:, None, None, :]
  weights = np.where(seen, np.exp(scores - scores.max(-1, keepdims=True)), 0)
  out = np.einsum("bhqk,bkhd->bqhd", weights / weights.sum(-1, keepdims=True), v)
  x1 = np.asarray(x, np.float64) + dense64(attn.out, out.reshape(b, n, heads * d))

  h = conv(block.canon_mlp, layer_norm64(block.mlp_norm, x1, eps))
  up = conv(block.mlp.canon, dense64(block.mlp.up, h))
  gelu = 0.5 * up * (1 + np.tanh(np.sqrt(2 / np.pi) * (up + 0.044715 * up ** 3)))
  want = x1 + dense64(block.mlp.down, gelu)
  np.testing.assert_allclose(got[m], want[m], atol=2e-5)


def test_a_causal_lm_with_canon_is_causal_ignores_padding_and_decodes_as_it_runs():
  lm = DecoderLM(dataclasses.replace(CONFIG, positions="rope"), rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(3), (2, 10), 0, 24)
  logits = run(lm, tokens)
  later = tokens.at[:, 6].set((tokens[:, 6] + 1) % 24)
  changed = run(lm, later)
  np.testing.assert_allclose(changed[:, :6], logits[:, :6], atol=1e-6)
  assert float(jnp.abs(changed[:, 6:] - logits[:, 6:]).max()) > 1e-3
  mask = padding_mask(2, 10, hole=4, tail=2)
  padded = run(lm, tokens, mask)
  noisy = run(lm, jnp.where(mask, tokens, (tokens + 5) % 24), mask)
  np.testing.assert_allclose(noisy[mask], padded[mask], atol=1e-6)

  lm.init_cache(2, 12)
  step = nnx.jit(lambda lm, token: lm.decode_step(token))
  stepped = jnp.stack([step(lm, tokens[:, t:t + 1]) for t in range(10)], 1)
  np.testing.assert_allclose(stepped, logits, atol=1e-5)


def test_a_packed_row_with_canon_equals_its_sequences_apart():
  packed_vs_apart(DecoderLM, CONFIG)


@pytest.mark.slow
def test_a_mixer_takes_canon_acd_and_decodes_as_it_runs():
  lm = DecoderLM(dataclasses.replace(CONFIG, attention="gla", canon="ACD"), rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(4), (2, 7), 0, 24)
  logits = run(lm, tokens)
  lm.init_cache(2, 7)
  stepped = jnp.stack([lm.decode_step(tokens[:, t:t + 1]) for t in range(7)], 1)
  np.testing.assert_allclose(stepped, logits, atol=1e-5)


@pytest.mark.parametrize("canon, message", [
    ("AE", "canon='AE'; give each of the points ABCD at most once"),
    ("AA", "canon='AA'; give each of the points ABCD at most once")])
def test_a_canon_string_outside_abcd_is_refused(canon, message):
  with pytest.raises(ValueError, match=message):
    dataclasses.replace(CONFIG, canon=canon)


def test_point_b_on_a_mixer_is_refused_naming_what_works():
  with pytest.raises(ValueError, match="mixer 'gla' owns its projections.*'ACD'"):
    DecoderLM(dataclasses.replace(CONFIG, attention="gla"), rngs=nnx.Rngs(0))


def test_the_harness_dry_run_builds_a_model_with_canon_abcd(tmp_path):
  (result,) = run_commands([["experiments.train", "--config=configs/mqar.py:full",
                             f"--workdir={tmp_path}", "--config.model.canon=ABCD",
                             "--dry_run"]], cwd=REPO)
  assert result["code"] == 0, result["stderr"][-2000:]
  for layer in ("['canon_attention']", "['self_attention']['canon']", "['canon_mlp']",
                "['mlp']['canon']"):
    assert f"params['decoder']['blocks'][1]{layer}['conv']['weight'] [4, " in result["stdout"]
