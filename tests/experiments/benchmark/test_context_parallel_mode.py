"""benchmark --mode=context_parallel: which mesh each variant gets, its tables, and a run on two
simulated devices (a child process: the device count is fixed when JAX starts)."""
import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

import attention_zoo as az
from attention_zoo.registry import scoped_registry
from attention_zoo.variants.full import FullAttention
from experiments.benchmark import context_parallel
from experiments.benchmark.context_parallel import Row

REPO = Path(__file__).resolve().parents[3]


def test_a_variant_without_the_capability_runs_on_fsdp_and_one_with_it_on_context():
  assert context_parallel.mesh_for("synthesizer", 1) == ({}, 1, "one device")
  assert context_parallel.mesh_for("synthesizer", 4) == ({"fsdp": 4}, 4, "fsdp 4")
  assert context_parallel.mesh_for("full", 4) == ({"context": 4}, 1, "context 4")
  with scoped_registry():
    az.register("cp_test_ring", exact=True, supports_causal=True, supports_cross=True,
                complexity="O(n^2)", paper="-", supports_context_parallel=True)(
                    type("Ring", (FullAttention,), {}))
    assert context_parallel.mesh_for("cp_test_ring", 4) == ({"context": 4}, 1, "context 4")


def test_tables_say_not_supported_and_give_the_time_against_one_device():
  rows = [Row("full", 1, "one device", 1, longest=4096, longest_bytes=2e9, timed_length=1024,
              step_s=0.5),
          Row("full", 2, "fsdp 2", 2, longest=4096, longest_bytes=1.9e9, timed_length=1024,
              step_s=0.6),
          Row("ring", 1, "one device", 1, longest=4096, longest_bytes=2e9, step_s=None,
              note="not timed: 1K exceeds the budget"),
          Row("ring", 2, "context 2", 1, longest=8192, longest_bytes=1.5e9, complete=False)]
  facts = {"device": "2 x cpu", "jax_version": "0", "date": "today", "model": "1 layer",
           "lengths": (1024, 2048, 4096, 8192), "device_counts": (1, 2), "budget_bytes": 2e9}
  text = context_parallel.markdown(rows, facts)
  assert "| full | 4K (2 GB) | context: not supported; fsdp 2, batch 2: 4K (1.9 GB) |" in text
  assert "| ring | 4K (2 GB) | ≥ 8K (the longest tried) (1.5 GB) |" not in text   # incomplete
  assert "| ring | 4K (2 GB) | ≥ 8K (1.5 GB) |" in text
  assert "| full | 1.00 (0.5 s) | 1.20 (0.6 s) |" in text
  assert "| ring | not timed: 1K exceeds the budget |" in text
  assert "say nothing about a network" in text


@pytest.mark.slow
def test_the_mode_on_two_simulated_devices_writes_both_counts(tmp_path):
  env = {**os.environ, "PYTHONPATH": str(REPO)}   # the mode adds the simulated devices
  process = subprocess.run(
      [sys.executable, "-m", "experiments.benchmark", "--mode=context_parallel",
       f"--out={tmp_path}", "--attentions=full,synthesizer", "--device_counts=1,2",
       "--min_length=128", "--max_length=256", "--lengths=128", "--num_layers=1",
       "--emb_dim=16", "--num_heads=2", "--mlp_dim=32", "--memory_limit_gb=1"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert process.returncode == 0, process.stderr
  with open(tmp_path / "benchmark_context_parallel.csv") as f:
    rows = list(csv.DictReader(f))
  assert [(r["attention"], r["devices"], r["mesh"], r["longest"]) for r in rows] == [
      ("full", "1", "one device", "256"), ("full", "2", "context 2", "256"),
      ("synthesizer", "1", "one device", "256"), ("synthesizer", "2", "fsdp 2", "256")]
  assert all(float(r["step_s"]) > 0 for r in rows)
  table = (tmp_path / "benchmark_context_parallel.md").read_text()
  assert "context: not supported; fsdp 2" in table   # synthesizer's
