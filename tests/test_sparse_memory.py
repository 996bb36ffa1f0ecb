"""Compiled memory of the sparse family: linear in the length, and a small part of `full`'s.

Temp bytes of forward+backward from XLA's `memory_analysis()` (deterministic, no timing), at the
default options, batch 1, 4 heads, head_dim 64, f32.
"""
import functools

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import attention_zoo as az

SPARSE = ["local", "sliding_window", "sparse_transformer", "longformer", "bigbird"]


@functools.cache
def temp_bytes(name, length):
  attn = az.create(name, num_heads=4, head_dim=64, rngs=nnx.Rngs(0))
  grad = jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v)), argnums=(0, 1, 2))
  x = jax.ShapeDtypeStruct((1, length, 4, 64), jnp.float32)
  return jax.jit(grad).lower(x, x, x).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("name", SPARSE)
def test_memory_grows_linearly_and_stays_far_below_full(name):
  at_2k, at_8k = temp_bytes(name, 2048), temp_bytes(name, 8192)
  assert at_8k <= 5 * at_2k, f"{name}: {at_8k / 2**20:.0f} MiB at 8K vs {at_2k / 2**20:.0f} MiB at 2K"
  full_8k = temp_bytes("full", 8192)
  assert at_8k <= 0.15 * full_8k, f"{name}: {at_8k / 2**20:.0f} MiB vs full's {full_8k / 2**20:.0f} MiB at 8K"
