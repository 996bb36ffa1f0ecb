"""Oracles for the kernelised variants, `performer` and `linear_transformer`.

The explicit O(n²) formulas are written here independently of `attention_zoo.variants.kernelized`:
A[i, j] = φ(q_i)·φ(k_j) over the allowed pairs, out = A V / A 1.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_zoo import reference
from attention_zoo.testing.conformance import apply
from helpers import decode_token_by_token, create_variant as build
from helpers import padding_mask, random_qkv, rel_err

HIGHEST = jax.lax.Precision.HIGHEST


def holes_mask(batch, length):
  """Row 0 unpadded; row 1 with a hole at position 2 and its last 3 positions padded."""
  return padding_mask(batch, length, hole=2, tail=3)


def explicit_kernel_attention(phi_q, phi_k, v, kv_mask, causal):
  """phi_q [b, q, h, m], phi_k [b, k, kvh, m], v [b, k, kvh, d]: the O(n²) formula."""
  group = phi_q.shape[2] // phi_k.shape[2]
  phi_k, v = jnp.repeat(phi_k, group, axis=2), jnp.repeat(v, group, axis=2)
  q_len, kv_len = phi_q.shape[1], phi_k.shape[1]
  allowed = kv_mask[:, None, None, :]                                       # [b, 1, 1, k]
  if causal:   # bottom-right: query i sees key j iff j <= i + kv_len - q_len
    allowed = allowed & (np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None] + kv_len - q_len)
  a = jnp.einsum("bqhm,bkhm->bhqk", phi_q, phi_k, precision=HIGHEST) * allowed  # [b, h, q, k]
  num = jnp.einsum("bhqk,bkhd->bqhd", a, v, precision=HIGHEST)
  den = jnp.sum(a, axis=-1).transpose(0, 2, 1)[..., None]                  # [b, q, h, 1]
  return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


def call(attn, q, k, v, **kwargs):
  return apply(attn, q, k, v, **kwargs)   # one compiled call; deterministic is static


# -- linear_transformer: the explicit formula ----------------------------------------------------

@pytest.mark.parametrize("causal,q_len,kv_len", [
    pytest.param(False, 9, 14, marks=pytest.mark.slow), (True, 14, 14),
    pytest.param(True, 9, 14, marks=pytest.mark.slow),
    pytest.param(True, 14, 9, marks=pytest.mark.slow)])
def test_linear_transformer_equals_explicit_formula(causal, q_len, kv_len):
  """Self- and cross-attention (bottom-right causal either way round), padded keys, GQA;
  output and gradients."""
  attn = build("linear_transformer", causal=causal, chunk_size=4)
  q, k, v = random_qkv(0, q_len=q_len, kv_len=kv_len)
  kv_mask = holes_mask(2, kv_len)
  phi = lambda x: jnp.where(x > 0, x + 1.0, jnp.exp(x))    # elu(x) + 1
  cotangent = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)

  @functools.partial(jax.jit, static_argnums=3)
  def output_and_grads(q, k, v, use_variant):
    fn = lambda q, k, v: (attn(q, k, v, kv_mask=kv_mask) if use_variant else
                          explicit_kernel_attention(phi(q), phi(k), v, kv_mask, causal))
    grads = jax.grad(lambda *x: jnp.sum(fn(*x) * cotangent), argnums=(0, 1, 2))(q, k, v)
    return fn(q, k, v), *grads

  got, expected = output_and_grads(q, k, v, True), output_and_grads(q, k, v, False)
  for g, e in zip(got, expected):    # output, dq, dk, dv
    assert rel_err(g, e) < 1e-5


@pytest.mark.parametrize("name", ["linear_transformer", "performer"])
def test_zeroed_padded_keys_are_kept_in_the_normaliser(name):
  """padded_keys="zeroed" (the Nyströmformer LRA code): padded keys and values become zeros
  and stay, so φ(0) joins every normaliser; the unpadded row is unchanged, the padded one
  shrinks towards zero by the weight of its zero keys."""
  options = {"nb_features": 24} if name == "performer" else {}
  zeroed = build(name, padded_keys="zeroed", **options)
  removed = build(name, **options)
  q, k, v = random_qkv(4, q_len=14)
  kv_mask = holes_mask(2, 14)
  real = kv_mask[:, :, None, None]
  zeros_kept = call(removed, q, jnp.where(real, k, 0.0), jnp.where(real, v, 0.0))
  got = call(zeroed, q, k, v, kv_mask=kv_mask)
  assert rel_err(got, zeros_kept) < 1e-5
  usual = call(removed, q, k, v, kv_mask=kv_mask)
  assert rel_err(got[0], usual[0]) < 1e-6 and rel_err(got[1], usual[1]) > 1e-2


def performer_pytorch(q, k, v, mask, omega):
  """float64 transcription of the Nyströmformer LRA code's Performer: its wrapper (q, k scaled by
  d^-1/4, k and v zeroed at padding) around performer-pytorch 0.15's FastAttention (softmax
  kernel: data scaled by d^-1/4 again, φ = exp(Ωx - |x|²/2 - max) + 1e-4, the max per query over
  its features and over the whole key tensor for keys; D⁻¹ φ(Q)(φ(K)ᵀV) with every key).
  q, k, v [b, n, h, d]; omega [h, m, d] (one projection per head)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  d = q.shape[-1]
  real = np.asarray(mask, np.float64)[:, :, None, None]
  q, k, v = q / d ** 0.25, k / d ** 0.25 * real, v * real

  def kernel(data, is_query):
    data = data * d ** -0.25
    dash = np.einsum("bnhd,hmd->bnhm", data, omega)
    diag = (data ** 2).sum(-1, keepdims=True) / 2
    top = dash.max(-1, keepdims=True) if is_query else dash.max()
    return np.exp(dash - diag - top) + 1e-4

  phi_q, phi_k = kernel(q, True), kernel(k, False)
  num = np.einsum("bnhm,bkhm,bkhe->bnhe", phi_q, phi_k, v)
  den = np.einsum("bnhm,bkhm->bnh", phi_q, phi_k)[..., None]
  return num / den


def test_performer_pytorch_stabiliser_equals_the_lra_codes_performer():
  """scale=1/head_dim (q and k scaled by d^-1/4 twice), padded_keys="zeroed", the
  performer_pytorch stabiliser, a fixed Ω: the light preset's Performer, against the
  transcription; and the floor matters (per_feature, the same otherwise, differs)."""
  options = dict(num_heads=2, num_kv_heads=2, nb_features=24, redraw=False, scale=1 / 8,
                 padded_keys="zeroed")
  attn = build("performer", stabiliser="performer_pytorch", **options)
  q, k, v = random_qkv(6, q_len=14, num_heads=2, num_kv_heads=2, std=3.0)
  kv_mask = holes_mask(2, 14)
  expected = performer_pytorch(q, k, v, kv_mask, np.asarray(attn.features[...], np.float64))
  out = call(attn, q, k, v, q_mask=kv_mask, kv_mask=kv_mask)
  real = np.asarray(kv_mask)
  assert rel_err(np.asarray(out)[real], expected[real]) < 1e-5
  usual = call(build("performer", **options), q, k, v, q_mask=kv_mask, kv_mask=kv_mask)
  assert rel_err(np.asarray(usual)[real], expected[real]) > 1e-3


def test_refusals():
  with pytest.raises(ValueError, match="temperature"):
    build("linear_transformer", scale=0.5)
  with pytest.raises(ValueError, match="dropout"):
    build("performer", dropout_rate=0.1)
  with pytest.raises(ValueError, match="features"):
    build("performer", kernel="relu", features="orthogonal")
  with pytest.raises(ValueError, match="kernel='relu'"):
    build("performer", features="deterministic")                 # softmax needs random features
  for option in (dict(nb_features=64), dict(redraw=False)):
    with pytest.raises(ValueError, match=f"{next(iter(option))} cannot apply"):
      build("performer", kernel="relu", features="deterministic", **option)
  with pytest.raises(ValueError, match="'per_feature' with kernel='relu'"):
    build("performer", kernel="relu", stabiliser="performer_pytorch")
  with pytest.raises(ValueError, match="'per_feature' when causal"):
    build("performer", causal=True, stabiliser="performer_pytorch")
  with pytest.raises(ValueError, match="padded_keys='dropped' is invalid"):
    build("linear_transformer", padded_keys="dropped")


# -- performer: the estimator, and its convergence to softmax ------------------------------------

@pytest.mark.parametrize("kernel", ["softmax", "relu"])
@pytest.mark.parametrize("causal", [False, True])
def test_performer_equals_its_explicit_estimator(kernel, causal):
  """The module computes exactly D⁻¹ φ(Q̂)(φ(K̂)ᵀV) with its stored Ω (stabilisers cancel)."""
  attn = build("performer", causal=causal, kernel=kernel, nb_features=24, chunk_size=4)
  q, k, v = random_qkv(2, q_len=14, kv_len=14)
  kv_mask = holes_mask(2, 14)
  omega = np.asarray(attn.features[...], np.float64)                        # [kvh, m, d]
  root_scale = 8 ** -0.25
  q64 = np.asarray(q, np.float64).reshape(2, 14, 2, 2, 8) * root_scale       # [b, n, kvh, g, d]
  k64 = np.asarray(k, np.float64) * root_scale
  q_proj = np.einsum("bnhgd,hmd->bnhgm", q64, omega).reshape(2, 14, 4, 24)
  k_proj = np.einsum("bnhd,hmd->bnhm", k64, omega)
  if kernel == "softmax":   # φ(x) = exp(Ωx - |x|²/2), no stabiliser
    phi_q = np.exp(q_proj - 0.5 * (q64 ** 2).sum(-1).reshape(2, 14, 4, 1))
    phi_k = np.exp(k_proj - 0.5 * (k64 ** 2).sum(-1, keepdims=True))
  else:                     # generalized attention: φ(x) = relu(Ωx) + 1e-3
    phi_q, phi_k = np.maximum(q_proj, 0) + 1e-3, np.maximum(k_proj, 0) + 1e-3
  expected = explicit_kernel_attention(jnp.asarray(phi_q), jnp.asarray(phi_k), v, kv_mask, causal)
  assert rel_err(call(attn, q, k, v, kv_mask=kv_mask), expected) < 1e-5


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [None, 1.0])
def test_deterministic_features_are_relu_of_the_head_coordinates(causal, scale):
  """features="deterministic": φ(x) = relu(x · sqrt(scale)) + 1e-3 on the head_dim coordinates,
  no projection; scale=1.0 is LRA's φ(x) = relu(x) + 1e-3. Nothing random: training = evaluation."""
  attn = build("performer", causal=causal, kernel="relu", features="deterministic", scale=scale,
               chunk_size=4)
  assert attn.nb_features == 8 and attn.features is None                 # no Ω stored
  q, k, v = random_qkv(8, q_len=14, kv_len=14)
  kv_mask = holes_mask(2, 14)
  root_scale = 8 ** -0.25 if scale is None else 1.0
  phi = lambda x: jnp.maximum(x * root_scale, 0) + 1e-3
  expected = explicit_kernel_attention(phi(q), phi(k), v, kv_mask, causal)
  out = call(attn, q, k, v, kv_mask=kv_mask)
  assert rel_err(out, expected) < 1e-5
  np.testing.assert_array_equal(call(attn, q, k, v, kv_mask=kv_mask, deterministic=False), out)


def _softmax_errors(nb_features, causal):
  """Relative error to exact softmax attention of each of 8 heads (each head has its own Ω,
  so the heads are 8 independent draws). n 64, head_dim 16; q, k ~ N(0, 0.25), so q·k/sqrt(d)
  has std 0.25: with N(0, 1) inputs the positive-feature estimator's variance (which grows like
  exp(|q̂ + k̂|²)) needs far more features for the same error."""
  q, k, v = random_qkv(100, batch=1, q_len=64, kv_len=64, num_heads=8, num_kv_heads=8,
                        head_dim=16, std=0.5)
  attn = build("performer", num_heads=8, num_kv_heads=8, head_dim=16, causal=causal,
               nb_features=nb_features, chunk_size=16)
  exact = reference.masked_softmax_attention(q, k, v, causal=causal)
  squares = lambda x: jnp.sum(x ** 2, axis=(0, 1, 3))                      # per head
  return np.sqrt(squares(call(attn, q, k, v) - exact) / squares(exact))


@pytest.mark.slow
def test_performer_error_to_softmax_shrinks_with_features():
  """Mean over the 8 heads, measured: 0.49, 0.25, 0.14, 0.08 for m = 16, 64, 256, 1024
  (about 1/sqrt(m), as the FAVOR+ variance bound says)."""
  budgets = (16, 64, 256, 1024)
  errors = [float(_softmax_errors(m, causal=False).mean()) for m in budgets]
  assert all(a > b for a, b in zip(errors, errors[1:])), errors
  assert errors[0] / errors[-1] > 3, errors
  assert errors[-1] < 0.12, errors


@pytest.mark.slow
def test_causal_performer_approximates_causal_softmax():
  """Against exact causal softmax, mean over 8 heads; measured 0.34 (m = 16) and 0.06 (m = 1024)."""
  coarse, fine = (float(_softmax_errors(m, causal=True).mean()) for m in (16, 1024))
  assert fine < 0.1 and coarse / fine > 3, (coarse, fine)


# -- performer: features, redraw, stabiliser ------------------------------------------------------

def test_performer_features_are_orthogonal_blocks_with_chi_norms():
  attn = build("performer", head_dim=8, nb_features=20)
  omega = np.asarray(attn.features[...])                                    # [kvh, 20, 8]
  assert omega.shape == (2, 20, 8)
  for block in (omega[:, :8], omega[:, 8:16], omega[:, 16:]):
    gram = np.einsum("hmd,hnd->hmn", block, block)
    off_diagonal = gram - np.einsum("hmm->hm", gram)[..., None] * np.eye(block.shape[1])
    assert np.abs(off_diagonal).max() < 1e-4                                # rows orthogonal
  norms = np.linalg.norm(omega, axis=-1)
  assert norms.std() > 0.1 and 1.5 < norms.mean() < 4.0                     # chi(8): mean 2.74
  assert not np.allclose(omega[0], omega[1])                                # one Ω per kv head


@pytest.mark.slow
def test_performer_redraw():
  q, k, v = random_qkv(3, q_len=10)
  attn = build("performer", nb_features=16, model_seed=1)
  fixed = np.asarray(attn.features[...])
  first, second = call(attn, q, k, v), call(attn, q, k, v)
  assert np.array_equal(first, second)                    # evaluation reproducible
  assert np.array_equal(attn.projection(deterministic=True), fixed)
  draw_a, draw_b = attn.projection(deterministic=False), attn.projection(deterministic=False)
  assert not np.allclose(draw_a, draw_b) and not np.allclose(draw_a, fixed)
  train_a = call(attn, q, k, v, deterministic=False)
  train_b = call(attn, q, k, v, deterministic=False)
  # fresh features each call
  assert np.max(np.abs(np.asarray(train_a) - np.asarray(train_b))) > 1e-3
  assert np.array_equal(attn.features[...], fixed)                         # the stored Ω is kept
  frozen = build("performer", nb_features=16, model_seed=1, redraw=False)
  # redraw=False: fixed in training too
  assert np.array_equal(frozen.projection(deterministic=False), fixed)


@pytest.mark.parametrize("causal", [pytest.param(False, marks=pytest.mark.slow), True])
def test_performer_stabiliser_ignores_padded_and_future_keys(causal):
  """A key aligned with the largest row of Ω has a feature exponent > 110 above the others
  (head_dim 256), so a key max taken over all positions would underflow every other key
  to 0 in f32. Placed in padding (or, causal, in the future) it must change no real output."""
  n, head_dim = 12, 256
  attn = build("performer", num_heads=2, num_kv_heads=1, head_dim=head_dim, causal=causal,
               nb_features=32, chunk_size=4)
  q, k, v = random_qkv(4, batch=1, q_len=n, kv_len=n, num_heads=2, num_kv_heads=1,
                        head_dim=head_dim, std=0.5)
  omega = np.asarray(attn.features[...][0], np.float64)                     # [m, d]
  # k̂ = k·d^(-1/4) = ω
  dominant = omega[np.argmax(np.linalg.norm(omega, axis=-1))] * head_dim ** 0.25
  exponent = lambda keys: (np.max(keys @ omega.T, axis=-1) - 0.5 * np.sum(keys ** 2, axis=-1))
  typical = exponent(np.asarray(k[0, :, 0], np.float64) * head_dim ** -0.25)  # [n]
  gap = exponent(dominant * head_dim ** -0.25) - typical.max()
  assert gap > 110, gap
  last = n - 1
  k2 = k.at[0, last, 0].set(jnp.asarray(dominant, jnp.float32))
  if causal:
    kv_mask = jnp.ones((1, n), bool)
  else:
    kv_mask = jnp.ones((1, n), bool).at[0, last].set(False)
  before = call(attn, q, k, v, kv_mask=kv_mask)
  after = call(attn, q, k2, v, kv_mask=kv_mask)
  seen = slice(0, last) if causal else slice(None)
  assert rel_err(after[:, seen], before[:, seen]) < 1e-5
  assert bool(jnp.all(jnp.isfinite(after)))


@pytest.mark.parametrize("name", ["performer", "linear_transformer"])
def test_causal_padding_invariance(name):
  """Causal with padding (the conformance padding check is non-causal): huge padded values
  change no real output."""
  attn = build(name, causal=True, chunk_size=4,
               **({"nb_features": 32} if name == "performer" else {}))
  q, k, v = random_qkv(5, q_len=14, kv_len=14)
  mask = holes_mask(2, 14)
  out = call(attn, q, k, v, q_mask=mask, kv_mask=mask)
  pad = ~mask[:, :, None, None]
  noise = random_qkv(6, q_len=14, kv_len=14)
  changed = call(attn, *(jnp.where(pad, x + 30 * e, x) for x, e in zip((q, k, v), noise)),
                 q_mask=mask, kv_mask=mask)
  assert rel_err(changed, out) < 1e-5


def log_space_estimator(q_log, k_log, v, mask, causal):
  """D⁻¹ A V with A_ij = Σ_m exp(q_log_im + k_log_jm), in float64 log space (no weight under- or
  overflows at any input norm); q_log [b, n, h, m], k_log [b, n, h, m], v [b, n, h, d] numpy."""
  def logsumexp(x, axis):
    top = np.max(x, axis=axis, keepdims=True)
    return np.squeeze(top, axis) + np.log(np.sum(np.exp(x - top), axis=axis))

  n = q_log.shape[1]
  pair = logsumexp(q_log[:, :, None] + k_log[:, None], axis=-1)           # [b, q, k, h]
  allowed = np.asarray(mask)[:, None, :, None]
  if causal:
    allowed = allowed & np.tril(np.ones((n, n), bool))[None, :, :, None]
  pair = np.where(allowed, pair, -np.inf)
  weights = np.exp(pair - pair.max(axis=2, keepdims=True))
  return np.einsum("bqkh,bkhd->bqhd", weights / weights.sum(axis=2, keepdims=True), v)


@pytest.mark.parametrize("causal", [pytest.param(False, marks=pytest.mark.slow), True])
def test_performer_keeps_every_row_at_large_input_norms(causal):
  """q, k ~ N(0, 16²), head_dim 64: the key feature exponents spread over ~2000 e-folds, so a
  single stabiliser per key (the previous code) underflowed whole rows to zero here (measured:
  100 of the 504 real rows, causal 86). Per-feature stabilisers keep every real row: finite,
  non-zero, and equal to the estimator D⁻¹ φ(Q̂)(φ(K̂)ᵀV) with the module's Ω evaluated in
  float64 log space (its weights are far beyond float64's range too)."""
  n, d = 128, 64
  attn = build("performer", num_heads=2, num_kv_heads=1, head_dim=d, causal=causal, nb_features=64,
               chunk_size=16)
  q, k, v = random_qkv(9, q_len=n, kv_len=n, num_heads=2, num_kv_heads=1, head_dim=d, std=16.0)
  mask = holes_mask(2, n)
  out = np.asarray(call(attn, q, k, v, q_mask=mask, kv_mask=mask), np.float64)
  real_rows = np.broadcast_to(np.asarray(mask)[:, :, None], out.shape[:3])
  assert np.isfinite(out).all()
  assert (np.abs(out).max(-1) > 0)[real_rows].all()
  omega = np.asarray(attn.features[...], np.float64)[0]                    # [m, d], K/V head 0
  q_hat, k_hat = (np.asarray(x, np.float64) * d ** -0.25 for x in (q, k))
  log_phi = lambda x: np.einsum("bnhd,md->bnhm", x, omega) - 0.5 * np.sum(x ** 2, -1, keepdims=True)
  expected = log_space_estimator(log_phi(q_hat), np.repeat(log_phi(k_hat), 2, axis=2),
                                 np.repeat(np.asarray(v, np.float64), 2, axis=2), mask, causal)
  np.testing.assert_allclose(out, expected * real_rows[..., None], atol=1e-3)


# -- recurrent decoding ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["performer", "linear_transformer"])
def test_recurrent_decode_equals_causal_forward(name):
  """20 one-token steps against the (S, z) state vs the chunked causal forward (chunk 8).
  Key norms grow with position, so the running max of the performer state keeps rising."""
  steps = 20
  attn = build(name, causal=True, chunk_size=8,
               **({"nb_features": 32} if name == "performer" else {}))
  q, k, v = random_qkv(7, batch=2, q_len=steps, kv_len=steps)
  k = k * jnp.linspace(0.2, 2.0, steps)[None, :, None, None]
  forward = call(attn, q, k, v)
  cache = attn.init_cache(2, steps, jnp.float32)
  assert cache["kv"].shape == (2, 2, attn.nb_features, 8)         # [b, kvh, m, d], not a KV cache
  assert rel_err(decode_token_by_token(attn, q, k, v, cache)[0], forward) < 1e-5


