"""attention_zoo.ops.forgetting_attention (FoX) against a dense float64 oracle written here:
outputs and gradients (q, k, v, log f), block sizes, GQA, padding, extreme gates, long-length
accuracy, linear memory, and the decode step."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_zoo import reference
from attention_zoo.ops.forgetting_attention import (cumsum_two_float, forgetting_attention,
                                                   forgetting_attention_step)

NUM_HEADS, HEAD_DIM = 4, 8


def make_inputs(length, num_kv_heads=2, batch=2, seed=0, gate=(-2.0, -0.01), num_heads=NUM_HEADS):
  """q, k, v, log_f (uniform in `gate`, or that constant if a float), d_out as f32 numpy."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  q = normal(batch, length, num_heads, HEAD_DIM)
  k, v = normal(2, batch, length, num_kv_heads, HEAD_DIM)
  if isinstance(gate, tuple):
    log_f = rng.uniform(*gate, (batch, length, num_heads)).astype(np.float32)
  else:
    log_f = np.full((batch, length, num_heads), gate, np.float32)
  return q, k, v, log_f, normal(*q.shape)


def oracle(q, k, v, log_f, mask=None, scale=None):
  """Dense FoX in whatever precision the inputs have: [T, T] logits s·q·k + c_i - c_j with
  c = cumsum(log f) (0 at padding), causal and key-padding mask, softmax, times v; padded
  queries give 0."""
  batch, length, num_heads, head_dim = q.shape
  group = num_heads // k.shape[2]
  k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))                   # [b, t, h, d]
  mask = jnp.ones((batch, length), bool) if mask is None else mask
  scale = head_dim ** -0.5 if scale is None else scale
  c = jnp.cumsum(jnp.where(mask[..., None], log_f, 0), axis=1).transpose(0, 2, 1)   # [b, h, t]
  logits = jnp.einsum("bihd,bjhd->bhij", q, k) * scale + c[..., :, None] - c[..., None, :]
  allowed = jnp.tril(jnp.ones((length, length), bool)) & mask[:, None, None, :]
  logits = jnp.where(allowed, logits, -jnp.inf)
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0))
  weights = jnp.where(allowed, jnp.exp(logits - row_max), 0)
  total = jnp.sum(weights, axis=-1, keepdims=True)
  out = jnp.einsum("bhij,bjhd->bihd", weights / jnp.where(total > 0, total, 1), v)
  return jnp.where(mask[:, :, None, None], out, 0)


def outputs_and_grads(attend, q, k, v, log_f, d_out):
  out, vjp = jax.vjp(attend, q, k, v, log_f)
  return (out, *vjp(d_out))


def oracle_outputs_and_grads(q, k, v, log_f, d_out, mask=None, scale=None):
  """The oracle's output and gradients in float64, as numpy."""
  with jax.enable_x64(True):
    f64 = [jnp.asarray(x, jnp.float64) for x in (q, k, v, log_f, d_out)]
    attend = lambda q, k, v, log_f: oracle(q, k, v, log_f, mask, scale)
    return [np.asarray(x) for x in outputs_and_grads(attend, *f64)]


def assert_close(got, want, tol, names=("out", "dq", "dk", "dv", "dlog_f")):
  """max |got - want| <= tol · max(|want|, 1) for each array (inputs are O(1), so tiny true
  gradients, as under extreme gates, are held to f32 rounding of that scale); finite."""
  for name, g, w in zip(names, got, want):
    g = np.asarray(g, np.float64)
    assert np.all(np.isfinite(g)), f"{name} has NaN/Inf"
    err, size = np.max(np.abs(g - w)), max(np.max(np.abs(w)), 1.0)
    assert err <= tol * size, f"{name}: max error {err:.2e} against max |want| {size:.2e}"


@functools.partial(jax.jit, static_argnames="block_size")
def run_fox(q, k, v, log_f, d_out, mask, block_size):
  """Output and gradients of the op; one compilation per shape and block size, shared by the
  tests (most use STANDARD)."""
  attend = lambda q, k, v, log_f: forgetting_attention(q, k, v, log_f, mask=mask,
                                                       block_size=block_size)
  return outputs_and_grads(attend, q, k, v, log_f, d_out)


STANDARD = dict(length=37, num_kv_heads=2, block_size=8)   # T not a multiple of the block, GQA
ALL_REAL = np.ones((2, STANDARD["length"]), bool)


@pytest.mark.parametrize("length, num_kv_heads, block_size", [
    tuple(STANDARD.values()),
    pytest.param(32, 4, 16, marks=pytest.mark.slow),   # whole blocks, a K/V head per q head
    (20, 1, 64),     # block > T (one tile), MQA
])
def test_matches_float64_oracle(length, num_kv_heads, block_size):
  inputs = make_inputs(length, num_kv_heads)
  got = run_fox(*inputs, np.ones((2, length), bool), block_size)
  assert all(g.dtype == jnp.float32 for g in got)
  assert_close(got, oracle_outputs_and_grads(*inputs), tol=1e-5)


@pytest.mark.parametrize("rows", [("right", "left"), ("holes", "all padding")])
def test_padding_masks(rows):
  """Padded keys are never attended, padded queries give 0, padded log f counts as 0 (so left
  padding changes nothing), and an all-padding row gives zeros and finite gradients."""
  length = STANDARD["length"]
  inputs = make_inputs(length, STANDARD["num_kv_heads"], seed=2)
  patterns = {"right": np.arange(length) < 30, "left": np.arange(length) >= 6,
              "holes": ~np.isin(np.arange(length), [0, 3, 4, 11, 20, 36]),
              "all padding": np.zeros(length, bool)}
  mask = np.stack([patterns[row] for row in rows])
  got = run_fox(*inputs, mask, STANDARD["block_size"])
  assert_close(got, oracle_outputs_and_grads(*inputs, mask=jnp.asarray(mask)), tol=1e-5)
  out = np.asarray(got[0])
  assert np.all(out[~mask] == 0)
  if rows[1] == "left":   # the real tokens' outputs equal those of the unpadded sequence
    q, k, v, log_f = (jnp.asarray(x[1:2, 6:]) for x in inputs[:4])
    np.testing.assert_allclose(out[1, 6:], np.asarray(oracle(q, k, v, log_f))[0],
                               rtol=1e-5, atol=1e-6)


def test_unit_gate_is_causal_softmax_attention():
  q, k, v, _, d_out = make_inputs(STANDARD["length"], STANDARD["num_kv_heads"], seed=3)
  got = run_fox(q, k, v, np.zeros(q.shape[:3], np.float32), d_out, ALL_REAL,
                STANDARD["block_size"])[0]
  want = reference.masked_softmax_attention(q, k, v, causal=True)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_extreme_gates():
  """Batch row 0: log f = -20 per step, each query sees essentially only itself (e^-20 per step
  back); row 1: log f = -1e-7, hardly any decay."""
  q, k, v, log_f, d_out = inputs = make_inputs(STANDARD["length"], STANDARD["num_kv_heads"],
                                               seed=4)
  log_f[0], log_f[1] = -20.0, -1e-7
  got = run_fox(*inputs, ALL_REAL, STANDARD["block_size"])
  assert_close(got, oracle_outputs_and_grads(*inputs), tol=1e-5)
  own_value = np.repeat(v[0], NUM_HEADS // k.shape[2], axis=1)
  np.testing.assert_allclose(np.asarray(got[0][0]), own_value, atol=1e-5)


def test_low_precision_inputs_accumulate_in_float32():
  """bf16 q, k, v: output and gradients in bf16, within bf16 rounding of the f64 oracle on the
  same (rounded) inputs."""
  q, k, v, log_f, d_out = make_inputs(STANDARD["length"], STANDARD["num_kv_heads"], seed=5)
  q, k, v, d_out = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, d_out))
  got = run_fox(q, k, v, log_f, d_out, ALL_REAL, STANDARD["block_size"])
  assert [g.dtype for g in got] == [jnp.bfloat16] * 4 + [jnp.float32]
  want = oracle_outputs_and_grads(*(np.asarray(x, np.float32) for x in (q, k, v, log_f, d_out)))
  assert_close(got, want, tol=3e-2)


def test_two_float_cumsum_keeps_differences_at_length():
  """c_i - c_j from the pair is exact to f32 rounding of the difference at 8K tokens, where
  c reaches -8e3 and a plain f32 cumsum keeps it only to ~5e-4."""
  log_f = -np.random.default_rng(6).uniform(0.01, 2.0, (1, 8192)).astype(np.float32)
  hi, lo = (np.asarray(x, np.float64) for x in jax.jit(cumsum_two_float,
                                                     static_argnums=1)(log_f, 1))
  exact = np.cumsum(log_f.astype(np.float64), axis=1)
  assert np.max(np.abs(hi + lo - exact)) < 1e-6
  for lag in (1, 7, 100):
    got = (hi[:, lag:] - hi[:, :-lag]) + (lo[:, lag:] - lo[:, :-lag])
    want = exact[:, lag:] - exact[:, :-lag]
    assert np.max(np.abs(got - want) / np.abs(want)) < 1e-6
  plain = np.cumsum(log_f, axis=1, dtype=np.float32).astype(np.float64)
  assert np.max(np.abs(plain[:, 1:] - plain[:, :-1] - log_f[:, 1:])) > 1e-4   # what it avoids


@pytest.mark.slow
def test_long_sequence_accuracy():
  """T = 2048, log f uniform in [-2, -0.01] (c reaches about -2000), default tiles (512): f32
  output within 1e-5 of the float64 oracle."""
  q, k, v, log_f, _ = make_inputs(2048, batch=1, seed=7)
  got = jax.jit(forgetting_attention)(q, k, v, log_f)
  with jax.enable_x64(True):
    want = np.asarray(oracle(*(jnp.asarray(x, jnp.float64) for x in (q, k, v, log_f))))
  assert_close([got], [want], tol=1e-5, names=["out"])


@pytest.mark.slow
def test_memory_grows_linearly():
  """Compiled temporaries of forward + backward (all four gradients) at 2K and 8K tokens: 4x the
  length costs less than 6x the memory (a [T, T] array would cost 16x)."""
  def temp_bytes(length):
    shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    q, kv, log_f = shape(1, length, 4, 32), shape(1, length, 2, 32), shape(1, length, 4)
    loss = lambda q, k, v, log_f: jnp.sum(forgetting_attention(q, k, v, log_f, block_size=256))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(q, kv, kv, log_f).compile()
    return compiled.memory_analysis().temp_size_in_bytes
  assert temp_bytes(8192) < 6 * temp_bytes(2048)


def test_decode_steps_equal_the_full_op():
  """Token by token against a growing cache (row 1 left-padded, as a batched prompt would be)
  equals the full op at every real position."""
  length = STANDARD["length"]
  inputs = make_inputs(length, STANDARD["num_kv_heads"], seed=8)
  q, k, v, log_f, _ = inputs
  mask = np.ones((2, length), bool)
  mask[1, :4] = False
  full = np.asarray(run_fox(*inputs, mask, STANDARD["block_size"])[0])
  step = jax.jit(forgetting_attention_step)
  for t in range(length):
    written = mask & (np.arange(length) <= t)                               # slots 0..t
    out = step(q[:, t], k, v, log_f, jnp.asarray(written))
    np.testing.assert_allclose(np.asarray(out)[mask[:, t]], full[:, t][mask[:, t]],
                               rtol=1e-5, atol=1e-6)


def test_bad_shapes_are_refused():
  q, k, v, log_f, _ = make_inputs(8)
  with pytest.raises(ValueError, match="log_f must be"):
    forgetting_attention(q, k, v, log_f[..., :2])
  with pytest.raises(ValueError, match="multiple of the 3 K/V heads"):
    forgetting_attention(q, k[..., :1, :].repeat(3, 2), v[..., :1, :].repeat(3, 2), log_f)
  with pytest.raises(ValueError, match="same length"):
    forgetting_attention(q[:, :5], k, v, log_f)
  with pytest.raises(ValueError, match="mask must be"):
    forgetting_attention(q, k, v, log_f, mask=np.ones((2, 7), bool))
