"""Gated DeltaNet-2's and Comba's ops (ops.*_gated_delta_rule2, ops.*_comba) against their
float64 token loops (tests/ops_reference.py, the K x K transition written out): both forms,
outputs, final state and the gradient of every input with masked holes and a carried state;
packed sequences against the segments run apart; strong per-channel gates (the products by
halves); the reductions to KDA and to the delta rule; bad shapes. All but the last in the
slow lane, as test_ops.py's sweeps run their ops outside the representative ones; the fast
lane has each layer against its float64 equation (tests/mixers/test_mixers.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_zoo import ops
from tests import ops_reference
from tests.ops import test_ops_segments
from tests.ops_reference import assert_close, loss_grads

B, T, H, K, V = 2, 37, 2, 8, 6
CHUNK = 16            # T = 37: two whole chunks and a partial third
# the op's inputs after q, k, v, in order
INPUTS = {"gated_delta_rule2": ("g", "b", "w"), "comba": ("p", "g", "beta")}
ORACLES = {"gated_delta_rule2": ops_reference.gated_delta_rule2_recurrence,
           "comba": ops_reference.comba_recurrence}


def make_inputs(name, *, gate_scale=1.0, seed=0):
  """q, k (unit), v, the gates in their ranges (log-sigmoid decays, per key channel for
  Gated DeltaNet-2 and per head for Comba; σ(·) erase, write and β gates; Comba's p = σ(·) k,
  a weaker feedback key) and an initial state, float32."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
  sigmoid = lambda z: 1 / (1 + np.exp(-z))
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  x = {"q": normal(B, T, H, K), "k": unit(normal(B, T, H, K)), "v": normal(B, T, H, V)}
  if name == "gated_delta_rule2":
    x["g"] = gate_scale * np.log(sigmoid(normal(B, T, H, K) + 2))
    x["b"], x["w"] = sigmoid(normal(B, T, H, K)), sigmoid(normal(B, T, H, V))
  else:
    x["p"] = sigmoid(normal(B, T, H, 1)) * x["k"]
    x["g"] = gate_scale * np.log(sigmoid(normal(B, T, H) + 2))
    x["beta"] = sigmoid(normal(B, T, H))
  x["initial_state"] = normal(B, H, K, V)
  return {key: jnp.asarray(value) for key, value in x.items()}


def call(name, form, x, **kw):
  args = [x[key] for key in ("q", "k", "v", *INPUTS[name])]
  kw = {"initial_state": x.get("initial_state"), **kw}
  if form == "chunk":
    kw.setdefault("chunk_size", CHUNK)
  return getattr(ops, f"{form}_{name}")(*args, **kw)


def reference_of(name, x, mask):
  return ORACLES[name](*(x[key] for key in ("q", "k", "v", *INPUTS[name])), scale=K ** -0.5,
                       initial_state=x["initial_state"], mask=mask)


def holes():
  """Row 0 whole, row 1 with two holes and a padded end."""
  mask = np.ones((B, T), bool)
  mask[1, [3, 20]] = False
  mask[1, -4:] = False
  return jnp.asarray(mask)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("name", INPUTS)
def test_forms_and_gradients_equal_the_float64_recurrence(name, form):
  mask = holes()
  x = make_inputs(name)
  rng = np.random.default_rng(2)
  do = jnp.asarray(rng.normal(size=(B, T, H, V)), jnp.float32)
  dS = jnp.asarray(rng.normal(size=(B, H, K, V)), jnp.float32)
  fn = lambda x: call(name, form, x, mask=mask)
  (o, state), grads = jax.jit(lambda x: (fn(x), loss_grads(fn, x, do, dS)))(x)
  with jax.enable_x64(True):
    f64 = lambda tree: jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), tree)
    reference = lambda x: reference_of(name, x, mask)
    (o_ref, state_ref), expected = jax.tree.map(
        np.asarray, (reference(f64(x)), loss_grads(reference, f64(x), *f64((do, dS)))))
  assert o.dtype == jnp.float32 and o.shape == (B, T, H, V) and state.shape == (B, H, K, V)
  assert_close(o, o_ref, 1e-5, "o")
  assert_close(state, state_ref, 1e-5, "final state")
  assert set(grads) == set(x)
  for key in x:
    assert_close(grads[key], expected[key], 1e-4, f"d{key}")


@pytest.mark.slow
@pytest.mark.parametrize("name", INPUTS)
def test_packed_sequences_equal_their_segments_run_apart(name):
  """Both forms: outputs and final state of a packed call equal each segment run alone from
  a zero state (the first from initial_state); boundaries off and on the chunks of 16, a
  one-token segment, holes (test_ops_segments' layout)."""
  x = make_inputs(name)
  ids = jnp.asarray(test_ops_segments.segment_ids())
  mask = test_ops_segments.padding_mask()
  for form in ("chunk", "recurrent"):
    run = jax.jit(lambda x, **kw: call(name, form, x, **kw))
    o, state = run(x, mask=jnp.asarray(mask), segment_ids=ids)
    o_apart, state_apart = test_ops_segments.split_apart(run, x, mask)
    assert_close(o, o_apart, 1e-5, f"{form}: o")
    assert_close(state, state_apart, 1e-5, f"{form}: final state")


@pytest.mark.slow
def test_gated_delta_rule2_with_strong_gates_equals_the_float64_recurrence():
  """Log-gates 30x the others: a chunk's cumulative gates span more than MIDPOINT_SPAN, so
  the per-channel products are built by halves."""
  x = make_inputs("gated_delta_rule2", gate_scale=30.0)
  o, state = call("gated_delta_rule2", "chunk", x)
  with jax.enable_x64(True):
    o_ref, state_ref = reference_of("gated_delta_rule2", x, None)
  assert_close(o, o_ref, 1e-5, "o")
  assert_close(state, state_ref, 1e-5, "final state")


@pytest.mark.slow
def test_equal_erase_and_write_gates_are_kda_and_comba_without_decay_the_delta_rule():
  """Gated DeltaNet-2 with b = w = β·1 is KDA; Comba with g = 0 and p = k the delta rule (both
  forms)."""
  x = make_inputs("gated_delta_rule2")
  beta = x["b"][..., 0]
  ones = lambda width: jnp.ones((B, T, H, width))
  for form in ("chunk", "recurrent"):
    kw = {"chunk_size": CHUNK} if form == "chunk" else {}
    gdn2 = call("gated_delta_rule2", form,
                {**x, "b": beta[..., None] * ones(K), "w": beta[..., None] * ones(V)})
    kda = getattr(ops, f"{form}_kda")(x["q"], x["k"], x["v"], x["g"], beta,
                                      initial_state=x["initial_state"], **kw)
    c = make_inputs("comba")
    comba = call("comba", form, {**c, "p": c["k"], "g": jnp.zeros_like(c["g"])})
    delta = getattr(ops, f"{form}_delta_rule")(c["q"], c["k"], c["v"], c["beta"],
                                               initial_state=c["initial_state"], **kw)
    for got, want, what in ((gdn2, kda, "kda"), (comba, delta, "delta rule")):
      assert_close(got[0], want[0], 1e-5, f"{form} {what}: o")
      assert_close(got[1], want[1], 1e-5, f"{form} {what}: state")


def test_bad_shapes_are_refused_with_what_is_expected():
  x = make_inputs("gated_delta_rule2")
  q, k, v, g, b, w = (x[key] for key in ("q", "k", "v", "g", "b", "w"))
  with pytest.raises(ValueError, match=r"chunk_gated_delta_rule2: w must be \[2, 37, 2, 6\]"):
    ops.chunk_gated_delta_rule2(q, k, v, g, b, w[..., :1])
  with pytest.raises(ValueError, match=r"recurrent_gated_delta_rule2: b must be \[2, 37, 2, 8\]"):
    ops.recurrent_gated_delta_rule2(q, k, v, g, b[..., 0], w)
  c = make_inputs("comba")
  with pytest.raises(ValueError, match=r"chunk_comba: g must be \[2, 37, 2\]"):
    ops.chunk_comba(c["q"], c["k"], c["v"], c["p"], c["g"][..., None], c["beta"])
