"""The conformance suite: the properties every registered attention variant and sequence mixer
must have.

    python -m attention_zoo.conformance MODULE [MODULE ...] [--checks=NAME[,NAME...]]

imports the modules (dotted names, or paths to .py files: `attention_zoo.plugins`), finds the
variants and mixers they register, checks each property below on each (or only those --checks
names), prints a pass/fail report with the measured error, and exits non-zero on any failure.
The pytest suite (tests/testing/test_conformance.py) runs the same checks over
`attention_zoo.available()`.

The suite builds every module at small shapes (length 20, cross q_len 12, 4 heads, 2 kv heads,
head_dim 8). Each class says how to build it there in its class attributes: `TEST_OPTIONS`
(e.g. a block size below 20, so several blocks exist) and, for attention, `CONTENT_ROUTING`
(which keys a query sees is chosen from token contents: causality is checked by changing future
values only). `settings(name)` reads them. A causal-only variant (spec.supports_bidirectional
False) is built causal wherever a check would build it with causal=False, and `options` checks
that it refuses causal=False.

Properties: shapes, options, jit, grad, bf16, gqa, padding, causal, masked_rows, determinism,
dropout, forward_mode (jax.jvp agrees with the VJP and Hessian-vector products are symmetric, or
the variant refuses forward mode with a ValueError: n/a), exact (spec.exact: output and
gradients of a freshly built module equal `reference.dense_attention` over the variant's
`pattern()`), decode (spec.can_decode: one-token steps equal the causal forward), sinks
(spec.supports_sinks: the `sink` option against no sink, a shrink of each row, and for exact
variants the dense oracle with the sinks in its denominator).

Sequence mixers (`register_mixer`) are built as layers on x [2, 20, 32] (4 heads, 2 kv heads,
head_dim 8) and checked for MIXER_CHECKS: shapes, options, jit, grad (every parameter gets a
finite, non-zero gradient), bf16 (compute dtype), padding (changing padded tokens, appending
padding or prepending it changes no real output, causal and bidirectional), causal (no output
before a changed token moves by more than 1e-6, also for bidirectional=False in an encoder),
masked_rows, determinism, forward_mode (as for attention, differentiated in x), decode (a
prefill of several tokens then one-token steps, with holes in the mask, equal the parallel
forward: recurrent state and convolution cache), bidirectional
(the encoder form is the mean of the forward pass and flip(f(flip(x), flip(mask))), or for a
mixer with ONE_PASS_ENCODER one pass in which an early output sees a late token; causal=True
ignores the option), packed (spec.supports_segment_ids: each run of a packed row, with padding,
equals that sequence run alone, causal and bidirectional; with chunked TEST_OPTIONS the runs
cross chunk edges). A mixer with WHY_NO_GQA is built with as many kv heads as heads, and
`shapes` checks that it refuses GQA and MQA with an error naming num_kv_heads.
"""
from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attention_zoo import plugins, registry
from attention_zoo.contract import normalise_mask
from attention_zoo.layers import create_mixer
from attention_zoo.ops import softmax
from attention_zoo.ops.oracle import dense_attention

BATCH, LEN, CROSS_Q_LEN, APPEND = 2, 20, 12, 5
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, MAX_LEN = 4, 2, 8, 32
TOL = 1e-5


def apply(attn, q, k, v, q_mask=None, kv_mask=None, deterministic=True, alibi_slopes=None):
  """One compiled call (compiling once beats op-by-op dispatch for blockwise variants). Absent
  masks are made all-True here, as the contract's call makes them anyway, so the checks' calls
  at one shape share a program."""
  name = attn.spec.name
  q_mask = normalise_mask(q_mask, q.shape[0], q.shape[1], "q_mask", name)
  kv_mask = normalise_mask(kv_mask, k.shape[0], k.shape[1], "kv_mask", name)
  return _apply(attn, q, k, v, q_mask, kv_mask, deterministic, alibi_slopes)


@nnx.jit(static_argnames=("deterministic",))
def _apply(attn, q, k, v, q_mask, kv_mask, deterministic, alibi_slopes):
  return attn(q, k, v, q_mask=q_mask, kv_mask=kv_mask, deterministic=deterministic,
              alibi_slopes=alibi_slopes)


@dataclasses.dataclass
class CheckResult:
  variant: str
  prop: str
  status: str          # "pass" | "fail" | "n/a"
  error: float | None = None
  detail: str = ""

  def describe(self) -> str:
    err = "" if self.error is None else f" (max error {self.error:.2e})"
    return f"{self.variant}.{self.prop}: {self.status.upper()}{err} {self.detail}".rstrip()


class CheckFailed(AssertionError):
  def __init__(self, message, error=None):
    super().__init__(message)
    self.error = error


CHECKS = {}
MIXER_CHECKS = {}


def _check(fn):
  CHECKS[fn.__name__.removeprefix("check_")] = fn
  return fn


def _mixer_check(fn):
  MIXER_CHECKS[fn.__name__.removeprefix("check_mixer_")] = fn
  return fn


def checks_for(name: str) -> dict:
  """The properties of `name`'s kind: CHECKS (attention) or MIXER_CHECKS (sequence mixers)."""
  return MIXER_CHECKS if registry.spec(name).kind == "mixer" else CHECKS


def run_check(prop: str, name: str) -> CheckResult:
  checks = checks_for(name)
  if prop not in checks:
    return CheckResult(name, prop, "n/a", None, f"not a property of {registry.spec(name).kind}s")
  try:
    outcome = checks[prop](name)
  except CheckFailed as e:
    return CheckResult(name, prop, "fail", e.error, str(e))
  except Exception as e:  # a crash is a failure of that property, reported with its cause
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return CheckResult(name, prop, "fail", None, f"raised {type(e).__name__}: {first_line}")
  if isinstance(outcome, str):   # a reason the property does not apply
    return CheckResult(name, prop, "n/a", None, outcome)
  return CheckResult(name, prop, "pass", outcome)


# -- how each variant is built and checked --------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Settings:
  """options: passed to every module the suite builds of the variant, so the small shapes
  exercise its structure. content_routing: which keys a query sees is chosen from token contents
  across the whole sequence (e.g. LSH buckets), so causality is checked by changing future
  values only."""
  options: dict
  content_routing: bool = False


def settings(name: str) -> Settings:
  """How the suite builds and checks `name`: its class's TEST_OPTIONS and CONTENT_ROUTING
  (validated when the class was registered)."""
  cls = registry.get(name)
  return Settings(dict(cls.TEST_OPTIONS), getattr(cls, "CONTENT_ROUTING", False))


# -- building blocks ------------------------------------------------------------------------

def build(name, *, causal=False, num_kv_heads=NUM_KV_HEADS, seed=0, max_len=MAX_LEN, **options):
  """`name` at the suite's shapes; a causal-only variant (spec.supports_bidirectional False) is
  built causal wherever a check asks for causal=False."""
  options = {**settings(name).options, **options}
  causal = causal or not registry.spec(name).supports_bidirectional
  return registry.create(name, num_heads=NUM_HEADS, head_dim=HEAD_DIM, num_kv_heads=num_kv_heads,
                         causal=causal, max_len=max_len, rngs=nnx.Rngs(seed), **options)


def inputs(seed, q_len=LEN, kv_len=None, num_kv_heads=NUM_KV_HEADS, dtype=jnp.float32):
  kv_len = q_len if kv_len is None else kv_len
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (BATCH, q_len, NUM_HEADS, HEAD_DIM), dtype)
  k = jax.random.normal(kk, (BATCH, kv_len, num_kv_heads, HEAD_DIM), dtype)
  v = jax.random.normal(kv, (BATCH, kv_len, num_kv_heads, HEAD_DIM), dtype)
  return q, k, v


def padding_mask(length, seed=0):
  """Batch row 0 unpadded; row 1 with its tail and one middle position masked."""
  mask = np.ones((BATCH, length), bool)
  mask[1, length - 6:] = False
  mask[1, 3] = False
  return jnp.asarray(mask)


def max_err(a, b) -> float:
  return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))


def expect_close(a, b, what, tol=TOL):
  err = max_err(a, b)
  scale = max(1.0, float(jnp.max(jnp.abs(jnp.asarray(b, jnp.float32)))))
  if not err <= tol * scale:
    raise CheckFailed(f"{what}: max error {err:.3e} > {tol * scale:.1e}", err)
  return err


def expect(condition, message, error=None):
  if not condition:
    raise CheckFailed(message, error)


def all_finite(tree) -> bool:
  return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree)
             if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact))


def expect_bf16_close(out16, out32, what) -> float:
  """A bfloat16 output: that dtype, finite, and within 5% mean relative error of float32's."""
  expect(out16.dtype == jnp.bfloat16, f"{what} gave {out16.dtype}")
  expect(all_finite(out16), f"{what}: the output has NaN or Inf")
  rel = float(jnp.mean(jnp.abs(out16.astype(jnp.float32) - out32)) / jnp.mean(jnp.abs(out32)))
  expect(rel <= 0.05, f"{what}: mean relative error to f32 is {rel:.3f} > 0.05", rel)
  return rel


# -- the properties -------------------------------------------------------------------------

@_check
def check_shapes(name):
  spec = registry.spec(name)
  for num_kv_heads in (NUM_KV_HEADS, 1, NUM_HEADS):      # GQA, MQA, MHA
    q, k, v = inputs(0, num_kv_heads=num_kv_heads)
    out = apply(build(name, num_kv_heads=num_kv_heads), q, k, v)
    expect(out.shape == q.shape and out.dtype == q.dtype,
           f"self-attention with {num_kv_heads} kv heads gave {out.shape} {out.dtype}, "
           f"want {q.shape} {q.dtype}")
  q, k, v = inputs(1, q_len=CROSS_Q_LEN, kv_len=LEN)
  if spec.supports_cross:
    out = apply(build(name), q, k, v)
    expect(out.shape == q.shape, f"cross-attention gave {out.shape}, want {q.shape}")
  else:
    try:
      apply(build(name), q, k, v)
    except ValueError:
      return 0.0
    raise CheckFailed("spec says supports_cross=False but q_len != kv_len was accepted")
  return 0.0


@_check
def check_options(name):
  spec = registry.spec(name)
  expect({"scale", "dropout_rate"} <= set(spec.options),
         f"spec.options {sorted(spec.options)} lacks scale/dropout_rate")
  try:
    build(name, not_an_option=1)
  except ValueError as e:
    expect("not_an_option" in str(e), f"unknown-option error does not name the option: {e}")
  else:
    raise CheckFailed("an unknown option was accepted")
  if not spec.supports_causal:
    try:
      build(name, causal=True)
    except ValueError:
      return 0.0
    raise CheckFailed("spec says supports_causal=False but causal=True was accepted")
  if not spec.supports_bidirectional:
    try:
      registry.create(name, num_heads=NUM_HEADS, head_dim=HEAD_DIM, causal=False,
                      rngs=nnx.Rngs(0), **settings(name).options)
    except ValueError as e:
      expect("causal" in str(e), f"the refusal of causal=False does not name causal: {e}")
      return 0.0
    raise CheckFailed("spec says supports_bidirectional=False but causal=False was accepted")
  return 0.0


@_check
def check_jit(name):
  attn = build(name)
  q, k, v = inputs(2)
  mask = padding_mask(LEN)
  eager = attn(q, k, v, q_mask=mask, kv_mask=mask)
  call = lambda m, q, k, v, mask: m(q, k, v, q_mask=mask, kv_mask=mask)
  jitted = nnx.jit(call)(attn, q, k, v, mask)
  return expect_close(jitted, eager, "jit vs eager", tol=1e-4)


@_check
def check_grad(name):
  attn = build(name)
  q, k, v = inputs(3)
  mask = padding_mask(LEN)
  cotangent = jax.random.normal(jax.random.key(9), q.shape)

  def loss(m, q, k, v):
    return jnp.sum(m(q, k, v, q_mask=mask, kv_mask=mask) * cotangent)

  grads = nnx.jit(nnx.grad(loss, argnums=(0, 1, 2, 3)))(attn, q, k, v)
  expect(all_finite(grads), "gradients contain NaN or Inf")
  expect(float(jnp.abs(grads[3]).sum()) > 0, "the gradient with respect to v is zero")
  expect(float(jnp.abs(grads[1]).sum()) > 0, "the gradient with respect to q is zero")
  return 0.0


@_check
def check_bf16(name):
  attn = build(name)
  q, k, v = inputs(4)
  out32 = apply(attn, q, k, v)
  out16 = apply(attn, *(x.astype(jnp.bfloat16) for x in (q, k, v)))
  return expect_bf16_close(out16, out32, "bf16 inputs")


@_check
def check_gqa(name):
  """Query heads see exactly their group's K/V head: a change to kv head 0 reaches only group 0."""
  attn = build(name)
  q, k, v = inputs(5)
  out = apply(attn, q, k, v)
  group = NUM_HEADS // NUM_KV_HEADS
  k2 = k.at[:, :, 0].add(1.0)
  v2 = v.at[:, :, 0].add(1.0)
  out2 = apply(attn, q, k2, v2)
  other = expect_close(out2[:, :, group:], out[:, :, group:],
                       "heads outside group 0 after changing kv head 0")
  expect(max_err(out2[:, :, :group], out[:, :, :group]) > 1e-3,
         "changing kv head 0 did not change the heads of group 0")
  return other


@_check
def check_padding(name):
  """Changing padded tokens, or appending padding, changes no real output."""
  attn = build(name)
  q, k, v = inputs(6)
  mask = padding_mask(LEN)
  out = apply(attn, q, k, v, q_mask=mask, kv_mask=mask)
  noise = inputs(7)
  pad = ~mask[:, :, None, None]
  changed = apply(attn, *(jnp.where(pad, x + 3 * n, x) for x, n in zip((q, k, v), noise)),
                  q_mask=mask, kv_mask=mask)
  err = expect_close(changed, out, "real outputs after changing padded q/k/v")
  expect(float(jnp.abs(jnp.where(pad, out, 0)).max()) == 0.0, "padded query rows are not zero")

  spec = registry.spec(name)
  if spec.exact:
    longer = attn.pattern(LEN + APPEND, LEN + APPEND)[:, :LEN, :LEN]
    if not np.array_equal(np.broadcast_to(longer, (NUM_HEADS, LEN, LEN)),
                          np.broadcast_to(attn.pattern(LEN, LEN), (NUM_HEADS, LEN, LEN))):
      return err   # its pattern depends on the length (e.g. random blocks): nothing more to check
  short = apply(attn, q, k, v)
  extra = inputs(8, q_len=APPEND)
  appended = [jnp.concatenate([x, e], axis=1) for x, e in zip((q, k, v), extra)]
  longer_mask = jnp.arange(LEN + APPEND)[None, :].repeat(BATCH, 0) < LEN
  out_long = apply(attn, *appended, q_mask=longer_mask, kv_mask=longer_mask)
  return max(err, expect_close(out_long[:, :LEN], short,
                               f"real outputs after appending {APPEND} padded positions"))


@_check
def check_causal(name):
  spec = registry.spec(name)
  if not spec.supports_causal:
    return "spec says supports_causal=False (create refuses causal=True: see options)"
  attn = build(name, causal=True)
  q, k, v = inputs(10)
  out = apply(attn, q, k, v)
  cut = LEN // 2 + 1
  future = jnp.arange(LEN)[None, :, None, None] >= cut
  noise = inputs(11)
  if settings(name).content_routing:
    changed = apply(attn, q, k, jnp.where(future, v + 3 * noise[2], v))
  else:
    changed = apply(attn, *(jnp.where(future, x + 3 * n, x) for x, n in zip((q, k, v), noise)))
  err = expect_close(changed[:, :cut], out[:, :cut],
                     f"outputs before position {cut} after changing later tokens")
  expect(max_err(changed[:, cut:], out[:, cut:]) > 1e-3,
         "changing later tokens changed no later output")
  return err


@_check
def check_masked_rows(name):
  """Masked queries give zeros; queries that see no key give finite output and gradients."""
  spec = registry.spec(name)
  q, k, v = inputs(12)
  q_mask = jnp.ones((BATCH, LEN), bool).at[0, :4].set(False)
  kv_mask = jnp.ones((BATCH, LEN), bool).at[1].set(False)   # batch row 1 sees no key at all
  for causal in (False, True) if spec.supports_causal else (False,):
    attn = build(name, causal=causal)
    # causal: the early rows of batch row 0 see nothing
    mask = kv_mask.at[0, :3].set(False) if causal else kv_mask

    def loss(m, q, k, v, mask):
      out = m(q, k, v, q_mask=q_mask, kv_mask=mask)
      return jnp.sum(out), out

    (_, out), grads = nnx.jit(nnx.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True))(
        attn, q, k, v, mask)
    expect(all_finite(out) and all_finite(grads),
           f"NaN/Inf in output or gradients (causal={causal})")
    expect(float(jnp.abs(out[0, :4]).max()) == 0.0, "masked query rows are not zero")
    if spec.exact:
      expect(float(jnp.abs(out[1]).max()) == 0.0, "rows that see no key are not zero")
  return 0.0


@_check
def check_determinism(name):
  q, k, v = inputs(13)
  a, b = build(name, seed=3), build(name, seed=3)
  first = apply(a, q, k, v)   # compiled: the jit check compares the eager call with it
  err = max(max_err(first, apply(b, q, k, v)), max_err(first, apply(a, q, k, v)))
  expect(err == 0.0, "same seed and inputs gave different outputs (deterministic=True)", err)
  train_a = apply(build(name, seed=4), q, k, v, deterministic=False)
  train_b = apply(build(name, seed=4), q, k, v, deterministic=False)
  err = max_err(train_a, train_b)
  expect(err == 0.0, "same seed gave different training-mode outputs", err)
  return 0.0


@_check
def check_dropout(name):
  try:
    attn = build(name, dropout_rate=0.3, seed=5)
  except ValueError as e:
    if "dropout" in str(e):
      return f"refuses attention dropout: {e}"
    raise
  q, k, v = inputs(14)
  reference_out = apply(build(name, seed=5), q, k, v)
  err = expect_close(apply(attn, q, k, v), reference_out,
                     "dropout_rate > 0 with deterministic=True vs no dropout")
  train = apply(attn, q, k, v, deterministic=False)
  expect(all_finite(train), "dropout output has NaN or Inf")
  expect(max_err(train, reference_out) > 1e-3, "dropout with deterministic=False changed nothing")
  return err


def _forward_mode(module, call, args, seed):
  """Forward-mode autodiff of `call(module, *args)` (an array), differentiated in args: jax.jvp
  agrees with the VJP (the dot-product test ⟨u, J t⟩ = ⟨Jᵀ u, t⟩), and Hessian-vector products of
  L = ⟨u, out⟩ (jax.jvp of jax.grad) are non-zero and symmetric, ⟨s, H t⟩ = ⟨t, H s⟩ (a
  derivative missing a term breaks both). The directions are independent where a custom VJP gives
  the backward (the dense and block-sparse paths); a custom JVP rule gives both (the chunk ops'
  triangular inverse: tests/ops/test_ops.py holds its float64 oracle). A ValueError from jax.jvp
  is a refusal: n/a."""
  graphdef, state = nnx.split(module)
  f = lambda *args: call(nnx.merge(graphdef, state), *args)
  keys = jax.random.split(jax.random.key(seed), 2 * len(args) + 1)
  normal = lambda key, like: jax.random.normal(key, like.shape, like.dtype)
  t = tuple(normal(key, x) for key, x in zip(keys, args))
  s = tuple(normal(key, x) for key, x in zip(keys[len(args):], args))
  u = normal(keys[-1], jax.eval_shape(f, *args))
  grad = jax.grad(lambda *args: jnp.sum(f(*args) * u), argnums=tuple(range(len(args))))

  @jax.jit   # one program for both directions: (∇L, J·tangents, H·tangents)
  def pushforward(tangents):
    (_, gradients), (jvp_out, hvp_out) = jax.jvp(lambda *args: (f(*args), grad(*args)), args,
                                                 tangents)
    return gradients, jvp_out, hvp_out

  try:
    gradients, jvp_t, h_t = pushforward(t)
  except ValueError as e:
    return f"refuses forward mode: {str(e).splitlines()[0]}"
  _, _, h_s = pushforward(s)
  dot = lambda xs, ys: float(sum(jnp.vdot(x, y) for x, y in zip(xs, ys)))
  norm = lambda xs: float(jnp.sqrt(dot(xs, xs)))
  err = abs(float(jnp.vdot(u, jvp_t)) - dot(gradients, t)) / (norm([u]) * norm([jvp_t]))
  expect(err <= 1e-5, f"jax.jvp disagrees with the VJP: relative error {err:.2e} in "
                      f"<u, J t> = <J^T u, t>", err)
  expect(all_finite((jvp_t, h_t, h_s)), "forward-mode derivatives contain NaN or Inf")
  expect(norm(h_t) > 0, "the Hessian-vector product is zero")
  asymmetry = abs(dot(s, h_t) - dot(t, h_s)) / (norm(s) * norm(h_t) + norm(t) * norm(h_s))
  expect(asymmetry <= 1e-5, f"Hessian-vector products are not symmetric: <s, H t> - <t, H s> is "
                            f"{asymmetry:.2e} of their scale", asymmetry)
  return max(err, asymmetry)


@_check
def check_forward_mode(name):
  causal = registry.spec(name).supports_causal
  q, k, v = inputs(15)
  mask = padding_mask(LEN)
  return _forward_mode(build(name, causal=causal),
                       lambda m, q, k, v: m(q, k, v, q_mask=mask, kv_mask=mask), (q, k, v), 15)


def _exact_cases(spec):
  cases = [dict(causal=False, q_len=LEN, kv_len=LEN)]
  if spec.supports_causal:
    cases.append(dict(causal=True, q_len=LEN, kv_len=LEN))
  if spec.supports_cross:
    cases.append(dict(causal=False, q_len=CROSS_Q_LEN, kv_len=LEN))
    if spec.supports_causal:
      cases.append(dict(causal=True, q_len=CROSS_Q_LEN, kv_len=LEN))
  return cases


@nnx.jit(static_argnums=0)
def value_and_vjp(f, module, q, k, v, cotangent):
  """f(module, q, k, v) and its VJP in (q, k, v) at `cotangent`, as one compiled program."""
  out, vjp = jax.vjp(lambda q, k, v: f(module, q, k, v), q, k, v)
  return out, vjp(cotangent)


@_check
def check_exact(name):
  spec = registry.spec(name)
  if not spec.exact:
    return "spec says exact=False (approximations have their own oracle tests)"
  worst = 0.0
  for i, case in enumerate(_exact_cases(spec)):
    attn = build(name, causal=case["causal"])
    q_len, kv_len = case["q_len"], case["kv_len"]
    q, k, v = inputs(20 + i, q_len=q_len, kv_len=kv_len)
    q_mask, kv_mask = padding_mask(q_len), padding_mask(kv_len)
    pattern = np.asarray(attn.pattern(q_len, kv_len))
    expect(pattern.dtype == bool and pattern.ndim == 3 and pattern.shape[1:] == (q_len, kv_len)
           and pattern.shape[0] in (1, NUM_HEADS),
           f"pattern() gave {pattern.dtype} {pattern.shape}")
    q_pos, k_pos = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    if case["causal"]:
      future = ~np.asarray(softmax.causal_allowed(q_pos, k_pos, q_len, kv_len))
      expect(not (pattern & future).any(), f"causal pattern() lets a query see the future ({case})")
    slopes = jnp.linspace(0.5, 0.0625, NUM_HEADS) if spec.supports_alibi else None
    bias = None
    if slopes is not None:
      bias = softmax.alibi_bias(slopes, q_pos, k_pos, q_len, kv_len)[None]
    allowed = (pattern[None] & np.asarray(q_mask)[:, None, :, None]
               & np.asarray(kv_mask)[:, None, None, :])
    ct = jax.random.normal(jax.random.key(40 + i), q.shape)

    def variant(m, q, k, v):
      return m(q, k, v, q_mask=q_mask, kv_mask=kv_mask, alibi_slopes=slopes)

    def oracle(q, k, v):
      out = dense_attention(q, k, v, allowed, scale=attn.scale, bias=bias)
      return jnp.where(q_mask[:, :, None, None], out, 0)

    out, grads = value_and_vjp(variant, attn, q, k, v, ct)
    ref_out, ref_grads = value_and_vjp(lambda _, *qkv: oracle(*qkv), attn, q, k, v, ct)
    worst = max(worst, expect_close(out, ref_out, f"output vs dense oracle ({case})"))
    for what, g, rg in zip("qkv", grads, ref_grads):
      worst = max(worst, expect_close(g, rg, f"d{what} vs dense oracle ({case})"))
  return worst


@_check
def check_decode(name):
  spec = registry.spec(name)
  if not spec.can_decode:
    return "spec says can_decode=False"
  attn = build(name, causal=True)
  steps = 12
  q, k, v = inputs(30, q_len=steps)
  slopes = jnp.linspace(0.5, 0.0625, NUM_HEADS) if spec.supports_alibi else None
  full = apply(attn, q, k, v, alibi_slopes=slopes)
  cache = attn.init_cache(BATCH, steps + 3, jnp.float32)   # a cache longer than what is decoded
  step = nnx.jit(lambda m, q, k, v, cache, slopes: m.decode(q, k, v, cache, alibi_slopes=slopes))
  outs = []
  for t in range(steps):
    out, cache = step(attn, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], cache, slopes)
    outs.append(out)
  return expect_close(jnp.concatenate(outs, axis=1), full, "step-by-step decode vs causal forward")


@_check
def check_sinks(name):
  """spec.supports_sinks: built with sink=True and the sink logits at -inf it equals the variant
  without a sink; with finite logits each output row is the sink-free row shrunk by one factor
  in (0, 1), and (spec.exact) output and gradients (q, k, v, the logits) equal the dense oracle
  with the sinks in its denominator, causal too."""
  spec = registry.spec(name)
  if not spec.supports_sinks:
    return "spec says supports_sinks=False"
  worst = 0.0
  mask = padding_mask(LEN)
  logits = jnp.linspace(-1.0, 2.0, NUM_HEADS)
  for i, causal in enumerate([False, True] if spec.supports_causal else [False]):
    q, k, v = inputs(50 + i)
    plain, sunk = build(name, causal=causal), build(name, causal=causal, sink=True)
    base = apply(plain, q, k, v, q_mask=mask, kv_mask=mask)
    sunk.sink_logits[...] = jnp.full((NUM_HEADS,), -jnp.inf)
    worst = max(worst, expect_close(apply(sunk, q, k, v, q_mask=mask, kv_mask=mask), base,
                                    f"sink logits -inf vs sink=False (causal={causal})"))
    sunk.sink_logits[...] = logits
    out = apply(sunk, q, k, v, q_mask=mask, kv_mask=mask)
    norm2 = jnp.sum(base * base, axis=-1)                                   # [b, q, h]
    factor = jnp.sum(out * base, axis=-1) / jnp.where(norm2 > 0, norm2, 1.0)
    worst = max(worst, expect_close(out, factor[..., None] * base,
                                    f"sink output vs a multiple of the sink-free row ({causal=})"))
    shrinks = (factor > 0) & (factor < 1)
    expect(bool(jnp.all(shrinks | (norm2 == 0))), "a sink factor outside (0, 1)")
    if not spec.exact:
      continue
    allowed = (np.asarray(sunk.pattern(LEN, LEN))[None] & np.asarray(mask)[:, None, None, :])
    ct = jax.random.normal(jax.random.key(60 + i), q.shape)

    def oracle(q, k, v, sinks):
      out = dense_attention(q, k, v, allowed, scale=sunk.scale, sinks=sinks)
      return jnp.sum(jnp.where(mask[:, :, None, None], out, 0) * ct), out

    def loss(m, q, k, v):
      out = m(q, k, v, q_mask=mask, kv_mask=mask)
      return jnp.sum(out * ct), out

    (_, ref_out), ref_grads = jax.jit(jax.value_and_grad(oracle, argnums=(0, 1, 2, 3),
                                                         has_aux=True))(q, k, v, logits)
    worst = max(worst, expect_close(out, jnp.where(mask[:, :, None, None], ref_out, 0),
                                    f"sink output vs dense oracle ({causal=})"))
    grads = nnx.jit(nnx.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(sunk, q, k, v)[0]
    for what, g, rg in zip(("dlogits", "dq", "dk", "dv"), (grads[0].sink_logits[...], *grads[1:]),
                           (ref_grads[3], *ref_grads[:3])):
      worst = max(worst, expect_close(g, rg, f"{what} with sinks vs dense oracle ({causal=})"))
  return worst


# -- sequence mixers ------------------------------------------------------------------------

EMB_DIM = NUM_HEADS * HEAD_DIM


def mixer_kv_heads(name) -> int:
  """The suite's kv heads for a mixer: NUM_KV_HEADS (GQA), or NUM_HEADS for one that has no
  key/value heads to share (WHY_NO_GQA)."""
  return NUM_HEADS if registry.get(name).WHY_NO_GQA else NUM_KV_HEADS


def build_mixer(name, *, causal=False, num_kv_heads=None, seed=0, dtype=jnp.float32,
                **options):
  options = {**settings(name).options, **options}
  num_kv_heads = mixer_kv_heads(name) if num_kv_heads is None else num_kv_heads
  return create_mixer(name, emb_dim=EMB_DIM, num_heads=NUM_HEADS,
                               num_kv_heads=num_kv_heads, causal=causal, max_len=MAX_LEN,
                               dtype=dtype, rngs=nnx.Rngs(seed), **options)


def mixer_input(seed, length=LEN, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), (BATCH, length, EMB_DIM), dtype)


@nnx.jit(static_argnames=("deterministic",))
def apply_mixer(mixer, x, mask=None, deterministic=True):
  return mixer(x, mask=mask, deterministic=deterministic)


@nnx.jit
def decode_mixer(mixer, x, mask):
  return mixer(x, mask=mask, decode=True)


@_mixer_check
def check_mixer_shapes(name):
  x = mixer_input(0)
  grouped = (NUM_KV_HEADS, 1)                 # GQA, MQA (MHA: the other checks)
  if registry.get(name).WHY_NO_GQA:
    for num_kv_heads in grouped:
      try:
        build_mixer(name, num_kv_heads=num_kv_heads)
      except ValueError as e:
        expect("num_kv_heads" in str(e), f"the error for num_kv_heads={num_kv_heads} does not "
                                         f"name num_kv_heads: {e}")
      else:
        raise CheckFailed(f"WHY_NO_GQA is set but num_kv_heads={num_kv_heads} was accepted")
    grouped = (NUM_HEADS,)
  for num_kv_heads in grouped:
    out = apply_mixer(build_mixer(name, num_kv_heads=num_kv_heads), x)
    expect(out.shape == x.shape and out.dtype == x.dtype,
           f"{num_kv_heads} kv heads gave {out.shape} {out.dtype}, want {x.shape} {x.dtype}")
  try:
    build_mixer(name)(x[..., :-1])
  except ValueError:
    return 0.0
  raise CheckFailed(f"an input of width {EMB_DIM - 1} was accepted by a mixer of width {EMB_DIM}")


@_mixer_check
def check_mixer_options(name):
  spec = registry.spec(name)
  expect(spec.kind == "mixer" and "bidirectional" in spec.options,
         f"spec kind {spec.kind!r}, options {sorted(spec.options)}: want a mixer with "
         f"the option bidirectional")
  for bad, wanted in (({"not_an_option": 1}, "not_an_option"),
                      ({"bidirectional": "yes"}, "bidirectional")):
    try:
      build_mixer(name, **bad)
    except ValueError as e:
      expect(wanted in str(e), f"the error for {bad} does not name {wanted}: {e}")
    else:
      raise CheckFailed(f"{bad} was accepted")
  try:
    registry.create(name, num_heads=NUM_HEADS, head_dim=HEAD_DIM, rngs=nnx.Rngs(0))
  except ValueError as e:
    expect("create_mixer" in str(e), f"create() refusing a mixer does not say create_mixer: {e}")
    return 0.0
  raise CheckFailed("create() built a mixer as attention (it takes x, not q, k, v)")


@_mixer_check
def check_mixer_jit(name):
  mixer = build_mixer(name)
  x, mask = mixer_input(2), padding_mask(LEN)
  return expect_close(apply_mixer(mixer, x, mask), mixer(x, mask=mask), "jit vs eager", tol=1e-4)


@_mixer_check
def check_mixer_grad(name):
  mixer = build_mixer(name)
  x, mask = mixer_input(3), padding_mask(LEN)
  cotangent = jax.random.normal(jax.random.key(9), x.shape)
  loss = lambda m, x: jnp.sum(m(x, mask=mask) * cotangent)
  grads, dx = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(mixer, x)
  expect(all_finite((grads, dx)), "gradients contain NaN or Inf")
  expect(float(jnp.abs(dx).sum()) > 0, "the gradient with respect to x is zero")
  unused = [jax.tree_util.keystr(path) for path, g in
            jax.tree_util.tree_leaves_with_path(nnx.state(grads, nnx.Param))
            if not float(jnp.abs(g).max()) > 0]
  expect(not unused, f"parameters with a zero gradient (unused or a dead gate): {unused}")
  return 0.0


@_mixer_check
def check_mixer_bf16(name):
  x = mixer_input(4)
  out32 = apply_mixer(build_mixer(name), x)
  out16 = apply_mixer(build_mixer(name, dtype=jnp.bfloat16), x.astype(jnp.bfloat16))
  return expect_bf16_close(out16, out32, "bf16 compute")


@_mixer_check
def check_mixer_padding(name):
  """Padded tokens' content, appended padding and prepended padding change no real output."""
  x, mask, noise = mixer_input(6), padding_mask(LEN), mixer_input(7)
  extra = mixer_input(8, APPEND)
  worst = 0.0
  for causal in (True, False):
    mixer, how = build_mixer(name, causal=causal), f"causal={causal}"
    out = apply_mixer(mixer, x, mask)
    changed = apply_mixer(mixer, jnp.where(mask[..., None], x, x + 3 * noise), mask)
    worst = max(worst, expect_close(changed, out, f"real outputs after changing padded tokens "
                                                  f"({how})"))
    expect(float(jnp.abs(jnp.where(mask[..., None], 0, out)).max()) == 0.0,
           f"padded rows are not zero ({how})")
    short = apply_mixer(mixer, x)
    positions = jnp.arange(LEN + APPEND)[None, :].repeat(BATCH, 0)
    right = apply_mixer(mixer, jnp.concatenate([x, extra], 1), positions < LEN)
    left = apply_mixer(mixer, jnp.concatenate([extra, x], 1), positions >= APPEND)
    worst = max(worst,
                expect_close(right[:, :LEN], short, f"after appending {APPEND} pads ({how})"),
                expect_close(left[:, APPEND:], short, f"after prepending {APPEND} pads ({how})"))
  return worst


@_mixer_check
def check_mixer_causal(name):
  x, noise = mixer_input(10), mixer_input(11)
  cut = LEN // 2 + 1
  future = jnp.arange(LEN)[None, :, None] >= cut
  worst = 0.0
  for options in ({"causal": True}, {"causal": False, "bidirectional": False}):
    mixer = build_mixer(name, **options)
    out = apply_mixer(mixer, x)
    changed = apply_mixer(mixer, jnp.where(future, x + 3 * noise, x))
    worst = max(worst, expect_close(changed[:, :cut], out[:, :cut],
                                    f"outputs before position {cut} after changing later tokens "
                                    f"({options})", tol=1e-6))
    expect(max_err(changed[:, cut:], out[:, cut:]) > 1e-3,
           f"changing later tokens changed no later output ({options})")
  return worst


@_mixer_check
def check_mixer_masked_rows(name):
  """Masked rows are zero; a sequence with no real token gives zeros and finite gradients."""
  x = mixer_input(12)
  mask = jnp.ones((BATCH, LEN), bool).at[0, :4].set(False).at[1].set(False)
  mixer = build_mixer(name)   # bidirectional: the forward and the reversed pass
  loss = lambda m, x: (jnp.sum(m(x, mask=mask) ** 2), m(x, mask=mask))
  (_, out), dx = nnx.jit(nnx.value_and_grad(loss, argnums=1, has_aux=True))(mixer, x)
  expect(all_finite(out) and all_finite(dx), "NaN/Inf in output or gradients")
  expect(float(jnp.abs(jnp.where(mask[..., None], 0, out)).max()) == 0.0,
         "masked rows are not zero")
  return 0.0


@_mixer_check
def check_mixer_determinism(name):
  x = mixer_input(13)
  a, b = build_mixer(name, seed=3), build_mixer(name, seed=3)
  first = apply_mixer(a, x)
  err = max(max_err(first, apply_mixer(b, x)), max_err(first, apply_mixer(a, x)),
            max_err(first, apply_mixer(a, x, deterministic=False)))
  expect(err == 0.0, "same seed and inputs gave different outputs", err)
  return 0.0


@_mixer_check
def check_mixer_forward_mode(name):
  mask = padding_mask(LEN)
  return _forward_mode(build_mixer(name, causal=True), lambda m, x: m(x, mask=mask),
                       (mixer_input(15),), 15)


@_mixer_check
def check_mixer_decode(name):
  if not registry.spec(name).can_decode:
    return "spec says can_decode=False"
  steps, prefill = 12, 5
  x = mixer_input(30, steps)
  mask = jnp.ones((BATCH, steps), bool).at[1, 2].set(False).at[1, 8].set(False)   # holes
  mixer = build_mixer(name, causal=True)
  full = apply_mixer(mixer, x, mask)
  mixer.init_cache(BATCH, steps + 3, jnp.float32)   # a cache longer than what is decoded
  outs = [decode_mixer(mixer, x[:, :prefill], mask[:, :prefill])]
  for t in range(prefill, steps):
    outs.append(decode_mixer(mixer, x[:, t:t + 1], mask[:, t:t + 1]))
  return expect_close(jnp.concatenate(outs, axis=1), full,
                      f"a {prefill}-token prefill then one-token steps vs the parallel forward")


@_mixer_check
def check_mixer_bidirectional(name):
  x, mask = mixer_input(31), padding_mask(LEN)
  flip = lambda a: jnp.flip(a, axis=1)
  forward_only = build_mixer(name, bidirectional=False)
  forward = apply_mixer(forward_only, x, mask)
  causal = apply_mixer(build_mixer(name, causal=True, bidirectional=True), x, mask)
  err = expect_close(causal, forward, "causal=True with bidirectional=True vs the forward pass")
  if registry.get(name).ONE_PASS_ENCODER:
    both = build_mixer(name)
    changed = apply_mixer(both, x.at[:, LEN - 7].add(3.0), mask)   # a real token of both rows
    expect(max_err(changed[:, 0], apply_mixer(both, x, mask)[:, 0]) > 1e-3,
           "the one-pass encoder form: changing a late token did not change the first output")
    return err
  backward = flip(apply_mixer(forward_only, flip(x), flip(mask)))
  expect(max_err(forward, backward) > 1e-3, "the reversed pass equals the forward pass")
  both = apply_mixer(build_mixer(name), x, mask)
  return max(err, expect_close(both, (forward + backward) / 2,
                               "bidirectional vs the mean of f(x) and flip(f(flip(x), "
                               "flip(mask)))"))


# -- the command ----------------------------------------------------------------------------

def run(names, props=None) -> list[CheckResult]:
  return [run_check(p, n) for n in names for p in (props or checks_for(n))]


def _claims(spec) -> str:
  claims = ["exact" if spec.exact else "approximate", spec.complexity]
  claims += [what for what, has in (("causal", spec.supports_causal),
                                    ("cross", spec.supports_cross),
                                    ("decode", spec.can_decode)) if has]
  return ", ".join(claims)


def _parse(argv):
  """-> (module targets, properties to check, dry run); raises ValueError on a bad flag."""
  targets, props, dry_run = [], None, False
  known = {**CHECKS, **MIXER_CHECKS}
  for arg in argv:
    if arg == "--dry_run":
      dry_run = True
    elif arg.startswith("--checks="):
      props = [p.strip() for p in arg.removeprefix("--checks=").split(",") if p.strip()]
      unknown = [p for p in props if p not in known]
      if unknown or not props:
        raise ValueError(f"unknown check(s) {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(known)}")
    elif arg.startswith("-"):
      raise ValueError(f"unknown flag {arg!r}; the flags are --checks=NAME[,NAME...] and "
                       "--dry_run")
    else:
      targets.append(arg)
  if not targets:
    raise ValueError("name at least one module (dotted name or .py path) that registers a variant")
  return targets, props, dry_run


USAGE = """usage: python -m attention_zoo.conformance MODULE [MODULE ...] [--checks=NAME[,NAME...]]
       [--dry_run]

MODULE: a dotted module name importable from the current directory (my_attention,
examples.cosine_attention, attention_zoo.variants.full) or a path to a .py file. Every variant the
modules register is checked (--dry_run: listed with the checks it would get). Exit status:
0 all checked properties pass (or do not apply), 1 a property failed, 2 bad usage or a module
that cannot be imported or registers nothing.
Checks: """ + ", ".join(CHECKS) + "\nMixer checks: " + ", ".join(MIXER_CHECKS)


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if not argv or argv[0] in ("-h", "--help"):
    print(USAGE)
    return 2
  try:
    targets, props, dry_run = _parse(argv)
  except ValueError as e:
    print(f"{e}\n\n{USAGE}", file=sys.stderr)
    return 2
  names = []
  for target in targets:
    try:
      module_name = plugins.import_plugin(target)
    except plugins.PluginError as e:
      print(f"cannot import {target!r}: {e}", file=sys.stderr)
      return 2
    found = plugins.registered_by(module_name)
    if not found:
      print(f"{module_name!r} registers no attention variant (decorate an attention_zoo.Attention "
            f"subclass with @attention_zoo.register, or a mixer with "
            f"@attention_zoo.register_mixer)", file=sys.stderr)
      return 2
    names += [n for n in found if n not in names]
  if dry_run:
    for name in names:
      print(f"{name}  ({_claims(registry.spec(name))}): checks "
            f"{', '.join(props or checks_for(name))}")
    return 0
  failed, counts = [], {"pass": 0, "n/a": 0, "fail": 0}
  for name in names:
    options = ", ".join(f"{k}={v!r}" for k, v in settings(name).options.items())
    print(f"{name}  ({_claims(registry.spec(name))})" + (f" with {options}" if options else ""))
    for result in run([name], props):
      counts[result.status] += 1
      if result.status == "fail":
        failed.append(f"{name}.{result.prop}")
      err = "" if result.error is None else f"  err={result.error:.2e}"
      print(f"  {result.status.upper():4s} {result.prop:12s}{err}  {result.detail}".rstrip())
  print(f"{counts['pass']} passed, {counts['n/a']} not applicable, {counts['fail']} failed"
        + (f": {', '.join(failed)}" if failed else ""))
  return 1 if failed else 0


@_mixer_check
def check_mixer_packed(name):
  if not registry.spec(name).supports_segment_ids:
    return "spec says supports_segment_ids=False"
  runs = ((0, 7), (7, 16), (16, LEN)), ((0, 13), (13, LEN))    # per batch row, [start, stop)
  segment_ids = jnp.asarray([np.repeat(np.arange(len(r)) + 5 * row, [b - a for a, b in r])
                             for row, r in enumerate(runs)])
  x, mask = mixer_input(31), padding_mask(LEN)
  # Each run alone, as one batch: a row of its own from position 0, padded at its end (padding
  # is the padding check's property), so one program serves every run.
  pieces = [(row, start, stop) for row, row_runs in enumerate(runs) for start, stop in row_runs]
  to_len = lambda a, start, stop: jnp.pad(a, ((0, LEN - stop + start),) + ((0, 0),) * (a.ndim - 1))
  alone_x = jnp.stack([to_len(x[row, start:stop], start, stop) for row, start, stop in pieces])
  alone_mask = jnp.stack([to_len(mask[row, start:stop], start, stop)
                          for row, start, stop in pieces])
  worst = 0.0
  for causal in (True, False):
    mixer = build_mixer(name, causal=causal)
    packed = apply_packed(mixer, x, mask, segment_ids)
    alone = apply_mixer(mixer, alone_x, alone_mask)
    for i, (row, start, stop) in enumerate(pieces):
      worst = max(worst, expect_close(packed[row, start:stop], alone[i, :stop - start],
                                      f"row {row}'s tokens {start}:{stop} packed vs alone "
                                      f"(causal={causal})"))
  return worst


@nnx.jit
def apply_packed(mixer, x, mask, segment_ids):
  return mixer(x, mask=mask, segment_ids=segment_ids)

