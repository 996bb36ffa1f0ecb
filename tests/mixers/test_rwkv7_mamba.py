"""RWKV-7 and Mamba (attention_zoo/mixers/rwkv7.py, mamba.py) against their papers' equations
written here in float64 from the layers' parameters, token by token in the papers' own layouts
(RWKV-7's state [d_v, d_k] right-multiplied by its transition, Mamba's h [d_inner, N]): the
output and the gradients in x and in every parameter (GQA and a padded row included); decoding
one token at a time against the parallel forward; the bidirectional encoder; state sizes. The
registry-wide properties: tests/testing/test_conformance.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attention_zoo as az
from attention_zoo.models import DecoderLM, Encoder, TransformerConfig
from helpers import assert_decoding_equals_forward, assert_mixer_equals_float64

NAMES = ["rwkv7", "mamba"]
OPTIONS = {"rwkv7": {"chunk_size": 4, "decay_low_rank_dim": 8, "a_low_rank_dim": 8,
                     "gate_low_rank_dim": 8},
           "mamba": {"chunk_size": 4, "d_state": 4}}


def dense(p, x):
  return x @ p["kernel"] + (p["bias"] if "bias" in p else 0)


def scan(step, state, *per_token):
  """lax.scan over the token axis (1) of each [b, T, ...] input -> outputs [b, T, ...]."""
  _, out = jax.lax.scan(step, state, [jnp.swapaxes(a, 0, 1) for a in per_token])
  return jnp.swapaxes(out, 0, 1)


def rwkv7_equations(p, x, mask, *, num_heads, num_kv_heads, eps):
  """RWKV-7's time mix, the paper's equations: state [d_v, d_k] per head,
  S_t = S_{t-1} (Diag(w_t) - κ̂_tᵀ (a_t ⊙ κ̂_t)) + v_tᵀ k̃_t, o_t = S_t r_t; a masked token
  shifts in as zeros, leaves S as it was and outputs 0."""
  b, T, _ = x.shape
  h, d = num_heads, p["r_proj"]["kernel"].shape[1] // num_heads
  x = jnp.where(mask[..., None], x, 0)
  previous = jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :-1]
  xr, xw, xk, xv, xa, xg = (x + mu * (previous - x) for mu in p["mu"])
  heads = lambda y: y.reshape(b, T, -1, d)
  shared = lambda y: jnp.repeat(heads(y), h // num_kv_heads, axis=2)             # GQA
  w_lora, a_lora, g_lora = (p[name]["layers"] for name in ("w_lora", "a_lora", "g_lora"))
  r, k, v = heads(dense(p["r_proj"], xr)), shared(dense(p["k_proj"], xk)), shared(
      dense(p["v_proj"], xv))
  w = jnp.exp(-np.exp(-0.5) * jax.nn.sigmoid(heads(dense(w_lora[2], jnp.tanh(
      dense(w_lora[0], xw))))))
  a = jax.nn.sigmoid(heads(dense(a_lora[1], dense(a_lora[0], xa))))
  g = dense(g_lora[2], jax.nn.sigmoid(dense(g_lora[0], xg)))
  kappa = k * p["k_k"]
  kappa = kappa / jnp.sqrt(jnp.sum(kappa ** 2, -1, keepdims=True) + 1e-6)   # the layer's eps
  k = k * (1 + (a - 1) * p["k_a"])

  def token(S, inputs):                                                         # S [b, h, V, K]
    r_t, w_t, k_t, v_t, kappa_t, a_t, real = inputs
    S_kappa = jnp.einsum("bhvk,bhk->bhv", S, kappa_t)
    new = (S * w_t[:, :, None, :] - S_kappa[..., None] * (a_t * kappa_t)[:, :, None, :]
           + v_t[..., None] * k_t[:, :, None, :])
    o = jnp.einsum("bhvk,bhk->bhv", new, r_t)
    return jnp.where(real[:, None, None, None], new, S), jnp.where(real[:, None, None], o, 0)

  o = scan(token, jnp.zeros((b, h, d, d)), r, w, k, v, kappa, a, mask)         # [b, T, h, V]
  mean = o.mean(-1, keepdims=True)
  var = ((o - mean) ** 2).mean(-1, keepdims=True)
  o = ((o - mean) / jnp.sqrt(var + d * eps)).reshape(b, T, h * d)
  o = heads(o * p["norm"]["scale"] + p["norm"]["bias"])
  o = o + jnp.sum(r * p["r_k"] * k, -1, keepdims=True) * v                       # the bonus
  y = dense(p["out"], o.reshape(b, T, h * d) * g)
  return jnp.where(mask[..., None], y, 0)


def mamba_equations(p, x, mask, allow_neg_eigval=False):
  """Mamba's selective SSM: h_t = exp(Δ_t A) ⊙ h_{t-1} + (Δ_t ⊙ x_t) B_tᵀ, y_t = h_t C_t + D x_t
  per channel (allow_neg_eigval: the transition 2 exp(Δ_t A) - 1, Grazzi et al. 2025); a masked
  token enters the conv as zeros, leaves h as it was and outputs 0."""
  b, T, _ = x.shape
  xs, z = jnp.split(dense(p["in_proj"], x), 2, axis=-1)
  xs = jnp.where(mask[..., None], xs, 0)
  weight = p["conv"]["weight"]                                                  # [taps, E]
  taps = len(weight)
  padded = jnp.pad(xs, ((0, 0), (taps - 1, 0), (0, 0)))    # tap i reads x_{t-i}
  xs = jax.nn.silu(p["conv"]["bias"] + sum(weight[i] * padded[:, taps - 1 - i:taps - 1 - i + T]
                                           for i in range(taps)))
  N = p["A_log"].shape[1]
  rank = p["x_proj"]["kernel"].shape[1] - 2 * N
  dt, B, C = jnp.split(dense(p["x_proj"], xs), [rank, rank + N], axis=-1)
  delta = jax.nn.softplus(dense(p["dt_proj"], dt))                              # [b, T, E]
  A = -jnp.exp(p["A_log"])                                                      # [E, N]

  def token(state, inputs):                                                     # [b, E, N]
    x_t, delta_t, B_t, C_t, real = inputs
    transition = jnp.exp(delta_t[..., None] * A)
    transition = 2 * transition - 1 if allow_neg_eigval else transition
    new = transition * state + (delta_t * x_t)[..., None] * B_t[:, None, :]
    y = jnp.einsum("ben,bn->be", new, C_t) + p["D"] * x_t
    return jnp.where(real[:, None, None], new, state), y

  y = scan(token, jnp.zeros((b, xs.shape[-1], N)), xs, delta, B, C, mask)
  y = dense(p["out"], y * jax.nn.silu(z))
  return jnp.where(mask[..., None], y, 0)


def equations(mixer, params, x, mask):
  if mixer.spec.name == "rwkv7":
    return rwkv7_equations(params, x, mask, num_heads=mixer.num_heads,
                           num_kv_heads=mixer.num_kv_heads, eps=mixer.options["norm_eps"])
  return mamba_equations(params, x, mask, mixer.options["allow_neg_eigval"])


def oracle(mixer, x, mask=None):
  """The layer's output by its paper's equations in float64 (numpy), from its parameters."""
  mask = jnp.ones(x.shape[:2], bool) if mask is None else mask
  with jax.enable_x64(True):
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64),
                          nnx.state(mixer, nnx.Param).to_pure_dict())
    run = jax.jit(lambda params, x: equations(mixer, params, x, mask))   # one program: fast
    return np.asarray(run(params, jnp.asarray(x, jnp.float64)))


def build(name, **options):
  mixer = az.create_mixer(name, emb_dim=16, num_heads=2, num_kv_heads=1, causal=True,
                          rngs=nnx.Rngs(1), **{**OPTIONS[name], **options})
  if options.get("allow_neg_eigval"):
    steeper_transitions(mixer)
  return mixer


def steeper_transitions(mixer):
  """A x 8 (Mamba's or Mamba2's), so that 2 exp(Δ A) - 1 takes both signs (at init Mamba's
  Δ A stays below log 2 and every transition is positive; measured at the tests' sizes: from
  -0.995 to 0.99, a quarter negative, for mamba)."""
  holder = mixer.decay if mixer.spec.name == "mamba2" else mixer               # A_log's owner
  holder.A_log[...] = holder.A_log[...] + jnp.log(8.0)


def inputs(length=9):
  """x [2, length, 16], its mask (the second row's last 3 tokens padded) and weights w like x
  (the loss Σ y·w)."""
  x, w = jax.random.normal(jax.random.key(2), (2, 2, length, 16), jnp.float32)
  mask = jnp.arange(length)[None] < jnp.array([[length], [length - 3]])
  return x, mask, w


@pytest.mark.slow   # the fast lane has test_mixers.py's float64 check of the output (`oracle`)
@pytest.mark.parametrize("name, options", [
    ("rwkv7", {}), ("mamba", {}), ("mamba", {"chunk_size": None}),          # token form
    ("mamba", {"allow_neg_eigval": True}),
    ("mamba", {"allow_neg_eigval": True, "chunk_size": None})])
def test_output_and_gradients_equal_the_float64_equations(name, options):
  mixer = build(name, **options)
  x, mask, w = inputs()
  # measured: errors below 9e-7
  assert_mixer_equals_float64(mixer, lambda p, x, mask: equations(mixer, p, x, mask), x, mask, w,
                              1e-5)


@pytest.mark.slow   # conformance's decode check runs in the slow lane for these names too
@pytest.mark.parametrize("name", NAMES)
def test_decoding_token_by_token_equals_the_parallel_forward(name):
  """Each step from the carried state and the conv / token-shift cache; a prefill's state."""
  x, mask, _ = inputs()
  assert_decoding_equals_forward(build(name), x, mask)


def config(name, **options):
  return TransformerConfig(vocab_size=11, max_len=12, num_layers=1, emb_dim=16, num_heads=2,
                           mlp_dim=16, dropout_rate=0.0, attention=name,
                           attention_options={**OPTIONS[name], **options})


@pytest.mark.slow   # two encoders and a language model per name
@pytest.mark.parametrize("name", NAMES)
def test_bidirectional_encoder_and_cached_generation(name):
  """In an encoder the first position sees the last token (bidirectional) or not
  (bidirectional=False); DecoderLM generates the same with the carried state as without."""
  tokens = jax.random.randint(jax.random.key(0), (2, 9), 1, 11)
  changed = tokens.at[:, -1].set(tokens[:, -1] % 10 + 1)
  for bidirectional in (True, False):
    encoder = Encoder(config(name, bidirectional=bidirectional), rngs=nnx.Rngs(0))
    first = lambda t: encoder(t)[0][:, 0]
    moved = float(jnp.abs(first(changed) - first(tokens)).max())
    assert (moved > 1e-4) == bidirectional, (bidirectional, moved)
  lm = DecoderLM(config(name), rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(lm.generate(tokens[:, :3], 3),
                                lm.generate(tokens[:, :3], 3, use_cache=False))


def test_state_sizes():
  dims = dict(emb_dim=64, num_heads=4, num_kv_heads=2, seq_len=100)
  assert az.state_size("rwkv7", **dims, options={}) == 4 * 16 * 16          # H · d · d
  assert az.state_size("mamba", **dims, options={}) == 2 * 64 * 16          # d_inner · N
  assert az.state_size("mamba", **dims, options={"expand": 1, "d_state": 8}) == 64 * 8

