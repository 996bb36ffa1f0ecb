r"""Efficiency benchmarks, one command with a mode each (LRA Table 2, extended; any machine):

    python -m experiments.benchmark --out=results/ [--mode=train] \
        [--attentions=full,local,performer] [--lengths=1024,2048,3072,4096,8192,16384] \
        [--dtype=float32|bfloat16] [--remat=none|block|dots] [--batch_size=B] [--repeats=5] \
        [--time_budget_s=60] [--memory_limit_gb=8] [--plugins=my_variants] \
        [--attention_options=performer:nb_features=128,redraw=false]
    python -m experiments.benchmark --mode=capacity --out=results/capacity \
        [--min_length=1024] [--max_length=131072] [--remats=none,block] \
        [--dtypes=float32,bfloat16] [--time_budget_s=3600] [--probe_lengths=2048,4096]
    python -m experiments.benchmark --mode=flash --out=results/       # on a GPU
    python -m experiments.benchmark --mode=flash --lengths=128,256 --interpret --out=/tmp/fb
    python -m experiments.benchmark --mode=approximation --out=results/ [--lengths=1024] \
        [--input_stds=0.5,1.0] [--masks=causal]

Modes (--mode):
  train          the trainer's own train step of the LRA Text model (configs/lra/text.py, fair
                 preset, at each length), for attention variants and sequence mixers alike
  attention      the attention module alone (forward, and forward+backward), beside
                 jax.nn.dot_product_attention and the device's matmul limit: attention
                 variants only (a mixer takes x, not q, k, v)
  ops            the linear-recurrence ops of attention_zoo.ops alone against causal `full`
                 (only --lengths, --repeats, --warmup, --time_budget_s and --out apply)
  capacity       per variant, the longest power-of-two length whose Text-model train step
                 (batch 1) fits the device's memory, with remat none and block, in float32 and
                 bfloat16, and the time of a step; decided from shapes and compiled memory
                 only, never by running what might not fit (experiments/capacity_search.py).
                 Formerly `python -m experiments.capacity`.
  flash          the FlashAttention kernels against cuDNN and XLA (experiments/kernels.py).
                 Formerly `python -m experiments.flash_bench`.
  approximation  each approximate variant's relative error to exact attention at its
                 defaults (experiments/kernels.py). Formerly `python -m experiments.approximation`.

Writes into --out: benchmark_<mode>.csv, .md (train mode: the paper's Table 2 layout with its
published TPU figures beside ours), .json, and _time.png / _memory.png (log-log, with the fitted
complexity exponent per variant) for train and attention; benchmark_ops.csv and .md;
capacity.md, .csv and .png; benchmark_flash.md; benchmark_approximation.md. Tables are rewritten
after every measurement, so a run that dies keeps what it measured. See
experiments/measure.py for how each figure is measured. The XLA flags in use (see
`cli.avoid_cpu_scheduler_deadlock`) are written into the outputs.

The flash mode on any machine with an NVIDIA GPU and a CUDA build of jax
(`pip install -U "jax[cuda12]"`, then this repository), starting no new row after 7.5 minutes:
    PYTHONUNBUFFERED=1 python -m experiments.benchmark --mode=flash --out=results/ \
        --time_budget_s=450
"""
from __future__ import annotations

import datetime
import itertools
import os
import shlex
import sys

from absl import flags, logging

import attention_zoo as az
from experiments import benchmark_output, capacity_search, cli, kernels, measure, provenance
from experiments.workloads import (DTYPES, MODES, REMATS, Settings, Status, default_batch_size,
                                   default_memory_limit_bytes, parse_attention_options)

FLAGS = flags.FLAGS
ALL_MODES = MODES + ("ops", "capacity", "flash", "approximation")
# Flags whose default depends on the mode (None on the command line: this table, else GENERAL).
GENERAL = {"lengths": ["1024", "2048", "3072", "4096", "8192", "16384"], "dtype": "float32",
           "repeats": 5, "time_budget_s": 60.0, "head_dims": ["64"], "masks": ["none"]}
MODE_DEFAULTS = {
    "capacity": {"time_budget_s": 3600.0},
    "flash": {"lengths": ["1024", "2048", "4096", "8192", "16384"], "dtype": "bfloat16",
              "repeats": 10, "time_budget_s": 420.0, "head_dims": ["64", "128"],
              "masks": ["none", "causal"]},
    "approximation": {"lengths": ["1024"], "num_heads": 4},
}


def mode_value(values, name: str):
  """The flag's value, or its default in this mode."""
  given = getattr(values, name)
  if given is not None:
    return given
  return MODE_DEFAULTS.get(values.mode, {}).get(name, GENERAL.get(name))


def integers(values, name: str) -> list[int]:
  items = mode_value(values, name)
  try:
    return [int(n) for n in items]
  except ValueError:
    raise cli.HarnessError(f"--{name} must be integers, got {','.join(items)}") from None


def settings_from_flags(values) -> Settings:
  """Settings of the train and attention modes from parsed flags (any object with the flags as
  attributes)."""
  return Settings(
      attentions=tuple(values.attentions) or az.available(None if values.mode == "train"
                                                           else "attention"),
      lengths=tuple(integers(values, "lengths")), mode=values.mode,
      dtype=mode_value(values, "dtype"), remat=values.remat,
      batch_size=values.batch_size or default_batch_size(),
      repeats=mode_value(values, "repeats"), warmup=values.warmup,
      time_budget_s=mode_value(values, "time_budget_s"),
      memory_limit_bytes=None if values.memory_limit_gb is None else values.memory_limit_gb * 1e9,
      num_layers=values.num_layers, emb_dim=values.emb_dim, num_heads=values.num_heads,
      mlp_dim=values.mlp_dim, attention_options=parse_attention_options(values.attention_options),
      seed=values.seed, matmul_size=values.matmul_size)


def run_and_write(settings: Settings, out: str, *, command: str, progress=None) -> list[dict]:
  """Measures, rewriting the tables after every measurement (a run that dies keeps what it
  measured), then writes every output with the plots; the rows."""
  write = lambda rows, plots: benchmark_output.write_outputs(rows, settings, out, command=command,
                                                             plots=plots)
  rows = measure.run(settings, progress=progress, on_row=lambda rows: write(rows, plots=False))
  for kind, path in write(rows, plots=True).items():
    logging.info("wrote %s: %s", kind, path)
  return rows


def _lengths(lengths) -> str:
  return ",".join(map(str, lengths))


def plan_lines(settings: Settings, out: str) -> list[str]:
  """A dry run's line per variant of the train and attention modes, as the config resolves."""
  lines = []
  for name in settings.names():
    options = settings.config(name, min(settings.lengths)).model.attention_options
    lines.append(f"{settings.mode} {name}: lengths {_lengths(settings.lengths)}, "
                 f"{settings.dtype}, remat {settings.remat}, batch {settings.batch_size}, "
                 f"{cli.count(settings.repeats, 'repeat')}, "
                 f"{cli.options_text(name, options)}")
  return lines + [f"then {out}/benchmark_{settings.mode}.csv, .md, .json and plots"]


def model_modes(command: str) -> int:
  from tqdm import tqdm

  try:
    settings = settings_from_flags(FLAGS)
  except ValueError as e:       # unknown attention or option, bad lengths: one line, no traceback
    raise cli.HarnessError(str(e)) from e
  cli.plan(lambda: plan_lines(settings, FLAGS.out))
  rows = run_and_write(settings, FLAGS.out, command=command,
                       progress=lambda total: tqdm(total=total, unit="run", file=sys.stderr))
  failed = [f"{r['attention']}@{r['length']}" for r in rows if r["status"] is Status.ERROR]
  if failed:
    logging.error("measurements that failed (see the log and the CSV notes): %s",
                  ", ".join(failed))
    return 1
  return 0


def capacity_mode(command: str) -> int:
  names = tuple(FLAGS.attentions) or az.available()
  for name in names:
    cli.check_attention(name)
  for flag, values, choices in (("remats", FLAGS.remats, REMATS), ("dtypes", FLAGS.dtypes, DTYPES)):
    unknown = [v for v in values if v not in choices]
    if unknown or not values:
      raise cli.HarnessError(f"--{flag}={','.join(values)}: choose from {', '.join(choices)}")
  try:
    lengths = capacity_search.candidates(FLAGS.min_length, FLAGS.max_length)
  except ValueError as e:
    raise cli.HarnessError(str(e)) from None
  try:
    probe_lengths = tuple(int(n) for n in FLAGS.probe_lengths)
  except ValueError:
    probe_lengths = ()
  if len(probe_lengths) != 2 or min(probe_lengths) < 1 or len(set(probe_lengths)) != 2:
    raise cli.HarnessError(f"--probe_lengths={','.join(FLAGS.probe_lengths)}: give two "
                           f"different positive lengths, e.g. 2048,4096")
  memory_limit = (FLAGS.memory_limit_gb * 1e9 if FLAGS.memory_limit_gb
                  else default_memory_limit_bytes())
  try:
    base = Settings(attentions=names, lengths=lengths, num_layers=FLAGS.num_layers,
                    emb_dim=FLAGS.emb_dim, num_heads=FLAGS.num_heads, mlp_dim=FLAGS.mlp_dim)
  except ValueError as e:
    raise cli.HarnessError(str(e)) from None
  model = base.config(names[0], lengths[0]).model
  time_budget_s = mode_value(FLAGS, "time_budget_s")
  cli.plan(lambda: [*(f"capacity {name}: lengths {lengths[0]}..{lengths[-1]}, remat "
                      f"{','.join(FLAGS.remats)}, {','.join(FLAGS.dtypes)}, steps timed: "
                      f"{FLAGS.time_steps}" for name in names),
                    f"then {FLAGS.out}/capacity.md, .csv and .png (time budget "
                    f"{time_budget_s:g} s)"])
  env = provenance.environment()
  facts = {"model": f"{cli.count(model.num_layers, 'layer')}, emb {model.emb_dim}, "
                    f"{cli.count(model.num_heads, 'head')}, MLP {model.mlp_dim}",
           "device": env["device"], "jax_version": env["versions"]["jax"], "lengths": lengths,
           "device_memory_bytes": measure.device_memory_bytes(),
           "memory_limit_bytes": memory_limit,
           "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
  logging.info("capacity of %d variants on %s: device memory %.3g GB, memory limit for timing "
               "%.3g GB, lengths %d..%d, time budget %g s", len(names), env["device"],
               facts["device_memory_bytes"] / 1e9, memory_limit / 1e9, lengths[0], lengths[-1],
               time_budget_s)

  def progress(results):
    r = results[-1]
    logging.info("%-20s remat %-5s %-8s longest %s, compiled %s, step %s s at %s %s",
                 r.attention, r.remat, r.dtype, r.longest, r.compiled, r.step_s, r.timed_length,
                 r.note)
    capacity_search.write_outputs(results, FLAGS.out, facts=facts, command=command, plots=False)

  results = capacity_search.run_capacity(
      names, lengths, settings=tuple(itertools.product(FLAGS.remats, FLAGS.dtypes)),
      time_budget_s=time_budget_s, memory_limit=memory_limit,
      time_steps=FLAGS.time_steps, timed_dtypes=tuple(FLAGS.timed_dtypes or FLAGS.dtypes),
      step_budget_s=FLAGS.step_budget_s, probe_lengths=probe_lengths, base=base,
      on_result=progress)
  for kind, path in capacity_search.write_outputs(results, FLAGS.out, facts=facts,
                                                  command=command).items():
    logging.info("wrote %s: %s", kind, path)
  return 0


def main(argv):
  if len(argv) > 1:
    raise cli.HarnessError(f"unexpected arguments: {' '.join(argv[1:])}")
  command = " ".join(["python -m experiments.benchmark", *map(shlex.quote, sys.argv[1:])])
  if FLAGS.mode in MODES:
    return model_modes(command)
  if FLAGS.mode == "capacity":
    return capacity_mode(command)
  lengths, repeats = integers(FLAGS, "lengths"), mode_value(FLAGS, "repeats")
  head_dims = integers(FLAGS, "head_dims")
  masks = mode_value(FLAGS, "masks")
  if set(masks) - {"none", "causal"}:
    raise cli.HarnessError(f"--masks={','.join(masks)}: choose from none, causal")
  budget_s = mode_value(FLAGS, "time_budget_s")
  if FLAGS.mode == "ops":
    cli.plan(lambda: [f"ops {name}: lengths {_lengths(lengths)}, {repeats} repeats"
                      for name in (kernels.BASELINE, *kernels.OPS)]
             + [f"then {FLAGS.out}/benchmark_ops.csv and .md (budget {budget_s:g} s each)"])
    kernels.run_and_write(lengths, FLAGS.out, warmup=FLAGS.warmup, repeats=repeats,
                          budget_s=budget_s, command=command,
                          progress=lambda row: logging.info("%-27s %6d %s %s ms", row["op"],
                                                            row["length"], row["status"].value,
                                                            row.get("fwd_bwd_ms")))
  elif FLAGS.mode == "flash":
    path = os.path.join(FLAGS.out, "benchmark_flash.md")
    cli.plan(lambda: [f"flash {impl}: lengths {_lengths(lengths)}, head_dims "
                      f"{_lengths(head_dims)}, masks {','.join(masks)}, "
                      f"{mode_value(FLAGS, 'dtype')}, interpret {FLAGS.interpret}"
                      for impl in FLAGS.impls] + [f"then {path} (budget {budget_s:g} s)"])
    kernels.flash_table(path, lengths=lengths, head_dims=head_dims, masks=masks,
                        impls=FLAGS.impls, dtype=mode_value(FLAGS, "dtype"), tokens=FLAGS.tokens,
                        hidden=FLAGS.hidden, batch_size=FLAGS.batch_size,
                        num_heads=FLAGS.num_heads, num_kv_heads=FLAGS.num_kv_heads,
                        repeats=repeats, interpret=FLAGS.interpret, verify=FLAGS.verify,
                        budget_s=budget_s, command=command)
    print(f"wrote {path}")
  else:   # approximation
    names = FLAGS.attentions or [n for n in az.available("attention") if not az.spec(n).exact]
    for name in names:
      cli.check_attention(name)
    stds = [float(s) for s in FLAGS.input_stds]
    path = os.path.join(FLAGS.out, "benchmark_approximation.md")
    cli.plan(lambda: [f"approximation {name}: lengths {_lengths(lengths)}, head_dims "
                      f"{_lengths(head_dims)}, masks {','.join(masks)}, input stds "
                      f"{','.join(FLAGS.input_stds)}" for name in names] + [f"then {path}"])
    lines = []
    for mask, length, head_dim in itertools.product(masks, lengths, head_dims):
      lines += kernels.approximation_table(names, length=length, head_dim=head_dim,
                                           num_heads=mode_value(FLAGS, "num_heads"), stds=stds,
                                           draws=FLAGS.draws, causal=mask == "causal") + [""]
    provenance.write_text(path, "\n".join(lines))
    print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  flags.DEFINE_enum("mode", "train", ALL_MODES,
                    "train: the trainer's train step of the LRA Text model; attention: the "
                    "attention module alone; ops: attention_zoo.ops against causal full; "
                    "capacity: the longest length that fits; flash: the FlashAttention kernels; "
                    "approximation: the error to exact attention.")
  flags.DEFINE_string("out", None, "Output folder.")
  flags.DEFINE_list("attentions", [], "Variants to measure (default: every registered one; "
                    "attention mode: every attention variant; approximation: every one that is "
                    "not exact). `full` is always measured too in train and attention mode: it is "
                    "the speed-up baseline (and, in attention mode, jax.nn.dot_product_attention).")
  flags.DEFINE_list("lengths", None, "Sequence lengths (default: 1K, 2K, 3K, 4K, 8K, 16K; flash: "
                    "without 3K; approximation: 1K).")
  flags.DEFINE_enum("dtype", None, ("float32", "bfloat16", "float16"), "Compute dtype "
                    "(parameters stay float32; default float32, flash bfloat16; float16 only in "
                    "flash mode).")
  flags.DEFINE_enum("remat", "none", REMATS, "Activation recomputation in the backward pass "
                    "(model.remat): none, block, or dots (keeps the matmul outputs).")
  flags.DEFINE_integer("batch_size", None, "Batch size (default: 1 on CPU, the paper's 32 on an "
                       "accelerator; flash: --tokens / length).")
  flags.DEFINE_integer("repeats", None, "Timed calls per measurement, the median reported "
                       "(default 5; flash 10).")
  flags.DEFINE_integer("warmup", 1, "Untimed calls first; the first one estimates the cost.")
  flags.DEFINE_float("time_budget_s", None, "Seconds per measurement in train, attention and ops "
                     "mode (default 60: longer ones, and the longer lengths of that variant, are "
                     "skipped); for the whole run in capacity mode (3600: past them no more "
                     "compiles or steps) and flash mode (420: no new row after them).")
  flags.DEFINE_float("memory_limit_gb", None, "Do not run (capacity: time) programs whose "
                     "compiled memory exceeds this (default: the accelerator's memory, or half "
                     "the free host memory on CPU).")
  flags.DEFINE_list("plugins", [], "Modules to import first; they may register more attention "
                    "variants.")
  flags.DEFINE_multi_string("attention_options", [], "name:key=value,... overriding a "
                            "variant's LRA options; repeat the flag for several variants.")
  flags.DEFINE_integer("num_layers", None, "Model size (default: the LRA Text config's: 4 "
                       "layers, emb 256, 4 heads, MLP 1024).")
  flags.DEFINE_integer("emb_dim", None, "Embedding width (and qkv_dim); head_dim = emb_dim / "
                       "num_heads.")
  flags.DEFINE_integer("num_heads", None, "Attention heads (flash: default --hidden / head_dim; "
                       "approximation: 4).")
  flags.DEFINE_integer("mlp_dim", None, "MLP width.")
  flags.DEFINE_integer("seed", 0, "Seed of parameters and inputs.")
  flags.DEFINE_integer("matmul_size", 4096, "Attention mode: the n x n matmul whose GFLOP/s is "
                       "the limit the exact variants' FLOP rates are compared with; 0: skip it.")
  # capacity mode
  flags.DEFINE_integer("min_length", 1024, "Capacity: the shortest length tried (rounded up to "
                       "a power of two).")
  flags.DEFINE_integer("max_length", 131072, "Capacity: the longest length tried.")
  flags.DEFINE_list("remats", ["none", "block"], f"Capacity: remat policies ({', '.join(REMATS)}).")
  flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "Capacity: compute dtypes "
                    f"({', '.join(DTYPES)}).")
  flags.DEFINE_bool("time_steps", True, "Capacity: time a step of each variant and setting.")
  flags.DEFINE_list("timed_dtypes", [], "Capacity: time steps only in these dtypes (default: "
                    "all of --dtypes).")
  flags.DEFINE_float("step_budget_s", 120.0, "Capacity: do not time a step predicted (a power "
                     "law through the steps at --probe_lengths) to take longer; a step slower "
                     "than this is timed by its first call alone.")
  flags.DEFINE_list("probe_lengths", [str(n) for n in capacity_search.PROBE_LENGTHS],
                    "Capacity: the two short lengths timed to predict each step.")
  # flash and approximation modes
  flags.DEFINE_list("head_dims", None, "Flash, approximation: head dimensions (default 64,128; "
                    "approximation 64).")
  flags.DEFINE_list("masks", None, "Flash, approximation: none and/or causal (default both; "
                    "approximation none).")
  flags.DEFINE_list("impls", ["pallas", "cudnn", "xla"], "Flash: pallas, cudnn, xla, chunked.")
  flags.DEFINE_integer("tokens", 16384, "Flash: batch · length when --batch_size is not given.")
  flags.DEFINE_integer("hidden", 2048, "Flash: heads · head_dim when --num_heads is not given.")
  flags.DEFINE_integer("num_kv_heads", None, "Flash: kv heads (default: as many as query heads).")
  flags.DEFINE_bool("interpret", False, "Flash: run the pallas kernels interpreted (needed on a "
                    "CPU).")
  flags.DEFINE_bool("verify", True, "Flash: check pallas/chunked against the dense oracle "
                    "before timing.")
  flags.DEFINE_list("input_stds", ["0.5", "1.0"], "Approximation: standard deviations of q and k.")
  flags.DEFINE_integer("draws", 3, "Approximation: input / parameter draws averaged.")
  flags.mark_flag_as_required("out")
  cli.run(main)
