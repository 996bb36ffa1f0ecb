"""Every registered variant and mixer that declares `supports_context_parallel` gives, with the
sequence split over a mesh's `context` axis, the outputs and gradients it gives on one device
(attention_zoo/testing/context_parallel.py: three cases in a child with 8 simulated devices); one
that does not declare it refuses such a mesh, naming those that can.

The fast lane checks `full` in one child; the slow lane every other declared name in another.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

import attention_zoo as az
from attention_zoo import registry
from attention_zoo.testing import context_parallel

az.available()   # registers the built-ins
DECLARED = registry.accepting("supports_context_parallel")
FAST = "full"


@functools.cache
def _results(names: tuple[str, ...]) -> dict:
  results = {}
  for result in context_parallel.run_in_child(names):
    results.setdefault(result.name, []).append(result)
  return results


# The slow names share one child; `xdist_group` (pytest.ini: --dist loadgroup) keeps them on one
# worker, so the child runs once, not once per worker.
SLOW = (pytest.mark.slow, pytest.mark.xdist_group("context_parallel"))


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == FAST else SLOW)
                                  for n in DECLARED])
def test_context_parallel_equals_one_device(name):
  group = (FAST,) if name == FAST else tuple(n for n in DECLARED if n != FAST)
  results = _results(group)[name]
  assert len(results) == len(context_parallel.cases_of(name))
  failed = [f"{r.case}: error {r.error} {r.note}" for r in results if not r.passed]
  assert not failed, f"{name}: " + "; ".join(failed)


def _context_mesh(size: int = 2):
  """An abstract mesh splitting the sequence: the contract's check needs no devices."""
  return jax.sharding.use_abstract_mesh(
      AbstractMesh((size,), ("context",), axis_types=(AxisType.Auto,)))


def test_a_variant_without_context_parallelism_refuses_a_context_mesh():
  undeclared = next(n for n in az.available("attention") if n not in DECLARED)
  attention = az.create(undeclared, num_heads=2, head_dim=4, rngs=nnx.Rngs(0))
  x = jnp.ones((1, 8, 2, 4))
  with _context_mesh(), pytest.raises(ValueError, match="context axis") as error:
    attention(x, x, x)
  assert undeclared in str(error.value)
  assert all(name in str(error.value) for name in DECLARED)


def test_a_mixer_without_context_parallelism_refuses_a_context_mesh():
  undeclared = next(n for n in az.available("mixer") if n not in DECLARED)
  mixer = az.create_mixer(undeclared, emb_dim=8, num_heads=2, causal=True, rngs=nnx.Rngs(0))
  with _context_mesh(4), pytest.raises(ValueError, match=r"context=4\)"):
    mixer(jnp.ones((1, 8, 8)))


def test_without_a_context_axis_nothing_is_refused():
  undeclared = next(n for n in az.available("attention") if n not in DECLARED)
  attention = az.create(undeclared, num_heads=2, head_dim=4, rngs=nnx.Rngs(0))
  x = jnp.ones((1, 8, 2, 4))
  with _context_mesh(1):
    assert attention(x, x, x).shape == x.shape
