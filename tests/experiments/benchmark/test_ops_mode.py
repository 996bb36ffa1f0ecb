"""experiments.benchmark --mode=ops (experiments/benchmark/ops.py)."""
import math

import jax
import jax.numpy as jnp
import pytest
from jax.extend import core as jax_core

import attention_zoo.ops
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
  # the FLOP rate of the chunk forms and the baseline, none for a token-by-token form
  assert "## FLOP rate" in table and "| recurrent_kda | " not in table.split("## FLOP rate")[1]
  assert by_op["chunk_kda"]["gflops_per_s"] == pytest.approx(
      ops.chunk_flops("chunk_kda", 16) / by_op["chunk_kda"]["fwd_bwd_ms"] / 1e6)
  assert (tmp_path / "benchmark_ops.csv").read_text().startswith("op,length,status")


def test_the_strong_gate_rows_time_the_products_by_halves():
  """At 4K in chunks of 64 the usual gates span at most MIDPOINT_SPAN in every chunk (the
  midpoint way) and the strong ones more (by halves)."""
  x = ops.inputs(4096)
  span = lambda g: float(jnp.max(jnp.ptp(jnp.cumsum(g.reshape(1, 64, 64, *g.shape[2:]), 2), 2)))
  assert span(x["g_channel"]) <= engine.MIDPOINT_SPAN < span(x["g_channel_strong"])
  assert {name for name in ops.OPS if name.endswith(ops.STRONG_GATES)} == {
      f"chunk_{family}{ops.STRONG_GATES}" for family in ("gla", "kda")}


def matmul_flops(jaxpr) -> float:
  """2·m·n·k of every dot_general in a jaxpr, a scan's body counted once per iteration."""
  total = 0.0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (contracted, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contracted)
      continue
    times = eqn.params["length"] if eqn.primitive.name == "scan" else 1
    for value in eqn.params.values():
      for inner in (value if isinstance(value, (tuple, list)) else (value,)):
        inner = getattr(inner, "jaxpr", inner)
        if isinstance(inner, jax_core.Jaxpr):
          total += times * matmul_flops(inner)
  return total


def test_the_nominal_counts_are_the_hand_counts_at_a_small_shape():
  """16 steps in chunks of 8 (two chunks), K = 4, V = 2: each product written out."""
  C, K, V = 8, 4, 2
  pair_k, pair_v, state = 2 * C * C * K, 2 * C * C * V, 2 * C * K * V   # 512, 256, 128
  hand = {"additive": pair_k + pair_v + 2 * state,                  # QKᵀ, P V, Kᵀ V, Q S
          "delta": 3 * pair_k + 2 * pair_v + 3 * state + C ** 3 / 3,  # + KKᵀ, T·βK, T·βV, W S
          "dplr": 5 * pair_k + 4 * pair_v + 4 * state + C ** 3 / 3}
  assert hand == {"additive": 1024, "delta": 2432 + 512 / 3, "dplr": 4096 + 512 / 3}
  for update, per_chunk in hand.items():
    assert ops.chunk_forward_flops(update, 16, C, K, V) == pytest.approx(2 * per_chunk)
  assert ops.chunk_flops("chunk_gla", 1024) == 3 * 4 * 16 * (
      2 * 64 * 64 * 128 + 4 * 64 * 64 * 64)   # batch 1 x 4 heads, 16 chunks of 64, K = V = 64
  assert ops.chunk_flops("chunk_gated_delta_product", 1024) == 2 * ops.chunk_flops(
      "chunk_gated_delta_rule", 1024)   # two Householder steps a token
  assert ops.chunk_flops("recurrent_gla", 1024) is None


@pytest.mark.parametrize("name,update", [("chunk_simple_gla", "additive"),
                                         ("chunk_gated_delta_rule", "delta")])
def test_the_nominal_counts_are_the_ops_own_matmuls(name, update):
  """The count of the dot products in the op's forward (scan bodies once per chunk) equals the
  nominal one, less the triangular inverse, which is counted at its minimal C³/3. (Scalar
  gates: with per-channel ones the products take a `cond` between two ways of computing them,
  each with its own matmuls; the nominal count is the plain product's.)"""
  B, T, H, K, V, C = 1, 128, 1, 8, 4, 64
  keys = iter(jax.random.split(jax.random.key(0), 5))
  x = lambda *shape: jax.random.normal(next(keys), (B, T, H, *shape))
  inputs = {"q": x(K), "k": x(K), "v": x(V), "beta": jax.nn.sigmoid(x()),
            "g": jax.nn.log_sigmoid(x())}
  names = ops.FAMILIES[name.removeprefix("chunk_")]
  forward = lambda *args: getattr(attention_zoo.ops, name)(*args)[0]
  counted = matmul_flops(jax.make_jaxpr(forward)(*(inputs[n] for n in names)).jaxpr)
  chunks = T // C
  inverse = matmul_flops(jax.make_jaxpr(engine.unit_lower_inverse)(
      jnp.zeros((chunks, C, C))).jaxpr) if update != "additive" else 0.0
  minimal_inverse = chunks * C ** 3 / 3 if update != "additive" else 0.0
  assert counted - inverse == pytest.approx(
      ops.chunk_forward_flops(update, T, C, K, V) - minimal_inverse)
