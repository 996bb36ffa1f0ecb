"""The ops mode: the linear-recurrence ops of attention_zoo.ops alone, forward+backward, each
chunkwise form against causal `full` attention and against its own token-by-token form.

At each length: batch 1, 4 heads, K = V = 64, float32, the gradients of Σ o with respect to
every input (q, k, v, and g and beta where the op takes them), in one process so that the
ratios share the machine's state. Each program is compiled first (its temporary memory from
XLA), then timed by programs.time_calls (median of --repeats calls after --warmup) under
--time_budget_s. Each chunk op's FLOP rate counts the matmuls of its chunk form nominally
(chunk_flops) against the matmul limit measured in the same run (--matmul_size). Writes
benchmark_ops.csv and .md.
"""
from __future__ import annotations

import types

import jax
import jax.numpy as jnp
from absl import logging
from flax import nnx

import attention_zoo as az
from attention_zoo import ops
from attention_zoo.ops.engine import DEFAULT_CHUNK_SIZE
from experiments.benchmark.attention import attention_flops
from experiments.benchmark.outputs import output_paths, run_environment, table_row, write_csv
from experiments.benchmark.programs import OverBudget, time_calls
from experiments.benchmark.settings import Status, length_label, lengths_text
from experiments.common import device, dry_run
from experiments.common.command_line import integers
from experiments.common.records import write_text

BATCH, HEADS, HEAD_DIM = 1, 4, 64
BASELINE = "full (causal)"
NUM_HOUSEHOLDER = 2   # Gated DeltaProduct's (k, v, beta) per token
# family -> its inputs; each family's chunk_<family> and recurrent_<family> are measured
FAMILIES = {"gated_delta_rule": ("q", "k", "v", "g", "beta"),
            "delta_rule": ("q", "k", "v", "beta"),
            "simple_gla": ("q", "k", "v", "g"),
            "gla": ("q", "k", "v", "g_channel"),
            "kda": ("q", "k", "v", "g_channel", "beta"),
            "dplr_delta_rule": ("q", "k", "v", "a", "b", "g_channel"),
            "gated_delta_product": ("q", "k_steps", "v_steps", "g", "beta_steps")}
OPS = {f"{form}_{family}": (getattr(ops, f"{form}_{family}"), names)
       for family, names in FAMILIES.items() for form in ("chunk", "recurrent")}
# The per-channel products take one matmul through each chunk's midpoint when the gates of
# every chunk span at most ops.engine.MIDPOINT_SPAN (these inputs' gates do), and are built by
# halves otherwise: these rows time that way, with log-gates 30x (per-step decays from about
# e^-40 to 0.8, median e^-3.8).
STRONG_GATES = " (strong gates)"
OPS |= {f"chunk_{family}{STRONG_GATES}": (getattr(ops, f"chunk_{family}"), tuple(
    "g_channel_strong" if name == "g_channel" else name for name in FAMILIES[family]))
    for family in ("gla", "kda")}
COLUMNS = ("op", "length", "status", "note", "fwd_bwd_ms", "speedup_vs_full",
           "speedup_vs_recurrent", "first_call_ms", "temp_bytes", "nominal_flops", "gflops_per_s",
           "fraction_of_matmul", "matmul_gflops", "device", "jax_version", "xla_flags", "date")
# What each chunk op's state update is (attention_zoo/ops/engine.py): additive, the delta rule
# (WY form), or DPLR; Gated DeltaProduct runs the delta rule over NUM_HOUSEHOLDER steps a token.
UPDATE = {"simple_gla": "additive", "gla": "additive", "delta_rule": "delta",
          "gated_delta_rule": "delta", "kda": "delta", "gated_delta_product": "delta",
          "dplr_delta_rule": "dplr"}


def chunk_forward_flops(update: str, steps: int, chunk: int, key_dim: int, value_dim: int) -> float:
  """The FLOPs of the matmuls of one head's chunk form over `steps` steps in chunks of `chunk`
  (the last padded), 2·m·n·k a product, as engine.chunk_recurrence / chunk_dplr_recurrence
  compute them; the triangular inverse (I + A)^{-1} counted as C³/3, its minimal cost."""
  C, K, V = chunk, key_dim, value_dim
  pairs, read_and_write = 2 * C * C, 2 * C * K * V   # a [C, C] product per d; a state product
  inverse = C ** 3 / 3
  per_chunk = {
      # P = QKᵀ, P V; the write Kᵀ V, the read Q S
      "additive": pairs * (K + V) + 2 * read_and_write,
      # P = QKᵀ, A = KKᵀ, W = T·βK, U = T·βV, P U'; W S and Kᵀ U' in the scan, the read Q S
      "delta": pairs * (3 * K + 2 * V) + inverse + 3 * read_and_write,
      # P_qk, P_qb, A_ab, A_ak; W = T·a; U = T·(A_ak V); P_qk V, P_qb u; the write Kᵀ V, W S,
      # Bᵀ u in the scan, the read Q S
      "dplr": pairs * (5 * K + 4 * V) + inverse + 4 * read_and_write,
  }[update]
  return per_chunk * -(-steps // C)


def chunk_flops(name: str, length: int) -> float | None:
  """Forward+backward FLOPs of op `name` at `length` as this mode runs it (BATCH x HEADS,
  K = V = HEAD_DIM, chunks of DEFAULT_CHUNK_SIZE steps): 3 x the forward's matmuls (each
  product's two gradients; the backward's recomputation of the chunk states not counted);
  causal attention's 3.5 x 4·b·h·n²·d / 2 for the baseline; None for a token-by-token form."""
  if name == BASELINE:
    return attention_flops(BATCH, HEADS, length, HEAD_DIM, causal=True, backward=True)
  if not name.startswith("chunk_"):
    return None
  family = name.removeprefix("chunk_").removesuffix(STRONG_GATES)
  steps = length * (NUM_HOUSEHOLDER if family == "gated_delta_product" else 1)
  chunk = min(DEFAULT_CHUNK_SIZE, -(-steps // 8) * 8)   # engine._chunk_layout: short, one chunk
  return 3 * BATCH * HEADS * chunk_forward_flops(UPDATE[family], steps, chunk, HEAD_DIM, HEAD_DIM)


def inputs(length: int) -> dict[str, jax.Array]:
  """Random inputs as a layer would give them: unit-norm keys, log-sigmoid gates (and 30x
  those: STRONG_GATES), beta in (0, 1); RWKV-7's a = -β k̂, b = k̂ (the delta rule's
  transition); Gated DeltaProduct's NUM_HOUSEHOLDER keys, values and betas per token."""
  keys = jax.random.split(jax.random.key(0), 9)
  shape = (BATCH, length, HEADS, HEAD_DIM)
  steps = (BATCH, length, NUM_HOUSEHOLDER, HEADS, HEAD_DIM)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  k, beta = unit(jax.random.normal(keys[1], shape)), jax.nn.sigmoid(
      jax.random.normal(keys[5], shape[:3]))
  return {"q": jax.random.normal(keys[0], shape), "k": k,
          "v": jax.random.normal(keys[2], shape),
          "g": jax.nn.log_sigmoid(jax.random.normal(keys[3], shape[:3]) + 2),
          "g_channel": jax.nn.log_sigmoid(jax.random.normal(keys[4], shape) + 2),
          "g_channel_strong": 30 * jax.nn.log_sigmoid(jax.random.normal(keys[4], shape) + 2),
          "beta": beta, "a": -beta[..., None] * k, "b": k,
          "k_steps": unit(jax.random.normal(keys[6], steps)),
          "v_steps": jax.random.normal(keys[7], steps),
          "beta_steps": jax.nn.sigmoid(jax.random.normal(keys[8], steps[:4]))}


def program(name: str):
  """-> (forward+backward of `name` as a function of the inputs dict, the input names)."""
  if name == BASELINE:
    attention = az.create("full", num_heads=HEADS, head_dim=HEAD_DIM, causal=True,
                          rngs=nnx.Rngs(0))
    return lambda q, k, v: attention(q, k, v), ("q", "k", "v")
  fn, names = OPS[name]
  return lambda *args: fn(*args)[0], names


def measure_one(name: str, length: int, *, warmup: int, repeats: int, budget_s: float) -> dict:
  row = {"op": name, "length": length, "status": Status.OK, "note": ""}
  fn, names = program(name)
  loss = lambda *args: jnp.sum(fn(*args))
  fwd_bwd = jax.jit(jax.grad(loss, argnums=tuple(range(len(names)))))
  args = [inputs(length)[key] for key in names]
  try:
    compiled = fwd_bwd.lower(*args).compile()
    row["temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes
    calls = types.SimpleNamespace(step=lambda _, compiled, args: (compiled(*args), args))
    row["fwd_bwd_ms"], row["first_call_ms"], _ = time_calls(
        calls, "fwd_bwd", compiled, args, warmup=warmup, repeats=repeats, budget_s=budget_s)
  except OverBudget as error:
    row.update(status=Status.OVER_TIME_BUDGET, note=str(error))
  return row


def run(lengths, *, warmup: int, repeats: int, budget_s: float, progress=None,
        matmul_size: int = 0) -> list[dict]:
  """Every op (and the baseline) at every length, with speed-ups against full attention and
  against the op's own token-by-token form at the same length, and the FLOP rate of the chunk
  forms and the baseline (against an n x n matmul's, n = matmul_size, measured first; 0: none)."""
  env = run_environment()
  if matmul_size:
    env["matmul_gflops"] = device.matmul_gflops(matmul_size, "float32")
  rows = []
  for length in sorted(lengths):
    for name in (BASELINE, *OPS):
      rows.append({**measure_one(name, length, warmup=warmup, repeats=repeats,
                                 budget_s=budget_s), **env})
      if progress:
        progress(rows[-1])
  for row in rows:
    same = {r["op"]: r.get("fwd_bwd_ms") for r in rows if r["length"] == row["length"]}
    mine = row.get("fwd_bwd_ms")
    own_recurrent = (row["op"].replace("chunk_", "recurrent_", 1)
                     if row["op"].startswith("chunk_") else None)
    for key, base in (("speedup_vs_full", BASELINE), ("speedup_vs_recurrent", own_recurrent)):
      row[key] = same[base] / mine if mine and same.get(base) else None
    row["nominal_flops"] = chunk_flops(row["op"], row["length"])
    if mine and row["nominal_flops"]:
      row["gflops_per_s"] = row["nominal_flops"] / (mine / 1e3) / 1e9
      limit = env.get("matmul_gflops")
      row["fraction_of_matmul"] = row["gflops_per_s"] / limit if limit else None
  return rows


def markdown(rows: list[dict], *, command: str, warmup: int, repeats: int) -> str:
  env = rows[0]
  lengths = sorted({r["length"] for r in rows})
  by_key = {(r["op"], r["length"]): r for r in rows}
  cell = lambda r: (f"{r['fwd_bwd_ms']:.1f} ms ({r['speedup_vs_full']:.2f}x)"
                    if r.get("fwd_bwd_ms") else r["status"].label)
  header = ["op"] + [length_label(n) for n in lengths]
  lines = ["# Linear-recurrence ops: forward+backward", "",
           f"- Device: {env['device']}; jax {env['jax_version']}; {env['date']}",
           f"- Batch {BATCH}, {HEADS} heads, K = V = {HEAD_DIM}, float32; gradients of Σ o "
           "with respect to every input.",
           f"- Times: median of {repeats} calls after {warmup} warm-up call(s); (Nx) = speed-up "
           f"vs `{BASELINE}` (az.create('full', causal=True)) in the same process.",
           f"- Command: `{command}`", "",
           table_row(header), table_row(["---"] * len(header))]
  names = list(dict.fromkeys(r["op"] for r in rows))
  lines += [table_row([name] + [cell(by_key[(name, n)]) for n in lengths])
            for name in names]
  lines += ["", "Each chunk form against its own token-by-token form:", ""]
  lines += [f"- chunk_{family}: " + ", ".join(
      f"{length_label(n)} {by_key[(f'chunk_{family}', n)]['speedup_vs_recurrent']:.2f}x"
      for n in lengths if by_key[(f"chunk_{family}", n)].get("speedup_vs_recurrent"))
      for family in FAMILIES]
  return "\n".join(lines + rate_lines(rows, names, lengths)) + "\n"


def rate_lines(rows: list[dict], names: list[str], lengths: list[int]) -> list[str]:
  """The FLOP rate table: GFLOP/s and the share of the matmul limit of every op counted."""
  by_key = {(r["op"], r["length"]): r for r in rows}
  rated = [name for name in names if chunk_flops(name, lengths[0]) is not None]
  limit = rows[0].get("matmul_gflops")
  lines = ["", "## FLOP rate", "",
           "Nominal FLOPs of each chunk form's matmuls (chunk_flops in experiments/benchmark/"
           "ops.py: the products of attention_zoo/ops/engine.py, 2·m·n·k each, the triangular "
           "inverse as C³/3, in chunks of 64; forward+backward = 3 x the forward), the "
           "baseline's 3.5 x 4·b·h·n²·d / 2 (causal)" + (
               f"; against the matmul limit, {limit:.4g} GFLOP/s (a square matmul, float32, "
               "measured in the same run)." if limit else "."), ""]
  header = ["op"] + [f"GFLOP/s {length_label(n)}" for n in lengths] + (
      [f"of limit {length_label(n)}" for n in lengths] if limit else [])
  lines += [table_row(header), table_row(["---"] * len(header))]
  for name in rated:
    measured = [by_key[(name, n)] for n in lengths]
    cells = [f"{r['gflops_per_s']:.3g}" if r.get("gflops_per_s") else r["status"].label
             for r in measured]
    if limit:
      cells += [f"{100 * r['fraction_of_matmul']:.0f}%" if r.get("fraction_of_matmul") else ""
                for r in measured]
    lines.append(table_row([name] + cells))
  return lines


def run_and_write(lengths, out: str, *, warmup: int, repeats: int, budget_s: float,
                  command: str, progress=None, matmul_size: int = 0) -> list[dict]:
  rows = run(lengths, warmup=warmup, repeats=repeats, budget_s=budget_s, progress=progress,
             matmul_size=matmul_size)
  paths = output_paths(out, "ops")
  write_csv(rows, paths["csv"], COLUMNS)
  write_text(paths["markdown"], markdown(rows, command=command, warmup=warmup, repeats=repeats))
  return rows


def run_mode(values, command: str) -> int:
  """`--mode=ops` from the parsed flags (the mode's defaults filled in)."""
  lengths = integers(values.lengths, "lengths")
  dry_run.plan(lambda: [f"ops {name}: lengths {lengths_text(lengths)}, {values.repeats} repeats"
                        for name in (BASELINE, *OPS)]
               + [f"then {values.out}/benchmark_ops.csv and .md (budget "
                  f"{values.time_budget_s:g} s each)"])
  run_and_write(lengths, values.out, warmup=values.warmup, repeats=values.repeats,
                budget_s=values.time_budget_s, command=command, matmul_size=values.matmul_size,
                progress=lambda row: logging.info("%-27s %6d %s %s ms", row["op"], row["length"],
                                                  row["status"].value, row.get("fwd_bwd_ms")))
  return 0
