"""hgrn2, lightning and based: each layer's output and gradients (in x and every parameter)
against its paper's equations written here in float64 from the layer's parameters (GQA, a hole
and a padded tail included); decoding token by token against the parallel forward; the
encoder's two directions. The contract: tests/testing/test_conformance.py; the registry-wide tests
(state sizes, every model kind): tests/mixers/test_mixers.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attention_zoo as az
from ops_reference import assert_close, recurrence

MIXERS = {"hgrn2": {"chunk_size": 4, "lower_bound": 0.3}, "lightning": {"chunk_size": 4},
          "based": {"chunk_size": 4, "window": 3, "feature_dim": 3}}


def build(name, causal=True, **options):
  return az.create_mixer(name, emb_dim=16, num_heads=2, num_kv_heads=1, causal=causal,
                         rngs=nnx.Rngs(1), **{**MIXERS[name], **options})


def inputs(length=9):
  """x [2, length, 16], a mask (row 1: a hole at 2 and its last 3 tokens padded) and loss
  weights w like x."""
  x, w = jax.random.normal(jax.random.key(2), (2, 2, length, 16), jnp.float32)
  mask = jnp.ones((2, length), bool).at[1, 2].set(False).at[1, length - 3:].set(False)
  return x, mask, w


# -- the equations in float64 (jnp, so that jax.grad differentiates them) --------------------

def dense(layer, x):
  bias = 0.0 if layer.bias is None else layer.bias[...]
  return x @ layer.kernel[...] + bias


def heads(a, count):
  return a.reshape(*a.shape[:2], count, -1)


def rms_norm(norm, y):
  """RMS over the whole last axis (all heads at once), the layer's scale per channel."""
  return y / jnp.sqrt(jnp.mean(y * y, axis=-1, keepdims=True) + norm.eps) * norm.scale[...]


def oracle_hgrn2(mixer, x, mask):
  """f = γ + (1 - γ) σ(W_f x); S_t = Diag(f_t) S_{t-1} + (1 - f_t) v_tᵀ; o_t = S_tᵀ q_t/√d_k,
  q = SiLU(W_q x); y = W_o RMSNorm(o)."""
  h, kvh, d_k, d_v = mixer.num_heads, mixer.num_kv_heads, mixer.d_k, mixer.d_v
  q, f, v = jnp.split(dense(mixer.qfv, x), [h * d_k, (h + kvh) * d_k], axis=-1)
  bound = mixer.options["lower_bound"]
  forget = bound + (1 - bound) * jax.nn.sigmoid(f)
  repeat = lambda a: jnp.repeat(heads(a, kvh), h // kvh, axis=2)
  o, _ = recurrence(jax.nn.silu(heads(q, h)), repeat(1 - forget), repeat(v), jnp.log(
      repeat(forget)), None, scale=d_k ** -0.5, initial_state=jnp.zeros((x.shape[0], h, d_k, d_v)),
      mask=mask)
  return dense(mixer.out, rms_norm(mixer.norm, o.reshape(*x.shape[:2], -1)))


def oracle_lightning(mixer, x, mask):
  """q, k, v = SiLU(W x); S_t = λ_h S_{t-1} + k_t v_tᵀ, λ_h = exp(-2^{-8(h+1)/H}(1 - depth +
  1e-5)) (H a power of two); o_t = S_tᵀ q_t; y = W_o (RMSNorm(o) ⊙ σ(W_g x))."""
  h, kvh, d = mixer.num_heads, mixer.num_kv_heads, mixer.head_dim
  q, k, v = jnp.split(jax.nn.silu(dense(mixer.qkv, x)), [h * d, (h + kvh) * d], axis=-1)
  slopes = 2.0 ** (-8.0 * (np.arange(h) + 1) / h)
  g = jnp.broadcast_to(-slopes * (1 - mixer.options["depth"] + 1e-5), x.shape[:2] + (h,))
  repeat = lambda a: jnp.repeat(heads(a, kvh), h // kvh, axis=2)
  o, _ = recurrence(heads(q, h), repeat(k), repeat(v), g, None, scale=1.0,
                    initial_state=jnp.zeros((x.shape[0], h, d, d)), mask=mask)
  y = rms_norm(mixer.norm, o.reshape(*x.shape[:2], -1)) * jax.nn.sigmoid(
      dense(mixer.gate_proj, x))
  return dense(mixer.out, y)


def rotate(a, positions):
  """RoPE: pairs (a_i, a_{i+d/2}) rotated by positions · 10000^{-2i/d}."""
  d = a.shape[-1]
  angles = positions[:, None] * 10000.0 ** (-np.arange(0, d, 2) / d)        # [T, d/2]
  cos, sin = jnp.cos(angles)[:, None], jnp.sin(angles)[:, None]
  a1, a2 = jnp.split(a, 2, axis=-1)
  return jnp.concatenate([a1 * cos - a2 * sin, a2 * cos + a1 * sin], axis=-1)


def oracle_based(mixer, x, mask):
  """The dense forms: o_i = Σ_{j<=i} κ_ij v_j / (Σ_{j<=i} κ_ij + ε) with the kernel
  κ_ij = 1 + s + s²/2, s = q_iᵀk_j/√f (what φ(q)ᵀφ(k) equals), and the window's softmax over
  i - w <= j <= i with RoPE; masked keys excluded, y = W_o [o ; window]."""
  h, kvh, d, f = mixer.num_heads, mixer.num_kv_heads, mixer.head_dim, mixer.options["feature_dim"]
  T, window, group = x.shape[1], mixer.options["window"], h // kvh
  q, k, v = jnp.split(dense(mixer.taylor_qkv, x), [h * f, (h + kvh) * f], axis=-1)
  q, k, v = heads(q, h), heads(k, kvh), heads(v, kvh)                         # [B, T, ·, ·]
  i, j = np.arange(T)[:, None], np.arange(T)[None, :]
  seen = lambda allowed: allowed[None, None] & mask[:, None, None, :]        # [B, 1, T, T]
  s = jnp.einsum("bihf,bjhf->bhij", q, jnp.repeat(k, group, axis=2)) / np.sqrt(f)
  kernel = jnp.where(seen(j <= i), 1 + s + s * s / 2, 0.0)                    # [B, h, T, T]
  linear = (jnp.einsum("bhij,bjhd->bihd", kernel, jnp.repeat(v, group, axis=2))
            / (kernel.sum(-1).transpose(0, 2, 1)[..., None] + 1e-12))
  outputs = [linear]
  if window:
    q, k, v = jnp.split(dense(mixer.window_qkv, x), [h * d, (h + kvh) * d], axis=-1)
    positions = np.arange(T, dtype=np.float64)
    q, k = rotate(heads(q, h), positions), rotate(heads(k, kvh), positions)
    scores = jnp.einsum("bihd,bjhd->bhij", q, jnp.repeat(k, group, axis=2)) / np.sqrt(d)
    scores = jnp.where(seen((j <= i) & (j >= i - window)), scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    weights = jnp.where(jnp.isnan(weights), 0.0, weights)   # a masked query that sees no key
    outputs.append(jnp.einsum("bhij,bjhd->bihd", weights,
                            jnp.repeat(heads(v, kvh), group, axis=2)))
  y = jnp.concatenate(outputs, axis=-1).reshape(*x.shape[:2], -1)
  return dense(mixer.out, y)


ORACLES = {"hgrn2": oracle_hgrn2, "lightning": oracle_lightning, "based": oracle_based}


def layer_output_and_grads(mixer, x, mask, w):
  loss = lambda mixer, x: jnp.sum(mixer(x, mask=mask) * w)
  grads, dx = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(mixer, x)
  return mixer(x, mask=mask), dx, nnx.state(grads, nnx.Param)


def oracle_output_and_grads(name, mixer, x, mask, w):
  """The oracle's output (masked rows 0) and gradients, in float64."""
  graph, params, rest = nnx.split(mixer, nnx.Param, ...)
  f64 = lambda tree: jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), tree)
  with jax.enable_x64(True):
    def loss(params, x):
      y = ORACLES[name](nnx.merge(graph, params, rest), x, mask)
      y = jnp.where(mask[..., None], y, 0.0)
      return jnp.sum(y * w.astype(jnp.float64)), y
    (_, y), (grads, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        f64(params), f64(x))
    return np.asarray(y), np.asarray(dx), jax.tree.map(np.asarray, grads)


# hgrn2's and based's compile for several seconds: the slow lane (the fast lane has lightning's
# and, forward only, every layer's oracle in tests/mixers/test_mixers.py)
@pytest.mark.parametrize("name", [pytest.param("based", marks=pytest.mark.slow),
                                  pytest.param("hgrn2", marks=pytest.mark.slow),
                                  pytest.param("lightning", marks=pytest.mark.slow)])
def test_output_and_gradients_equal_the_equations_in_float64(name):
  mixer = build(name)
  x, mask, w = inputs()
  y, dx, grads = layer_output_and_grads(mixer, x, mask, w)
  y64, dx64, grads64 = oracle_output_and_grads(name, mixer, x, mask, w)
  assert_close(y, y64, 1e-5, "output")
  assert_close(dx, dx64, 1e-5, "d x")
  flat = jax.tree_util.tree_leaves_with_path(grads)
  flat64 = jax.tree_util.tree_leaves_with_path(grads64)
  assert [path for path, _ in flat] == [path for path, _ in flat64]
  for (path, got), (_, want) in zip(flat, flat64):
    assert_close(got, want, 1e-5, f"d {jax.tree_util.keystr(path)}")


# based's window compiles a flex call per block size: the slow lane (as its conformance checks)
HEAVY_BASED = [pytest.param("based", marks=pytest.mark.slow),
               pytest.param("hgrn2", marks=pytest.mark.slow), "lightning"]


@pytest.mark.parametrize("name", HEAVY_BASED)
def test_decoding_equals_the_parallel_forward(name):
  """One token at a time from the carried state (the window's buffer too), and two prefills of
  several tokens (the buffer joined to a block of new tokens), equal the parallel forward and
  leave the same state."""
  mixer = build(name)
  x, mask, _ = inputs()
  want = mixer(x, mask=mask)
  step = nnx.jit(lambda mixer, x, mask: mixer(x, mask=mask, decode=True))
  T = x.shape[1]
  mixer.init_cache(2, T)
  tokens = [step(mixer, x[:, t:t + 1], mask[:, t:t + 1]) for t in range(T)]
  assert_close(jnp.concatenate(tokens, axis=1), want, 1e-5, "one token at a time")
  stepped = mixer.cache.get_value()
  mixer.init_cache(2, T)
  blocks = [step(mixer, x[:, :5], mask[:, :5]), step(mixer, x[:, 5:], mask[:, 5:])]
  assert_close(jnp.concatenate(blocks, axis=1), want, 1e-5, "two prefills")
  jax.tree.map(lambda a, b: assert_close(a, b, 1e-5, "state"), stepped, mixer.cache.get_value())


@pytest.mark.parametrize("name", HEAVY_BASED)
def test_encoder_form_averages_the_two_directions_of_the_equations(name):
  """bidirectional (an encoder's default): the mean of the oracle over x and over the reversed
  x (reversed mask), reversed back."""
  mixer = build(name, causal=False)
  x, mask, _ = inputs()
  flip = lambda a: jnp.flip(a, axis=1)
  with jax.enable_x64(True):
    oracle = lambda x, mask: np.asarray(ORACLES[name](mixer, jnp.asarray(x, jnp.float64), mask))
    want = (oracle(x, mask) + flip(oracle(flip(x), flip(mask)))) / 2
  got = nnx.jit(lambda mixer, x: mixer(x, mask=mask))(mixer, x)
  assert_close(got, np.where(mask[..., None], want, 0), 1e-5, "encoder")


def test_options_change_what_the_equations_say():
  """based's window=0 is the linear attention alone; hgrn2's lower bound and lightning's depth
  reach the oracle (their defaults are not what the tests above use)."""
  x, mask, _ = inputs()
  for name, options in [("based", {"window": 0}), ("hgrn2", {"lower_bound": 0.0}),
                        ("lightning", {"depth": 0.5})]:
    mixer = build(name, **options)
    with jax.enable_x64(True):
      want = np.asarray(ORACLES[name](mixer, jnp.asarray(x, jnp.float64), mask))
    assert_close(mixer(x, mask=mask), np.where(mask[..., None], want, 0), 1e-5, name)
  assert build("based", window=0).window_qkv is None


def test_state_sizes():
  size = lambda name, **options: az.state_size(name, emb_dim=64, num_heads=4, num_kv_heads=2,
                                               seq_len=100, options=options)
  assert size("hgrn2") == 4 * 16 * 16 and size("hgrn2", expand_k=2.0) == 4 * 32 * 16
  assert size("lightning") == 4 * 16 * 16
  taylor = 1 + 16 + 16 * 17 // 2                                    # 153 features of φ
  assert size("based") == 4 * taylor * 17 + 64 * (2 * 2 * 16 + 1)  # S, z; the window's k, v, flag
  assert size("based", window=0) == 4 * taylor * 17
  assert size("based", window=500) == 4 * taylor * 17 + 100 * (2 * 2 * 16 + 1)


def test_bad_options_say_what_is_allowed():
  with pytest.raises(ValueError, match="lower_bound"):
    build("hgrn2", lower_bound=1.0)
  with pytest.raises(ValueError, match="depth"):
    build("lightning", depth=1.5)
  with pytest.raises(ValueError, match="window.*odd head_dim 5"):
    az.create_mixer("based", emb_dim=15, num_heads=3, rngs=nnx.Rngs(0))
