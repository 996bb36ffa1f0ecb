"""Every registered variant and mixer that declares `supports_context_parallel` gives, with the
sequence split over a mesh's `context` axis, the outputs and gradients it gives on one device
(attention_zoo/testing/context_parallel.py: its cases in a child with 8 simulated devices); one
that does not declare it refuses such a mesh, naming those that can.

The fast lane checks `full` in one child; the slow lane every other declared name in two.
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


# The case that adds a data axis to the split checks the mesh, which the modules of one
# context-parallel form share: in the slow lane it runs for one module of each form (the ring,
# the cross-shard scan, the linear sums) and for those whose float64 case it is; every module
# runs the other cases.
MESH_CASE = "data2_context2"
MESH_CASE_NAMES = {"sliding_window", "gated_deltanet", "performer",
                   *(n for n, case in context_parallel.FLOAT64_CASES.items() if case == MESH_CASE)}


def _group(name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(the names run in one child with `name`, the cases they leave out)."""
  if name == FAST:
    return (FAST,), ()
  if name in MESH_CASE_NAMES:
    return tuple(n for n in DECLARED if n in MESH_CASE_NAMES), ()
  return tuple(n for n in DECLARED if n != FAST and n not in MESH_CASE_NAMES), (MESH_CASE,)


@functools.cache
def _results(names: tuple[str, ...], without: tuple[str, ...]) -> dict:
  results = {}
  for result in context_parallel.run_in_child(names, without=without):
    results.setdefault(result.name, []).append(result)
  return results


# The slow names share two children; `xdist_group` (pytest.ini: --dist loadgroup) keeps them on
# one worker, so each child runs once, not once per worker.
SLOW = (pytest.mark.slow, pytest.mark.xdist_group("context_parallel"))


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == FAST else SLOW)
                                  for n in DECLARED])
def test_context_parallel_equals_one_device(name):
  names, without = _group(name)
  results = _results(names, without)[name]
  assert len(results) == len(context_parallel.cases_of(name, without))
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
