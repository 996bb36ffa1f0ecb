"""Mamba-3 (attention_zoo/mixers/mamba3.py) against the paper's recurrence written here in
float64, token by token, from the layer's parameters: the state h_t [N, P] per head updated by
the trapezoidal rule from the current and the previous token, B and C rotated by the running
angles as complex numbers, SISO and MIMO. The output and the gradients in x and in every
parameter (a padded row, with a hole, included) in the chunk form and the token form; packed
rows; decoding against the parallel forward; memory at length. The registry-wide properties:
tests/testing/test_conformance.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attention_zoo as az
from helpers import assert_decoding_equals_forward, assert_mixer_equals_float64, mixer_temp_bytes
from ops_reference import assert_close

# Chunks of 4 (token, rank) pairs: several over the tests' 9 to 11 tokens.
OPTIONS = {"mamba3": {"chunk_size": 4, "d_state": 8}}
# Relative tolerance of the f32 layer against float64, as the other mixers' (measured: below
# 2e-6 for the output, 5e-6 for the gradients).
TOLERANCE = 2e-5


def dense(p, x):
  return x @ p["kernel"]


def rms(v, scale, eps=1e-5):
  return v / jnp.sqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps) * scale


def rotate(v, phi):
  """The first M channel pairs of v as complex numbers times e^{iφ} (the complex state of the
  paper); v [..., N], phi [..., M] broadcast against v's leading axes."""
  pairs = phi.shape[-1]
  z = (v[..., 0:2 * pairs:2] + 1j * v[..., 1:2 * pairs:2]) * jnp.exp(1j * phi)
  rotated = jnp.stack([z.real, z.imag], axis=-1).reshape(*z.shape[:-1], 2 * pairs)
  return jnp.concatenate([rotated, v[..., 2 * pairs:]], axis=-1)


def mamba3_equations(p, x, mask, *, heads, groups, d_state, rank, pairs, a_floor):
  """Δ = softplus(a_Δ + dt_bias), A = -max(softplus(a_A), a_floor), α = e^{ΔA}, λ = σ(a_λ),
  φ_t = φ_{t-1} + π tanh(a_θ) Δ_t, B̃ = rot(φ_t, RMSNorm(B) + b_B) (C̃ likewise),
  h_t = α_t h_{t-1} + (1 - λ_t) Δ_t α_t Σ_j B̃'_j x'_jᵀ + λ_t Δ_t Σ_j B̃_{t,j} x_{t,j}ᵀ with
  (B̃', x') the last real token's, y_{t,i} = h_tᵀ C̃_{t,i} + D x_{t,i}; SISO y ⊙ SiLU(z), MIMO
  Σ_i w^o_i ⊙ y_i ⊙ SiLU(z ⊙ w^z_i) (x_{t,i} = x_t ⊙ w^x_i); then W_out. A masked token leaves
  (h, B̃', x', φ) as they were and outputs 0."""
  b, T, _ = x.shape
  d_inner = p["out"]["kernel"].shape[0]
  P, bc = d_inner // heads, rank * groups * d_state
  widths = np.cumsum([d_inner, d_inner, bc, bc, heads, heads, heads])
  z, xs, B, C, a_dt, a_A, a_lam, a_theta = jnp.split(dense(p["in_proj"], x), widths, axis=-1)
  delta = jax.nn.softplus(a_dt + p["dt_bias"])                                  # [b, T, h]
  alpha = jnp.exp(-delta * jnp.maximum(jax.nn.softplus(a_A), a_floor))
  lam = jax.nn.sigmoid(a_lam)
  increment = jnp.pi * jnp.tanh(a_theta)[:, :, None, :] * delta[..., None]      # [b, T, h, M]

  def per_head(v, norm, bias):                                                  # [b, T, r, h, N]
    v = rms(v.reshape(b, T, rank, groups, d_state), norm["scale"])
    return jnp.repeat(v, heads // groups, axis=3) + bias

  B, C = per_head(B, p["b_norm"], p["b_bias"]), per_head(C, p["c_norm"], p["c_bias"])
  xs = xs.reshape(b, T, 1, heads, P)
  values = xs * p["mimo_x"] if rank > 1 else xs                                 # [b, T, r, h, P]

  def token(carry, inputs):
    h, key_prev, value_prev, phi = carry
    B_t, C_t, v_t, inc_t, alpha_t, lam_t, delta_t, real = inputs
    phi_t = phi + inc_t                                                         # [b, h, M]
    k_t, q_t = rotate(B_t, phi_t[:, None]), rotate(C_t, phi_t[:, None])
    scalar = lambda s: s[:, :, None, None]
    h_t = (scalar(alpha_t) * h
           + scalar((1 - lam_t) * delta_t * alpha_t) * jnp.einsum("brhk,brhv->bhkv", key_prev,
                                                                  value_prev)
           + scalar(lam_t * delta_t) * jnp.einsum("brhk,brhv->bhkv", k_t, v_t))
    y_t = jnp.einsum("bhkv,brhk->brhv", h_t, q_t) + p["D"][:, None] * v_t
    keep = lambda new, old: jnp.where(real.reshape(-1, *[1] * (new.ndim - 1)), new, old)
    return (keep(h_t, h), keep(k_t, key_prev), keep(v_t, value_prev), keep(phi_t, phi)), y_t

  zeros = lambda *shape: jnp.zeros((b, *shape))
  carry = (zeros(heads, d_state, P), zeros(rank, heads, d_state), zeros(rank, heads, P),
           zeros(heads, pairs))
  per_token = (B, C, jnp.broadcast_to(values, (b, T, rank, heads, P)), increment, alpha, lam,
               delta, mask)
  _, y = jax.lax.scan(token, carry, [jnp.swapaxes(a, 0, 1) for a in per_token])
  y = jnp.swapaxes(y, 0, 1)                                                     # [b, T, r, h, P]
  z = z.reshape(b, T, 1, heads, P)
  if rank > 1:
    y = jnp.sum(p["mimo_out"] * y * jax.nn.silu(z * p["mimo_z"]), axis=2)
  else:
    y = y[:, :, 0] * jax.nn.silu(z[:, :, 0])
  return jnp.where(mask[..., None], dense(p["out"], y.reshape(b, T, d_inner)), 0)


def equations(mixer):
  """mamba3_equations at the mixer's shapes and options: (params, x, mask) -> y."""
  options = mixer.options
  d_state = options["d_state"]
  return lambda p, x, mask: mamba3_equations(
      p, x, mask, heads=mixer.num_heads, groups=mixer.num_kv_heads, d_state=d_state,
      rank=options["mimo_rank"], pairs=int(d_state * options["rope_fraction"]) // 2,
      a_floor=options["a_floor"])


def oracle(mixer, x, mask=None):
  """The layer's output by the paper's recurrence in float64, from its parameters."""
  mask = jnp.ones(x.shape[:2], bool) if mask is None else mask
  with jax.enable_x64(True):
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64),
                          nnx.state(mixer, nnx.Param).to_pure_dict())
    run = jax.jit(lambda params, x: equations(mixer)(params, x, mask))
    return np.asarray(run(params, jnp.asarray(x, jnp.float64)))


def build(num_kv_heads=2, **options):
  """4 heads over 2 groups of B and C; steps Δ near 1 (dt_bias 0.5), so the angles turn by up
  to π per token and the decays reach about e^-1 (the authors' init turns them by < 0.3)."""
  mixer = az.create_mixer("mamba3", emb_dim=16, num_heads=4, num_kv_heads=num_kv_heads,
                          causal=True, rngs=nnx.Rngs(1), **{**OPTIONS["mamba3"], **options})
  mixer.dt_bias[...] = jnp.full_like(mixer.dt_bias[...], 0.5)
  for bias in (mixer.b_bias, mixer.c_bias):   # biases that differ by head and rank
    bias[...] = bias[...] + 0.5 * jax.random.normal(jax.random.key(7), bias.shape)
  return mixer


def inputs(length=9):
  """x [2, length, 16], its mask (row 1: a hole at 3 and the last 2 tokens padded) and
  weights w like x (the loss Σ y·w)."""
  x, w = jax.random.normal(jax.random.key(2), (2, 2, length, 16), jnp.float32)
  mask = np.ones((2, length), bool)
  mask[1, 3] = mask[1, -2:] = False
  return x, jnp.asarray(mask), w


def assert_output_and_gradients_equal_the_equations(mixer, x, mask, w):
  assert_mixer_equals_float64(mixer, equations(mixer), x, mask, w, TOLERANCE)


@pytest.mark.parametrize("options", [{}, {"mimo_rank": 3}], ids=["siso", "mimo"])
def test_chunk_form_output_and_gradients_equal_the_float64_recurrence(options):
  """Chunks of 4 (token, rank) pairs; MIMO rank 3: a token's 3 pairs split by chunk edges."""
  x, mask, w = inputs()
  assert_output_and_gradients_equal_the_equations(build(**options), x, mask, w)


@pytest.mark.slow   # the token form and a longer sequence: more compiles
@pytest.mark.parametrize("options", [{"chunk_size": None}, {"chunk_size": None, "mimo_rank": 2},
                                     {"chunk_size": 8, "rope_fraction": 1.0, "mimo_rank": 2}])
def test_other_forms_equal_the_float64_recurrence(options):
  x, mask, w = inputs(length=21)
  assert_output_and_gradients_equal_the_equations(build(**options), x, mask, w)


# SISO in the slow lane: the conformance check `packed` covers it there too; MIMO (the same code
# with r > 1) stays fast.
SISO_SLOW_MIMO_FAST = [pytest.param({}, id="siso", marks=pytest.mark.slow),
                       pytest.param({"mimo_rank": 2}, id="mimo")]


@pytest.mark.parametrize("options", SISO_SLOW_MIMO_FAST)
def test_packed_rows_equal_their_sequences_apart(options):
  """Segments of 4, 5 (a hole inside) and 3 tokens in a row of 14 (2 padded): each equals its
  sequence alone, so no look-ahead weight, angle or state crosses a segment's start."""
  mixer = build(**options)
  run = nnx.jit(lambda mixer, x, mask, ids: mixer(x, mask=mask, segment_ids=ids))
  lengths = (4, 5, 3)
  x = jax.random.normal(jax.random.key(3), (1, 14, 16))
  mask = np.arange(14) < sum(lengths)
  mask[6] = False
  ids = jnp.asarray(np.repeat([0, 1, 2, 3], [*lengths, 2]))[None]
  packed = run(mixer, x, jnp.asarray(mask)[None], ids)
  start = 0
  for length in lengths:
    part = slice(start, start + length)
    alone = run(mixer, x[:, part], jnp.asarray(mask[part])[None], jnp.zeros((1, length), int))
    assert_close(packed[:, part], alone, 1e-5, f"segment at {start}")
    start += length


@pytest.mark.parametrize("options", SISO_SLOW_MIMO_FAST)   # SISO: conformance's `decode` too
def test_decoding_equals_the_parallel_forward(options):
  """Each token from the carried (h, last B̃ and x, φ), across a hole and a padded end; a
  prefill's state equals the stepped one."""
  x, mask, _ = inputs()
  assert_decoding_equals_forward(build(**options), x, mask)


def test_state_size_counts_h_the_last_key_and_value_and_the_angles():
  dims = dict(emb_dim=32, num_heads=2, num_kv_heads=2, seq_len=100)
  # H (N P + r (N + P) + M): N = 16, P = 2 · 16, M = 16 · 0.5 / 2
  assert az.state_size("mamba3", **dims, options={"d_state": 16}) == 2 * (
      16 * 32 + 16 + 32 + 4)
  assert az.state_size("mamba3", **dims, options={"d_state": 16, "mimo_rank": 4}) == 2 * (
      16 * 32 + 4 * (16 + 32) + 4)
  with pytest.raises(ValueError, match="rope_fraction"):
    build(d_state=2, rope_fraction=0.5)


@pytest.mark.slow   # compiles the backward at 2K and 8K tokens
@pytest.mark.parametrize("options", [{}, {"mimo_rank": 2}], ids=["siso", "mimo"])
def test_memory_is_linear_in_length(options):
  """XLA's compiled forward+backward temp memory (nothing runs), emb 64 in 2 heads: 4x the
  length needs at most 4.5x the memory (quadratic: 16x)."""
  def temp_bytes(length):
    return mixer_temp_bytes("mamba3", length, d_state=16, **options)

  short, long = temp_bytes(2048), temp_bytes(8192)
  assert long <= 4.5 * short, f"{long / 2**20:.1f} MiB at 8K vs {short / 2**20:.1f} MiB at 2K"
