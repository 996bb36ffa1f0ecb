"""Test-session set-up shared by every test file, and the fast lane's definition.

`pytest -q -m "not slow"` (the fast lane, for development) touches every module at small
shapes: the contract, each variant's own oracle tests (their heaviest cases are slow), the
conformance suite and the config sweep for one variant per family (`REPRESENTATIVE_VARIANTS`),
the options, layers and models, the recurrent ops of the chunk engine's gate paths
(`REPRESENTATIVE_OPS`). `pytest -q -n 2` (what CI runs) runs everything. Slow: what
trains through the harness, starts subprocesses, writes or reads datasets or compiles at long
lengths (the modules in `SLOW_MODULES`), the registry sweeps for every other registered name
(new ones included: CI checks them), and single tests marked `slow` (each variant's heaviest
cases).
"""
import os

import pytest

from experiments.common import xla_flags

# Before JAX starts its CPU backend: the XLA scheduler setting the command-line tools use too.
xla_flags.avoid_cpu_scheduler_deadlock()
# The tests compile hundreds of small programs and run each a few times, so LLVM's optimisation
# of the generated code costs more than it saves (the suite took 16 minutes without it, 22 with
# it, on 2 cores). XLA's own passes (fusion, buffer assignment: what the memory tests read)
# still run, and no test times anything. Subprocesses inherit it.
XLA_FLAGS = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in XLA_FLAGS:
  os.environ["XLA_FLAGS"] = f"{XLA_FLAGS} --xla_backend_optimization_level=0".strip()
# For the same reason the elemental IR emitters rather than XLA's newer CPU fusion emitters, which
# took about twice as long to compile the tests' small programs: single-core CPU time of the fast
# lane's tests/testing/test_conformance.py and test_models.py 242 s with them, 92 s without (jaxlib
# 0.10.2, 2026-12-03). Both emit code for the same fused HLO. An XLA that no longer knows the flag
# would abort, so xla_flags.add_xla_flag tries it in a child first; the xdist workers inherit the
# result.
xla_flags.add_xla_flag("--xla_cpu_use_fusion_emitters=false")

SLOW_MODULES = {
    "test_approximation",          # each approximate variant against exact attention
    "test_benchmark",              # compiles and times whole train steps
    "test_conformance_runner",     # the conformance CLI in subprocesses
    "test_harness_cli",            # entry points in subprocesses, two processes over gloo
    "test_harness_files",          # report, sweep and the metrics writer over finished runs
    "test_harness_train",          # every task trained through the trainer
    "test_lra_listops",            # data generation, hash-seed subprocesses
    "test_lra_readers",            # readers of the official formats on written fixtures
    "test_lra_tfds",               # the TFDS fallbacks
    "test_pathfinder_generator",   # image generation
    "test_scaling",                # compiles every variant at 8K-16K
}


# Tests that sweep the whole registry, and the parameter naming the variant. In the fast lane
# they run for one variant per family (REPRESENTATIVE_VARIANTS): dense exact, a window pattern on
# the block-sparse engine, a kernelised one, and one sequence mixer (a delta rule with a decay:
# the chunk engine's most general path). Flash's Pallas kernels in interpret mode and BigBird's
# random blocks have their own fast-lane oracle tests (tests/ops/test_flash.py,
# tests/variants/test_sparse.py). Every other registered name, a newly
# registered one too, runs them in the slow lane (CI runs both); add a name to move it.
REGISTRY_SWEEPS = {"test_conformance": "name", "test_mixer_conformance": "name",
                   "test_every_task_attention_config_builds": "attention",
                   "test_variant_backward_hands_no_high_rank_array_to_a_fusion_library": "name",
                   # tests/mixers/test_delta_mixers.py, over the delta-rule mixers
                   "test_allow_neg_eigval_equals_its_equation": "name",
                   "test_decoding_token_by_token_equals_the_chunked_forward": "name",
                   # tests/mixers/test_mixers.py: every mixer against its equation in float64
                   "test_layer_equals_its_equation_in_float64": "name"}
REPRESENTATIVE_VARIANTS = {"full", "sliding_window", "performer", "gated_deltanet"}
# The op sweeps (tests/ops/test_ops.py over its OPS, test_ops_segments.py over their chunk and
# recurrent forms): in the fast lane the ops of the chunk engine's gate paths run (a scalar gate
# with the delta rule's inverse, a per-channel gate with and without it); the other ops of a
# sweep run in the slow lane.
OP_SWEEPS = {"test_ops", "test_ops_segments"}
REPRESENTATIVE_OPS = {"gated_delta_rule", "kda", "gla"}


def is_slow(item) -> bool:
  module = item.module.__name__.rpartition(".")[2]
  if module in SLOW_MODULES:
    return True
  callspec = getattr(item, "callspec", None)
  if module in OP_SWEEPS and callspec is not None and "name" in callspec.params:
    op = callspec.params["name"].removeprefix("chunk_").removeprefix("recurrent_")
    return op not in REPRESENTATIVE_OPS
  variant_param = REGISTRY_SWEEPS.get(getattr(item, "originalname", None))
  return variant_param is not None and item.callspec.params[variant_param] not in (
      REPRESENTATIVE_VARIANTS)


def pytest_collection_modifyitems(items):
  for item in items:
    if is_slow(item):
      item.add_marker(pytest.mark.slow)


def _map_limit() -> int:
  try:
    with open("/proc/sys/vm/max_map_count", encoding="ascii") as limit:
      return int(limit.read())
  except (OSError, ValueError):
    return 65530


# A worker releases its compiled programs when its memory maps pass a third of the kernel's
# limit, checked every 20 tests (reading the maps costs a few ms): see release_compiled_programs.
MAP_BUDGET, CHECK_EVERY = _map_limit() // 3, 20
_tests_run = 0


def pytest_runtest_teardown(item, nextitem):
  global _tests_run
  _tests_run += 1
  if _tests_run % CHECK_EVERY == 0:
    from helpers import release_compiled_programs   # JAX loads after the flags above are set
    release_compiled_programs(MAP_BUDGET)

