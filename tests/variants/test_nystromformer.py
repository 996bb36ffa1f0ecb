"""Nyströmformer: the paper's formula, convergence to softmax attention, padding (memory:
test_scaling.py).

The oracle is written independently of `attention_zoo.variants.nystromformer`, in float64
numpy, the way the paper's code forms landmarks (a reshape into equal segments, so lengths
divisible by m).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attention_zoo as az
from attention_zoo import reference
from attention_zoo.ops import nystrom
from attention_zoo.testing.conformance import apply
from attention_zoo.variants import nystromformer
from helpers import create_variant, random_qkv


def build(**options):
  return create_variant("nystromformer", **options)


def softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def papers_formula(q, k, v, num_landmarks, iterations, conv=None):
  """float64: F A⁺ (B V) with segment means by reshape, + the depthwise conv of V if given."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, n, h, d = q.shape
  group = h // k.shape[2]
  k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)           # [b, n, h, d]
  q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))                    # [b, h, n, d]
  s = d ** -0.5
  q_tilde = q.reshape(b, h, num_landmarks, n // num_landmarks, d).mean(-2)
  k_tilde = k.reshape(b, h, num_landmarks, n // num_landmarks, d).mean(-2)
  f = softmax(q @ k_tilde.swapaxes(-1, -2) * s)
  a = softmax(q_tilde @ k_tilde.swapaxes(-1, -2) * s)
  bb = softmax(q_tilde @ k.swapaxes(-1, -2) * s)
  z = a.swapaxes(-1, -2) / (a.sum(-2).max(-1) * a.sum(-1).max(-1))[..., None, None]
  eye = np.eye(num_landmarks)
  for _ in range(iterations):
    az_ = a @ z
    z = 0.25 * z @ (13 * eye - az_ @ (15 * eye - az_ @ (7 * eye - az_)))
  out = f @ (z @ (bb @ v))                                                  # [b, h, n, d]
  if conv is not None:                                                       # conv [taps, 1, h]
    taps = conv.shape[0]
    padded = np.pad(v, [(0, 0), (0, 0), (taps // 2, taps // 2), (0, 0)])
    for t in range(taps):
      out = out + conv[t, 0][None, :, None, None] * padded[:, :, t:t + n]
  return out.transpose(0, 2, 1, 3)


@pytest.mark.parametrize("conv_kernel_size", [0, 5])
def test_equals_the_papers_formula(conv_kernel_size):
  """Output and the formula agree (GQA, 24 tokens, 6 landmarks of 4 tokens each)."""
  attn = build(num_landmarks=6, conv_kernel_size=conv_kernel_size)
  q, k, v = random_qkv(0, q_len=24)
  conv = None if attn.conv is None else np.asarray(attn.conv[...], np.float64)
  expected = papers_formula(q, k, v, 6, 6, conv)
  out = np.asarray(apply(attn, q, k, v))
  assert np.max(np.abs(out - expected)) / np.max(np.abs(expected)) < 1e-4


def released_lra_code(q, k, v, mask, num_landmarks, conv):
  """float64 transcription of the Nyströmformer LRA code (mlpen/Nystromformer,
  LRA/code/attention_nystrom.py): q, k zeroed at padding and scaled by d^-1/4 each, landmarks
  as reshape means over all n positions, F and A unmasked, B masking padded keys (-1e9), the
  pseudo-inverse started from Aᵀ / (the largest column sum of any matrix in the batch), and the
  conv over the zeroed values. q, k, v [b, n, h, d] (no GQA); conv [taps, 1, h]."""
  q, k, v = (np.asarray(x, np.float64).transpose(0, 2, 1, 3) for x in (q, k, v))  # [b, h, n, d]
  b, h, n, d = q.shape
  real = np.asarray(mask, np.float64)[:, None, :, None]                    # [b, 1, n, 1]
  q, k = q * real / d ** 0.25, k * real / d ** 0.25
  means = lambda x: x.reshape(b, h, num_landmarks, n // num_landmarks, d).mean(-2)
  q_tilde, k_tilde = means(q), means(k)
  kernel_1 = softmax(q @ k_tilde.swapaxes(-1, -2))
  kernel_2 = softmax(q_tilde @ k_tilde.swapaxes(-1, -2))
  kernel_3 = softmax(q_tilde @ k.swapaxes(-1, -2) - 1e9 * (1 - real.swapaxes(-1, -2)))
  z = kernel_2.swapaxes(-1, -2) / kernel_2.sum(-2).max()
  eye = np.eye(num_landmarks)
  for _ in range(6):
    kz = kernel_2 @ z
    z = (0.25 * z) @ (13 * eye - kz @ (15 * eye - kz @ (7 * eye - kz)))
  out = kernel_1 @ z @ (kernel_3 @ v)
  taps = conv.shape[0]
  padded = np.pad(v * real, [(0, 0), (0, 0), (taps // 2, taps // 2), (0, 0)])
  for t in range(taps):
    out = out + conv[t, 0][None, :, None, None] * padded[:, :, t:t + n]
  return out.transpose(0, 2, 1, 3)


def test_the_lra_codes_landmarks_and_pinv_init_equal_its_transcription():
  """landmarks="padded_segments", pinv_init="batch_global" (the light preset's Nyströmformer)
  against the released code, rows of 24, 13 and 5 real tokens out of 24 (landmarks of zeros in
  the short rows, the batch-global init mixing the rows); the real positions of every row."""
  attn = build(num_heads=2, num_kv_heads=2, num_landmarks=6, conv_kernel_size=5,
               landmarks="padded_segments", pinv_init="batch_global")
  q, k, v = random_qkv(4, batch=3, q_len=24, num_heads=2, num_kv_heads=2)
  mask = np.arange(24)[None] < np.array([[24], [13], [5]])
  expected = released_lra_code(q, k, v, mask, 6, np.asarray(attn.conv[...], np.float64))
  out = np.asarray(apply(attn, q, k, v, q_mask=jnp.asarray(mask), kv_mask=jnp.asarray(mask)))
  assert np.max(np.abs(out - expected)[mask]) / np.max(np.abs(expected)) < 1e-4
  # each switch alone changes the padded rows' outputs
  for options in ({"landmarks": "padded_segments"}, {"pinv_init": "batch_global"}):
    one = build(num_heads=2, num_kv_heads=2, num_landmarks=6, conv_kernel_size=5, **options)
    got = np.asarray(apply(one, q, k, v, q_mask=jnp.asarray(mask), kv_mask=jnp.asarray(mask)))
    assert np.max(np.abs(got - expected)[mask]) / np.max(np.abs(expected)) > 1e-3, options


def test_batch_global_pinv_init_divides_by_the_largest_norms_of_the_batch():
  a = np.asarray(jax.nn.softmax(jax.random.normal(jax.random.key(5), (3, 4, 4)) * 3), np.float64)
  z = np.asarray(nystromformer.pinv(jnp.asarray(a, jnp.float32), 0, batch_global=True))
  np.testing.assert_allclose(z, a.swapaxes(-1, -2) / (a.sum(-2).max() * a.sum(-1).max()),
                             rtol=1e-6)
  per_matrix = np.asarray(nystromformer.pinv(jnp.asarray(a, jnp.float32), 0))
  np.testing.assert_allclose(
      per_matrix, a.swapaxes(-1, -2) / (a.sum(-2).max(-1) * a.sum(-1).max(-1))[:, None, None],
      rtol=1e-6)


def mean_relative_error(num_landmarks, *, length=64, pinv_iterations=6, kv_mask=None):
  q, k, v = random_qkv(1, batch=4, q_len=length, num_heads=2, num_kv_heads=2, head_dim=16)
  attn = build(num_heads=2, num_kv_heads=2, head_dim=16, num_landmarks=num_landmarks,
               pinv_iterations=pinv_iterations)
  kv_mask = jnp.ones((4, length), bool) if kv_mask is None else kv_mask
  out = apply(attn, q, k, v, q_mask=kv_mask, kv_mask=kv_mask)
  exact = reference.dense_attention(q, k, v, kv_mask[:, None, None, :])
  exact = jnp.where(kv_mask[:, :, None, None], exact, 0.0)
  return float(jnp.mean(jnp.abs(out - exact)) / jnp.mean(jnp.abs(exact)))


@pytest.mark.slow
def test_error_shrinks_as_landmarks_grow():
  errors = [mean_relative_error(m) for m in (4, 16, 64)]   # length 64, default pinv_iterations
  assert errors[0] > errors[1] > errors[2], errors
  assert errors[2] < 0.1 * errors[1], errors   # 64 landmarks at length 64: one token each


def test_exact_when_every_token_is_a_landmark():
  """m >= n: Q̃ = Q, K̃ = K and S A⁺ S = S, up to the pseudo-inverse's accuracy; more landmarks
  than real tokens (empty landmarks, a padded row) too."""
  padded = jnp.ones((4, 32), bool).at[1, 20:].set(False).at[1, 5].set(False)
  assert mean_relative_error(32, length=32, pinv_iterations=30) < 1e-4
  assert mean_relative_error(40, length=32, pinv_iterations=30, kv_mask=padded) < 1e-4


@pytest.mark.slow
def test_padding_equals_the_sequence_without_it():
  """Padded tokens enter no landmark and get no weight: a row with a hole and a padded tail
  gives what its 17 real tokens give alone (17 is not a multiple of the 4 landmarks)."""
  attn = build(num_landmarks=4)
  q, k, v = random_qkv(2, batch=1, q_len=23)
  mask = np.ones((1, 23), bool)
  mask[0, 6], mask[0, 18:] = False, False
  real = np.flatnonzero(mask[0])
  out = apply(attn, q, k, v, q_mask=jnp.asarray(mask), kv_mask=jnp.asarray(mask))
  alone = apply(attn, q[:, real], k[:, real], v[:, real])
  np.testing.assert_allclose(out[:, real], alone, atol=1e-5, rtol=1e-5)


def test_segments_are_contiguous_near_equal_and_skip_padding():
  mask = np.ones((3, 23), bool)
  mask[1, 17:] = False
  mask[2, 2:] = False     # 2 real tokens, 4 landmarks: two of them empty
  one_hot = np.asarray(nystrom.segments(jnp.asarray(mask), 4))
  real_landmarks = one_hot.any(axis=1)
  for row in range(3):
    count = mask[row].sum()
    assert not one_hot[row][~mask[row]].any()                         # padding in no segment
    assert (one_hot[row][mask[row]].sum(-1) == 1).all()               # each real token in one
    segment_of = one_hot[row][mask[row]].argmax(-1)
    assert (np.diff(segment_of) >= 0).all()                           # contiguous, in order
    sizes = one_hot[row].sum(0)
    expected = {count // 4, -(-count // 4)} if count >= 4 else {0, 1}
    assert set(sizes.tolist()) <= expected, sizes
  assert np.asarray(real_landmarks).tolist() == [[True] * 4, [True] * 4, [True, False, True, False]]


@pytest.mark.slow
def test_pinv_converges_and_keeps_empty_landmarks_empty():
  a = np.asarray(jax.nn.softmax(jax.random.normal(jax.random.key(3), (6, 6))), np.float64)
  a[:, 4] = a[4, :] = 0.0                                             # landmark 4 is empty
  z = np.asarray(nystromformer.pinv(jnp.asarray(a, jnp.float32), 40), np.float64)
  np.testing.assert_allclose(z, np.linalg.pinv(a), atol=1e-4)
  assert (z[4, :] == 0).all() and (z[:, 4] == 0).all()
  assert (np.asarray(nystromformer.pinv(jnp.zeros((3, 3)), 6)) == 0).all()   # an all-empty A


def test_refusals_say_why():
  with pytest.raises(ValueError,
                     match="cannot be causal: each landmark is the mean of a whole segment"):
    az.create("nystromformer", num_heads=2, head_dim=8, causal=True, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError,
                     match="option num_landmarks=0 is invalid: expected an integer >= 1"):
    build(num_landmarks=0)
  q, k, v = random_qkv(0, q_len=10)
  with pytest.raises(ValueError, match="n=10 that is not a multiple of num_landmarks=4"):
    apply(build(num_landmarks=4, landmarks="padded_segments"), q, k, v)
  with pytest.raises(ValueError, match=r"option conv_kernel_size=4 is invalid: expected an integer "
                                       r">= 0 that is 0 \(no skip convolution\) or odd"):
    build(conv_kernel_size=4)
  with pytest.raises(ValueError, match="self-attention only"):
    attn = build()
    q, k, v = random_qkv(0, q_len=24)
    attn(q[:, :10], k, v)
