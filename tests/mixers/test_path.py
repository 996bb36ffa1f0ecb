"""PaTH attention: the blockwise op (attention_zoo.ops.path_attention) against a dense float64
oracle of the paper's definition written here (each query-key pair's product of Householder
transforms formed as a matrix), forward and gradients, with GQA, padding and partial blocks;
decoding with its cache of transformed keys; the layer against its equation (`oracle_path`,
also run by tests/mixers/test_mixers.py); memory linear in the length.

The layer-level properties (padding, causality, decoding, the encoder form, ...) are the
conformance suite's (tests/testing/test_conformance.py -k path)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attention_zoo as az
from attention_zoo.ops import softmax
from attention_zoo.ops.path_attention import householder_update, path_attention, path_decode_step


def oracle(q, k, v, w, beta, log_f, mask, scale):
  """s_ij = scale · q_iᵀ H_i ⋯ H_{j+1} k_j with H_t = I − β_t w_t w_tᵀ (I at a padded token),
  the product formed as a [D, D] matrix per pair, plus Σ_{j<l<=i} log f_l with a forget gate;
  causal softmax over the real keys. q [B, T, H, D]; k, v, w [B, T, KVH, D]; beta [B, T, KVH];
  log_f [B, T, H] or None; mask bool [B, T]. Differentiable; float64 under jax.enable_x64."""
  B, T, H, D = q.shape
  KVH = k.shape[2]
  beta = jnp.where(mask[..., None], beta, 0.0)
  transforms = jnp.eye(D) - beta[..., None, None] * w[..., :, None] * w[..., None, :]

  def pair_products(transforms):
    """[T, D, D] -> [T(i), T(j), D, D], entry (i, j) = H_i ⋯ H_{j+1} for j <= i."""
    def for_query(i):
      def step(product, j):                 # j from T - 1 down to 0
        return jnp.where(j <= i, product @ transforms[j], product), product
      return jax.lax.scan(step, jnp.eye(D), jnp.arange(T)[::-1])[1][::-1]
    return jax.vmap(for_query)(jnp.arange(T))

  products = jax.vmap(jax.vmap(pair_products, in_axes=1), in_axes=0)(transforms)  # [B,KVH,T,T,D,D]
  products = jnp.repeat(products, H // KVH, axis=1)                         # [B, H, T, T, D, D]
  k_heads, v_heads = (jnp.repeat(x, H // KVH, axis=2) for x in (k, v))      # [B, T, H, D]
  scores = scale * jnp.einsum("bihd,bhijde,bjhe->bhij", q, products, k_heads)
  if log_f is not None:   # Σ_{j<l<=i} log f_l, over real tokens, as a sum of the terms between
    between = (jnp.arange(T)[None, :, None] <= jnp.arange(T)[:, None, None]) & (
        jnp.arange(T)[None, :, None] > jnp.arange(T)[None, None, :])       # [i, l, j]
    gates = jnp.where(mask[..., None], log_f, 0.0)                          # [B, T, H]
    scores = scores + jnp.einsum("ilj,blh->bhij", between.astype(gates.dtype), gates)
  allowed = jnp.tril(jnp.ones((T, T), bool)) & mask[:, None, None, :]
  scores = jnp.where(allowed, scores, -jnp.inf)
  row_max = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
  weights = jnp.where(allowed, jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0)), 0)
  total = jnp.sum(weights, axis=-1, keepdims=True)
  out = jnp.einsum("bhij,bjhd->bihd", weights / jnp.where(total > 0, total, 1), v_heads)
  return jnp.where(mask[:, :, None, None], out, 0)


def make_inputs(length, num_heads=4, num_kv_heads=2, head_dim=8, batch=2, seed=0):
  """q, k, v, unit w, β in (0, 2) (so that negative eigenvalues occur), log f in [-2, -0.01]
  and an output cotangent."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
  q = normal(batch, length, num_heads, head_dim)
  k, v, w = (normal(batch, length, num_kv_heads, head_dim) for _ in range(3))
  w /= np.linalg.norm(w, axis=-1, keepdims=True)
  beta = (2 / (1 + np.exp(-2 * normal(batch, length, num_kv_heads)))).astype(np.float32)
  log_f = rng.uniform(-2, -0.01, (batch, length, num_heads)).astype(np.float32)
  return q, k, v, w, beta, log_f, normal(batch, length, num_heads, head_dim)


# One compilation per block size, shared by the tests that need only the output.
path_jit = jax.jit(path_attention, static_argnames="block_size")


def outputs_and_grads(attend, inputs, d_out):
  """attend's output and the gradients of <output, d_out> in each of inputs (q, k, v, w, β
  and, with the gate, log f)."""
  out, vjp = jax.vjp(lambda *xs: attend(*xs[:5], xs[5] if len(xs) == 6 else None), *inputs)
  return (out, *vjp(d_out))


@functools.partial(jax.jit, static_argnames="block_size")
def run_path(inputs, d_out, mask, block_size):
  attend = lambda *xs: path_attention(*xs[:5], log_f=xs[5], mask=mask, block_size=block_size)
  return outputs_and_grads(attend, inputs, d_out)


def oracle_outputs_and_grads(inputs, d_out, mask):
  with jax.enable_x64(True):
    f64 = lambda xs: [jnp.asarray(x, jnp.float64) for x in xs]
    scale = inputs[0].shape[-1] ** -0.5
    attend = lambda *xs: oracle(*xs, jnp.asarray(mask), scale)
    return [np.asarray(x) for x in outputs_and_grads(attend, f64(inputs), f64([d_out])[0])]


def assert_close(got, want, tol, names=("out", "dq", "dk", "dv", "dw", "dbeta", "dlog_f")):
  """max |got - want| <= tol · max(|want|, 1) for each array; finite."""
  for name, g, w in zip(names, got, want):
    g = np.asarray(g, np.float64)
    assert np.all(np.isfinite(g)), f"{name} has NaN/Inf"
    err, size = np.max(np.abs(g - w)), max(np.max(np.abs(w)), 1.0)
    assert err <= tol * size, f"{name}: max error {err:.2e} against max |want| {size:.2e}"


def padded(length, left=3, hole=5):
  """Row 0 all real; row 1 left-padded by `left` with one more padded token at `hole`."""
  mask = np.ones((2, length), bool)
  mask[1, :left] = False
  mask[1, hole] = False
  return mask


@pytest.mark.parametrize("length, num_heads, num_kv_heads, block_size, gated", [
    (13, 4, 2, 4, True),       # GQA, several blocks, a partial last one, the forget gate
    pytest.param(13, 4, 2, 4, False, marks=pytest.mark.slow),    # without the gate
    pytest.param(16, 2, 2, 16, False, marks=pytest.mark.slow),   # one block, a K/V head per head
    pytest.param(20, 4, 1, 8, True, marks=pytest.mark.slow),     # MQA, three blocks
])
def test_matches_float64_oracle(length, num_heads, num_kv_heads, block_size, gated):
  *inputs, log_f, d_out = make_inputs(length, num_heads, num_kv_heads)
  inputs = (*inputs, log_f) if gated else tuple(inputs)
  mask = padded(length)
  got = run_path(inputs, d_out, mask, block_size)
  assert all(g.dtype == jnp.float32 for g in got)
  assert_close(got, oracle_outputs_and_grads(inputs, d_out, mask), tol=1e-5)


@pytest.mark.slow
def test_left_padding_equals_the_unpadded_sequence():
  q, k, v, w, beta, log_f, _ = make_inputs(9, batch=1)
  pad = lambda x: np.concatenate([np.full((1, 3) + x.shape[2:], 7, x.dtype), x], axis=1)
  mask = np.arange(12)[None] >= 3
  got = path_jit(*map(pad, (q, k, v, w, beta)), log_f=pad(log_f), mask=mask, block_size=4)
  np.testing.assert_allclose(got[:, 3:], path_jit(q, k, v, w, beta, log_f=log_f, block_size=4),
                             rtol=1e-5, atol=1e-6)
  assert not np.asarray(got[:, :3]).any()


@pytest.mark.slow
def test_zero_beta_is_causal_softmax_attention():
  """H_t = I: no position information, plain causal attention."""
  q, k, v, w, beta, _, _ = make_inputs(11)
  got = path_jit(q, k, v, w, np.zeros_like(beta), block_size=4)
  want = softmax.masked_softmax_attention(q, k, v, causal=True)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gated", [True, False])
def test_decode_steps_equal_the_full_op(gated):
  """Token by token, every cached key multiplied by the new token's transform (with the gate,
  FoX's step over the cached log f), with a padded prefix and a hole in row 1: the full op's
  output at every position."""
  length = 11
  q, k, v, w, beta, log_f, _ = make_inputs(length, seed=3)
  log_f = log_f if gated else None
  mask = padded(length)
  full = np.asarray(path_jit(q, k, v, w, beta, log_f=log_f, mask=mask, block_size=4))
  cache = {"key": np.zeros_like(k), "value": np.zeros_like(v),
           "filled": np.zeros((2, length), bool), "index": 0}
  if gated:
    cache["log_f"] = np.zeros_like(log_f)
  step = jax.jit(path_decode_step)
  for t in range(length):
    out, cache = step(q[:, t], k[:, t], v[:, t], w[:, t], beta[:, t], cache,
                      log_f=None if log_f is None else log_f[:, t], mask=mask[:, t])
    np.testing.assert_allclose(out, full[:, t], rtol=1e-5, atol=1e-6)


def test_householder_update_is_the_transform():
  _, k, _, w, beta, _, _ = make_inputs(5)
  got = householder_update(k, w[:, 0], beta[:, 0])
  transforms = np.eye(8) - beta[:, 0, :, None, None] * w[:, 0, :, :, None] * w[:, 0, :, None, :]
  np.testing.assert_allclose(got, np.einsum("bhde,bshe->bshd", transforms, k), rtol=1e-5,
                             atol=1e-6)


def test_bad_shapes_are_refused():
  q, k, v, w, beta, log_f, _ = make_inputs(8)
  with pytest.raises(ValueError, match="w must be"):
    path_attention(q, k, v, w[..., :4], beta)
  with pytest.raises(ValueError, match="beta must be"):
    path_attention(q, k, v, w, beta[..., :1])
  with pytest.raises(ValueError, match="same length"):
    path_attention(q[:, :5], k, v, w, beta)
  with pytest.raises(ValueError, match="mask must be"):
    path_attention(q, k, v, w, beta, mask=np.ones((2, 7), bool))
  with pytest.raises(ValueError, match="segment_ids must be"):
    path_attention(q, k, v, w, beta, segment_ids=np.zeros((2, 8)))
  with pytest.raises(ValueError, match="block_size"):
    path_attention(q, k, v, w, beta, block_size=0)
  with pytest.raises(ValueError, match="log_f must be"):
    path_attention(q, k, v, w, beta, log_f=log_f[..., :2])
  cache = {"key": k, "value": v, "filled": np.ones((2, 8), bool), "index": 0}
  with pytest.raises(ValueError, match="k and v of the new token"):
    path_decode_step(q[:, 0], k, v, w[:, 0], beta[:, 0], cache)
  with pytest.raises(ValueError, match="log_f"):
    path_decode_step(q[:, 0], k[:, 0], v[:, 0], w[:, 0], beta[:, 0], cache, log_f=log_f[:, 0])


# -- the layer ------------------------------------------------------------------------------

def oracle_path(mixer, x):
  """The layer in float64 from its parameters: q, k, v and w = L2norm(SiLU(conv(W_w x))) per
  K/V head, β = 2σ(w_βᵀ x + b), log f = log σ(w_fᵀ x + b_f) with the forget gate, `oracle`
  above, the output projection. x [1, T, emb] -> [T, emb]."""
  h, kvh, d = mixer.num_heads, mixer.num_kv_heads, mixer.head_dim
  T = x.shape[1]
  qkv = np.asarray(mixer.qkv(x)[0], np.float64)
  q, k, v = np.split(qkv, [h * d, (h + kvh) * d], axis=-1)
  w = np.asarray(mixer.w_proj(x)[0], np.float64)                              # [T, kvh·d]
  if mixer.conv is not None:
    taps = np.asarray(mixer.conv.weight[...], np.float64)                     # [K, kvh·d]
    window = np.concatenate([np.zeros((len(taps) - 1, w.shape[1])), w])
    w = sum(taps[i] * window[len(taps) - 1 - i:len(taps) - 1 - i + T] for i in range(len(taps)))
    w = w + np.asarray(mixer.conv.bias[...], np.float64)
    w = w / (1 + np.exp(-w))                                                  # SiLU
  w = w.reshape(T, kvh, d)
  w = w / np.sqrt((w * w).sum(-1, keepdims=True) + 1e-6)
  beta = 2 / (1 + np.exp(-np.asarray(mixer.beta_proj(x)[0], np.float64)))    # [T, kvh]
  log_f = None
  if mixer.forget_proj is not None:
    log_f = -np.logaddexp(0.0, -np.asarray(mixer.forget_proj(x)[0], np.float64))   # [T, h]
  with jax.enable_x64(True):
    f64 = lambda a: None if a is None else jnp.asarray(a[None], jnp.float64)
    o = oracle(*map(f64, (q.reshape(T, h, d), k.reshape(T, kvh, d), v.reshape(T, kvh, d), w,
                          beta, log_f)), jnp.ones((1, T), bool), d ** -0.5)
  return mixer.out(jnp.asarray(np.asarray(o).reshape(1, T, h * d), jnp.float32))[0]


@pytest.mark.slow   # tests/mixers/test_mixers.py runs the first case in its registry sweep
@pytest.mark.parametrize("num_kv_heads, gated", [(2, False), (1, True)])   # w_proj: low-rank; full
def test_layer_equals_its_equation_with_gqa_and_the_gate(num_kv_heads, gated):
  mixer = az.create_mixer("path", emb_dim=16, num_heads=2, num_kv_heads=num_kv_heads,
                          causal=True, rngs=nnx.Rngs(1), block_size=4, use_forget_gate=gated)
  x = jax.random.normal(jax.random.key(2), (1, 11, 16))
  got = nnx.jit(lambda mixer, x: mixer(x))(mixer, x)[0]   # one program: faster than op by op
  np.testing.assert_allclose(got, oracle_path(mixer, x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("gated", [True, False])
def test_state_is_the_transformed_keys_values_and_gates(gated):
  options = {"use_forget_gate": gated}
  mixer = az.create_mixer("path", emb_dim=16, num_heads=2, num_kv_heads=1, causal=True,
                          rngs=nnx.Rngs(0), **options)
  state = mixer.empty_state(1, 9, jnp.float32)
  floats = sum(state[name].size for name in ("key", "value", "log_f") if name in state)
  assert floats == az.state_size("path", emb_dim=16, num_heads=2, num_kv_heads=1, seq_len=9,
                                 options=options)


@pytest.mark.slow
def test_memory_grows_linearly():
  """Compiled temporaries of forward + backward (all six gradients, the forget gate on) at 2K
  and 8K tokens: 4x the length costs less than 4.5x the memory (a [T, T] array would cost
  16x)."""
  def temp_bytes(length):
    shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    q, kv, beta = shape(1, length, 2, 32), shape(1, length, 1, 32), shape(1, length, 1)
    loss = lambda *xs: jnp.sum(path_attention(*xs[:5], log_f=xs[5]))
    compiled = jax.jit(jax.grad(loss, argnums=tuple(range(6)))).lower(
        q, kv, kv, kv, beta, shape(1, length, 2)).compile()
    return compiled.memory_analysis().temp_size_in_bytes
  at_2k, at_8k = temp_bytes(2048), temp_bytes(8192)
  assert at_8k < 4.5 * at_2k, f"{at_8k / 2**20:.1f} MiB at 8K vs {at_2k / 2**20:.1f} MiB at 2K"


@pytest.mark.slow
def test_packed_sequences_equal_each_run_alone():
  """Three runs (ids 0, 1, 0: the last is a new sequence) across block edges, with padding:
  each run's outputs are the op's on that run alone."""
  q, k, v, w, beta, log_f, _ = make_inputs(14, batch=1, seed=5)
  segment_ids = np.array([[0] * 5 + [1] * 6 + [0] * 3])
  mask = np.ones((1, 14), bool)
  mask[0, 6] = False
  got = np.asarray(path_jit(q, k, v, w, beta, log_f=log_f, mask=mask, segment_ids=segment_ids,
                            block_size=4))
  for start, stop in [(0, 5), (5, 11), (11, 14)]:
    run = lambda x: x[:, start:stop]
    alone = path_jit(*map(run, (q, k, v, w, beta)), log_f=run(log_f), mask=run(mask),
                     block_size=4)
    np.testing.assert_allclose(got[:, start:stop], alone, rtol=1e-5, atol=1e-6)
