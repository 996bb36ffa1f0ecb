"""Hawk (RG-LRU), mLSTM and sLSTM (attention_zoo/mixers/hawk.py, mlstm.py, slstm.py) against
their papers' equations written here in float64 from the layers' parameters, token by token:
the output and the gradients in x and in every parameter (a padded row included), in the chunk
form and the token form; decoding one token at a time against the parallel forward. The
registry-wide properties (packed rows, causality, ...): tests/testing/test_conformance.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attention_zoo as az
from helpers import assert_decoding_equals_forward, assert_mixer_equals_float64, mixer_temp_bytes

OPTIONS = {"hawk": {"chunk_size": 4}, "mlstm": {"chunk_size": 4}, "slstm": {}}
# Relative tolerance of the f32 layer against float64. mLSTM: measured up to 1.3e-5 (d W_i, W_f)
# in the chunk and token forms alike, float32 rounding amplified by input gates up to e^10.
TOLERANCE = {"hawk": 1e-5, "mlstm": 3e-5, "slstm": 1e-5}


def dense(p, x):
  return x @ p["kernel"] + (p["bias"] if "bias" in p else 0)


def scan(step, state, *per_token):
  """lax.scan over the token axis (1) of each [b, T, ...] input -> outputs [b, T, ...]."""
  _, out = jax.lax.scan(step, state, [jnp.swapaxes(a, 0, 1) for a in per_token])
  return jnp.swapaxes(out, 0, 1)


def causal_conv(p, x):
  """The short convolution y_t = b + Σ_i w_i x_{t-i} (x [b, T, c])."""
  weight, T = p["weight"], x.shape[1]
  taps = len(weight)
  padded = jnp.pad(x, ((0, 0), (taps - 1, 0), (0, 0)))               # tap i reads x_{t-i}
  return p["bias"] + sum(weight[i] * padded[:, taps - 1 - i:taps - 1 - i + T]
                         for i in range(taps))


def hawk_equations(p, x, mask):
  """Griffin's recurrent block: r_t = σ(W_a u_t + b_a), i_t = σ(W_x u_t + b_x),
  a_t = σ(Λ)^{8 r_t}, h_t = a_t h_{t-1} + sqrt(1 - a_t²) (i_t u_t), out = W_out(GeLU(W_y x) h);
  a masked token enters the conv as zeros, leaves h as it was and outputs 0."""
  b, T, _ = x.shape
  heads, width = p["gate_bias"].shape[0], p["gate_bias"].shape[1] // 2
  u = causal_conv(p["conv"], jnp.where(mask[..., None], dense(p["in_proj"], x), 0))
  gates = jnp.einsum("bthi,hio->btho", u.reshape(b, T, heads, width), p["gate_weight"])
  gates = jax.nn.sigmoid(gates + p["gate_bias"])
  r = gates[..., :width].reshape(b, T, -1)
  i = gates[..., width:].reshape(b, T, -1)
  a = jax.nn.sigmoid(p["Lambda"]) ** (8 * r)                                    # [b, T, D]

  def token(h, inputs):                                                         # h [b, D]
    a_t, i_t, u_t, real = inputs
    new = a_t * h + jnp.sqrt(1 - a_t ** 2) * (i_t * u_t)
    return jnp.where(real[:, None], new, h), new

  hidden = scan(token, jnp.zeros((b, a.shape[-1])), a, i, u, mask)
  y = dense(p["out"], jax.nn.gelu(dense(p["gate_branch"], x)) * hidden)
  return jnp.where(mask[..., None], y, 0)


def mlstm_equations(p, x, mask, eps=1e-5):
  """xLSTM's mLSTM block, its cell unstabilised (float64 holds exp(ĩ)): C_t = f_t C_{t-1} +
  i_t v_t k_tᵀ, n_t = f_t n_{t-1} + i_t k_t, h_t = C_t q_t / max(|n_tᵀ q_t|, 1), i = exp(ĩ),
  f = σ(f̃); then RMSNorm per head, the skip, the SiLU(z) gate and W_down. A masked token enters
  the conv as zeros, leaves C and n as they were and outputs 0."""
  b, T, _ = x.shape
  heads = p["gate_proj"]["bias"].shape[0] // 2
  x_m, z = jnp.split(dense(p["up_proj"], x), 2, axis=-1)
  x_c = jax.nn.silu(causal_conv(p["conv"], jnp.where(mask[..., None], x_m, 0)))
  q, k, v = dense(p["q_proj"], x_c), dense(p["k_proj"], x_c), dense(p["v_proj"], x_m)
  gates = dense(p["gate_proj"], jnp.concatenate([q, k, v], -1))
  i, f = jnp.exp(gates[..., :heads]), jax.nn.sigmoid(gates[..., heads:])       # [b, T, h]
  split = lambda a: a.reshape(b, T, heads, -1)
  q, k, v = split(q), split(k), split(v)
  d = q.shape[-1]
  k = k / np.sqrt(d)

  def token(carry, inputs):                                  # C [b, h, V, K] (the paper's), n
    C, n = carry
    q_t, k_t, v_t, i_t, f_t, real = inputs
    C_new = f_t[..., None, None] * C + i_t[..., None, None] * v_t[..., :, None] * k_t[..., None, :]
    n_new = f_t[..., None] * n + i_t[..., None] * k_t
    h = jnp.einsum("bhvk,bhk->bhv", C_new, q_t) / jnp.maximum(
        jnp.abs(jnp.sum(n_new * q_t, -1)), 1.0)[..., None]
    keep = lambda new, old: jnp.where(real.reshape(-1, *[1] * (new.ndim - 1)), new, old)
    return (keep(C_new, C), keep(n_new, n)), h

  o = scan(token, (jnp.zeros((b, heads, d, d)), jnp.zeros((b, heads, d))), q, k, v, i, f, mask)
  o = o / jnp.sqrt(jnp.mean(o ** 2, -1, keepdims=True) + eps) * p["norm"]["scale"]
  y = (o.reshape(b, T, -1) + p["skip"] * x_c) * jax.nn.silu(z)
  return jnp.where(mask[..., None], dense(p["down_proj"], y), 0)


def slstm_equations(p, x, mask, eps=1e-5):
  """xLSTM's sLSTM, its cell unstabilised: pre-activations W x (i, f from the convolved input)
  + R h_{t-1} + b per channel, c_t = f_t c_{t-1} + i_t tanh(z̃_t), n_t = f_t n_{t-1} + i_t,
  h_t = σ(õ_t) c_t / n_t, i = exp(ĩ), f = σ(f̃); then RMSNorm per head and W_out. A masked
  token enters the conv as zeros, leaves the state as it was and outputs 0."""
  b, T, _ = x.shape
  heads, _, d = p["bias"].shape
  x_conv = jax.nn.silu(causal_conv(p["conv"], jnp.where(mask[..., None], x, 0)))
  i_x, f_x = jnp.split(dense(p["input_gates"], x_conv), 2, axis=-1)
  z_x, o_x = jnp.split(dense(p["cell_gates"], x), 2, axis=-1)
  split = lambda a: a.reshape(b, T, heads, d)
  R = p["recurrent"].reshape(heads, d, 4, d)                                    # [h, d, 4, d]

  def token(carry, inputs):                                                     # [b, h, d] each
    c, n, h = carry
    i_t, f_t, z_t, o_t, real = inputs
    r = jnp.einsum("bhd,hdge->bhge", h, R) + p["bias"]                          # [b, h, 4, d]
    i_t, f_t = jnp.exp(i_t + r[:, :, 0]), jax.nn.sigmoid(f_t + r[:, :, 1])
    z_t, o_t = jnp.tanh(z_t + r[:, :, 2]), jax.nn.sigmoid(o_t + r[:, :, 3])
    c_new, n_new = f_t * c + i_t * z_t, f_t * n + i_t
    h_new = o_t * c_new / n_new
    keep = lambda new, old: jnp.where(real[:, None, None], new, old)
    return (keep(c_new, c), keep(n_new, n), keep(h_new, h)), h_new

  zeros = jnp.zeros((b, heads, d))
  hidden = scan(token, (zeros, zeros, zeros), *map(split, (i_x, f_x, z_x, o_x)), mask)
  hidden = hidden / jnp.sqrt(jnp.mean(hidden ** 2, -1, keepdims=True) + eps) * p["norm"]["scale"]
  return jnp.where(mask[..., None], dense(p["out"], hidden.reshape(b, T, -1)), 0)


EQUATIONS = {"hawk": hawk_equations, "mlstm": mlstm_equations, "slstm": slstm_equations}


def oracle(mixer, x, mask=None):
  """The layer's output by its paper's equations in float64, from its parameters."""
  mask = jnp.ones(x.shape[:2], bool) if mask is None else mask
  with jax.enable_x64(True):
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64),
                          nnx.state(mixer, nnx.Param).to_pure_dict())
    run = jax.jit(lambda params, x: EQUATIONS[mixer.spec.name](params, x, mask))
    return np.asarray(run(params, jnp.asarray(x, jnp.float64)))


def build(name, **options):
  mixer = az.create_mixer(name, emb_dim=16, num_heads=2, causal=True, rngs=nnx.Rngs(1),
                          **{**OPTIONS[name], **options})
  if name == "mlstm":   # gates that depend on the token (the authors' init: zero weights), and
    # input gates up to e^10, past the normaliser's floor of 1: the stabiliser at work
    gate = mixer.gate_proj
    gate.kernel[...] = 0.3 * jax.random.normal(jax.random.key(5), gate.kernel.shape)
    gate.bias[...] = gate.bias[...].at[:mixer.num_heads].add(4.0)
  return mixer


def inputs(length=9):
  """x [2, length, 16], its mask (the second row's last 3 tokens padded) and weights w like x
  (the loss Σ y·w)."""
  x, w = jax.random.normal(jax.random.key(2), (2, 2, length, 16), jnp.float32)
  mask = jnp.arange(length)[None] < jnp.array([[length], [length - 3]])
  return x, mask, w


def assert_output_and_gradients_equal_the_equations(mixer, x, mask, w):
  name = mixer.spec.name
  assert_mixer_equals_float64(mixer, EQUATIONS[name], x, mask, w, TOLERANCE[name])


@pytest.mark.slow   # the fast lane has test_mixers.py's float64 check of the output (`oracle`)
@pytest.mark.parametrize("name, options", [("hawk", {}), ("mlstm", {}), ("slstm", {})])
def test_output_and_gradients_equal_the_float64_equations(name, options):
  """The chunk form (chunks of 4 over 9 tokens; sLSTM: its scan)."""
  x, mask, w = inputs()
  assert_output_and_gradients_equal_the_equations(build(name, **options), x, mask, w)


@pytest.mark.slow   # the token form and a longer sequence: more compiles
@pytest.mark.parametrize("name, options", [
    ("hawk", {"chunk_size": None}), ("hawk", {"chunk_size": 8}), ("mlstm", {"chunk_size": None}),
    ("mlstm", {"chunk_size": 8})])
def test_other_forms_equal_the_float64_equations(name, options):
  x, mask, w = inputs(length=21)
  assert_output_and_gradients_equal_the_equations(build(name, **options), x, mask, w)


@pytest.mark.slow   # conformance's decode check runs in the slow lane for these names too
@pytest.mark.parametrize("name", ["hawk", "mlstm", "slstm"])
def test_decoding_token_by_token_equals_the_parallel_forward(name):
  """Each step from the carried state and the conv cache; a prefill's state."""
  x, mask, _ = inputs()
  assert_decoding_equals_forward(build(name), x, mask)


def test_state_sizes():
  dims = dict(emb_dim=48, num_heads=4, num_kv_heads=4, seq_len=100)
  assert az.state_size("hawk", **dims, options={}) == 4 * 16              # H · int(4/3 · 12)
  assert az.state_size("hawk", **dims, options={"expand": 1.0}) == 48
  assert az.state_size("mlstm", **dims, options={}) == 4 * (24 * 24 + 24 + 1)   # d = 2 · 12
  assert az.state_size("slstm", **dims, options={}) == 4 * 48                 # c, n, m, h


@pytest.mark.slow   # compiles each mixer's backward at 2K and 8K tokens
@pytest.mark.parametrize("name, options", [("hawk", {}), ("hawk", {"chunk_size": 64}),
                                           ("mlstm", {}), ("mlstm", {"chunk_size": None}),
                                           ("slstm", {})])
def test_memory_is_linear_in_length(name, options):
  """XLA's compiled forward+backward temp memory (deterministic, nothing runs), the default
  form and the other, emb 64 in 2 heads: 4x the length needs at most 4.5x the memory
  (quadratic: 16x)."""
  def temp_bytes(length):
    return mixer_temp_bytes(name, length, **options)

  short, long = temp_bytes(2048), temp_bytes(8192)
  assert long <= 4.5 * short, f"{long / 2**20:.1f} MiB at 8K vs {short / 2**20:.1f} MiB at 2K"
