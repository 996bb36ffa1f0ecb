"""Attention sinks (the `sink` option: a learned logit per head in the softmax's denominator)
against a float64 oracle written from the definition, p_ij = e^{x_ij} / (e^{s_h} + Σ_k e^{x_ik}):
every path that applies them (the dense path, the block-sparse engine, the Pallas kernels of
GPU and TPU, interpreted) in output and gradients (q, k, v and the sink logits), causal, GQA,
padded, and a row that sees no key (0, finite gradients). Also the option's declaration and
refusals. The per-variant check (no sink at -inf, a shrink of each row, the dense oracle) is
the conformance suite's `sinks`."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import tpu as pltpu

import attention_zoo as az
from attention_zoo import contract
from attention_zoo.ops import flex, softmax
from attention_zoo.ops.flash import pallas_gpu, pallas_tpu
from attention_zoo.variants import full
from helpers import create_variant, normal, random_qkv, rel_err

Q_LEN, KV_LEN, HEADS, KV_HEADS, DIM = 13, 21, 4, 2, 8
SINKS = jnp.asarray([-1.0, 0.0, 1.5, 3.0])


def sink_attention64(q, k, v, sinks, kv_mask, causal):
  """Softmax over the allowed keys plus a sink column of logit s_h that carries no value, in
  float64; K/V heads repeated; bottom-right causal rule."""
  q, k, v, sinks = (jnp.asarray(x, jnp.float64) for x in (q, k, v, sinks))
  group = q.shape[2] // k.shape[2]
  k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
  q_len, kv_len = q.shape[1], k.shape[1]
  allowed = jnp.asarray(kv_mask)[:, None, None, :]
  if causal:
    allowed = allowed & (np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None] + kv_len - q_len)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  scores = jnp.where(allowed, scores, -jnp.inf)
  sink_column = jnp.broadcast_to(sinks[None, :, None, None], scores.shape[:-1] + (1,))
  weights = jax.nn.softmax(jnp.concatenate([scores, sink_column], -1), axis=-1)[..., :-1]
  return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def dense(q, k, v, sinks, kv_mask, causal):
  return softmax.masked_softmax_attention(q, k, v, kv_mask=kv_mask, causal=causal, sinks=sinks)


def engine(q, k, v, sinks, kv_mask, causal):
  mask = (flex.create_block_mask(flex.causal_mask(Q_LEN, KV_LEN), None, None, Q_LEN, KV_LEN,
                                 block_q=4, block_k=8) if causal
          else flex.full_block_mask(Q_LEN, KV_LEN, block_q=4, block_k=8))
  return flex.flex_attention(q, k, v, block_mask=mask, kv_mask=kv_mask, sinks=sinks)


def gpu_kernels(q, k, v, sinks, kv_mask, causal):
  return pallas_gpu.flash_attention(q, k, v, kv_mask, causal=causal, scale=DIM ** -0.5,
                                    block_q=8, block_k=8, block_q_bwd=8, block_k_bwd=4,
                                    interpret=True, sinks=sinks)


def tpu_kernels(q, k, v, sinks, kv_mask, causal):
  return pallas_tpu.flash_attention(q, k, v, kv_mask, causal=causal, scale=DIM ** -0.5,
                                    block_q=8, block_k=16, block_q_bwd=16, block_k_bwd=16,
                                    interpret=pltpu.InterpretParams(), sinks=sinks)


@pytest.mark.parametrize("path, causal", [
    (dense, True), (engine, False), (engine, True), (gpu_kernels, True),
    pytest.param(dense, False, marks=pytest.mark.slow),
    pytest.param(gpu_kernels, False, marks=pytest.mark.slow),
    pytest.param(tpu_kernels, True, marks=pytest.mark.slow)])
def test_each_path_equals_the_float64_oracle(path, causal):
  q, k, v = random_qkv(0, q_len=Q_LEN, kv_len=KV_LEN, num_heads=HEADS, num_kv_heads=KV_HEADS,
                       head_dim=DIM)
  kv_mask = np.ones((2, KV_LEN), bool)
  kv_mask[0, 4] = False
  kv_mask[1] = False             # row 1 sees no key: output 0, finite gradients
  kv_mask = jnp.asarray(kv_mask)
  cotangent = normal(5, q.shape)
  out, pull = jax.vjp(lambda *args: path(*args, kv_mask, causal), q, k, v, SINKS)
  grads = pull(cotangent)
  with jax.enable_x64(True):
    want, pull_want = jax.vjp(lambda *args: sink_attention64(*args, kv_mask, causal),
                              q, k, v, SINKS)
    grads_want = pull_want(jnp.asarray(cotangent, jnp.float64))
  assert np.all(np.asarray(out[1]) == 0) and rel_err(out, want) < 1e-5
  for what, got, ref in zip(("dq", "dk", "dv", "dsinks"), grads, grads_want):
    assert bool(jnp.all(jnp.isfinite(got))), what
    assert rel_err(got, ref) < 1e-5, what


def test_the_option_starts_as_one_key_of_score_zero():
  """sink=True adds one parameter per head, zeros: the sink weighs like a key of score 0 (a
  row of n equal scores x keeps n e^x / (n e^x + 1) of its output)."""
  attn = create_variant("full", sink=True)
  assert attn.sink_logits.shape == (4,) and not np.any(attn.sink_logits[...])
  assert create_variant("full").sink_logits is None
  q = jnp.zeros((2, 5, 4, 8))
  k, v = jnp.zeros((2, 5, 2, 8)), jnp.ones((2, 5, 2, 8))
  np.testing.assert_allclose(np.asarray(attn(q, k, v)), 5 / 6, rtol=1e-6)


def test_the_declared_variants_and_the_refusals(monkeypatch):
  assert {"full", "flash", "local", "sliding_window"} <= set(az.registry.accepting(
      "supports_sinks"))
  with pytest.raises(ValueError, match="performer does not accept sink .* variants that do: "):
    create_variant("performer", sink=True)
  assert "no attention sinks" in full.cudnn_refusal(jnp.zeros((1, 8, 1, 8)),
                                                    jnp.zeros((1, 8, 1, 8)), causal=False,
                                                    dropout=False, sinks=True)
  q = jnp.zeros((1, 8, 1, 8), jnp.bfloat16)
  assert not full.auto_picks_cudnn(q, q, causal=False, dropout=False, backend="gpu", sinks=True)
  attn = az.create("full", num_heads=1, head_dim=8, sink=True, rngs=nnx.Rngs(0))
  monkeypatch.setattr(contract, "context_size", lambda: 2)
  with pytest.raises(ValueError, match="sink=True has no context-parallel form"):
    attn(q, q, q)
