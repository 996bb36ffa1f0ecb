"""Float64 oracles for attention_zoo.ops, written independently of the ops: token-by-token
scans of the recurrences in their textbook form (a masked token is skipped, where the ops feed
it neutral values; the delta product's steps are an inner loop; Gated DeltaNet-2 and Comba as
the K x K transition matrix times the state), the quadratic form of
scalar-gated linear attention; and the comparison helpers the ops' tests share. Call the
recurrences inside `jax.enable_x64(True)`."""
import functools

import jax
import jax.numpy as jnp
import numpy as np


@functools.partial(jax.jit, static_argnames=("scale",))
def recurrence(q, k, v, g, beta, *, scale, initial_state, mask):
  """For each token t that is real: S <- Diag(exp g_t) S; S <- S + k_t u_tᵀ with u_t = v_t, or
  (delta rule, beta given) u_t = beta_t (v_t - Sᵀ k_t); o_t = Sᵀ (scale q_t). A masked token
  skips both and outputs 0. q, k [B, T, H, K], v [B, T, H, V], g [B, T, H] or [B, T, H, K] or
  None, beta [B, T, H] or None, initial_state [B, H, K, V], mask [B, T] or None.
  -> (o [B, T, H, V], S [B, H, K, V]), float64, differentiable."""
  f64 = lambda x: None if x is None else jnp.asarray(x, jnp.float64)
  q, k, v, g, beta, state = map(f64, (q, k, v, g, beta, initial_state))
  B, T, H, K = q.shape
  g = jnp.zeros((B, T, H, K)) if g is None else jnp.broadcast_to(
      g if g.ndim == 4 else g[..., None], (B, T, H, K))
  mask = jnp.ones((B, T), bool) if mask is None else jnp.asarray(mask)

  def token(state, inputs):
    q_t, k_t, v_t, g_t, beta_t, real = inputs
    new = state * jnp.exp(g_t)[..., None]                                # [B, H, K, V]
    write = v_t                                                           # [B, H, V]
    if beta_t is not None:
      write = beta_t[..., None] * (write - jnp.sum(new * k_t[..., None], axis=2))
    new = new + k_t[..., None] * write[:, :, None, :]
    out = scale * jnp.sum(new * q_t[..., None], axis=2)                  # [B, H, V]
    return (jnp.where(real[:, None, None, None], new, state),
            jnp.where(real[:, None, None], out, 0.0))

  steps = [None if x is None else jnp.swapaxes(x, 0, 1) for x in (q, k, v, g, beta, mask)]
  state, o = jax.lax.scan(token, state, steps)
  return jnp.swapaxes(o, 0, 1), state


@functools.partial(jax.jit, static_argnames=("scale",))
def dplr_recurrence(q, k, v, a, b, g, *, scale, initial_state, mask):
  """For each real token t: S <- Diag(exp g_t) S + b_t (a_tᵀ S) + k_t v_tᵀ, the low-rank term
  reading S before the decay; o_t = Sᵀ (scale q_t). A masked token skips both and outputs 0.
  q, k, a, b, g [B, T, H, K], v [B, T, H, V], initial_state [B, H, K, V], mask [B, T] or None.
  -> (o [B, T, H, V], S [B, H, K, V]), float64, differentiable."""
  q, k, v, a, b, g, state = (jnp.asarray(x, jnp.float64)
                             for x in (q, k, v, a, b, g, initial_state))
  mask = jnp.ones(q.shape[:2], bool) if mask is None else jnp.asarray(mask)

  def token(state, inputs):
    q_t, k_t, v_t, a_t, b_t, g_t, real = inputs
    low_rank = jnp.sum(state * a_t[..., None], axis=2)                    # [B, H, V], aᵀS
    new = (state * jnp.exp(g_t)[..., None] + b_t[..., None] * low_rank[:, :, None, :]
           + k_t[..., None] * v_t[:, :, None, :])
    out = scale * jnp.sum(new * q_t[..., None], axis=2)
    return (jnp.where(real[:, None, None, None], new, state),
            jnp.where(real[:, None, None], out, 0.0))

  steps = [jnp.swapaxes(x, 0, 1) for x in (q, k, v, a, b, g, mask)]
  state, o = jax.lax.scan(token, state, steps)
  return jnp.swapaxes(o, 0, 1), state


@functools.partial(jax.jit, static_argnames=("scale",))
def delta_product_recurrence(q, k, v, g, beta, *, scale, initial_state, mask):
  """For each real token t: S <- exp(g_t) S once, then for each step j:
  S <- S + beta_tj k_tj (v_tj - Sᵀ k_tj)ᵀ; o_t = Sᵀ (scale q_t). q [B, T, H, K],
  k [B, T, n, H, K], v [B, T, n, H, V], g [B, T, H], beta [B, T, n, H], initial_state
  [B, H, K, V], mask [B, T] or None. -> (o [B, T, H, V], S [B, H, K, V]), float64."""
  q, k, v, g, beta, state = (jnp.asarray(x, jnp.float64)
                             for x in (q, k, v, g, beta, initial_state))
  mask = jnp.ones(q.shape[:2], bool) if mask is None else jnp.asarray(mask)

  def token(state, inputs):
    q_t, k_t, v_t, g_t, beta_t, real = inputs
    new = state * jnp.exp(g_t)[..., None, None]
    for j in range(k_t.shape[1]):
      k_j = k_t[:, j]                                                     # [B, H, K]
      error = v_t[:, j] - jnp.sum(new * k_j[..., None], axis=2)           # [B, H, V]
      new = new + beta_t[:, j, :, None, None] * k_j[..., None] * error[:, :, None, :]
    out = scale * jnp.sum(new * q_t[..., None], axis=2)
    return (jnp.where(real[:, None, None, None], new, state),
            jnp.where(real[:, None, None], out, 0.0))

  steps = [jnp.swapaxes(x, 0, 1) for x in (q, k, v, g, beta, mask)]
  state, o = jax.lax.scan(token, state, steps)
  return jnp.swapaxes(o, 0, 1), state


@functools.partial(jax.jit, static_argnames=("scale",))
def gated_delta_rule2_recurrence(q, k, v, g, b, w, *, scale, initial_state, mask):
  """Gated DeltaNet-2, for each real token t as the paper writes it:
  S <- (I - k_t (b_t ⊙ k_t)ᵀ) Diag(exp g_t) S + k_t (w_t ⊙ v_t)ᵀ; o_t = Sᵀ (scale q_t). A masked
  token skips both and outputs 0. q, k, g, b [B, T, H, K], v, w [B, T, H, V], initial_state
  [B, H, K, V], mask [B, T] or None. -> (o [B, T, H, V], S [B, H, K, V]), float64."""
  q, k, v, g, b, w, state = (jnp.asarray(x, jnp.float64)
                             for x in (q, k, v, g, b, w, initial_state))
  mask = jnp.ones(q.shape[:2], bool) if mask is None else jnp.asarray(mask)
  eye = jnp.eye(q.shape[-1])

  def token(state, inputs):
    q_t, k_t, v_t, g_t, b_t, w_t, real = inputs
    transition = eye - k_t[..., :, None] * (b_t * k_t)[..., None, :]    # [B, H, K, K]
    decayed = state * jnp.exp(g_t)[..., None]                           # Diag(exp g_t) S
    new = (jnp.einsum("bhij,bhjv->bhiv", transition, decayed)
           + k_t[..., None] * (w_t * v_t)[:, :, None, :])
    out = scale * jnp.sum(new * q_t[..., None], axis=2)
    return (jnp.where(real[:, None, None, None], new, state),
            jnp.where(real[:, None, None], out, 0.0))

  steps = [jnp.swapaxes(x, 0, 1) for x in (q, k, v, g, b, w, mask)]
  state, o = jax.lax.scan(token, state, steps)
  return jnp.swapaxes(o, 0, 1), state


@functools.partial(jax.jit, static_argnames=("scale",))
def comba_recurrence(q, k, v, p, g, beta, *, scale, initial_state, mask):
  """Comba's scalar-plus-low-rank transition, for each real token t:
  S <- (exp(g_t) I - beta_t k_t p_tᵀ) S + beta_t k_t v_tᵀ; o_t = Sᵀ (scale q_t). A masked token
  skips both and outputs 0. q, k, p [B, T, H, K], v [B, T, H, V], g, beta [B, T, H],
  initial_state [B, H, K, V], mask [B, T] or None. -> (o [B, T, H, V], S [B, H, K, V])."""
  q, k, v, p, g, beta, state = (jnp.asarray(x, jnp.float64)
                                for x in (q, k, v, p, g, beta, initial_state))
  mask = jnp.ones(q.shape[:2], bool) if mask is None else jnp.asarray(mask)
  eye = jnp.eye(q.shape[-1])

  def token(state, inputs):
    q_t, k_t, v_t, p_t, g_t, beta_t, real = inputs
    transition = (jnp.exp(g_t)[..., None, None] * eye
                  - beta_t[..., None, None] * k_t[..., :, None] * p_t[..., None, :])
    new = (jnp.einsum("bhij,bhjv->bhiv", transition, state)
           + beta_t[..., None, None] * k_t[..., None] * v_t[:, :, None, :])
    out = scale * jnp.sum(new * q_t[..., None], axis=2)
    return (jnp.where(real[:, None, None, None], new, state),
            jnp.where(real[:, None, None], out, 0.0))

  steps = [jnp.swapaxes(x, 0, 1) for x in (q, k, v, p, g, beta, mask)]
  state, o = jax.lax.scan(token, state, steps)
  return jnp.swapaxes(o, 0, 1), state


def quadratic_simple_gla(q, k, v, g, *, scale):
  """O = ((s Q Kᵀ) ⊙ exp(G_i - G_j) ⊙ [j <= i]) V per head, G the cumulative sum of the
  scalar log-gates g [B, T, H] over the whole sequence (fine in float64 at short T); zero
  initial state, no mask. numpy, float64."""
  q, k, v, g = (np.asarray(x, np.float64) for x in (q, k, v, g))
  G = np.cumsum(g, axis=1)                                                 # [B, T, H]
  T = q.shape[1]
  causal = np.tril(np.ones((T, T), bool))
  diff = G[:, :, None, :] - G[:, None, :, :]                              # [B, i, j, H]
  decay = np.exp(np.where(causal[None, :, :, None], diff, -np.inf))
  scores = scale * np.einsum("bihk,bjhk->bijh", q, k) * decay              # [B, i, j, H]
  return np.einsum("bijh,bjhv->bihv", scores, v)                           # [B, T, H, V]


def assert_close(actual, expected, rtol, what=""):
  """Relative error in the max norm: max |actual - expected| <= rtol * max |expected|."""
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
  error = np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30)
  assert error <= rtol, f"{what}: relative error {error:.3g} > {rtol:g}"


def loss_grads(fn, x, do, dS):
  """Gradients of Σ o·do + Σ S_T·dS with respect to every input of x."""
  def loss(x):
    o, state = fn(x)
    return jnp.sum(o * do) + jnp.sum(state * dS)
  return jax.grad(loss)(x)
