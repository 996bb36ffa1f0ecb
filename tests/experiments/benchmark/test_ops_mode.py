"""experiments.benchmark --mode=ops (experiments/benchmark/ops.py)."""
import jax.numpy as jnp
import pytest

from attention_zoo.ops import engine
from experiments.benchmark import ops


@pytest.mark.slow
def test_ops_benchmark_rows_and_table(tmp_path):
  """experiments.benchmark --mode=ops at a tiny length: every op and the baseline timed, the
  speed-ups filled in (each chunk form against its own recurrent form), the markdown table
  written (compiles fifteen programs, hence slow)."""
  rows = ops.run_and_write([16], str(tmp_path), warmup=0, repeats=1, budget_s=60, command="test")
  assert [row["op"] for row in rows] == [ops.BASELINE, *ops.OPS]
  assert all(row["fwd_bwd_ms"] > 0 and row["speedup_vs_full"] > 0 for row in rows)
  by_op = {row["op"]: row for row in rows}
  for family in ops.FAMILIES:
    chunk, recurrent = by_op[f"chunk_{family}"], by_op[f"recurrent_{family}"]
    assert chunk["speedup_vs_recurrent"] == pytest.approx(
        recurrent["fwd_bwd_ms"] / chunk["fwd_bwd_ms"])
    assert recurrent["speedup_vs_recurrent"] is None
  table = (tmp_path / "benchmark_ops.md").read_text()
  assert "| chunk_kda |" in table and "- chunk_dplr_delta_rule: " in table
  assert (tmp_path / "benchmark_ops.csv").read_text().startswith("op,length,status")


def test_the_strong_gate_rows_time_the_products_by_halves():
  """At 4K in chunks of 64 the usual gates span at most MIDPOINT_SPAN in every chunk (the
  midpoint way) and the strong ones more (by halves)."""
  x = ops.inputs(4096)
  span = lambda g: float(jnp.max(jnp.ptp(jnp.cumsum(g.reshape(1, 64, 64, *g.shape[2:]), 2), 2)))
  assert span(x["g_channel"]) <= engine.MIDPOINT_SPAN < span(x["g_channel_strong"])
  assert {name for name in ops.OPS if name.endswith(ops.STRONG_GATES)} == {
      f"chunk_{family}{ops.STRONG_GATES}" for family in ("gla", "kda")}
