"""attention_zoo.ops against float64 oracles (tests/ops_reference.py: token-by-token scans
written independently of the ops from each recurrence's equations, and the quadratic form of
scalar-gated linear attention): both forms of every recurrent op, chunk sizes, carried states,
masks, gradients of every input, the reduction identities (among them DPLR to the delta rule,
the gated delta rule and KDA), the delta rule's exact overwrite, beta in (0, 2), bf16 inputs,
extreme gates and compiled memory. Packed sequences: tests/ops/test_ops_segments.py."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_zoo import ops
from attention_zoo.ops import engine
from tests import ops_reference
from tests.ops_reference import assert_close, loss_grads

B, T, H, K, V = 2, 37, 2, 8, 6
CHUNK = 16            # the tests' chunk size: T = 37 spans a partial third chunk
STEPS = 3             # the delta product's steps per token: chunks of 16 steps cut tokens apart
# The recurrent ops: their gate (None, scalar [B, T, H] or per channel [B, T, H, K]) and their
# inputs after q, k, v.
OPS = {"simple_gla": ("scalar", ("g",)), "gla": ("channel", ("g",)),
       "delta_rule": (None, ("beta",)), "gated_delta_rule": ("scalar", ("g", "beta")),
       "kda": ("channel", ("g", "beta")), "gated_delta_product": ("scalar", ("g", "beta")),
       "dplr_delta_rule": ("channel", ("a", "b", "g"))}
DELTA_OPS = [name for name in OPS if "beta" in OPS[name][1]]
JITTED = {name: jax.jit(getattr(ops, name),
                        static_argnames=("chunk_size",) if name.startswith("chunk") else ())
          for name in ops.__all__}


def make_inputs(name, *, length=T, seed=0, gate=None, steps=STEPS, beta_max=1.0, gate_scale=1.0):
  """Random inputs of op `name`: {q, k, v, its inputs, initial_state}, float32. Delta-rule
  keys are L2-normalised (as the layers give them), beta = beta_max · σ(·); the delta product
  has `steps` keys, values and betas per token ([B, T, steps, ...]); DPLR's a = -κ̂,
  b = κ̂ ⊙ σ(·) with κ̂ a unit key (as RWKV-7 gives them). `gate`: a constant log-gate instead
  of random log-sigmoid gates; `gate_scale` multiplies the random ones."""
  gate_kind, inputs = OPS[name]
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
  sigmoid = lambda z: 1 / (1 + np.exp(-z))
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  per_step = (steps,) if name == "gated_delta_product" else ()
  x = {"q": normal(B, length, H, K), "k": normal(B, length, *per_step, H, K),
       "v": normal(B, length, *per_step, H, V)}
  if "beta" in inputs:
    x["k"] = unit(x["k"])
    x["beta"] = beta_max * sigmoid(normal(B, length, *per_step, H))
  if name == "dplr_delta_rule":
    key = unit(normal(B, length, H, K))
    x["a"], x["b"] = -key, key * sigmoid(normal(B, length, H, K))
  if gate_kind:
    shape = (B, length, H) + ((K,) if gate_kind == "channel" else ())
    # log-sigmoid gates, decays from about 0.3 to 0.99 per step
    x["g"] = (np.full(shape, gate, np.float32) if gate is not None
              else gate_scale * np.log(sigmoid(normal(*shape) + 2)))
  x["initial_state"] = normal(B, H, K, V)
  return {key: jnp.asarray(value) for key, value in x.items()}


def call(name, form, x, **kw):
  """ops.<form>_<name> on the inputs dict x (positional q, k, v and the op's inputs)."""
  args = [x[key] for key in ("q", "k", "v", *OPS[name][1])]
  kw = {"initial_state": x.get("initial_state"), **kw}
  if form == "chunk":
    kw.setdefault("chunk_size", CHUNK)
  return JITTED[f"{form}_{name}"](*args, **kw)


def reference_of(name, x, mask):
  """The float64 recurrence of op `name` on x (call inside jax.enable_x64)."""
  oracle = {"dplr_delta_rule": ops_reference.dplr_recurrence,
            "gated_delta_product": ops_reference.delta_product_recurrence}.get(name)
  if oracle is None:
    return ops_reference.recurrence(x["q"], x["k"], x["v"], x.get("g"), x.get("beta"),
                                    scale=K ** -0.5, initial_state=x["initial_state"],
                                    mask=mask)
  return oracle(*(x[key] for key in ("q", "k", "v", *OPS[name][1])), scale=K ** -0.5,
                initial_state=x["initial_state"], mask=mask)


def reference(name, x, mask=None):
  with jax.enable_x64(True):
    return jax.tree.map(np.asarray, reference_of(name, x, mask))


# 64 > T: one chunk of 40. The per-channel products of these gates go through the midpoint;
# by halves (chunk 32 down to single tokens, 40 down to blocks of 5, by columns) at strong gates
FORMS = [("chunk", {"chunk_size": c}) for c in (1, 8, 16, 32, 64)] + [("recurrent", {})]
FORM_IDS = ["chunk1", "chunk8", "chunk16", "chunk32", "chunk64", "recurrent"]


@pytest.mark.parametrize("form,kw", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("name", OPS)
def test_forms_equal_the_float64_recurrence(name, form, kw):
  """Every chunk size (1; 8, 16 and 32, T = 37 not a multiple; 64 > T) and the token form."""
  x = make_inputs(name)
  o, state = call(name, form, x, **kw)
  o_ref, state_ref = reference(name, x)
  assert o.dtype == jnp.float32 and o.shape == (B, T, H, V)
  assert state.dtype == jnp.float32 and state.shape == (B, H, K, V)
  assert_close(o, o_ref, 1e-5, "o")
  assert_close(state, state_ref, 1e-5, "final state")


CHANNEL_OPS = [name for name in OPS if OPS[name][0] == "channel"]


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("name", CHANNEL_OPS)
def test_per_channel_ops_with_strong_gates_equal_the_float64_recurrence(name, chunk_size):
  """Random log-gates 30x the others (per-step decays from about e^-40 to 0.8): the cumulative
  gates of a chunk span more than MIDPOINT_SPAN, so the products are built by halves (chunks
  of 16 down to single tokens; 64 > T: the one chunk of 40, halved to blocks of 5, by
  columns), where the other tests' gates go through the midpoint."""
  x = make_inputs(name, gate_scale=30.0)
  first_chunk = np.cumsum(np.asarray(x["g"])[:, :chunk_size], axis=1)
  assert np.max(first_chunk.max(1) - first_chunk.min(1)) > engine.MIDPOINT_SPAN
  o, state = call(name, "chunk", x, chunk_size=chunk_size)
  o_ref, state_ref = reference(name, x)
  assert_close(o, o_ref, 1e-5, "o")
  assert_close(state, state_ref, 1e-5, "final state")


def direct_products(a, b, G, counts):
  """Σ_d a_id b_jd e^{G_id - G_jd} over j <= i, the exponent 0 where counts are equal, in
  float64 numpy: [M, L, K] -> [M, L, L]."""
  L = a.shape[1]
  exponent = np.where((counts[:, :, None] == counts[:, None, :])[..., None], 0.0,
                      G[:, :, None, :] - G[:, None, :, :])                # [M, i, j, K]
  decay = np.exp(np.where(np.tril(np.ones((L, L), bool))[None, :, :, None], exponent, -np.inf))
  return np.einsum("mik,mjk,mijk->mij", a, b, decay)


@pytest.mark.parametrize("length", [6, 16])
@pytest.mark.parametrize("gate_scale", [1.0, 100.0])
def test_per_channel_products_equal_the_direct_sum(gate_scale, length):
  """Through the midpoint (weak gates only: its domain) and by halves (any gates; 6 halves to
  blocks of 3, by columns), with holes (tokens that do not decay), float64; the dispatcher
  takes the midpoint exactly when the span allows, and two pairs in one call equal each
  alone."""
  rng = np.random.default_rng(3)
  M, K = 3, 4
  a, b = rng.normal(size=(2, M, length, K))
  decaying = rng.random((M, length)) < 0.7
  g = np.where(decaying[..., None], gate_scale * np.log(1 / (1 + np.exp(-rng.normal(
      size=(M, length, K)) - 2))), 0.0)
  G, counts = np.cumsum(g, axis=1), np.cumsum(decaying, axis=1)[..., None]
  expected = {(a_, b_): direct_products(x, y, G, counts[..., 0])
              for a_, b_, x, y in (("a", "b", a, b), ("b", "a", b, a))}
  weak = np.max(G.max(1) - G.min(1)) <= engine.MIDPOINT_SPAN
  with jax.enable_x64(True):
    ways = {"by_halves": engine._products_by_halves}
    if weak:
      ways["through_midpoint"] = engine._products_through_midpoint
    for way, fn in ways.items():
      assert_close(fn(a, b, G, counts), expected["a", "b"], 1e-12, way)
    grouped = lambda x: jnp.asarray(x).reshape(M, 1, 1, length, -1)     # [n, b, h, C, K]
    chosen = engine._decayed_products([(grouped(a), grouped(b)), (grouped(b), grouped(a))],
                                      grouped(G), grouped(counts), None)
  for products, key in zip(chosen, [("a", "b"), ("b", "a")]):
    assert_close(products.reshape(M, length, length), expected[key], 1e-12, f"dispatched {key}")
  assert weak == (gate_scale == 1.0)


def test_the_midpoint_way_keeps_finite_gradients_on_gates_it_is_not_chosen_for():
  """A select of both ways evaluates the midpoint's on any gates: its exponents are clipped,
  or e^{±175} here would overflow and the zero cotangent times inf would be NaN."""
  rng = np.random.default_rng(0)
  a, b = (jnp.asarray(rng.normal(size=(2, 8, 4)), jnp.float32) for _ in range(2))
  G = jnp.cumsum(jnp.asarray(-50 - 10 * rng.random((2, 8, 4)), jnp.float32), axis=1)
  counts = jnp.cumsum(jnp.ones((2, 8, 1), jnp.int32), axis=1)
  chosen = lambda a, b, G: jnp.sum(jnp.where(
      False, engine._products_through_midpoint(a, b, G, counts),
      engine._products_by_halves(a, b, G, counts)))
  for name, grad in zip("abG", jax.grad(chosen, argnums=(0, 1, 2))(a, b, G)):
    assert np.all(np.isfinite(np.asarray(grad))), name


@pytest.mark.parametrize("name", OPS)
def test_chunk_form_in_float64_equals_the_recurrence_to_rounding(name):
  """Float64 inputs compute in float64: the chunk algebra is exact, not merely close."""
  x = make_inputs(name)
  with jax.enable_x64(True):
    x64 = {key: value.astype(jnp.float64) for key, value in x.items()}
    o, state = call(name, "chunk", x64)
    assert o.dtype == jnp.float64 and state.dtype == jnp.float64
    o_ref, state_ref = reference(name, x64)
  assert_close(o, o_ref, 1e-12, "o")
  assert_close(state, state_ref, 1e-12, "final state")


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("name", OPS)
def test_two_halves_with_the_carried_state_equal_one_pass(name, form):
  x = make_inputs(name)
  o, state = call(name, form, x)
  split = 20
  first = {key: value[:, :split] for key, value in x.items() if key != "initial_state"}
  second = {key: value[:, split:] for key, value in x.items() if key != "initial_state"}
  o1, state1 = call(name, form, {**first, "initial_state": x["initial_state"]})
  o2, state2 = call(name, form, {**second, "initial_state": state1})
  assert_close(jnp.concatenate([o1, o2], axis=1), o, 1e-5, "o")
  assert_close(state2, state, 1e-5, "final state")


def masks():
  """[B, T] masks: left padding and right padding; holes and an all-pad row."""
  position = np.arange(T)
  left_right = np.stack([position >= 9, position < 30])
  holes_empty = np.stack([(position % 5 != 2) & (position != 17), np.zeros(T, bool)])
  return {"left_right": left_right, "holes_empty": holes_empty}


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("mask_name", ["left_right", "holes_empty"])
@pytest.mark.parametrize("name", OPS)
def test_masked_tokens_are_skipped(name, mask_name, form):
  """A masked token leaves the state untouched and outputs 0 (the oracle skips it); an
  all-pad row gives zeros and its initial state back."""
  mask = masks()[mask_name]
  x = make_inputs(name)
  # what sits under the mask must not matter, not even a non-finite value
  x_dirty = {key: (jnp.where(mask.reshape(B, T, *[1] * (value.ndim - 2)), value, jnp.nan)
                   if key != "initial_state" else value) for key, value in x.items()}
  o, state = call(name, form, x_dirty, mask=jnp.asarray(mask))
  o_ref, state_ref = reference(name, x, mask)
  assert_close(o, o_ref, 1e-5, "o")
  assert_close(state, state_ref, 1e-5, "final state")
  assert np.all(np.asarray(o)[~mask] == 0)
  if not mask[1].any():
    np.testing.assert_array_equal(state[1], x["initial_state"][1])


@pytest.mark.parametrize("name", OPS)
def test_holes_act_as_deleting_the_tokens(name):
  mask = masks()["holes_empty"][0]
  x = make_inputs(name)
  row = {key: value[:1] for key, value in x.items()}
  kept = {key: (value if key == "initial_state" else value[:, mask]) for key, value in row.items()}
  o, state = call(name, "chunk", row, mask=jnp.asarray(mask[None]))
  o_kept, state_kept = call(name, "chunk", kept)
  assert_close(o[:, mask], o_kept, 1e-5, "o")
  assert_close(state, state_kept, 1e-5, "final state")


@pytest.mark.parametrize("name", OPS)
def test_batch_rows_are_independent(name):
  x = make_inputs(name)
  other = make_inputs(name, seed=1)
  mixed = {key: value.at[1].set(other[key][1]) for key, value in x.items()}
  for form in ("chunk", "recurrent"):
    o, state = call(name, form, x)
    o_mixed, state_mixed = call(name, form, mixed)
    np.testing.assert_array_equal(o[0], o_mixed[0])
    np.testing.assert_array_equal(state[0], state_mixed[0])


GRADIENT_CASES = [(name, form, None) for name in OPS for form in ("chunk", "recurrent")] + [
    (name, "chunk", gate) for name in OPS if OPS[name][0] for gate in (-20.0, -1e-7)]


@pytest.mark.parametrize("name,form,gate", GRADIENT_CASES)
def test_gradients_equal_float64_autodiff_of_the_recurrence(name, form, gate):
  """Every input, including g, beta, a, b and the initial state, with masked holes; also at a
  log-gate of -20 per step and of -1e-7 (no decay to float32): the chunk form's dg comes from
  cumulative sums whose rounding could swamp it (the cancelling pairs of the delta product's
  undecayed steps and of DPLR's rows decayed to the token before, at the holes, included)."""
  mask = jnp.asarray(masks()["holes_empty"][0][None].repeat(B, 0))
  x = make_inputs(name, gate=gate)
  rng = np.random.default_rng(2)
  do = jnp.asarray(rng.normal(size=(B, T, H, V)), jnp.float32)
  dS = jnp.asarray(rng.normal(size=(B, H, K, V)), jnp.float32)
  kw = {"chunk_size": 32} if form == "chunk" else {}   # several chunks, each halved down
  grads = jax.jit(lambda x: loss_grads(lambda x: call(name, form, x, mask=mask, **kw), x, do,
                                       dS))(x)
  with jax.enable_x64(True):
    f64 = lambda tree: jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), tree)
    expected = loss_grads(lambda x: reference_of(name, x, mask), f64(x), *f64((do, dS)))
    expected = jax.tree.map(np.asarray, expected)
  for key in x:
    assert_close(grads[key], expected[key], 1e-4, f"d{key}")


@pytest.mark.parametrize("name", ["delta_rule", "gated_delta_rule"])
def test_forward_mode_and_hessian_vector_products_equal_float64_autodiff_of_the_recurrence(name):
  """jax.jvp of the chunk form (its triangular inverse has a custom JVP, where a custom VJP would
  refuse forward mode) and forward over reverse, jax.jvp of jax.grad: the Hessian-vector product
  of Σ o·do + Σ S_T·dS, along a tangent of every input."""
  mask = jnp.asarray(masks()["holes_empty"][0][None].repeat(B, 0))
  x = make_inputs(name)
  rng = np.random.default_rng(3)
  tangent = {key: jnp.asarray(rng.normal(size=value.shape), jnp.float32)
             for key, value in x.items()}
  do = jnp.asarray(rng.normal(size=(B, T, H, V)), jnp.float32)
  dS = jnp.asarray(rng.normal(size=(B, H, K, V)), jnp.float32)

  def derivatives(fn, x, tangent, do, dS):
    """(d(o, S_T), d grads) along tangent."""
    both = lambda x: (fn(x), loss_grads(fn, x, do, dS))
    return jax.jvp(both, (x,), (tangent,))[1]

  chunk = lambda x: call(name, "chunk", x, mask=mask)
  (do_t, dstate_t), hvp = jax.jit(functools.partial(derivatives, chunk))(x, tangent, do, dS)
  with jax.enable_x64(True):
    f64 = lambda tree: jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), tree)
    expected = derivatives(lambda x: reference_of(name, x, mask), *f64((x, tangent, do, dS)))
    (do_ref, dstate_ref), hvp_ref = jax.tree.map(np.asarray, expected)
  assert_close(do_t, do_ref, 1e-4, "jvp of o")
  assert_close(dstate_t, dstate_ref, 1e-4, "jvp of the final state")
  for key in x:
    assert_close(hvp[key], hvp_ref[key], 1e-4, f"Hessian-vector product, d{key}")


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_gated_delta_rule_with_zero_gate_is_the_delta_rule(form):
  x = make_inputs("gated_delta_rule")
  zero = {**x, "g": jnp.zeros_like(x["g"])}
  plain = {key: value for key, value in zero.items() if key != "g"}
  for got, want in zip(call("gated_delta_rule", form, zero), call("delta_rule", form, plain)):
    assert_close(got, want, 1e-6)


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_dplr_with_a_equal_to_minus_beta_k_is_the_delta_rule(form):
  """a = -beta k̂, b = k̂, g = 0 give the transition I - beta k̂ k̂ᵀ of the delta rule; its write
  beta k̂ vᵀ needs the write key beta k̂ (or the value beta v). Negative control: with the key
  k̂ and the value v unscaled the write is k̂ vᵀ, not the delta rule's."""
  x = make_inputs("delta_rule")
  beta, key = x["beta"][..., None], x["k"]
  want = call("delta_rule", form, x)
  dplr = lambda k, v: call("dplr_delta_rule", form,
                           {**x, "k": k, "v": v, "a": -beta * key, "b": key,
                            "g": jnp.zeros_like(key)})
  for got in (dplr(beta * key, x["v"]), dplr(key, beta * x["v"])):
    assert_close(got[0], want[0], 1e-5, "o")
    assert_close(got[1], want[1], 1e-5, "final state")
  unscaled = dplr(key, x["v"])
  assert np.max(np.abs(np.asarray(unscaled[0]) - np.asarray(want[0]))) > 1e-2


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("name", ["gated_delta_rule", "kda"])
def test_dplr_with_decayed_a_is_the_gated_delta_rule_and_kda(name, form):
  """(I - beta k kᵀ) Diag(e^g) S = Diag(e^g) S + k (-beta (e^g ⊙ k))ᵀ S: a = -beta e^g ⊙ k̂,
  b = k̂, write key beta k̂ (a scalar gate broadcast over the channels)."""
  x = make_inputs(name)
  beta, key = x["beta"][..., None], x["k"]
  g = jnp.broadcast_to(x["g"] if OPS[name][0] == "channel" else x["g"][..., None], key.shape)
  got = call("dplr_delta_rule", form, {**x, "k": beta * key, "a": -beta * jnp.exp(g) * key,
                                       "b": key, "g": g})
  want = call(name, form, x)
  assert_close(got[0], want[0], 1e-5, "o")
  assert_close(got[1], want[1], 1e-5, "final state")


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_one_step_product_is_the_gated_delta_rule(form):
  x = make_inputs("gated_delta_product", steps=1)
  single = {**x, **{key: x[key][:, :, 0] for key in ("k", "v", "beta")}}
  for got, want in zip(call("gated_delta_product", form, x),
                       call("gated_delta_rule", form, single)):
    assert_close(got, want, 1e-6)


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("name", DELTA_OPS)
def test_beta_up_to_two_is_not_clipped(name, form):
  """beta in (0, 2) (`allow_neg_eigval`: the transition's eigenvalue 1 - beta down to -1)
  against the float64 recurrences, which do not clip either."""
  x = make_inputs(name, beta_max=2.0)
  assert float(jnp.max(x["beta"])) > 1.5
  o, state = call(name, form, x)
  o_ref, state_ref = reference(name, x)
  assert_close(o, o_ref, 1e-5, "o")
  assert_close(state, state_ref, 1e-5, "final state")


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("channel_op,scalar_op", [("gla", "simple_gla"),
                                                  ("kda", "gated_delta_rule")])
def test_a_channel_constant_gate_is_the_scalar_gate(channel_op, scalar_op, form):
  x = make_inputs(scalar_op)
  channel = {**x, "g": jnp.repeat(x["g"][..., None], K, axis=-1)}
  for got, want in zip(call(channel_op, form, channel), call(scalar_op, form, x)):
    assert_close(got, want, 1e-5)


@pytest.mark.parametrize("name", ["simple_gla", "gla"])
def test_zero_gates_give_unnormalised_causal_linear_attention(name):
  """o = scale · tril(Q Kᵀ) V, computed in float64 numpy."""
  x = make_inputs(name, gate=0.0)
  del x["initial_state"]
  q, k, v = (np.asarray(x[key], np.float64) for key in "qkv")
  scores = np.einsum("bihd,bjhd->bhij", q, k) * np.tril(np.ones((T, T))) * K ** -0.5
  expected = np.einsum("bhij,bjhv->bihv", scores, v)
  for form in ("chunk", "recurrent"):
    assert_close(call(name, form, x)[0], expected, 1e-5, form)


@pytest.mark.parametrize("name", ["simple_gla", "gla"])
def test_scalar_gates_equal_the_quadratic_form(name):
  """((s Q Kᵀ) ⊙ exp(G_i - G_j) ⊙ M) V with a global cumulative gate, float64 (GLA with a
  channel-constant gate)."""
  x = make_inputs("simple_gla")
  del x["initial_state"]
  expected = ops_reference.quadratic_simple_gla(x["q"], x["k"], x["v"], x["g"], scale=K ** -0.5)
  if name == "gla":
    x["g"] = jnp.repeat(x["g"][..., None], K, axis=-1)
  assert_close(call(name, "chunk", x)[0], expected, 1e-5)


def overwrite_inputs():
  """beta = 1, keys e_{t mod K}, T = K + 3: the first three keys are written twice."""
  length = K + 3
  rng = np.random.default_rng(3)
  keys = np.eye(K, dtype=np.float32)[np.arange(length) % K]
  x = {"q": np.zeros((1, length, 1, K), np.float32), "k": keys[None, :, None],
       "v": rng.normal(size=(1, length, 1, V)).astype(np.float32),
       "beta": np.ones((1, length, 1), np.float32)}
  return {key: jnp.asarray(value) for key, value in x.items()}


@pytest.mark.parametrize("form,kw", [("chunk", {"chunk_size": 4}), ("chunk", {"chunk_size": 16}),
                                     ("recurrent", {})], ids=["chunk4", "chunk16", "recurrent"])
def test_delta_rule_overwrites_and_additive_rule_adds(form, kw):
  x = overwrite_inputs()
  v = np.asarray(x["v"][0, :, 0])                                     # [T, V]
  _, state = JITTED[f"{form}_delta_rule"](x["q"], x["k"], x["v"], x["beta"], **kw)
  stored = np.asarray(state[0, 0])                                    # [K, V]: row i = Sᵀ e_i
  np.testing.assert_allclose(stored[:3], v[K:], atol=1e-6)            # the later value wins
  np.testing.assert_allclose(stored[3:], v[3:K], atol=1e-6)           # the rest untouched
  # negative control: the additive rule sums both writes
  gate = jnp.zeros(x["beta"].shape)
  _, state = JITTED[f"{form}_simple_gla"](x["q"], x["k"], x["v"], gate, **kw)
  np.testing.assert_allclose(np.asarray(state[0, 0])[:3], v[:3] + v[K:], atol=1e-6)


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("name", ["delta_rule", "gated_delta_rule", "kda"])
def test_beta_zero_leaves_the_state_unchanged(name, form):
  """o_t = (s q_t ⊙ exp(G_t))ᵀ S0, S_T = Diag(exp G_T) S0 with G the cumulative gate (per
  channel for KDA)."""
  x = make_inputs(name)
  x["beta"] = jnp.zeros_like(x["beta"])
  o, state = call(name, form, x)
  g = np.asarray(x["g"], np.float64) if "g" in x else np.zeros((B, T, H))
  G = np.cumsum(np.broadcast_to(g if g.ndim == 4 else g[..., None], (B, T, H, K)), axis=1)
  S0 = np.asarray(x["initial_state"], np.float64)
  expected = np.einsum("bthk,bhkv->bthv", np.asarray(x["q"]) * K ** -0.5 * np.exp(G), S0)
  assert_close(o, expected, 1e-5, "o")
  assert_close(state, np.exp(G[:, -1])[..., None] * S0, 1e-5, "final state")


@pytest.mark.parametrize("name", OPS)
def test_bfloat16_inputs_are_close_to_float32(name):
  x = make_inputs(name)
  o, state = call(name, "chunk", x)
  bf16 = {key: value.astype(jnp.bfloat16) for key, value in x.items()}
  o_bf16, state_bf16 = call(name, "chunk", bf16)
  assert o_bf16.dtype == jnp.bfloat16 and state_bf16.dtype == jnp.float32
  assert_close(o_bf16, o, 2e-2, "o")
  assert_close(state_bf16, state, 2e-2, "final state")


@pytest.mark.parametrize("size", [12, 64])
def test_blocked_triangular_inverse_and_its_gradient(size):
  """(I + A)^{-1} by blocks (12: one block by substitution; 64: four, merged pairwise) against
  numpy's inverse in float64; its closed-form derivative, forward and backward, against autodiff
  of jnp.linalg.inv."""
  from attention_zoo.ops.engine import unit_lower_inverse
  rng = np.random.default_rng(4)
  A = np.tril(rng.normal(size=(3, size, size)) * 0.3, -1)
  dX = rng.normal(size=(3, size, size))
  with jax.enable_x64(True):
    np.testing.assert_allclose(jax.jit(unit_lower_inverse)(jnp.asarray(A)),
                               np.linalg.inv(np.eye(size) + A), rtol=1e-10, atol=1e-12)
    grad = jax.jit(jax.grad(lambda A: jnp.sum(unit_lower_inverse(A) * dX)))(jnp.asarray(A))
    dense = jax.grad(lambda A: jnp.sum(jnp.linalg.inv(jnp.eye(size) + A) * dX))(jnp.asarray(A))
    np.testing.assert_allclose(grad, np.tril(dense, -1), rtol=1e-10, atol=1e-12)
    dA = np.tril(dX, -1)   # forward mode (the rule both directions come from): a lower tangent
    _, tangent = jax.jit(lambda A, dA: jax.jvp(unit_lower_inverse, (A,), (dA,)))(A, dA)
    _, dense = jax.jvp(lambda A: jnp.linalg.inv(jnp.eye(size) + A), (A,), (dA,))
    np.testing.assert_allclose(tangent, dense, rtol=1e-10, atol=1e-12)


def test_bad_inputs_are_refused_with_what_is_expected():
  x = make_inputs("gated_delta_rule")
  q, k, v, g, beta = (x[key] for key in ("q", "k", "v", "g", "beta"))
  with pytest.raises(ValueError, match=r"chunk_gated_delta_rule: g must be \[2, 37, 2\]"):
    ops.chunk_gated_delta_rule(q, k, v, g[..., None], beta)
  with pytest.raises(ValueError, match=r"chunk_gla: g must be \[2, 37, 2, 8\]"):
    ops.chunk_gla(q, k, v, g)
  with pytest.raises(ValueError, match="q and k must both be"):
    ops.recurrent_delta_rule(q, k[:, :5], v, beta)
  with pytest.raises(ValueError, match="v must be"):
    ops.chunk_delta_rule(q, k, v[:1], beta)
  with pytest.raises(ValueError, match="initial_state must be"):
    ops.chunk_delta_rule(q, k, v, beta, initial_state=v)
  with pytest.raises(ValueError, match="mask must be bool"):
    ops.chunk_delta_rule(q, k, v, beta, mask=jnp.ones((B, T)))
  with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
    ops.chunk_delta_rule(q, k, v, beta, chunk_size=0)
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
@pytest.mark.parametrize("name,gate", [(name, gate) for name in OPS
                                       for gate in ((-20.0, -1e-7) if OPS[name][0] else (None,))])
def test_extreme_gates_at_length_have_finite_outputs_and_gradients(name, gate):
  """T = 4096 (the delta product: 2 steps per token), float32, a log-gate of -20 per step or
  -1e-7 (the delta rule: random inputs), every input's gradient."""
  length = 4096
  x = make_inputs(name, length=length, gate=gate, steps=2)
  fn = lambda x: call(name, "chunk", x, chunk_size=64)
  o, state = jax.jit(fn)(x)
  grads = jax.jit(lambda x: loss_grads(fn, x, jnp.ones_like(o), jnp.ones_like(state)))(x)
  for key, value in {"o": o, "state": state, **{f"d{k}": g for k, g in grads.items()}}.items():
    assert np.all(np.isfinite(np.asarray(value))), key


@pytest.mark.slow
def test_compiled_memory_of_forward_and_backward_grows_linearly():
  """Temporary bytes of chunk_gated_delta_rule's forward+backward at 2K and 8K: linear growth
  is 4x, a quadratic term would give 16x."""
  def temp_bytes(length):
    shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    qkv = shape(1, length, 4, 64)
    gate = shape(1, length, 4)
    loss = lambda q, k, v, g, beta: jnp.sum(ops.chunk_gated_delta_rule(q, k, v, g, beta)[0])
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    return grad.lower(qkv, qkv, qkv, gate, gate).compile().memory_analysis().temp_size_in_bytes
  ratio = temp_bytes(8192) / temp_bytes(2048)
  assert ratio < 6, ratio
