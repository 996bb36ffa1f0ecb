"""Context parallelism of the linear approximations (ops/kernelized.py, length_projection.py,
nystrom.py):
on a mesh whose `context` axis splits the sequence, each equals one device (outputs and every
gradient, testing/context_parallel's three cases), and its compiled program shows that it is its
own form that ran, not XLA's partitioner gathering the sequence: what crosses devices is the
small sums (no collective moves a full-length activation), and per-device memory grows linearly
with the length, at about 1/context of one device's.

One child process with simulated devices serves every test of this file: the names selected
(the fast lane: performer; the slow lane: the whole family), checked and profiled at once.
"""
import functools
import math

import pytest

from attention_zoo.testing import conformance
from attention_zoo.testing import context_parallel as cp

FAST = "performer"
FAMILY = [FAST, *(pytest.param(name, marks=pytest.mark.slow)
                  for name in ("linear_transformer", "linformer", "nystromformer"))]
LENGTHS = (2048, 4096)   # long enough that a full-length K outweighs the C shard states
CONTEXT = 8
# The collectives each form's program must contain: its cross-shard reductions (the causal
# kernelised form's all-gather of the shard states; a psum's all-reduce) and Nyströmformer's
# convolution halo (collective-permute; the suite builds it with conv_kernel_size 5).
COLLECTIVES = {"performer": {"all-gather"}, "linear_transformer": {"all-gather"},
               "linformer": {"all-reduce"}, "nystromformer": {"all-reduce", "collective-permute"}}


@functools.cache
def _checked(names: tuple) -> tuple:
  return cp.check_in_child(names, profile_lengths=LENGTHS, profile_context=CONTEXT)


@pytest.fixture
def checked(request):
  """(case results, profiles) of every name of this file that the session runs, one child."""
  names = (item.callspec.params["name"] for item in request.session.items
           if item.module is request.module)
  return _checked(tuple(dict.fromkeys(names)))


@pytest.mark.parametrize("name", FAMILY)
def test_equals_one_device(name, checked):
  results = [r for r in checked[0] if r.name == name]
  assert len(results) == len(cp.CASES)
  for result in results:
    assert result.passed, f"{name} {result.case}: error {result.error} {result.note}"


@pytest.mark.parametrize("name", FAMILY)
def test_its_form_runs_and_only_the_sums_cross_devices(name, checked):
  """The program holds the op's shard_map regions; no collective moves as much as half a
  full-length K (the partitioner's gather would move all of it); the form's reductions are
  there. (XLA's partitioner alone splits linformer's and nystromformer's sums without a gather
  too, at 1/3 of one device's memory on 4 devices; their forms take less, and make it sure.)"""
  for found in (p for p in checked[1] if p.name == name):
    assert found.manual_regions > 0
    full_k = found.length * conformance.NUM_KV_HEADS * conformance.HEAD_DIM
    sizes = [(opcode, shape) for opcode, shapes in found.collectives for shape in shapes]
    assert all(math.prod(shape) < full_k / 2 for _, shape in sizes), (found.length, sizes)
    assert COLLECTIVES[name] <= {opcode for opcode, _ in sizes}, sizes


@pytest.mark.parametrize("name", FAMILY)
def test_memory_per_device_is_linear_in_length_and_split(name, checked):
  short, long = sorted((p for p in checked[1] if p.name == name), key=lambda p: p.length)
  assert long.bytes <= 2.2 * short.bytes, (short.bytes, long.bytes)
  for found in (short, long):   # the claim for the ring and the chunk mixers, at 8 devices
    assert found.bytes <= found.one_device_bytes / 4, (found.bytes, found.one_device_bytes)
