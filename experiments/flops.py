"""The device's matmul speed, the yardstick for an attention kernel's FLOP rate, and the
nominal FLOPs of exact attention.

`matmul_gflops()` times one square matmul (a 4096 x 4096 f32 product by default, 2·n³ FLOPs);
an attention kernel's GFLOP/s divided by it is the fraction of the matmul limit it reaches.
"""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def median_call_s(fn, *args, repeats: int = 5) -> float:
  """Median seconds of `repeats` calls of a compiled fn(*args), after one warm-up call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def matmul_gflops(n: int = 4096, dtype: str = "float32", repeats: int = 5) -> float:
  """GFLOP/s of an n x n by n x n matmul (2·n³ FLOPs) on the default device, median of `repeats`."""
  a, b = jax.random.normal(jax.random.key(0), (2, n, n), jnp.dtype(dtype))
  product = jax.jit(jnp.matmul).lower(a, b).compile()
  return 2 * n ** 3 / median_call_s(product, a, b, repeats=repeats) / 1e9


def attention_flops(batch: int, heads: int, length: int, head_dim: int, *, causal: bool,
                    backward: bool) -> float:
  """The nominal FLOPs of exact softmax attention as the FlashAttention papers count them:
  4·b·h·n²·d for the forward (two n x n x d products), halved when causal; the backward is
  2.5 x the forward (its recomputation included), so forward+backward is 3.5 x."""
  forward = 4 * batch * heads * length ** 2 * head_dim / (2 if causal else 1)
  return forward * (3.5 if backward else 1.0)
