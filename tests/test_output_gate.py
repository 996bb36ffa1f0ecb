"""The output gate of MultiHeadAttention (Qiu et al. 2025, Gated Attention for LLMs): each head's
output times sigmoid(x W_g + b_g), headwise or elementwise, against a hand-written gated layer;
its shapes, W_g = 0 giving exactly half the ungated output, decoding, the errors, and the
option reaching a model through TransformerConfig and the harness's config."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attention_zoo as az
from attention_zoo.layers import MultiHeadAttention
from attention_zoo.models import TransformerConfig
from command_runner import REPO, run_commands
from helpers import normal

EMB, HEADS, KV_HEADS, N = 16, 4, 2, 7


def layer(output_gate, attention="full", causal=False, **options):
  return MultiHeadAttention(EMB, HEADS, num_kv_heads=KV_HEADS, attention=attention,
                            attention_options=options, causal=causal, output_gate=output_gate,
                            rngs=nnx.Rngs(0))


def gated_by_hand(mha, x, mask):
  """The gated layer written out: projections, softmax attention per head (K/V repeated for
  GQA), each head's output times sigmoid(x W_g + b_g), the out projection."""
  b, n, _ = x.shape
  d = mha.head_dim
  q = mha.query(x).reshape(b, n, HEADS, d)
  k, v = (jnp.repeat(p(x).reshape(b, n, KV_HEADS, d), HEADS // KV_HEADS, axis=2)
          for p in (mha.key, mha.value))
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") / np.sqrt(d)
  weights = jax.nn.softmax(jnp.where(mask[:, None, None, :], scores, -jnp.inf), axis=-1)
  heads = jnp.einsum("bhqk,bkhd->bqhd", weights, v, precision="highest")    # [b, n, h, d]
  gate = jax.nn.sigmoid(x @ mha.gate.kernel[...] + mha.gate.bias[...]).reshape(b, n, HEADS, -1)
  heads = jnp.where(mask[:, :, None, None], heads * gate, 0.0)
  return heads.reshape(b, n, HEADS * d) @ mha.out.kernel[...] + mha.out.bias[...]


@pytest.mark.parametrize("output_gate, width", [("headwise", HEADS), ("elementwise", EMB)])
def test_gate_shapes_and_equality_with_the_hand_written_layer(output_gate, width):
  mha = layer(output_gate)
  assert mha.gate.kernel.shape == (EMB, width) and mha.gate.bias.shape == (width,)
  assert not np.allclose(mha.gate.kernel[...], 0)               # drawn like the projections
  x = normal(1, (2, N, EMB))
  mask = jnp.asarray(np.arange(N)[None] < np.array([[N], [N - 2]]))
  got = mha(x, mask=mask)
  want = gated_by_hand(mha, x, mask)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_no_gate_by_default_and_a_zero_gate_halves_the_output():
  """W_g = 0, b_g = 0: every gate is sigmoid(0) = 1/2, so the layer (its out projection's bias
  aside) gives half the ungated output."""
  plain = layer("none")
  assert plain.gate is None
  x = normal(2, (2, N, EMB))
  for output_gate in ("headwise", "elementwise"):
    gated = layer(output_gate)   # the same seed: the same q/k/v/out projections
    gated.gate.kernel[...] = jnp.zeros_like(gated.gate.kernel[...])
    bias = plain.out.bias[...]
    np.testing.assert_allclose(np.asarray(gated(x) - bias), np.asarray(plain(x) - bias) / 2,
                               atol=1e-6)


@pytest.mark.parametrize("output_gate", ["headwise", "elementwise"])
def test_decoding_with_the_gate_equals_the_causal_forward(output_gate):
  mha = layer(output_gate, attention="sliding_window", causal=True, window=3)
  x = normal(3, (2, N, EMB))
  full = mha(x)
  mha.init_cache(2, N)
  steps = [mha(x[:, t:t + 1], decode=True) for t in range(N)]
  np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, 1)), np.asarray(full), atol=1e-5)


def test_bad_values_and_mixers_are_refused():
  with pytest.raises(ValueError, match="output_gate must be one of none, headwise, elementwise"):
    layer("channelwise")
  with pytest.raises(ValueError, match="output_gate must be 'none'"):
    az.create_mixer("gla", emb_dim=EMB, num_heads=HEADS, output_gate="headwise",
                    rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="TransformerConfig.output_gate='per_head'"):
    TransformerConfig(output_gate="per_head")


def test_the_model_config_reaches_every_blocks_gate():
  config = TransformerConfig(attention="flash", num_layers=2, emb_dim=EMB, num_heads=HEADS,
                             output_gate="headwise", max_len=16)
  model = az.models.DecoderLM(config, rngs=nnx.Rngs(0))
  kernels = [block.self_attention.gate.kernel.shape for block in model.decoder.blocks]
  assert kernels == [(EMB, HEADS)] * 2


@pytest.mark.slow
def test_the_harness_dry_run_builds_a_gated_model(tmp_path):
  (run,) = run_commands([["experiments.train", "--config=configs/mqar.py:full",
                          "--config.model.output_gate=elementwise", f"--workdir={tmp_path}",
                          "--dry_run"]], cwd=REPO)
  assert run["code"] == 0, run["stderr"][-2000:]
  assert "['self_attention']['gate']['kernel'] [64, 64]" in run["stdout"]
