"""Context parallelism of MoBA and NSA (ops/selection_ring.py): on a mesh whose `context` axis
splits the sequence each equals one device (outputs and every gradient, testing/
context_parallel's cases; the slow registry sweep, tests/testing/test_context_parallel.py, runs
all three for both), and its compiled program shows that it is its own form that ran, not XLA's
partitioner gathering the sequence: the program holds the op's shard_map regions and the ring's
collective-permutes, no collective moves a full-length K (what is gathered is the block
summaries, n/B or n/stride rows), and per-device memory grows linearly with the length (16K to 32K
on 8 devices) and is within the issue's 1/4 of one device at 32K.

The fast lane: MoBA's hardest case (context 4, causal, padded) in one child. The slow lane: both
names' compiled programs (never run) in one child.
"""
import math

import pytest

from attention_zoo.testing import conformance
from attention_zoo.testing import context_parallel as cp

NAMES = ("moba", "nsa")
LENGTHS = (16384, 32768)   # on CONTEXT devices: memory linear in the length; at 32K the
CONTEXT = 8                # issue's claim, <= 1/4 of one device


def _problems(name, profiles) -> list[str]:
  """What the compiled programs of one name show wrong (nothing: [])."""
  problems = []
  for found in profiles:
    full_k = found.length * conformance.NUM_KV_HEADS * conformance.HEAD_DIM
    moved = [(opcode, shape) for opcode, shapes in found.collectives for shape in shapes]
    if not found.manual_regions:
      problems.append(f"length {found.length}: no shard_map region, the op's form did not run")
    if "collective-permute" not in {opcode for opcode, _ in moved}:
      problems.append(f"length {found.length}: no collective-permute (the ring): {moved}")
    too_long = [(opcode, shape) for opcode, shape in moved
                if found.length in shape or math.prod(shape) >= full_k]
    if too_long:
      problems.append(f"length {found.length}: full-length collectives {too_long}")
  short, long = sorted(profiles, key=lambda p: p.length)
  if long.bytes > 2.2 * short.bytes:
    problems.append(f"memory not linear in length on context {CONTEXT}: {short.bytes} -> "
                    f"{long.bytes} bytes per device")
  if long.bytes > long.one_device_bytes / 4:
    problems.append(f"length {long.length}: {long.bytes} bytes per device on context {CONTEXT}, "
                    f"more than 1/4 of one device's {long.one_device_bytes}")
  return [f"{name}: {problem}" for problem in problems]


def test_moba_equals_one_device_on_four_shards():
  without = [case.name for case in cp.CASES if case.name != "context4_causal_packed"]
  results = cp.run_in_child(["moba"], without=without)
  assert [r.case for r in results] == ["context4_causal_packed"]
  assert all(r.passed for r in results), results


@pytest.mark.slow
def test_moba_and_nsa_ring_in_linear_memory_and_gather_no_full_length_kv():
  _, profiles = cp.check_in_child(list(NAMES), profile_lengths=LENGTHS, profile_context=CONTEXT,
                                  without=[case.name for case in cp.CASES])
  problems = [problem for name in NAMES
              for problem in _problems(name, [p for p in profiles if p.name == name])]
  assert len(profiles) == len(NAMES) * len(LENGTHS) and not problems, "\n".join(problems)
