r"""Efficiency benchmark (LRA Table 2, extended): every variant, longer lengths, any machine.

    python -m experiments.benchmark --out=results/ \
        [--attentions=full,local,performer] [--lengths=1024,2048,3072,4096,8192,16384] \
        [--mode=train|attention|ops] [--dtype=float32|bfloat16] [--remat=none|block|dots] \
        [--batch_size=B] [--repeats=5] [--time_budget_s=60] [--memory_limit_gb=8] \
        [--plugins=my_variants] [--attention_options=performer:nb_features=128,redraw=false]

`train` mode times the trainer's own train step of the LRA Text model (configs/lra/text.py,
fair preset, at each length), for attention variants and sequence mixers alike; `attention`
mode the attention module alone (forward, and forward+backward), beside
jax.nn.dot_product_attention and the device's matmul limit: attention variants only (a mixer
takes x, not q, k, v). Writes
to --out: benchmark_<mode>.csv, .md (the paper's Table 2 layout with its published TPU
figures beside ours), .json, and _time.png / _memory.png (log-log, with the fitted complexity
exponent per variant). `ops` mode times the linear-recurrence ops of attention_zoo.ops alone
against causal `full` (experiments/bench/ops.py; only --lengths, --repeats, --warmup,
--time_budget_s and --out apply), writing benchmark_ops.csv and .md. See experiments/bench/ for
how each figure is measured.

The XLA flags in use (see `cli.avoid_cpu_scheduler_deadlock`) are written into the outputs.
"""
from __future__ import annotations

import shlex
import sys

from absl import flags, logging

import attention_zoo as az
from experiments import cli
from experiments.bench import measure, output
from experiments.bench.settings import (DTYPES, MODES, REMATS, Settings, Status,
                                        default_batch_size, parse_attention_options)
from experiments.plugins import load_plugins

FLAGS = flags.FLAGS


def settings_from_flags(values) -> Settings:
  """Settings from parsed flags (any object with the flags as attributes)."""
  try:
    lengths = tuple(int(n) for n in values.lengths)
  except ValueError:
    raise ValueError(f"--lengths must be integers, got {','.join(values.lengths)}") from None
  return Settings(
      attentions=tuple(values.attentions) or az.available(None if values.mode == "train"
                                                           else "attention"),
      lengths=lengths, mode=values.mode,
      dtype=values.dtype, remat=values.remat,
      batch_size=values.batch_size or default_batch_size(), repeats=values.repeats,
      warmup=values.warmup, time_budget_s=values.time_budget_s,
      memory_limit_bytes=None if values.memory_limit_gb is None else values.memory_limit_gb * 1e9,
      num_layers=values.num_layers, emb_dim=values.emb_dim, num_heads=values.num_heads,
      mlp_dim=values.mlp_dim, attention_options=parse_attention_options(values.attention_options),
      seed=values.seed, matmul_size=values.matmul_size)


def run_and_write(settings: Settings, out: str, *, command: str, progress=None) -> list[dict]:
  """Measures, rewriting the tables after every measurement (a run that dies keeps what it
  measured), then writes every output with the plots; the rows."""
  write = lambda rows, plots: output.write_outputs(rows, settings, out, command=command,
                                                   plots=plots)
  rows = measure.run(settings, progress=progress, on_row=lambda rows: write(rows, plots=False))
  for kind, path in write(rows, plots=True).items():
    logging.info("wrote %s: %s", kind, path)
  return rows


def main(argv):
  if len(argv) > 1:
    raise cli.HarnessError(f"unexpected arguments: {' '.join(argv[1:])}")
  from tqdm import tqdm

  load_plugins(FLAGS.plugins)   # already imported by cli.run from the command line; no-op then
  command = " ".join(["python -m experiments.benchmark", *map(shlex.quote, sys.argv[1:])])
  if FLAGS.mode == "ops":
    from experiments.bench import ops
    ops.run_and_write([int(n) for n in FLAGS.lengths], FLAGS.out, warmup=FLAGS.warmup,
                      repeats=FLAGS.repeats, budget_s=FLAGS.time_budget_s, command=command,
                      progress=lambda row: logging.info("%-27s %6d %s %s ms", row["op"],
                                                        row["length"], row["status"].value,
                                                        row.get("fwd_bwd_ms")))
    return 0
  try:
    settings = settings_from_flags(FLAGS)
  except ValueError as e:       # unknown attention or option, bad lengths: one line, no traceback
    raise cli.HarnessError(str(e)) from e
  rows = run_and_write(settings, FLAGS.out, command=command,
                       progress=lambda total: tqdm(total=total, unit="run", file=sys.stderr))
  failed = [f"{r['attention']}@{r['length']}" for r in rows if r["status"] is Status.ERROR]
  if failed:
    logging.error("measurements that failed (see the log and the CSV notes): %s",
                  ", ".join(failed))
    return 1
  return 0


if __name__ == "__main__":
  flags.DEFINE_list("attentions", [], "Variants to measure (default: every registered one; "
                    "attention mode: every attention variant). "
                    "`full` is always measured too: it is the speed-up baseline (and, in "
                    "attention mode, jax.nn.dot_product_attention).")
  flags.DEFINE_list("lengths", ["1024", "2048", "3072", "4096", "8192", "16384"],
                    "Sequence lengths.")
  flags.DEFINE_enum("mode", "train", MODES + ("ops",),
                    "train: the trainer's train step of the LRA Text model; attention: the "
                    "attention module alone; ops: attention_zoo.ops against causal full.")
  flags.DEFINE_enum("dtype", "float32", DTYPES, "Compute dtype (parameters stay float32).")
  flags.DEFINE_enum("remat", "none", REMATS, "Activation recomputation in the backward pass "
                    "(model.remat): none, block, or dots (keeps the matmul outputs).")
  flags.DEFINE_integer("batch_size", None, "Batch size (default: 1 on CPU, the paper's 32 on an "
                       "accelerator).")
  flags.DEFINE_integer("repeats", 5, "Timed calls per measurement (the median is reported).")
  flags.DEFINE_integer("warmup", 1, "Untimed calls first; the first one estimates the cost.")
  flags.DEFINE_float("time_budget_s", 60.0, "Seconds per measurement; longer ones, and the "
                     "longer lengths of that variant, are skipped.")
  flags.DEFINE_float("memory_limit_gb", None, "Do not run programs whose compiled memory "
                     "exceeds this (default: the accelerator's memory, or half the free host "
                     "memory on CPU).")
  flags.DEFINE_list("plugins", [], "Modules to import first; they may register more attention "
                    "variants.")
  flags.DEFINE_multi_string("attention_options", [], "name:key=value,... overriding a "
                            "variant's LRA options; repeat the flag for several variants.")
  flags.DEFINE_integer("num_layers", None, "Model size (default: the LRA Text config's: 4 "
                       "layers, emb 256, 4 heads, MLP 1024).")
  flags.DEFINE_integer("emb_dim", None, "Embedding width (and qkv_dim); head_dim = emb_dim / "
                       "num_heads.")
  flags.DEFINE_integer("num_heads", None, "Attention heads.")
  flags.DEFINE_integer("mlp_dim", None, "MLP width.")
  flags.DEFINE_integer("seed", 0, "Seed of parameters and inputs.")
  flags.DEFINE_integer("matmul_size", 4096, "Attention mode: the n x n matmul whose GFLOP/s is "
                       "the limit the exact variants' FLOP rates are compared with; 0: skip it.")
  flags.DEFINE_string("out", None, "Output folder.")
  flags.mark_flag_as_required("out")
  cli.run(main)
