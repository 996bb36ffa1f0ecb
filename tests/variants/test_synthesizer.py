"""Synthesizer attention: every mode against its formula written out in numpy."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attention_zoo as az
from helpers import create_variant, padding_mask, random_qkv

B, H, KVH, D, MAX_LEN, N = 2, 4, 2, 8, 16, 12


def make(mode, mix, causal=False, seed=0, max_len=MAX_LEN, **options):
  return create_variant("synthesizer", num_heads=H, head_dim=D, num_kv_heads=KVH, causal=causal,
                        max_len=max_len, model_seed=seed, mode=mode, mix_dot_product=mix, k=3,
                        **options)


def qkv(seed=0, n=N):
  return random_qkv(seed, batch=B, q_len=n, num_heads=H, num_kv_heads=KVH, head_dim=D)


def padding():
  return padding_mask(B, N, hole=2, tail=4)


def params(attn):
  return {path[-1]: var[...] for path, var in nnx.state(attn, nnx.Param).flat_state()}


@nnx.jit
def forward(attn, q, k, v, mask):
  return attn(q, k, v, q_mask=mask, kv_mask=mask)


def mixture_weights(attn):
  """α for (synthesized, dot product): softmax of the learned logits, or (1, 1) for a plain sum."""
  if attn.mixture_logits is None:
    return 1.0, 1.0
  a = np.asarray(attn.mixture_logits[...], np.float64)
  return tuple(np.exp(a) / np.exp(a).sum())


def formula(attn, q, k, v, mask, weights=None):
  """The synthesizer written out: logits from the parameters (sliced to N), mixed with
  QKᵀ/sqrt(d) by `weights` (default: the module's α) if mixed, masked, softmax, times the
  values of each head's K/V group."""
  q, k, v, mask = (np.asarray(x, np.float64) for x in (q, k, v, mask))
  p = {name: np.asarray(value, np.float64) for name, value in params(attn).items()}
  n = q.shape[1]
  if attn.mode == "random":
    logits = np.broadcast_to(p["random"][:, :n, :n], (B, H, n, n))
  elif attn.mode == "factorized_random":
    logits = np.broadcast_to(p["random_left"][:, :n] @ p["random_right"][:, :, :n], (B, H, n, n))
  else:
    logits = np.zeros((B, H, n, n))
    for h in range(H):
      hidden = np.maximum(q[:, :, h] @ p["hidden_kernel"][h] + p["hidden_bias"][h], 0)   # [b, n, d]
      logits[:, h] = hidden @ p["logit_kernel"][h][:, :n] + p["logit_bias"][h][:n]
  k_h, v_h = np.repeat(k, H // KVH, axis=2), np.repeat(v, H // KVH, axis=2)
  if attn.mix_dot_product:
    synthesized_weight, dot_weight = mixture_weights(attn) if weights is None else weights
    dot = np.einsum("bqhd,bkhd->bhqk", q, k_h) / np.sqrt(D)
    logits = synthesized_weight * logits + dot_weight * dot
  allowed = np.broadcast_to(mask[:, None, None, :] > 0, logits.shape)
  if attn.causal:
    allowed = allowed & np.tril(np.ones((n, n), bool))
  logits = np.where(allowed, logits, -np.inf)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  return np.einsum("bhqk,bkhd->bqhd", weights, v_h) * mask[:, :, None, None]


@pytest.mark.parametrize("mode, mix, causal", [
    ("dense", True, False), ("dense", False, True), ("random", True, True),
    ("random", False, False), ("factorized_random", True, False),
    ("factorized_random", False, True)])
def test_mode_matches_its_formula(mode, mix, causal):
  attn = make(mode, mix, causal)
  q, k, v = qkv(1)
  mask = padding()
  np.testing.assert_allclose(forward(attn, q, k, v, mask), formula(attn, q, k, v, mask), atol=1e-5)


@pytest.mark.parametrize("mode", ["dense", "factorized_random"])
def test_padding_and_causal_mask_the_synthesized_logits(mode):
  """Without the dot product: padded tokens and future tokens change no real / earlier output."""
  attn = make(mode, mix=False, causal=True)
  q, k, v = qkv(2)
  mask = padding()
  out = forward(attn, q, k, v, mask)
  noise = qkv(3)
  pad = ~mask[:, :, None, None]
  changed = forward(attn, *(jnp.where(pad, x + 3 * e, x) for x, e in zip((q, k, v), noise)), mask)
  np.testing.assert_allclose(changed, out, atol=1e-6)
  future = jnp.arange(N)[None, :, None, None] >= 7
  changed = forward(attn, *(jnp.where(future, x + 3 * e, x) for x, e in zip((q, k, v), noise)),
                    mask)
  np.testing.assert_allclose(changed[:, :7], out[:, :7], atol=1e-6)
  assert float(jnp.abs(changed[:, 7:] - out[:, 7:]).max()) > 1e-3


def test_learned_mixture_starts_as_an_equal_average():
  """At initialisation α = (1/2, 1/2): half the synthesized plus half the dot-product logits."""
  attn = make("random", True)
  q, k, v = qkv(4)
  mask = padding()
  out = forward(attn, q, k, v, mask)
  np.testing.assert_allclose(out, formula(attn, q, k, v, mask, (0.5, 0.5)), atol=1e-5)
  assert float(np.abs(out - formula(attn, q, k, v, mask, (1.0, 1.0))).max()) > 1e-2


@nnx.jit
def mixture_gradient(attn, q, k, v, mask):
  grads = nnx.grad(lambda m: jnp.sum(m(q, k, v, q_mask=mask, kv_mask=mask) ** 2))(attn)
  return grads.mixture_logits[...]


@pytest.mark.parametrize("mode", ["dense", "factorized_random"])
def test_learned_mixture_weights_train_and_follow_the_softmax(mode):
  attn = make(mode, True, causal=True)
  q, k, v = qkv(5)
  mask = padding()
  assert float(jnp.abs(mixture_gradient(attn, q, k, v, mask)).sum()) > 0
  attn.mixture_logits[...] = jnp.array([1.0, -0.5])
  weights = np.exp([1.0, -0.5]) / np.exp([1.0, -0.5]).sum()
  expected = formula(attn, q, k, v, mask, tuple(weights))
  np.testing.assert_allclose(forward(attn, q, k, v, mask), expected, atol=1e-5)


def test_sum_mixture_is_the_plain_sum():
  """mixture="sum": softmax(B + QKᵀ/sqrt(d)) with no mixture parameter (the behaviour before
  learned weights); the other parameters are drawn as with the learned mixture."""
  summed, learned = make("random", True, mixture="sum"), make("random", True)
  assert summed.mixture_logits is None and set(params(summed)) == {"random"}
  np.testing.assert_array_equal(summed.random[...], learned.random[...])
  q, k, v = qkv(6)
  mask = padding()
  expected = formula(summed, q, k, v, mask, (1.0, 1.0))
  np.testing.assert_allclose(forward(summed, q, k, v, mask), expected, atol=1e-5)


def test_parameters_are_sized_by_max_len():
  shapes = {m: {name: p.shape for name, p in params(make(m, True)).items()}
            for m in ("random", "factorized_random", "dense")}
  assert shapes["random"] == {"random": (H, MAX_LEN, MAX_LEN), "mixture_logits": (2,)}
  assert shapes["factorized_random"] == {"random_left": (H, MAX_LEN, 3),
                                         "random_right": (H, 3, MAX_LEN), "mixture_logits": (2,)}
  assert shapes["dense"]["logit_kernel"] == (H, D, MAX_LEN)


def test_bad_configuration():
  with pytest.raises(ValueError, match="max_len"):
    az.create("synthesizer", num_heads=H, head_dim=D, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="mode"):
    make("sparse", True)
  with pytest.raises(ValueError, match="mixture"):
    make("random", True, mixture="average")
  with pytest.raises(ValueError, match="option k=0 is invalid"):
    az.create("synthesizer", num_heads=H, head_dim=D, max_len=MAX_LEN, rngs=nnx.Rngs(0), k=0)
  q, k, v = qkv(0, n=MAX_LEN + 4)
  with pytest.raises(ValueError, match="exceeds max_len"):
    make("random", True)(q, k, v)
  with pytest.raises(ValueError, match="self-attention"):
    make("random", True)(q[:, :4], k[:, :8], v[:, :8])


@pytest.mark.slow
def test_finite_at_4k_in_bf16():
  """16K is not run: the synthesizer forms n × n logits by nature (at 16K, 1 GiB of f32 per head
  for the logits alone, and `random` needs 268M parameters per head); 4K with factorized_random."""
  n = 4096
  attn = az.create("synthesizer", num_heads=1, head_dim=16, max_len=n, rngs=nnx.Rngs(0),
                   mode="factorized_random")
  x = jax.random.normal(jax.random.key(0), (1, n, 1, 16), jnp.bfloat16)
  out = nnx.jit(lambda m, x: m(x, x, x))(attn, x)
  assert out.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(out)))
