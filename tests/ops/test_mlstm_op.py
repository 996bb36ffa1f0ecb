"""ops.chunk_mlstm and ops.recurrent_mlstm (xLSTM's mLSTM cell) against the paper's recurrence
written unstabilised, token by token in float64: output, final state and gradients, with
padding, packed sequences and an initial state; and input gates up to e^100, which overflow
float32 unless the stabiliser works."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_zoo import ops
from ops_reference import assert_close

B, T, H, K, V = 2, 13, 2, 3, 2


def mlstm_recurrence(q, k, v, log_i, log_f, initial_state, mask, segment_ids):
  """S_t = f_t S_{t-1} + i_t k_t v_tᵀ, n_t = f_t n_{t-1} + i_t k_t (both 0 before a segment's
  first token), o_t = S_tᵀ q_t / max(|n_tᵀ q_t|, 1), q scaled by K^-1/2, i = exp(ĩ), f =
  exp(log f); a masked token leaves the state as it was and outputs 0. The initial state is
  the true (S, n) = e^m (S̃, ñ). -> (o, (S, n))."""
  S0, n0, m0 = initial_state
  S, n = S0 * jnp.exp(m0)[..., None, None], n0 * jnp.exp(m0)[..., None]
  i, f, q = jnp.exp(log_i), jnp.exp(log_f), q * K ** -0.5
  outputs = []
  for t in range(T):
    start = (segment_ids[:, t] != segment_ids[:, t - 1]) if t else jnp.zeros(B, bool)
    S_prev = jnp.where(start[:, None, None, None], 0.0, S)
    n_prev = jnp.where(start[:, None, None], 0.0, n)
    S_new = (f[:, t, :, None, None] * S_prev
             + i[:, t, :, None, None] * jnp.einsum("bhk,bhv->bhkv", k[:, t], v[:, t]))
    n_new = f[:, t, :, None] * n_prev + i[:, t, :, None] * k[:, t]
    real = mask[:, t]
    S = jnp.where(real[:, None, None, None], S_new, S)
    n = jnp.where(real[:, None, None], n_new, n)
    o = jnp.einsum("bhkv,bhk->bhv", S_new, q[:, t]) / jnp.maximum(
        jnp.abs(jnp.sum(n_new * q[:, t], -1)), 1.0)[..., None]
    outputs.append(jnp.where(real[:, None, None], o, 0.0))
  return jnp.stack(outputs, axis=1), (S, n)


def make_inputs(input_gate_scale):
  keys = jax.random.split(jax.random.key(0), 8)
  q, k = (jax.random.normal(key, (B, T, H, K)) for key in keys[:2])
  v = jax.random.normal(keys[2], (B, T, H, V))
  log_i = input_gate_scale * jax.random.normal(keys[3], (B, T, H))
  log_f = jax.nn.log_sigmoid(2.0 * jax.random.normal(keys[4], (B, T, H)) + 1.0)
  state = (jax.random.normal(keys[5], (B, H, K, V)), jax.random.normal(keys[6], (B, H, K)),
           jax.random.normal(keys[7], (B, H)))
  # the second row: a hole (tokens 2, 3) and right padding (the last 3)
  position = jnp.arange(T)[None]
  mask = (position < jnp.array([[T], [T - 3]])) & ~((position >= 2) & (position <= 3)
                                                     & (jnp.arange(B)[:, None] == 1))
  segment_ids = jnp.array([[0] * 5 + [1] * 6 + [2] * 2, [3] * 9 + [4] * 4])
  return (q, k, v, log_i, log_f), state, mask, segment_ids


def true_state(state):
  S, n, m = state
  return S * jnp.exp(m)[..., None, None], n * jnp.exp(m)[..., None]


FORMS = {"chunk": lambda *a, **kw: ops.chunk_mlstm(*a, chunk_size=4, **kw),
         "token": ops.recurrent_mlstm}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("packed", [False, True])
def test_forms_equal_the_float64_recurrence_under_huge_input_gates(form, packed):
  """Input gates e^ĩ with ĩ up to ~ 100 (float32 overflows at e^89): the output and the final
  state (its true scale e^m (S̃, ñ), compared in float64)."""
  inputs, state, mask, segment_ids = make_inputs(input_gate_scale=40.0)
  segments = segment_ids if packed else jnp.zeros_like(segment_ids)
  o, final = FORMS[form](*inputs, initial_state=state, mask=mask,
                         segment_ids=segment_ids if packed else None)
  with jax.enable_x64(True):
    as64 = lambda tree: jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), tree)
    o64, final64 = mlstm_recurrence(*as64(inputs), as64(state), mask, segments)
    assert_close(o, o64, 1e-5, "o")
    for got, want, what in zip(true_state(as64(final)), final64, ("S", "n")):
      assert_close(got, want, 1e-5, what)


@pytest.mark.parametrize("form", ["chunk", pytest.param("token", marks=pytest.mark.slow)])
def test_gradients_equal_the_float64_recurrence(form):
  """Every input's gradient, the initial state's included, of Σ o·do + Σ e^m S̃ · dS (moderate
  gates: e^m stays inside float32), packed and padded."""
  inputs, state, mask, segment_ids = make_inputs(input_gate_scale=3.0)
  do = jax.random.normal(jax.random.key(9), (B, T, H, V))
  dS = jax.random.normal(jax.random.key(10), (B, H, K, V))

  def loss(inputs, state, recurrence, stabilised):
    o, final = recurrence(*inputs, state)
    S = true_state(final)[0] if stabilised else final[0]
    return jnp.sum(o * do) + jnp.sum(S * dS)
  ours = lambda *a: FORMS[form](*a[:5], initial_state=a[5], mask=mask, segment_ids=segment_ids)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=(2, 3))(
      inputs, state, ours, True)
  with jax.enable_x64(True):
    as64 = lambda tree: jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), tree)
    theirs = lambda *a: mlstm_recurrence(*a[:5], a[5], mask, segment_ids)
    grads64 = jax.grad(loss, argnums=(0, 1))(as64(inputs), as64(state), theirs, False)
  names = ["q", "k", "v", "log_i", "log_f", "S0", "n0", "m0"]
  for name, got, want in zip(names, jax.tree.leaves(grads), jax.tree.leaves(grads64)):
    assert np.abs(np.asarray(want)).max() > 0, f"d{name} is zero"
    assert_close(got, want, 2e-5, f"d{name}")


def test_bad_state_is_named():
  inputs, _, _, _ = make_inputs(1.0)
  with pytest.raises(ValueError, match=r"initial_state must be the tuple \(S"):
    ops.chunk_mlstm(*inputs, initial_state=jnp.zeros((B, H, K, V)))
  with pytest.raises(ValueError, match=r"initial_state\[2\] \(m\) must be \[2, 2\]"):
    ops.recurrent_mlstm(*inputs, initial_state=(jnp.zeros((B, H, K, V)), jnp.zeros((B, H, K)),
                                                jnp.zeros((B, H, 1))))
