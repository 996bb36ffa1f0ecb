"""Forward-mode autodiff (jax.jvp, jax.jacfwd) and forward over reverse (Hessian-vector products)
through the paths whose backward is a custom VJP: `ops.autodiff.autodiff_modes` read against each
JAX transformation (it reads JAX internals), the dense path and flash's chunked path against
JAX's derivatives of the dense oracle, and the refusal of flash's Pallas kernels. The chunk ops
are checked in test_ops.py, flex_attention in test_flex.py, remat models in test_models.py and
every registered variant by the conformance suite (its forward_mode property)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_zoo as az
from attention_zoo import reference
from attention_zoo.ops.autodiff import autodiff_modes
from attention_zoo.testing import conformance
from helpers import create_variant, padding_mask, random_qkv


def modes_under(transform):
  """What autodiff_modes() says inside `transform` applied to a scalar function of x [3]."""
  seen = []

  def f(x):
    seen.append(autodiff_modes())
    return jnp.sum(jnp.sin(x) ** 2)

  transform(f, jnp.ones(3))
  return seen[0]


TRANSFORMS = {
    "plain": (lambda f, x: f(x), ()),
    "jvp": (lambda f, x: jax.jvp(f, (x,), (x,)), ("forward",)),
    "jacfwd": (lambda f, x: jax.jacfwd(f)(x), ("forward",)),
    "jit of jvp": (lambda f, x: jax.jit(lambda x: jax.jvp(f, (x,), (x,)))(x), ("forward",)),
    "jvp of vmap": (lambda f, x: jax.jvp(jax.vmap(f), (x[None],), (x[None],)), ("forward",)),
    "grad": (lambda f, x: jax.grad(f)(x), ("reverse",)),
    "vjp": (lambda f, x: jax.vjp(f, x), ("reverse",)),
    "vmap of grad": (lambda f, x: jax.vmap(jax.grad(f))(x[None]), ("reverse",)),
    "jit of grad": (lambda f, x: jax.jit(jax.grad(f))(x), ("reverse",)),
    "hessian": (lambda f, x: jax.hessian(f)(x), ("reverse", "forward")),
    "jvp of grad": (lambda f, x: jax.jvp(jax.grad(f), (x,), (x,)), ("reverse", "forward")),
    "grad of jvp": (lambda f, x: jax.grad(lambda x: jax.jvp(f, (x,), (x,))[1])(x),
                    ("forward", "reverse")),
    # jit traces f into a program first (cached, reused under any transformation): nothing seen
    "jvp of jit": (lambda f, x: jax.jvp(jax.jit(f), (x,), (x,)), ()),
}


@pytest.mark.parametrize("name", TRANSFORMS)
def test_autodiff_modes_reads_each_transformation(name):
  transform, expected = TRANSFORMS[name]
  assert modes_under(transform) == expected


def forward_derivatives(f, args, tangents, cotangent):
  """(J t, H t) of f and of L = Σ cotangent · f, differentiated in every arg."""
  grad = jax.grad(lambda *args: jnp.sum(f(*args) * cotangent), argnums=tuple(range(len(args))))
  return jax.jvp(lambda *args: (f(*args), grad(*args)), args, tangents)[1]


@pytest.mark.parametrize("name, options, causal", [
    pytest.param("full", {"impl": "xla"}, False, marks=pytest.mark.slow),
    ("full", {"impl": "xla"}, True),
    ("flash", {"impl": "chunked", "block_q": 8, "block_k": 8}, True)])
def test_forward_mode_and_hessian_vector_products_equal_the_dense_oracle(name, options, causal):
  """jax.jvp and jax.jvp of jax.grad of the variant (GQA, padding, ALiBi) against the same
  derivatives of reference.dense_attention over its pattern, a plain JAX function."""
  q_len = 13
  attn = create_variant(name, causal=causal, **options)
  args = random_qkv(0, q_len=q_len)
  tangents = random_qkv(1, q_len=q_len)
  cotangent = random_qkv(2, q_len=q_len)[0]
  mask = padding_mask(2, q_len, hole=4, tail=3)
  slopes = jnp.linspace(0.5, 0.0625, 4)
  positions = np.arange(q_len)
  bias = reference.alibi_bias(slopes, positions[:, None], positions[None, :], q_len, q_len)[None]
  allowed = (np.asarray(attn.pattern(q_len, q_len))[None] & np.asarray(mask)[:, None, :, None]
             & np.asarray(mask)[:, None, None, :])
  ours = lambda q, k, v: attn(q, k, v, q_mask=mask, kv_mask=mask, alibi_slopes=slopes)

  def oracle(q, k, v):
    out = reference.dense_attention(q, k, v, allowed, scale=attn.scale, bias=bias)
    return jnp.where(mask[:, :, None, None], out, 0)

  got = jax.jit(forward_derivatives, static_argnums=0)(ours, args, tangents, cotangent)
  want = forward_derivatives(oracle, args, tangents, cotangent)
  for what, g, w in zip(("J t", "H t: q", "k", "v"), (got[0], *got[1]), (want[0], *want[1])):
    assert float(jnp.abs(w).max()) > 1e-2, what
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=0, err_msg=what)


@pytest.mark.parametrize("transform", ["jvp", "jvp of grad"])
def test_flash_pallas_refuses_forward_mode_naming_the_variants_that_support_it(transform):
  attn = conformance.build("flash", impl="pallas")
  q, k, v = conformance.inputs(0)
  f = lambda q: jnp.sum(attn(q, k, v) ** 2)
  differentiate = {"jvp": lambda: jax.jvp(f, (q,), (q,)),
                   "jvp of grad": lambda: jax.jvp(jax.grad(f), (q,), (q,))}[transform]
  with pytest.raises(ValueError, match="flash with impl='pallas' cannot be differentiated in "
                                       "forward mode") as refusal:
    differentiate()
  message = str(refusal.value)
  assert "impl='chunked'" in message
  supported = [name for name in az.available("attention") if name != "flash"]
  assert supported and all(f"{name}," in message or f"{name})" in message for name in supported)
