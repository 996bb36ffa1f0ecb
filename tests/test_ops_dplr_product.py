"""The DPLR delta rule and Gated DeltaProduct against float64 recurrences written from their
equations (tests/ops_reference.py): both forms, chunk sizes, carried states, masks, gradients
of every input, extreme gates, bf16 inputs; the reductions (DPLR to the delta rule, the gated
delta rule and KDA; a one-step product to the gated delta rule); beta in (0, 2) in every delta
op; refused inputs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_zoo import ops
from tests import ops_reference
from tests.ops_reference import assert_close, loss_grads

B, T, H, K, V = 2, 37, 2, 8, 6
CHUNK = 16              # T = 37 spans a partial third chunk
STEPS = 3               # delta product steps per token: chunks of 16 steps cut tokens apart
# each op's positional inputs after q, k, v
ARGS = {"dplr_delta_rule": ("a", "b", "g"), "gated_delta_product": ("g", "beta")}
JITTED = {f"{form}_{name}": jax.jit(getattr(ops, f"{form}_{name}"),
                                    static_argnames=("chunk_size",) if form == "chunk" else ())
          for name in ARGS for form in ("chunk", "recurrent")}


def make_inputs(name, *, length=T, seed=0, gate=None, steps=STEPS, beta_max=1.0):
  """Random float32 inputs of op `name` (a dict with initial_state). DPLR as RWKV-7 gives them:
  a = -κ̂, b = κ̂ ⊙ σ(·) with κ̂ a unit key, per-channel log-sigmoid gates. The product: unit
  keys [B, T, steps, H, K], beta = beta_max · σ(·), scalar gates. `gate`: a constant log-gate."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
  sigmoid = lambda z: 1 / (1 + np.exp(-z))
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  gate_shape = (B, length, H, K) if name == "dplr_delta_rule" else (B, length, H)
  x = {"q": normal(B, length, H, K),
       "g": (np.full(gate_shape, gate, np.float32) if gate is not None
             else np.log(sigmoid(normal(*gate_shape) + 2))),     # decays about 0.3 to 0.99
       "initial_state": normal(B, H, K, V)}
  if name == "dplr_delta_rule":
    key = unit(normal(B, length, H, K))
    x.update(k=normal(B, length, H, K), v=normal(B, length, H, V), a=-key,
             b=key * sigmoid(normal(B, length, H, K)))
  else:
    x.update(k=unit(normal(B, length, steps, H, K)), v=normal(B, length, steps, H, V),
             beta=beta_max * sigmoid(normal(B, length, steps, H)))
  return {key: jnp.asarray(value) for key, value in x.items()}


def call(name, form, x, **kw):
  """ops.<form>_<name> on the inputs dict x."""
  kw = {"initial_state": x["initial_state"], **kw}
  if form == "chunk":
    kw.setdefault("chunk_size", CHUNK)
  return JITTED[f"{form}_{name}"](x["q"], x["k"], x["v"], *(x[arg] for arg in ARGS[name]), **kw)


def reference_of(name, x, mask=None):
  oracle = (ops_reference.dplr_recurrence if name == "dplr_delta_rule"
            else ops_reference.delta_product_recurrence)
  return oracle(x["q"], x["k"], x["v"], *(x[arg] for arg in ARGS[name]), scale=K ** -0.5,
                initial_state=x["initial_state"], mask=mask)


def reference(name, x, mask=None):
  with jax.enable_x64(True):
    return jax.tree.map(np.asarray, reference_of(name, x, mask))


def holes():
  """[B, T]: row 0 with holes, row 1 all padding."""
  position = np.arange(T)
  return np.stack([(position % 5 != 2) & (position != 17), np.zeros(T, bool)])


FORMS = [("chunk", {"chunk_size": c}) for c in (1, 8, 16, 32, 64)] + [("recurrent", {})]
FORM_IDS = ["chunk1", "chunk8", "chunk16", "chunk32", "chunk64", "recurrent"]


@pytest.mark.parametrize("form,kw", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("name", ARGS)
def test_forms_equal_the_float64_recurrence(name, form, kw):
  """Every chunk size (8, 16 and 32 leave a partial chunk; 32 has four sub-chunks of DPLR's
  per-channel products; 64 > T for DPLR) and the token form."""
  x = make_inputs(name)
  o, state = call(name, form, x, **kw)
  o_ref, state_ref = reference(name, x)
  assert o.dtype == jnp.float32 and o.shape == (B, T, H, V)
  assert state.dtype == jnp.float32 and state.shape == (B, H, K, V)
  assert_close(o, o_ref, 1e-5, "o")
  assert_close(state, state_ref, 1e-5, "final state")


@pytest.mark.parametrize("name", ARGS)
def test_chunk_form_in_float64_equals_the_recurrence_to_rounding(name):
  x = make_inputs(name)
  with jax.enable_x64(True):
    x64 = {key: value.astype(jnp.float64) for key, value in x.items()}
    o, state = call(name, "chunk", x64)
    assert o.dtype == jnp.float64 and state.dtype == jnp.float64
    o_ref, state_ref = reference(name, x64)
  assert_close(o, o_ref, 1e-12, "o")
  assert_close(state, state_ref, 1e-12, "final state")


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("name", ARGS)
def test_two_halves_with_the_carried_state_equal_one_pass(name, form):
  x = make_inputs(name)
  o, state = call(name, form, x)
  per_token = {key: value for key, value in x.items() if key != "initial_state"}
  first = {key: value[:, :20] for key, value in per_token.items()}
  second = {key: value[:, 20:] for key, value in per_token.items()}
  o1, state1 = call(name, form, {**first, "initial_state": x["initial_state"]})
  o2, state2 = call(name, form, {**second, "initial_state": state1})
  assert_close(jnp.concatenate([o1, o2], axis=1), o, 1e-5, "o")
  assert_close(state2, state, 1e-5, "final state")


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("name", ARGS)
def test_masked_tokens_are_skipped(name, form):
  """Whatever lies under the mask (NaN here) is skipped; an all-pad row keeps its state."""
  mask = holes()
  x = make_inputs(name)
  dirty = {key: (value if key == "initial_state" else jnp.where(
      mask.reshape(B, T, *[1] * (value.ndim - 2)), value, jnp.nan)) for key, value in x.items()}
  o, state = call(name, form, dirty, mask=jnp.asarray(mask))
  o_ref, state_ref = reference(name, x, mask)
  assert_close(o, o_ref, 1e-5, "o")
  assert_close(state, state_ref, 1e-5, "final state")
  assert np.all(np.asarray(o)[~mask] == 0)
  np.testing.assert_array_equal(state[1], x["initial_state"][1])


GRADIENT_CASES = [(name, form, None) for name in ARGS for form in ("chunk", "recurrent")] + [
    (name, "chunk", gate) for name in ARGS for gate in (-20.0, -1e-7)]


@pytest.mark.parametrize("name,form,gate", GRADIENT_CASES)
def test_gradients_equal_float64_autodiff_of_the_recurrence(name, form, gate):
  """Every input (a, b, g, beta and the initial state too), with masked holes; at a log-gate
  of -20 and of -1e-7 per step as well (the chunk form's dg comes from cumulative sums)."""
  mask = jnp.asarray(holes()[0][None].repeat(B, 0))
  x = make_inputs(name, gate=gate)
  rng = np.random.default_rng(2)
  do = jnp.asarray(rng.normal(size=(B, T, H, V)), jnp.float32)
  dS = jnp.asarray(rng.normal(size=(B, H, K, V)), jnp.float32)
  kw = {"chunk_size": 32} if form == "chunk" else {}
  grads = jax.jit(lambda x: loss_grads(lambda x: call(name, form, x, mask=mask, **kw), x, do,
                                       dS))(x)
  with jax.enable_x64(True):
    f64 = lambda tree: jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), tree)
    expected = loss_grads(lambda x: reference_of(name, x, mask), f64(x), *f64((do, dS)))
    expected = jax.tree.map(np.asarray, expected)
  for key in x:
    assert_close(grads[key], expected[key], 1e-4, f"d{key}")


def delta_inputs(gate):
  """Inputs of the gated delta rule (gate "scalar"), KDA ("channel") or the delta rule (None)."""
  rng = np.random.default_rng(5)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  k = normal(B, T, H, K)
  x = {"q": normal(B, T, H, K), "k": k / jnp.linalg.norm(k, axis=-1, keepdims=True),
       "v": normal(B, T, H, V), "beta": jax.nn.sigmoid(normal(B, T, H)),
       "initial_state": normal(B, H, K, V)}
  if gate:
    x["g"] = jax.nn.log_sigmoid(normal(*(B, T, H, K)[:4 if gate == "channel" else 3]) + 2)
  return x


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_dplr_with_a_equal_to_minus_beta_k_is_the_delta_rule(form):
  """a = -beta k̂, b = k̂, g = 0 gives the transition I - beta k̂ k̂ᵀ of the delta rule; its write
  beta k̂ vᵀ needs the write key beta k̂ (or the value beta v). Negative control: with the key
  k̂ and the value v unscaled the write is k̂ vᵀ, not the delta rule's."""
  x = delta_inputs(None)
  beta, key = x["beta"][..., None], x["k"]
  kw = {"initial_state": x["initial_state"], **({"chunk_size": CHUNK} if form == "chunk" else {})}
  want = getattr(ops, f"{form}_delta_rule")(x["q"], key, x["v"], x["beta"], **kw)
  dplr = getattr(ops, f"{form}_dplr_delta_rule")
  zero = jnp.zeros_like(key)
  for write_key, value in ((beta * key, x["v"]), (key, beta * x["v"])):
    got = dplr(x["q"], write_key, value, -beta * key, key, zero, **kw)
    assert_close(got[0], want[0], 1e-5, "o")
    assert_close(got[1], want[1], 1e-5, "final state")
  unscaled = dplr(x["q"], key, x["v"], -beta * key, key, zero, **kw)
  assert np.max(np.abs(np.asarray(unscaled[0]) - np.asarray(want[0]))) > 1e-2


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("name,gate", [("gated_delta_rule", "scalar"), ("kda", "channel")])
def test_dplr_with_decayed_a_is_the_gated_delta_rule_and_kda(name, gate, form):
  """(I - beta k kᵀ) Diag(e^g) S = Diag(e^g) S + k (-beta (e^g ⊙ k))ᵀ S: a = -beta e^g ⊙ k̂,
  b = k̂, write key beta k̂ (a scalar gate broadcast over the channels)."""
  x = delta_inputs(gate)
  beta, key = x["beta"][..., None], x["k"]
  g = jnp.broadcast_to(x["g"] if gate == "channel" else x["g"][..., None], key.shape)
  kw = {"initial_state": x["initial_state"], **({"chunk_size": CHUNK} if form == "chunk" else {})}
  want = getattr(ops, f"{form}_{name}")(x["q"], key, x["v"], x["g"], x["beta"], **kw)
  got = getattr(ops, f"{form}_dplr_delta_rule")(x["q"], beta * key, x["v"],
                                                -beta * jnp.exp(g) * key, key, g, **kw)
  assert_close(got[0], want[0], 1e-5, "o")
  assert_close(got[1], want[1], 1e-5, "final state")


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_one_step_product_is_the_gated_delta_rule(form):
  x = make_inputs("gated_delta_product", steps=1)
  got = call("gated_delta_product", form, x)
  kw = {"initial_state": x["initial_state"], **({"chunk_size": CHUNK} if form == "chunk" else {})}
  want = getattr(ops, f"{form}_gated_delta_rule")(x["q"], x["k"][:, :, 0], x["v"][:, :, 0],
                                                  x["g"], x["beta"][:, :, 0], **kw)
  assert_close(got[0], want[0], 1e-6, "o")
  assert_close(got[1], want[1], 1e-6, "final state")


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("name", ["delta_rule", "gated_delta_rule", "kda",
                                  "gated_delta_product"])
def test_beta_up_to_two_is_not_clipped(name, form):
  """beta in (0, 2) (`allow_neg_eigval`: the transition's eigenvalue 1 - beta down to -1)
  against the float64 recurrences, which do not clip either."""
  if name == "gated_delta_product":
    x = make_inputs(name, beta_max=2.0)
    got, want = call(name, form, x), reference(name, x)
  else:
    x = delta_inputs({"delta_rule": None, "gated_delta_rule": "scalar", "kda": "channel"}[name])
    x["beta"] = 2 * x["beta"]
    kw = {"initial_state": x["initial_state"], **({"chunk_size": CHUNK} if form == "chunk"
                                                   else {})}
    args = [x[key] for key in ("q", "k", "v", "g", "beta") if key in x]
    got = getattr(ops, f"{form}_{name}")(*args, **kw)
    with jax.enable_x64(True):
      want = jax.tree.map(np.asarray, ops_reference.recurrence(
          x["q"], x["k"], x["v"], x.get("g"), x["beta"], scale=K ** -0.5,
          initial_state=x["initial_state"], mask=None))
  assert float(jnp.max(x["beta"])) > 1.5
  assert_close(got[0], want[0], 1e-5, "o")
  assert_close(got[1], want[1], 1e-5, "final state")


@pytest.mark.parametrize("name", ARGS)
def test_bfloat16_inputs_are_close_to_float32(name):
  x = make_inputs(name)
  o, state = call(name, "chunk", x)
  o_bf16, state_bf16 = call(name, "chunk", {key: value.astype(jnp.bfloat16)
                                            for key, value in x.items()})
  assert o_bf16.dtype == jnp.bfloat16 and state_bf16.dtype == jnp.float32
  assert_close(o_bf16, o, 2e-2, "o")
  assert_close(state_bf16, state, 2e-2, "final state")


def test_bad_inputs_are_refused_with_what_is_expected():
  x = make_inputs("dplr_delta_rule")
  q, k, v, a, b, g = (x[key] for key in ("q", "k", "v", "a", "b", "g"))
  with pytest.raises(ValueError, match=r"chunk_dplr_delta_rule: b must be \[2, 37, 2, 8\]"):
    ops.chunk_dplr_delta_rule(q, k, v, a, b[..., 0], g)
  with pytest.raises(ValueError, match=r"recurrent_dplr_delta_rule: g must be \[2, 37, 2, 8\]"):
    ops.recurrent_dplr_delta_rule(q, k, v, a, b, g[..., 0])
  x = make_inputs("gated_delta_product")
  q, k, v, g, beta = (x[key] for key in ("q", "k", "v", "g", "beta"))
  with pytest.raises(ValueError, match=r"k \[B, T, n, H, K\] \(n steps per token\)"):
    ops.chunk_gated_delta_product(q, k[:, :, 0], v, g, beta)
  with pytest.raises(ValueError, match=r"v must be \[B, T, n, H, V\] = \(2, 37, 3, 2, V\)"):
    ops.chunk_gated_delta_product(q, k, v[:, :, :2], g, beta)
  with pytest.raises(ValueError, match=r"beta must be \[2, 37, 3, 2\]"):
    ops.recurrent_gated_delta_product(q, k, v, g, beta[:, :, 0])
  with pytest.raises(ValueError, match=r"mask must be \[2, 37\]"):
    ops.chunk_gated_delta_product(q, k, v, g, beta, mask=jnp.ones((2, 37 * 3), bool))


@pytest.mark.slow
@pytest.mark.parametrize("name,gate", [(name, gate) for name in ARGS for gate in (-20.0, -1e-7)])
def test_extreme_gates_at_length_have_finite_outputs_and_gradients(name, gate):
  """T = 4096 (the product: 2 steps per token), float32, a log-gate of -20 or -1e-7 per step,
  every input's gradient."""
  x = make_inputs(name, length=4096, gate=gate, steps=2)
  fn = lambda x: call(name, "chunk", x, chunk_size=64)
  o, state = jax.jit(fn)(x)
  grads = jax.jit(lambda x: loss_grads(fn, x, jnp.ones_like(o), jnp.ones_like(state)))(x)
  for key, value in {"o": o, "state": state, **{f"d{k}": g for k, g in grads.items()}}.items():
    assert np.all(np.isfinite(np.asarray(value))), key
