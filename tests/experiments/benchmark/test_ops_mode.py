"""experiments.benchmark --mode=ops (experiments/benchmark/ops.py)."""
import pytest

from experiments.benchmark import ops


@pytest.mark.slow
def test_ops_benchmark_rows_and_table(tmp_path):
  """experiments.benchmark --mode=ops at a tiny length: every op and the baseline timed, the
  speed-ups filled in, the markdown table written (compiles six programs, hence slow)."""
  rows = ops.run_and_write([16], str(tmp_path), warmup=0, repeats=1, budget_s=60, command="test")
  assert [row["op"] for row in rows] == [ops.BASELINE, *ops.OPS]
  assert all(row["fwd_bwd_ms"] > 0 and row["speedup_vs_full"] > 0 for row in rows)
  table = (tmp_path / "benchmark_ops.md").read_text()
  assert "| chunk_gated_delta_rule |" in table and "vs recurrent_gated_delta_rule" in table
  assert (tmp_path / "benchmark_ops.csv").read_text().startswith("op,length,status")
