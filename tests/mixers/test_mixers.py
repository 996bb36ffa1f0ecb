"""The sequence mixers: in every model, by name; the registry's two kinds; state sizes; each
layer's output against its paper's recurrence in float64; linear memory at length.

The layer-level properties (padding, causality, decoding, the bidirectional form, ...) are the
conformance suite's (tests/testing/test_conformance.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attention_zoo as az
from attention_zoo import positions
from attention_zoo.layers import MultiHeadAttention
from attention_zoo.models import (Classifier, DecoderLM, DualEncoderClassifier, EncoderDecoder,
                                  TransformerConfig)
from test_linear_mixers import ORACLES as LINEAR_ORACLES
from test_mamba3 import OPTIONS as MAMBA3_OPTIONS
from test_mamba3 import oracle as mamba3_oracle
from helpers import assert_decoding_equals_forward
from test_mla import causal_mla64
from test_path import oracle_path
from test_recurrent_mixers import OPTIONS as RECURRENT_OPTIONS
from test_recurrent_mixers import oracle as recurrent_oracle
from test_rwkv7_mamba import OPTIONS as RWKV7_MAMBA_OPTIONS
from test_rwkv7_mamba import oracle as rwkv7_mamba_oracle
from test_rwkv7_mamba import steeper_transitions

# Small chunks, so the tiny lengths below span several.
OPTIONS = {"deltanet": {"chunk_size": 4}, "gated_deltanet": {"chunk_size": 4},
           "gla": {"chunk_size": 4}, "mamba2": {"chunk_size": 4, "d_state": 4},
           "retnet": {"chunk_size": 4, "decay_exponent": 3.5},   # not the default 5
           "fox": {"block_size": 4}, "kda": {"chunk_size": 4},
           "gated_deltanet2": {"chunk_size": 4}, "comba": {"chunk_size": 4},
           "gated_deltaproduct": {"chunk_size": 5},   # 5 steps: a token's 2 split by a chunk
           "hgrn2": {"chunk_size": 4, "lower_bound": 0.3}, "lightning": {"chunk_size": 4},
           "based": {"chunk_size": 4, "window": 3, "feature_dim": 3},
           "mla": {"block_size": 4}, "path": {"block_size": 4},
           **RWKV7_MAMBA_OPTIONS, **RECURRENT_OPTIONS, **MAMBA3_OPTIONS}


def test_every_mixer_has_test_options():
  assert set(az.available("mixer")) == set(OPTIONS)


def config(name, **kw):
  return TransformerConfig(vocab_size=11, max_len=12, num_layers=1, emb_dim=16, num_heads=2,
                           mlp_dim=16, dropout_rate=0.0, attention=name,
                           attention_options={**OPTIONS[name], **kw.pop("options", {})}, **kw)


# Each model kind around one mixer of each structure (a chunked delta rule, a state-space scan, a
# softmax over a latent cache); every mixer's own grad, decode and bidirectional form are the
# conformance suite's, and its decoding inside a model is test_the_lm_generates_alike_...
MODEL_KIND_MIXERS = ("gated_deltanet", "mamba2", "mla")


@pytest.mark.slow   # compiles five models per mixer
@pytest.mark.parametrize("name", MODEL_KIND_MIXERS)
def test_every_model_kind_runs(name):
  tokens, mask = _tokens()
  for bidirectional in (True, False):
    model = Classifier(config(name, options={"bidirectional": bidirectional}, remat="block"),
                       rngs=nnx.Rngs(0))
    loss = lambda m: jnp.sum(m(tokens, mask) ** 2)
    value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
    assert np.isfinite(float(value))
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(nnx.state(grads, nnx.Param)))
  dual = DualEncoderClassifier(config(name), rngs=nnx.Rngs(0))
  assert dual(tokens, mask, tokens, mask).shape == (2, 2)
  seq2seq = EncoderDecoder(config(name, positions="rope"), rngs=nnx.Rngs(0))
  assert seq2seq(tokens, tokens[:, :5], mask).shape == (2, 5, 11)


@pytest.mark.slow
@pytest.mark.parametrize("name", az.available("mixer"))
def test_the_lm_generates_alike_with_and_without_the_mixers_cache(name):
  prompt = _tokens()[0][:, :3]
  lm = DecoderLM(config(name, positions="rope"), rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(lm.generate(prompt, 4), lm.generate(prompt, 4, use_cache=False))


def _tokens():
  tokens = jax.random.randint(jax.random.key(0), (2, 9), 1, 11)
  return tokens, jnp.arange(9)[None] < jnp.array([[9], [6]])


def test_unknown_names_list_both_kinds():
  for make in (lambda: az.create_mixer("nope", emb_dim=8, num_heads=2, rngs=nnx.Rngs(0)),
               lambda: TransformerConfig(attention="nope")):
    with pytest.raises(ValueError, match="unknown attention or mixer 'nope'; available: "
                                         "attention variants: .*full.*; mixers: .*gated_deltanet"):
      make()
  # a misspelt mixer is named a mixer, with the mixer it is close to
  with pytest.raises(ValueError, match=r"unknown mixer 'gated_deltanett' \(did you mean "
                                       r"'gated_deltanet'\?\)"):
    az.create_mixer("gated_deltanett", emb_dim=8, num_heads=2, rngs=nnx.Rngs(0))
  mixers = az.available("mixer")
  with pytest.raises(ValueError, match=f"unknown mixer 'nope'; available: {mixers[0]}, "
                                       f".*{mixers[-1]}$"):
    az.spec("nope", "mixer")
  assert type(az.spec("gla")) is az.MixerSpec and type(az.spec("full")) is az.AttentionSpec
  assert issubclass(az.MixerSpec, az.Spec) and issubclass(az.AttentionSpec, az.Spec)


def test_create_and_create_mixer():
  assert set(az.available()) == set(az.available("attention")) | set(az.available("mixer"))
  assert not set(az.available("attention")) & set(az.available("mixer"))
  with pytest.raises(ValueError, match="kind must be one of"):
    az.available("mixers")
  spec = az.spec("gla")
  assert (spec.kind, spec.exact, spec.supports_causal, spec.supports_cross, spec.can_decode,
          spec.supports_alibi, spec.supports_dropout) == ("mixer", False, True, False, True,
                                                          False, False)
  assert az.spec("full").kind == "attention"
  with pytest.raises(ValueError, match="use.*create_mixer|create_mixer"):
    az.create("gla", num_heads=2, head_dim=4, rngs=nnx.Rngs(0))
  layer = az.create_mixer("full", emb_dim=8, num_heads=2, causal=True, rngs=nnx.Rngs(0))
  assert isinstance(layer, MultiHeadAttention)
  mixer = az.create_mixer("gla", emb_dim=8, num_heads=2, rngs=nnx.Rngs(0))
  assert isinstance(mixer, az.Mixer)
  x = jnp.ones((1, 5, 8))
  run = nnx.jit(lambda module, x: module(x, mask=None))   # one program, not op by op
  assert run(layer, x).shape == run(mixer, x).shape == x.shape
  with pytest.raises(ValueError, match="position_kind must be 'none'"):
    az.create_mixer("gla", emb_dim=8, num_heads=2, position_kind="rope", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="cross-attention needs an attention variant"):
    TransformerConfig(cross_attention="gla")
  with pytest.raises(ValueError, match="attention_dropout_rate"):
    Classifier(TransformerConfig(attention="gla", attention_dropout_rate=0.1), rngs=nnx.Rngs(0))


def test_state_size_formulas():
  dims = dict(emb_dim=64, num_heads=4, num_kv_heads=2, seq_len=100)
  size = lambda name, **options: az.state_size(name, **dims, options=options)
  assert size("full") == 2 * 100 * 2 * 16                     # the KV cache
  assert size("sliding_window", window=10) == 2 * 10 * 2 * 16
  assert size("sliding_window", window=1000) == 2 * 100 * 2 * 16
  assert size("linear_transformer") == 2 * 16 * 17            # S [m, d] and z [m] per kv head
  assert size("performer", nb_features=32) == 2 * 32 * 17
  assert size("gated_deltanet") == 4 * 16 * 32                # H · d_k · d_v, d_v = 2 d_k
  assert size("gated_deltaproduct", num_householder=3) == 4 * 16 * 32
  assert size("kda") == 4 * 16 * 16
  assert size("deltanet", expand_k=0.5) == 4 * 8 * 16
  assert size("gla") == 4 * 8 * 16
  assert size("retnet") == 4 * 16 * 32
  assert size("mamba2", d_state=16) == 4 * 16 * 32            # H · N · P, P = 2 · 16
  assert size("fox") == 100 * (2 * 2 * 16 + 4)                # k, v, log f per token
  assert size("mla") == 100 * (4 * 16 + 8)                    # the latent, the shared RoPE key
  assert size("path") == 2 * 100 * 2 * 16                     # transformed keys, values
  assert az.state_size("gla", emb_dim=64, num_heads=4, seq_len=7, head_dim=32) == 4 * 16 * 32
  with pytest.raises(ValueError, match="gla: unknown option"):
    size("gla", nope=1)


def test_retnet_decays_default_to_the_papers():
  """γ_h = 1 - 2^(-5-h) unless decay_exponent moves them (the oracle test runs a moved one)."""
  decays = lambda **options: np.exp(az.create_mixer("retnet", emb_dim=16, num_heads=4,
                                                    rngs=nnx.Rngs(0), **options).log_gamma)
  np.testing.assert_allclose(decays(), [1 - 1 / 32, 1 - 1 / 64, 1 - 1 / 128, 1 - 1 / 256])
  np.testing.assert_allclose(decays(decay_exponent=8), [1 - 2.0 ** -e for e in (8, 9, 10, 11)])
  with pytest.raises(ValueError, match="decay_exponent"):
    decays(decay_exponent=0)


@pytest.mark.parametrize("name", sorted(set(az.available("mixer")) - {"fox", "mla", "path"}))
def test_state_size_is_the_decode_state(name):
  """The formula counts what decoding carries (the recurrent state; not the conv cache)."""
  options = OPTIONS[name]
  mixer = az.create_mixer(name, emb_dim=16, num_heads=2, causal=True, rngs=nnx.Rngs(0),
                          **options)
  state = mixer.empty_state(1, 9, jnp.float32)
  floats = sum(a.size for a in jax.tree.leaves(state) if a.ndim)
  assert floats == az.state_size(name, emb_dim=16, num_heads=2, seq_len=9, options=options)


# -- each layer against its equation in float64 ----------------------------------------------

def recurrence64(q, k, v, decay, beta=None, scale=1.0):
  """S_t = Diag(decay_t) S_{t-1}; then S_t += k_t v_tᵀ (beta None) or the delta rule
  S_t += β_t k_t (v_t - S_tᵀ k_t)ᵀ; o_t = S_tᵀ (scale q_t). One sequence: q [T, H, K],
  k [T, H, K], v [T, H, V], decay [T, H, K], beta [T, H]; or with n delta steps per token
  (DeltaProduct: after the decay, j = 1..n in turn) k [T, n, H, K], v [T, n, H, V],
  beta [T, n, H]."""
  q, k, v, decay = (np.asarray(a, np.float64) for a in (q, k, v, decay))
  if k.ndim == 3:    # one step per token
    k, v, beta = k[:, None], v[:, None], None if beta is None else np.asarray(beta)[:, None]
  state = np.zeros(k.shape[2:] + v.shape[-1:])
  out = []
  for t in range(q.shape[0]):
    state = decay[t][..., None] * state
    for j in range(k.shape[1]):
      u = v[t, j] if beta is None else np.asarray(beta[t, j], np.float64)[:, None] * (
          v[t, j] - np.einsum("hk,hkv->hv", k[t, j], state))
      state = state + k[t, j][..., None] * u[:, None, :]
    out.append(np.einsum("hk,hkv->hv", scale * q[t], state))
  return np.stack(out)


def split_heads(a, *widths):
  parts = np.split(np.asarray(a, np.float64), np.cumsum(widths[:-1]), axis=-1)
  return parts


def l2(a):
  return a / np.sqrt((a * a).sum(-1, keepdims=True) + 1e-6)


def silu(a):
  return np.asarray(jax.nn.silu(jnp.asarray(a, jnp.float32)), np.float64)


def softplus(a):
  return np.logaddexp(0.0, np.asarray(a, np.float64))


def sigmoid(a):
  return 1 / (1 + np.exp(-np.asarray(a, np.float64)))


def finish(mixer, o, gate_input, activation=silu):
  """RMSNorm per head with the layer's scale, times activation(gate), then the layer's output
  projection, on the oracle's o [T, H, V]."""
  o = np.asarray(o, np.float64)
  y = o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + mixer.norm.eps)
  y = y * np.asarray(mixer.norm.scale[...], np.float64)
  if gate_input is not None:
    y = y * activation(np.asarray(gate_input, np.float64).reshape(o.shape))
  return mixer.out(jnp.asarray(y.reshape(1, o.shape[0], -1), jnp.float32))[0]


def oracle_delta(mixer, x, activation=silu):
  """DeltaNet, Gated DeltaNet, KDA (decay per key channel, sigmoid output gate) and Gated
  DeltaProduct (n steps per token: k, v, β projected n times, step-major channels)."""
  h, d_k, d_v, n = mixer.num_heads, mixer.d_k, mixer.d_v, mixer.options.get("num_householder", 1)
  qkv = silu(mixer.conv(mixer.qkv(x)))[0]
  q, k, v = split_heads(qkv, h * d_k, n * h * d_k, n * h * d_v)
  T = q.shape[0]
  q, k, v = l2(q.reshape(T, h, d_k)), l2(k.reshape(T, n, h, d_k)), v.reshape(T, n, h, d_v)
  beta = sigmoid(mixer.beta_proj(x)[0]).reshape(T, n, h)
  if mixer.options["allow_neg_eigval"]:
    beta = 2 * beta
  decay = np.ones((T, h, d_k))
  if hasattr(mixer, "decay"):   # α = exp(-exp(A_log) softplus(a + dt_bias)), per head or channel
    a = np.asarray(mixer.decay_proj(x)[0], np.float64).reshape(T, h, -1)
    rate = np.exp(np.asarray(mixer.decay.A_log[...], np.float64))[:, None]
    dt_bias = np.asarray(mixer.decay.dt_bias[...], np.float64).reshape(h, -1)
    decay = np.broadcast_to(np.exp(-rate * softplus(a + dt_bias)), decay.shape)
  o = recurrence64(q, k, v, decay, beta, scale=d_k ** -0.5)
  gate = None if mixer.gate_proj is None else mixer.gate_proj(x)[0]
  return finish(mixer, o, gate, activation)


def oracle_gated_deltanet2(mixer, x):
  """S_t = (I - k_t (b_t ⊙ k_t)ᵀ) Diag(α_t) S_{t-1} + k_t (w_t ⊙ v_t)ᵀ, b = σ(W_b x) (2σ with
  allow_neg_eigval), w = σ(W_w x), KDA's α; SiLU output gate."""
  h, d_k, d_v = mixer.num_heads, mixer.d_k, mixer.d_v
  q, k, v = split_heads(silu(mixer.conv(mixer.qkv(x)))[0], h * d_k, h * d_k, h * d_v)
  T = q.shape[0]
  q, k, v = l2(q.reshape(T, h, d_k)), l2(k.reshape(T, h, d_k)), v.reshape(T, h, d_v)
  erase = sigmoid(mixer.beta_proj(x)[0]).reshape(T, h, d_k)
  erase = 2 * erase if mixer.options["allow_neg_eigval"] else erase
  write = sigmoid(mixer.write_proj(x)[0]).reshape(T, h, d_v)
  a = np.asarray(mixer.decay_proj(x)[0], np.float64).reshape(T, h, d_k)
  rate = np.exp(np.asarray(mixer.decay.A_log[...], np.float64))[:, None]
  decay = np.exp(-rate * softplus(a + np.asarray(mixer.decay.dt_bias[...], np.float64)))
  state, out = np.zeros((h, d_k, d_v)), []
  for t in range(T):
    transition = np.eye(d_k) - k[t][:, :, None] * (erase[t] * k[t])[:, None, :]   # [h, K, K]
    state = (np.einsum("hij,hjv->hiv", transition, decay[t][..., None] * state)
             + k[t][:, :, None] * (write[t] * v[t])[:, None, :])
    out.append(np.einsum("hk,hkv->hv", d_k ** -0.5 * q[t], state))
  return finish(mixer, np.stack(out), mixer.gate_proj(x)[0])


def oracle_comba(mixer, x):
  """S_t = (α_t I - β_t k_t p_tᵀ) S_{t-1} + β_t k_t v_tᵀ, p = σ(λ) k, o_t = S_tᵀ (q_t - d p_t)
  scaled; Gated DeltaNet's α and β (2σ with allow_neg_eigval); sigmoid output gate."""
  h, d_k, d_v = mixer.num_heads, mixer.d_k, mixer.d_v
  q, k, v = split_heads(silu(mixer.conv(mixer.qkv(x)))[0], h * d_k, h * d_k, h * d_v)
  T = q.shape[0]
  q, k, v = l2(q.reshape(T, h, d_k)), l2(k.reshape(T, h, d_k)), v.reshape(T, h, d_v)
  beta = sigmoid(mixer.beta_proj(x)[0])                                            # [T, h]
  beta = 2 * beta if mixer.options["allow_neg_eigval"] else beta
  a = np.asarray(mixer.decay_proj(x)[0], np.float64)
  rate = np.exp(np.asarray(mixer.decay.A_log[...], np.float64))
  decay = np.exp(-rate * softplus(a + np.asarray(mixer.decay.dt_bias[...], np.float64)))
  p = sigmoid(mixer.inner_decay[...])[:, None] * k
  q = q - np.asarray(mixer.correction[...], np.float64)[:, None] * p
  state, out = np.zeros((h, d_k, d_v)), []
  for t in range(T):
    transition = (decay[t][:, None, None] * np.eye(d_k)
                  - beta[t][:, None, None] * k[t][:, :, None] * p[t][:, None, :])   # [h, K, K]
    state = (np.einsum("hij,hjv->hiv", transition, state)
             + beta[t][:, None, None] * k[t][:, :, None] * v[t][:, None, :])
    out.append(np.einsum("hk,hkv->hv", d_k ** -0.5 * q[t], state))
  return finish(mixer, np.stack(out), mixer.gate_proj(x)[0], activation=sigmoid)


def oracle_gla(mixer, x):
  h, d_k, d_v = mixer.num_heads, mixer.d_k, mixer.d_v
  q, k, v = split_heads(mixer.qkv(x)[0], h * d_k, h * d_k, h * d_v)
  T = q.shape[0]
  logits = np.asarray(mixer.gate_up(mixer.gate_down(x))[0], np.float64)
  decay = sigmoid(logits) ** (1 / 16)                      # α = σ(x W1 W2 + b)^(1/τ)
  o = recurrence64(q.reshape(T, h, d_k), k.reshape(T, h, d_k), v.reshape(T, h, d_v),
                   decay.reshape(T, h, d_k), scale=d_k ** -0.5)
  return finish(mixer, o, mixer.gate_proj(x)[0])


def oracle_retnet(mixer, x):
  h, d_k, d_v = mixer.num_heads, mixer.d_k, mixer.d_v
  q, k, v = split_heads(mixer.qkv(x)[0], h * d_k, h * d_k, h * d_v)
  T = q.shape[0]
  rotate = lambda a: np.asarray(positions.rope(jnp.asarray(a.reshape(1, T, h, d_k), jnp.float32),
                                               jnp.arange(T)))[0]
  gamma = 1 - 2.0 ** (-mixer.options["decay_exponent"] - np.arange(h))
  o = recurrence64(rotate(q), rotate(k), v.reshape(T, h, d_v),
                   np.broadcast_to(gamma[None, :, None], (T, h, d_k)), scale=d_k ** -0.5)
  return finish(mixer, o, mixer.gate_proj(x)[0])


def transition64(mixer, exponent):
  """exp(Δ A), or with allow_neg_eigval 2 exp(Δ A) - 1 (Grazzi et al. 2025), in float64."""
  decay = np.exp(np.asarray(exponent, np.float64))
  return 2 * decay - 1 if mixer.options["allow_neg_eigval"] else decay


def oracle_mamba2(mixer, x):
  h, p, n, d_inner = mixer.num_heads, mixer.p, mixer.n, mixer.d_inner
  groups = mixer.num_kv_heads
  z, xbc, dt = split_heads(mixer.in_proj(x)[0], d_inner, d_inner + 2 * groups * n, h)
  xbc = silu(mixer.conv(jnp.asarray(xbc, jnp.float32)[None]))[0]
  xs, B, C = split_heads(xbc, d_inner, groups * n, groups * n)
  T = xs.shape[0]
  delta = softplus(dt + np.asarray(mixer.decay.dt_bias[...]))           # Δ [T, h]
  A = -np.exp(np.asarray(mixer.decay.A_log[...], np.float64))
  xs = xs.reshape(T, h, p)
  heads = lambda a: np.repeat(a.reshape(T, groups, n), h // groups, axis=1)  # B, C per group
  transition = transition64(mixer, delta * A)                           # [T, h]
  y = recurrence64(heads(C), heads(B), xs * delta[..., None],
                   np.broadcast_to(transition[..., None], (T, h, n)))
  y = y + np.asarray(mixer.D[...])[:, None] * xs                       # D skip
  # RMSNormGated(d_inner, group_size=d_inner / groups): gate, RMS per group, scale per channel
  y = (y.reshape(T, d_inner) * silu(z)).reshape(T, groups, -1)
  y = y / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + mixer.norm.eps)
  y = y.reshape(T, d_inner) * np.asarray(mixer.norm.scale[...], np.float64)
  return mixer.out(jnp.asarray(y[None], jnp.float32))[0]


def oracle_fox(mixer, x):
  h, d = mixer.num_heads, mixer.head_dim
  q, k, v = (a.reshape(-1, h, d) for a in split_heads(mixer.qkv(x)[0], h * d, h * d, h * d))
  log_f = np.log(sigmoid(mixer.forget_proj(x)[0]))                      # [T, h]
  c = np.cumsum(log_f, axis=0)
  scores = np.einsum("ihd,jhd->hij", q, k) * d ** -0.5 + (c.T[:, :, None] - c.T[:, None, :])
  scores = np.where(np.tril(np.ones((len(c), len(c)), bool)), scores, -np.inf)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  o = np.einsum("hij,jhd->ihd", weights / weights.sum(-1, keepdims=True), v)
  return mixer.out(jnp.asarray(o.reshape(1, -1, h * d), jnp.float32))[0]


def float64_oracle(oracle):
  """One of tests/mixers/test_linear_mixers.py's oracles (jnp, batched, with a mask) in float64."""
  def run(mixer, x):
    with jax.enable_x64(True):
      return np.asarray(oracle(mixer, jnp.asarray(x, jnp.float64), jnp.ones(x.shape[:2], bool)))[0]
  return run


ORACLES = {"deltanet": oracle_delta, "gated_deltanet": oracle_delta,
           "gated_deltaproduct": oracle_delta,
           "kda": lambda m, x: oracle_delta(m, x, activation=sigmoid), "gla": oracle_gla,
           "gated_deltanet2": oracle_gated_deltanet2, "comba": oracle_comba,
           "retnet": oracle_retnet, "mamba2": oracle_mamba2, "fox": oracle_fox,
           **{name: float64_oracle(oracle) for name, oracle in LINEAR_ORACLES.items()},
           "mla": causal_mla64, "path": oracle_path,
           "rwkv7": lambda m, x: rwkv7_mamba_oracle(m, x)[0],
           "mamba": lambda m, x: rwkv7_mamba_oracle(m, x)[0],
           **{name: lambda m, x: recurrent_oracle(m, x)[0] for name in RECURRENT_OPTIONS},
           "mamba3": lambda m, x: mamba3_oracle(m, x)[0]}


@pytest.mark.parametrize("name", az.available("mixer"))
def test_layer_equals_its_equation_in_float64(name):
  groups = {"num_kv_heads": 2} if name == "mamba2" else {}   # B, C and the norm in 2 groups
  mixer = az.create_mixer(name, emb_dim=16, num_heads=2, causal=True, rngs=nnx.Rngs(1), **groups,
                          **OPTIONS[name])
  if name == "mamba2":   # a scale per channel, not one shared by the groups
    mixer.norm.scale[...] = jax.random.uniform(jax.random.key(3), mixer.norm.scale.shape) + 0.5
  x = jax.random.normal(jax.random.key(2), (1, 11, 16))
  got = nnx.jit(lambda mixer, x: mixer(x))(mixer, x)[0]   # one program: faster than op by op
  want = ORACLES[name](mixer, x)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", [pytest.param("mamba", marks=pytest.mark.slow), "mamba2"])
def test_negative_eigenvalues_equal_their_equation_and_decode_exactly(name):
  """allow_neg_eigval: transitions 2 exp(Δ A) - 1, of both signs once A is steeper; the chunk
  form equals the float64 equation, and decoding token by token (the token form) the chunked
  forward. (mamba's gradients and its token form: test_rwkv7_mamba.py.)"""
  mixer = az.create_mixer(name, emb_dim=16, num_heads=2, causal=True, rngs=nnx.Rngs(1),
                          allow_neg_eigval=True, **OPTIONS[name])
  steeper_transitions(mixer)
  x = jax.random.normal(jax.random.key(2), (1, 11, 16))
  np.testing.assert_allclose(mixer(x)[0], ORACLES[name](mixer, x), rtol=1e-4, atol=1e-5)
  length = 9
  x = jax.random.normal(jax.random.key(4), (2, length, 16))
  mask = jnp.arange(length)[None] < jnp.array([[length], [length - 3]])
  assert_decoding_equals_forward(mixer, x, mask)


# -- memory at length -----------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", ["gated_deltanet", "gated_deltanet2", "comba"])
def test_classifier_memory_is_linear_in_length(name):
  """Compiled forward+backward temp memory of a classifier around the mixer (Gated DeltaNet;
  Gated DeltaNet-2 and Comba, the delta engine's erase gate and the DPLR engine's scalar
  gate): 4x the length needs at most 4.5x the memory (quadratic would be 16x)."""
  def temp_bytes(length):
    model = Classifier(TransformerConfig(vocab_size=11, max_len=length, num_layers=1, emb_dim=32,
                                         num_heads=2, mlp_dim=32, attention=name),
                       rngs=nnx.Rngs(0))
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    loss = lambda params, tokens: jnp.sum(nnx.merge(graph, params, rest)(tokens))
    tokens = jax.ShapeDtypeStruct((1, length), jnp.int32)
    compiled = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  short, long = temp_bytes(2048), temp_bytes(8192)
  assert long <= 4.5 * short, (short, long)
