"""Differential attention against a float64 oracle written from the paper's equation: two
softmax maps over the halves of each head's query and key, their λ-weighted difference times V,
a per-head RMSNorm and the (1 − λ_init) scale. Output and gradients (inputs and every
parameter) within 1e-5 in f32, non-causal, causal, cross, padded, MHA / GQA / MQA; the depth
rule of λ_init; no n x n array. Decoding, dropout, bf16 and the rest of the contract are the
conformance suite's; linear memory, test_scaling.py's."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attention_zoo.variants.diff import lambda_init_for_depth
from helpers import array_shapes, create_variant, normal, padding_mask, random_qkv, rel_err


def diff_attention64(q, k, v, q_mask, kv_mask, params, *, causal, lambda_init, eps=1e-5):
  """The paper's differential attention in float64, K/V heads repeated for GQA; the causal rule
  bottom-right aligned, masked query rows and rows that see no key give 0."""
  q, k, v = (jnp.asarray(x, jnp.float64) for x in (q, k, v))
  group = q.shape[2] // k.shape[2]
  k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
  half = q.shape[-1] // 2
  q_len, kv_len = q.shape[1], k.shape[1]
  allowed = jnp.asarray(kv_mask)[:, None, None, :]                        # [b, 1, 1, kv]
  if causal:
    allowed = allowed & (np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None] + kv_len - q_len)

  def softmax_map(q_half, k_half):                                        # -> [b, h, q, kv]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q_half, k_half) / np.sqrt(half)
    scores = jnp.where(allowed, scores, -jnp.inf)
    top = jax.lax.stop_gradient(jnp.max(jnp.where(allowed, scores, 0.0), -1, keepdims=True))
    weights = jnp.where(allowed, jnp.exp(scores - top), 0.0)
    total = weights.sum(-1, keepdims=True)
    return weights / jnp.where(total > 0, total, 1.0)

  p = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), params)
  lam = (jnp.exp(p["lambda_q1"] @ p["lambda_k1"]) - jnp.exp(p["lambda_q2"] @ p["lambda_k2"])
         + lambda_init)
  maps = (softmax_map(q[..., :half], k[..., :half])
          - lam * softmax_map(q[..., half:], k[..., half:]))
  out = jnp.einsum("bhqk,bkhd->bqhd", maps, v)                            # [b, q, h, d]
  out = out / jnp.sqrt(jnp.mean(out * out, -1, keepdims=True) + eps) * p["norm"]["scale"]
  out = (1 - lambda_init) * out
  return jnp.where(jnp.asarray(q_mask)[:, :, None, None], out, 0.0)


CASES = [  # (causal, q_len, kv_len, num_kv_heads, padded)
    (False, 20, 20, 4, False), (True, 20, 20, 2, True),
    pytest.param(False, 12, 20, 1, True, marks=pytest.mark.slow),
    pytest.param(True, 12, 20, 2, True, marks=pytest.mark.slow),
    pytest.param(False, 20, 20, 2, True, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("causal, q_len, kv_len, num_kv_heads, padded", CASES)
def test_output_and_gradients_equal_the_float64_oracle(causal, q_len, kv_len, num_kv_heads,
                                                       padded):
  attn = create_variant("diff", num_kv_heads=num_kv_heads, causal=causal, lambda_init=0.5,
                        block_q=8, block_k=8)
  # a norm scale away from ones, so its gradient and its place in the equation are checked
  attn.norm.scale[...] = 1 + 0.3 * normal(3, (8,))
  graph, param_state, rest = nnx.split(attn, nnx.Param, ...)
  params = nnx.to_pure_dict(param_state)
  q, k, v = random_qkv(1, q_len=q_len, kv_len=kv_len, num_kv_heads=num_kv_heads)
  q_mask = padding_mask(2, q_len, hole=2, tail=3) if padded else jnp.ones((2, q_len), bool)
  kv_mask = padding_mask(2, kv_len, hole=5, tail=4) if padded else jnp.ones((2, kv_len), bool)
  cotangent = normal(9, q.shape)

  def variant(q, k, v, params):
    state = jax.tree.map(lambda x: x, param_state)   # fresh variables inside the trace
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graph, state, rest)(q, k, v, q_mask=q_mask, kv_mask=kv_mask)

  def oracle(q, k, v, params):
    return diff_attention64(q, k, v, q_mask, kv_mask, params, causal=causal, lambda_init=0.5)

  out, pull = jax.vjp(variant, q, k, v, params)
  with jax.enable_x64(True):
    want, pull_want = jax.vjp(oracle, q, k, v, params)
    grads_want = pull_want(jnp.asarray(cotangent, jnp.float64))
  assert out.dtype == jnp.float32
  assert rel_err(out, want) < 1e-5
  for what, got, ref in zip(("dq", "dk", "dv", "dparams"), pull(cotangent), grads_want):
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(ref)):
      assert rel_err(g, r) < 1e-5, (what, jax.tree_util.keystr(path))


def test_lambda_init_follows_the_papers_depth_rule():
  assert lambda_init_for_depth(1) == pytest.approx(0.2)
  assert lambda_init_for_depth(2) == pytest.approx(0.8 - 0.6 * np.exp(-0.3))
  assert lambda_init_for_depth(40) == pytest.approx(0.8, abs=1e-5)
  with pytest.raises(ValueError, match="layer must be >= 1"):
    lambda_init_for_depth(0)


def test_defaults_and_the_reweighting():
  """λ_init 0.8 by default; λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init from the parameters;
  the softmax scale is (d/2)^-1/2 (each map's key has d/2 channels)."""
  attn = create_variant("diff")
  assert attn.lambda_init == 0.8 and attn.scale == pytest.approx(4 ** -0.5)
  p = {name: getattr(attn, name)[...] for name in ("lambda_q1", "lambda_k1", "lambda_q2",
                                                    "lambda_k2")}
  assert float(jnp.std(jnp.stack(list(p.values())))) > 0                 # drawn, not zeros
  want = np.exp(p["lambda_q1"] @ p["lambda_k1"]) - np.exp(p["lambda_q2"] @ p["lambda_k2"]) + 0.8
  assert float(attn.reweighting()) == pytest.approx(float(want), rel=1e-6)


def test_an_odd_head_dim_is_refused():
  with pytest.raises(ValueError, match="head_dim must be even"):
    create_variant("diff", head_dim=7)


def test_no_n_by_n_array():
  """The two maps run in the engine's tiles: no array holds the 64 x 64 scores."""
  n = 64
  attn = create_variant("diff", causal=True, block_q=16, block_k=16)
  q, k, v = random_qkv(0, q_len=n)
  loss = lambda q, k, v: jnp.sum(attn(q, k, v))
  shapes = array_shapes(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr)
  assert not any(shape[-2:] == (n, n) for shape in shapes if len(shape) >= 2)
