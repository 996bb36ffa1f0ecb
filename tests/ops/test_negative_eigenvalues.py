"""ops.with_negative_eigenvalues: the GLA ops with the transition 2 exp(g) - 1 in (-1, 1]
(Grazzi et al. 2025, Mamba's form) against the recurrence written with that transition, token by
token in float64: output, final state and gradients, for the chunk and token forms, scalar and
per-key-channel gates, with padding, packed sequences and an initial state."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_zoo import ops
from ops_reference import assert_close

B, T, H, K, V = 2, 13, 2, 3, 2


def signed_recurrence(q, k, v, g, initial_state, mask, segment_ids):
  """S_t = Diag(2 e^{g_t} - 1) S_{t-1} + k_t v_tᵀ (S_{t-1} = 0 at a segment start), o_t =
  S_tᵀ q_t K^-1/2; a masked token leaves S as it was and outputs 0."""
  a = 2 * jnp.exp(g) - 1
  a = a if a.ndim == 4 else jnp.broadcast_to(a[..., None], a.shape + (K,))
  state, outputs = initial_state, []
  for t in range(T):
    start = (segment_ids[:, t] != segment_ids[:, t - 1]) if t else jnp.zeros(B, bool)
    previous = jnp.where(start[:, None, None, None], 0.0, state)
    new = a[:, t, ..., None] * previous + jnp.einsum("bhk,bhv->bhkv", k[:, t], v[:, t])
    real = mask[:, t, None, None, None]
    state = jnp.where(real, new, state)
    outputs.append(jnp.where(real[..., 0], jnp.einsum("bhkv,bhk->bhv", new, q[:, t]) * K ** -0.5,
                             0.0))
  return jnp.stack(outputs, axis=1), state


def make_inputs(per_channel: bool):
  keys = jax.random.split(jax.random.key(0), 5)
  q, k = (jax.random.normal(key, (B, T, H, K)) for key in keys[:2])
  v = jax.random.normal(keys[2], (B, T, H, V))
  # log-decays down to -3: transitions 2e^g - 1 from -0.9 to 1, both signs
  g = jax.random.uniform(keys[3], (B, T, H) + ((K,) if per_channel else ()), minval=-3.0,
                         maxval=0.0)
  state = jax.random.normal(keys[4], (B, H, K, V))
  mask = jnp.arange(T)[None] < jnp.array([[T], [T - 3]])
  segment_ids = jnp.stack([jnp.zeros(T, int), (jnp.arange(T) >= 6).astype(int)])
  return (q, k, v, g), state, mask, segment_ids


@pytest.mark.parametrize("form, per_channel", [
    ("chunk", True), pytest.param("chunk", False, marks=pytest.mark.slow),
    pytest.param("recurrent", False, marks=pytest.mark.slow),
    pytest.param("recurrent", True, marks=pytest.mark.slow)])
def test_output_state_and_gradients_equal_the_signed_recurrence(form, per_channel):
  name = f"{form}_{'gla' if per_channel else 'simple_gla'}"
  extra = {"chunk_size": 4} if form == "chunk" else {}
  op = ops.with_negative_eigenvalues(getattr(ops, name))
  inputs, state, mask, segment_ids = make_inputs(per_channel)
  assert (2 * jnp.exp(inputs[3]) - 1).min() < -0.5            # negative transitions present
  weights = jax.random.normal(jax.random.key(9), (B, T, H, V))

  def loss(run, inputs, state):
    o, final = run(*inputs, state)
    return jnp.sum(o * weights) + jnp.sum(final ** 2), (o, final)

  run = lambda q, k, v, g, s: op(q, k, v, g, initial_state=s, mask=mask,
                                 segment_ids=segment_ids, **extra)
  (_, (o, final)), grads = jax.value_and_grad(loss, argnums=(1, 2), has_aux=True)(
      run, inputs, state)
  with jax.enable_x64(True):
    to64 = lambda tree: jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), tree)
    oracle = lambda q, k, v, g, s: signed_recurrence(q, k, v, g, s, mask, segment_ids)
    (_, (o64, final64)), grads64 = jax.value_and_grad(loss, argnums=(1, 2), has_aux=True)(
        oracle, to64(inputs), to64(state))
  assert_close(o, o64, 1e-5, "output")
  assert_close(final, final64, 1e-5, "final state")
  for name_, got, want in zip(["dq", "dk", "dv", "dg", "d initial state"],
                              [*grads[0], grads[1]], [*grads64[0], grads64[1]]):
    assert_close(got, want, 1e-5, name_)


def test_without_negative_transitions_it_is_the_op_itself():
  """Where every 2e^g - 1 is positive the extension only rewrites g as log(2e^g - 1)."""
  (q, k, v, g), state, mask, _ = make_inputs(False)
  g = g / 10                                                    # transitions above 0.5
  got = ops.with_negative_eigenvalues(ops.recurrent_simple_gla)(q, k, v, g, initial_state=state,
                                                                mask=mask)
  want = ops.recurrent_simple_gla(q, k, v, jnp.log(2 * jnp.exp(g) - 1), initial_state=state,
                                  mask=mask)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
