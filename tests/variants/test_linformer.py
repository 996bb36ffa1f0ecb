"""Oracles for `linformer`: identity projections with k = n give full attention; each sharing
mode against its projections applied head by head; the rest of its contract (padding zeroed
before the projection, slicing, refusals; long inputs and memory: test_scaling.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attention_zoo as az
from attention_zoo.testing.conformance import apply
from helpers import create_variant, random_qkv, rel_err


def build(*, max_len=12, **options):
  return create_variant("linformer", max_len=max_len, **options)


SHARING = ["none", "headwise", "kv", "kv_per_head"]


@pytest.mark.parametrize("share", [  # each mode's own projections: the test below
    SHARING[0], *[pytest.param(share, marks=pytest.mark.slow) for share in SHARING[1:]]])
def test_identity_projections_with_k_equal_n_give_full_attention(share):
  """E = F = I (k = n = max_len): softmax(Q Kᵀ s) V exactly, output and gradients, with GQA."""
  n = 12
  attn = build(max_len=n, k=n, share=share)
  for projection in (attn.key_projection, attn.value_projection):
    if projection is not None:
      projection[...] = jnp.broadcast_to(jnp.eye(n), projection.shape)
  full = az.create("full", num_heads=4, head_dim=8, num_kv_heads=2, rngs=nnx.Rngs(0))
  q, k, v = random_qkv(0, q_len=n, kv_len=n)
  cotangent = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)

  @jax.jit
  def output_and_grads(q, k, v):
    results = []
    for module in (attn, full):
      fn = lambda q, k, v: module(q, k, v)
      grads = jax.grad(lambda *x: jnp.sum(fn(*x) * cotangent), argnums=(0, 1, 2))(q, k, v)
      results.append((fn(q, k, v), *grads))
    return results

  got, expected = output_and_grads(q, k, v)
  for g, e in zip(got, expected):   # output, dq, dk, dv
    assert rel_err(g, e) < 1e-5


def explicit_linformer(q, k, v, kv_mask, e, f):
  """Each query head h (K/V head h // 2) attends over E_hᵀ K and F_hᵀ V of its K/V head, with
  padded keys and values zeroed first; e, f [kv heads, kv_len, k], numpy float64."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  real = np.asarray(kv_mask)[:, :, None]
  out = np.zeros(q.shape)
  for h in range(q.shape[2]):
    kv_head = h // (q.shape[2] // k.shape[2])
    k_proj = np.einsum("bnd,nr->brd", np.where(real, k[:, :, kv_head], 0), e[kv_head])   # [b, k, d]
    v_proj = np.einsum("bnd,nr->brd", np.where(real, v[:, :, kv_head], 0), f[kv_head])
    scores = np.einsum("bqd,brd->bqr", q[:, :, h], k_proj) / np.sqrt(q.shape[-1])
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    out[:, :, h] = np.einsum("bqr,brd->bqd", weights / weights.sum(-1, keepdims=True), v_proj)
  return out


@pytest.mark.parametrize("share", SHARING)
def test_each_sharing_mode_equals_its_projections_applied_explicitly(share):
  """With the drawn projections (sliced to kv_len < max_len), padding and cross-attention: "none"
  projects each K/V head with its own E_h, F_h, "headwise" all heads with one E and one F,
  "kv" with one E = F, "kv_per_head" each K/V head with its own E_h = F_h."""
  attn = build(max_len=16, k=5, share=share)
  q, k, v = random_qkv(2, q_len=7, kv_len=12)
  kv_mask = np.ones((2, 12), bool)
  kv_mask[1, 8:] = kv_mask[1, 3] = False
  e = np.asarray(attn.key_projection[...], np.float64)[:, :12]             # the first kv_len rows
  kv_shared = share in ("kv", "kv_per_head")
  assert (attn.value_projection is None) == kv_shared
  f = e if kv_shared else np.asarray(attn.value_projection[...], np.float64)[:, :12]
  heads = 2 if share in ("none", "kv_per_head") else 1
  assert e.shape == f.shape == (heads, 12, 5)
  if heads == 2:
    assert not np.allclose(e[0], e[1]) and not np.allclose(f[0], f[1])
  e, f = (np.broadcast_to(x, (2, 12, 5)) for x in (e, f))
  expected = explicit_linformer(q, k, v, kv_mask, e, f)
  assert rel_err(apply(attn, q, k, v, kv_mask=jnp.asarray(kv_mask)), expected) < 1e-5


def test_parameter_counts_follow_the_sharing():
  count = lambda m: sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
  per_matrix = 12 * 4
  assert count(build(k=4, share="none")) == 2 * 2 * per_matrix    # E_h and F_h for 2 K/V heads
  assert count(build(k=4, share="headwise")) == 2 * per_matrix
  assert count(build(k=4, share="kv")) == per_matrix
  assert count(build(k=4, share="kv_per_head")) == 2 * per_matrix


def test_init_std_draws_the_projections_from_that_normal():
  """init_std=0.02 (the Nyströmformer code's N(0, 0.02²)) against the default Xavier normal,
  whose std is sqrt(2 / (max_len + k)) for [max_len, k] per head."""
  big = dict(max_len=512, k=64, share="kv_per_head")
  drawn = np.asarray(build(**big, init_std=0.02).key_projection[...])
  assert abs(drawn.mean()) < 1e-3 and drawn.std() == pytest.approx(0.02, rel=0.02)
  xavier = np.asarray(build(**big).key_projection[...])
  assert xavier.std() == pytest.approx(np.sqrt(2 / (512 + 64)), rel=0.03)
  with pytest.raises(ValueError, match="init_std=0"):
    build(init_std=0.0)


def test_refusals():
  with pytest.raises(ValueError, match="future"):
    az.create("linformer", num_heads=4, head_dim=8, causal=True, max_len=12, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="max_len"):
    az.create("linformer", num_heads=4, head_dim=8, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="share"):
    build(share="layer")
  with pytest.raises(ValueError, match=r"option k=0 is invalid: expected an integer >= 1"):
    build(k=0)
  q, k, v = random_qkv(3, q_len=4, kv_len=13)
  with pytest.raises(ValueError, match="exceeds max_len 12"):
    build(k=4)(q, k, v)
