"""`softcap` (tanh soft-capping of the scores) and segment ids (packed sequences) on every exact
variant that accepts them, against a dense float64 softmax oracle written here (output and
gradients, f32 within 1e-5); packed model rows against the sequences run apart, with attention,
sequence mixers and short convolutions; the refusals. Each mixer's own packed check is the
conformance suite's `packed`.
The Pallas kernels' own checks are in tests/ops/test_flash.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_zoo as az
from attention_zoo import models, registry
from attention_zoo.testing import conformance
from helpers import packed_vs_apart

LEN, NUM_HEADS = 20, conformance.NUM_HEADS
CAP = 1.0   # small enough to bite: the scaled scores here are ~N(0, 1)
# flash's Pallas kernels are interpreted on CPU (slow): here its chunked path, which the
# kernels are checked against in tests/ops/test_flash.py
OPTIONS = {"flash": dict(impl="chunked", block_q=8, block_k=8, block_q_bwd=None,
                         block_k_bwd=None)}
# contiguous documents that cross the variants' block edges, different per batch row
SEGMENTS = jnp.asarray(np.stack([np.repeat([0, 1, 2], [7, 9, 4]), np.repeat([5, 6], [13, 7])]))
SLOPES = jnp.linspace(0.5, 0.0625, NUM_HEADS)


def dense_oracle(q, k, v, allowed, *, scale, cap=None, slopes=None):
  """softmax(cap(q·k · scale) + ALiBi) over `allowed` [b, h|1, q, kv] in float64; rows that see
  no key give 0."""
  with jax.enable_x64(True):
    q, k, v = (jnp.asarray(x, jnp.float64) for x in (q, k, v))
    k, v = (jnp.repeat(x, q.shape[2] // k.shape[2], axis=2) for x in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if cap is not None:
      scores = cap * jnp.tanh(scores / cap)
    if slopes is not None:
      i, j = np.arange(q.shape[1])[:, None], np.arange(k.shape[1])[None, :]
      scores = scores - jnp.asarray(slopes, jnp.float64)[:, None, None] * np.abs(i - j)
    allowed = jnp.broadcast_to(allowed, scores.shape)
    top = jax.lax.stop_gradient(jnp.max(jnp.where(allowed, scores, -jnp.inf), -1, keepdims=True))
    weights = jnp.where(allowed, jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    total = weights.sum(-1, keepdims=True)
    return jnp.einsum("bhqk,bkhd->bqhd", weights / jnp.where(total > 0, total, 1.0), v)


def assert_matches_oracle(attend, oracle, seed):
  q, k, v = conformance.inputs(seed)
  cotangent = jax.random.normal(jax.random.key(seed + 1), q.shape)

  def out_and_grads(f, q, k, v):
    out, pull = jax.vjp(f, q, k, v)
    return (out, *pull(cotangent.astype(out.dtype)))
  got = jax.jit(out_and_grads, static_argnums=0)(attend, q, k, v)
  with jax.enable_x64(True):
    want = out_and_grads(oracle, q, k, v)
  for what, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    assert g.dtype == jnp.float32, what
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=0, err_msg=what)


def fast_for(names, fast):
  """Every name, the slow lane for those outside `fast` (the fast lane's representatives)."""
  return [pytest.param(n, marks=() if n in fast else pytest.mark.slow) for n in names]


def test_which_variants_accept_them():
  exact = {n for n in az.available("attention") if az.spec(n).exact}
  assert set(registry.accepting("supports_softcap")) == exact
  mixers = set(az.available("mixer"))           # every one: tests/test_packed_mixers.py
  assert set(registry.accepting("supports_segment_ids")) == exact | mixers
  assert az.spec("full").options["softcap"] is None            # off by default


@pytest.mark.parametrize("name", fast_for(registry.accepting("supports_softcap"),
                                          {"full", "sliding_window"}))
def test_softcap_equals_the_dense_oracle(name):
  """Capped scores, then ALiBi, over the variant's pattern() and the padding masks."""
  attn = conformance.build(name, softcap=CAP, **OPTIONS.get(name, {}))
  mask = conformance.padding_mask(LEN)
  allowed = (np.asarray(attn.pattern(LEN, LEN))[None] & np.asarray(mask)[:, None, :, None]
             & np.asarray(mask)[:, None, None, :])
  attend = lambda q, k, v: attn(q, k, v, q_mask=mask, kv_mask=mask, alibi_slopes=SLOPES)
  oracle = lambda q, k, v: dense_oracle(q, k, v, allowed, scale=attn.scale, cap=CAP,
                                        slopes=SLOPES)
  assert_matches_oracle(attend, oracle, seed=3)


@pytest.mark.parametrize("name", fast_for(
    sorted(set(registry.accepting("supports_segment_ids")) & set(az.available("attention"))),
    {"flash", "bigbird"}))
def test_segment_ids_equal_the_dense_oracle(name):
  """Causal packed rows: the pattern AND the same-segment mask (and the padding masks)."""
  attn = conformance.build(name, causal=True, **OPTIONS.get(name, {}))
  mask = conformance.padding_mask(LEN)
  same = np.asarray(SEGMENTS)[:, :, None] == np.asarray(SEGMENTS)[:, None, :]
  allowed = (np.asarray(attn.pattern(LEN, LEN))[None] & same[:, None]
             & np.asarray(mask)[:, None, :, None] & np.asarray(mask)[:, None, None, :])
  attend = lambda q, k, v: attn(q, k, v, q_mask=mask, kv_mask=mask, q_segment_ids=SEGMENTS,
                                kv_segment_ids=SEGMENTS)
  assert_matches_oracle(attend, lambda q, k, v: dense_oracle(q, k, v, allowed, scale=attn.scale),
                        seed=5)


def test_refusals_name_the_variants_that_accept():
  with pytest.raises(ValueError, match="performer does not accept softcap.*variants that do: "
                                       "bigbird, flash, full"):
    conformance.build("performer", softcap=30.0)
  with pytest.raises(ValueError, match="softcap=0"):
    conformance.build("full", softcap=0)
  q, k, v = conformance.inputs(0)
  ids = jnp.zeros((2, LEN), jnp.int32)
  with pytest.raises(ValueError, match="performer does not accept segment ids.*variants that do: "
                                       "bigbird, flash, full"):
    conformance.build("performer")(q, k, v, q_segment_ids=ids, kv_segment_ids=ids)
  full = conformance.build("full")
  with pytest.raises(ValueError, match="both q_segment_ids and kv_segment_ids"):
    full(q, k, v, q_segment_ids=ids)
  with pytest.raises(ValueError, match="int \\[batch, len\\]"):
    full(q, k, v, q_segment_ids=ids[:, :5], kv_segment_ids=ids)
  with pytest.raises(ValueError, match="int \\[batch, len\\]"):
    full(q, k, v, q_segment_ids=ids.astype(jnp.float32), kv_segment_ids=ids)


@pytest.mark.parametrize("positions", ["rope", pytest.param("learned", marks=pytest.mark.slow)])
def test_a_packed_encoder_row_equals_its_sequences_apart(positions):
  config = models.TransformerConfig(vocab_size=11, emb_dim=16, num_heads=2, qkv_dim=16,
                                    mlp_dim=32, num_layers=2, max_len=LEN, positions=positions,
                                    attention="sliding_window",
                                    attention_options=dict(window=4, softcap=5.0))
  packed_vs_apart(models.Encoder, config)


def test_a_packed_causal_decoder_row_equals_its_sequences_apart():
  config = models.TransformerConfig(vocab_size=11, emb_dim=16, num_heads=2, qkv_dim=16,
                                    mlp_dim=32, num_layers=2, max_len=LEN, positions="sinusoidal",
                                    attention="full", remat="block")
  packed_vs_apart(models.DecoderLM, config)


@pytest.mark.parametrize("attention, causal, short_conv", [
    # bidirectional, the reversed pass restarting too (the fast lane: conformance's `packed`)
    pytest.param("gated_deltanet", False, 0, marks=pytest.mark.slow),
    ("mamba2", True, 3),                   # its own convolution and the block's
    pytest.param("full", True, 3, marks=pytest.mark.slow),
    pytest.param("retnet", True, 0, marks=pytest.mark.slow),   # its RoPE restarts per run
    pytest.param("fox", False, 0, marks=pytest.mark.slow)])
def test_a_packed_row_with_mixers_or_short_convolutions_equals_its_sequences_apart(
    attention, causal, short_conv):
  options = {**conformance.settings(attention).options, **({} if attention == "full" else
                                                           {"bidirectional": not causal})}
  config = models.TransformerConfig(vocab_size=11, emb_dim=16, num_heads=2, qkv_dim=16,
                                    mlp_dim=32, num_layers=2, max_len=LEN, attention=attention,
                                    attention_options=options, short_conv=short_conv,
                                    positions="learned")
  packed_vs_apart(models.DecoderLM if causal else models.Encoder, config)


def test_mixer_refusals_of_segment_ids():
  mixer = conformance.build_mixer("deltanet", causal=True)
  x, ids = conformance.mixer_input(0), jnp.zeros((2, LEN), jnp.int32)
  with pytest.raises(ValueError, match="deltanet: segment_ids must be int \\[batch, len\\]"):
    mixer(x, segment_ids=ids[:, :5])
  mixer.init_cache(2, LEN)
  with pytest.raises(ValueError, match="segment_ids .* not to decoding"):
    mixer(x[:, :1], decode=True, segment_ids=ids[:, :1])

  with az.scoped_registry():
    @az.register_mixer("no_packing", complexity="O(n)", paper="none")
    class NoPacking(type(mixer)):
      pass
    with pytest.raises(ValueError, match="no_packing does not accept segment ids.*the mixers that "
                                         "do: .*deltanet, fox"):
      conformance.build_mixer("no_packing")(x, segment_ids=ids)

