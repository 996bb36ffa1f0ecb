"""Test-session set-up shared by every test file, and the fast lane's definition.

`pytest -q -m "not slow"` runs the contract, every variant's oracle and conformance checks, the
options, layers and models at small shapes; `pytest -q` (what CI runs) runs everything. A test
is slow when it trains through the harness, starts subprocesses, writes or reads datasets, or
compiles at long lengths: the modules below as a whole, and single tests marked `slow`.
"""
import os

import pytest

from experiments import cli

# Before JAX starts its CPU backend: the XLA scheduler setting the command-line tools use too.
cli.avoid_cpu_scheduler_deadlock()
# The tests compile hundreds of small programs and run each a few times, so LLVM's optimisation
# of the generated code costs more than it saves (the suite took 16 minutes without it, 22 with
# it, on 2 cores). XLA's own passes (fusion, buffer assignment: what the memory tests read)
# still run, and no test times anything. Subprocesses inherit it.
XLA_FLAGS = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in XLA_FLAGS:
  os.environ["XLA_FLAGS"] = f"{XLA_FLAGS} --xla_backend_optimization_level=0".strip()

SLOW_MODULES = {
    "test_approximation",          # trains tiny ListOps models to compare approximations
    "test_benchmark",              # compiles and times whole train steps
    "test_conformance_runner",     # the conformance CLI in subprocesses
    "test_harness_cli",            # entry points in subprocesses, two processes over gloo
    "test_harness_files",          # report, sweep and writers over finished runs
    "test_harness_train",          # every task trained through the trainer
    "test_lra_listops",            # data generation, hash-seed subprocesses
    "test_lra_readers",            # readers of the official formats on written fixtures
    "test_lra_tfds",               # the TFDS fallbacks
    "test_pathfinder_generator",   # image generation
    "test_readme",                 # runs the README's Python example
    "test_scaling",                # compiles every variant at 8K-16K
}


def pytest_collection_modifyitems(items):
  for item in items:
    if item.module.__name__.rpartition(".")[2] in SLOW_MODULES:
      item.add_marker(pytest.mark.slow)
