"""Context parallelism of the linear approximations (ops/kernelized.py, length_projection.py,
nystrom.py): on a mesh whose `context` axis splits the sequence, each equals one device
(outputs and every gradient, testing/context_parallel's three cases), and its compiled program
shows that it is its own form that ran, not XLA's partitioner gathering the sequence: the
program holds the op's shard_map regions and their collectives, what crosses devices is the
small sums (no collective moves a full-length activation), and per-device memory grows
linearly with the length, within the issue's 1/4 of one device on 8 devices.

Each test checks its names in one child process with simulated devices: the fast lane
performer; the slow lane the rest of the family (performer is the fast lane's).
"""
import math

import pytest

from attention_zoo.testing import conformance
from attention_zoo.testing import context_parallel as cp

LENGTHS = (2048, 4096)   # long enough that a full-length K outweighs the C shard states
CONTEXT = 8
# The collectives each form's program must contain: its cross-shard reductions (the causal
# kernelised form's all-gather of the shard states; a psum's all-reduce) and Nyströmformer's
# convolution halo (collective-permute; the suite builds it with conv_kernel_size 5).
COLLECTIVES = {"performer": {"all-gather"}, "linear_transformer": {"all-gather"},
               "linformer": {"all-reduce"}, "nystromformer": {"all-reduce", "collective-permute"}}


def _problems(name, results, profiles) -> list[str]:
  """What is wrong with one name's context-parallel form (nothing: [])."""
  problems = [f"{r.case}: error {r.error} {r.note}" for r in results if not r.passed]
  if len(results) != len(cp.CASES):
    problems.append(f"{len(results)} case results, expected {len(cp.CASES)}")
  for found in profiles:
    full_k = found.length * conformance.NUM_KV_HEADS * conformance.HEAD_DIM
    moved = [(opcode, shape) for opcode, shapes in found.collectives for shape in shapes]
    if not found.manual_regions:
      problems.append(f"length {found.length}: no shard_map region, the op's form did not run")
    if any(math.prod(shape) >= full_k / 2 for _, shape in moved):
      problems.append(f"length {found.length}: a collective moves half a full-length K: {moved}")
    if not COLLECTIVES[name] <= {opcode for opcode, _ in moved}:
      problems.append(f"length {found.length}: {COLLECTIVES[name]} not all in {moved}")
    if found.bytes > found.one_device_bytes / 4:
      problems.append(f"length {found.length}: {found.bytes} bytes per device, more than 1/4 of "
                      f"one device's {found.one_device_bytes}")
  short, long = sorted(profiles, key=lambda p: p.length)
  if long.bytes > 2.2 * short.bytes:
    problems.append(f"memory not linear in length: {short.bytes} -> {long.bytes} bytes")
  return [f"{name}: {problem}" for problem in problems]


def check(names):
  results, profiles = cp.check_in_child(names, profile_lengths=LENGTHS, profile_context=CONTEXT)
  problems = [problem for name in names for problem in _problems(
      name, [r for r in results if r.name == name], [p for p in profiles if p.name == name])]
  assert not problems, "\n".join(problems)


def test_performer_splits_and_equals_one_device():
  check(["performer"])


@pytest.mark.slow
def test_the_other_linear_forms_split_and_equal_one_device():
  check(["linear_transformer", "linformer", "nystromformer"])
