"""Efficient variants at long lengths: compiled memory linear in the length and a small part of
`full`'s, and finite outputs at 16K tokens in bf16.

Memory is XLA's `memory_analysis()` of the compiled forward+backward (temp bytes: deterministic,
no timing), batch 1, 2 heads sharing 1 kv head (GQA), head_dim 32, f32, default options.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attention_zoo as az

# (name, causal, options): every variant whose memory should be linear in the length.
LINEAR_MEMORY = [
    ("local", False, {}), ("local", True, {}), ("sliding_window", False, {}),
    ("sliding_window", True, {}), ("sparse_transformer", False, {}),
    ("sparse_transformer", True, {}), ("longformer", False, {}), ("bigbird", False, {}),
    ("bigbird", True, {}), ("performer", False, {}), ("performer", True, {}),
    ("linear_transformer", False, {}), ("linear_transformer", True, {}), ("linformer", False, {}),
    ("reformer", False, {}), ("reformer", True, {}), ("sinkhorn", False, {}),
    ("sinkhorn", True, {}), ("nystromformer", False, {}), ("flash", False, {"impl": "chunked"}),
    ("flash", True, {"impl": "chunked"}), ("moba", False, {}), ("moba", True, {}),
    ("nsa", True, {}), ("stick_breaking", True, {}), ("softpick", False, {}),
    ("softpick", True, {}), ("diff", False, {}), ("diff", True, {}),
    ("dsa", False, {}), ("dsa", True, {}),
]
# Approximations (plus the kernel-based exact path) that must stay finite at 16K in bf16.
LONG_BF16 = [("performer", False), ("performer", True), ("linear_transformer", True),
             ("linformer", False), ("reformer", False), ("reformer", True), ("sinkhorn", True),
             ("nystromformer", False)]


def _build(name, length, causal, options):
  return az.create(name, num_heads=2, head_dim=32, num_kv_heads=1, causal=causal, max_len=length,
                   rngs=nnx.Rngs(0), **options)


@functools.cache
def temp_bytes(name, length, causal=False, options=()):
  graph, state = nnx.split(_build(name, length, causal, dict(options)))
  loss = lambda state, q, k, v: jnp.sum(nnx.merge(graph, state)(q, k, v))
  q = jax.ShapeDtypeStruct((1, length, 2, 32), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, length, 1, 32), jnp.float32)
  compiled = jax.jit(jax.grad(loss, argnums=(1, 2, 3))).lower(state, q, kv, kv).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_the_measure_sees_quadratic_growth():
  """Control: `full` grows about 16x from 2K to 8K under the same measure."""
  assert temp_bytes("full", 8192) > 12 * temp_bytes("full", 2048)


@pytest.mark.parametrize("name, causal, options", LINEAR_MEMORY)
def test_memory_grows_linearly_and_stays_far_below_full(name, causal, options):
  options = tuple(sorted(options.items()))
  at_2k, at_8k = temp_bytes(name, 2048, causal, options), temp_bytes(name, 8192, causal, options)
  full_8k = temp_bytes("full", 8192, causal)
  mib = lambda x: f"{x / 2**20:.1f} MiB"
  assert at_8k <= 4.5 * at_2k, f"{mib(at_8k)} at 8K vs {mib(at_2k)} at 2K (linear: 4x)"
  # full keeps one [heads, n, n] f32 array (its weights) for the backward: 1 GiB at 8K here.
  assert at_8k <= 0.25 * full_8k, f"{mib(at_8k)} vs full's {mib(full_8k)} at 8K"


@pytest.mark.parametrize("name, causal", LONG_BF16)
def test_finite_at_16k_in_bf16(name, causal):
  n = 16384
  attn = _build(name, n, causal, {})
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(0, 2, (1, n, 2, 32)), jnp.bfloat16)
  k, v = (jnp.asarray(rng.normal(0, 2, (1, n, 1, 32)), jnp.bfloat16) for _ in range(2))
  mask = jnp.asarray(np.arange(n)[None] < n - 1000)
  out = nnx.jit(lambda m, q, k, v, mask: m(q, k, v, q_mask=mask, kv_mask=mask))(attn, q, k, v, mask)
  out = np.asarray(out, np.float32)
  assert out.dtype == np.float32 and np.isfinite(out).all()
  assert np.abs(out[0, : n - 1000]).mean() > 1e-3          # real rows carry signal


def test_flash_chunked_is_at_most_an_eighth_of_full_at_8k():
  chunked = temp_bytes("flash", 8192, False, (("impl", "chunked"),))
  assert chunked <= temp_bytes("full", 8192) / 8
