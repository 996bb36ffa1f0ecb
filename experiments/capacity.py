r"""Capacity table: for each variant, the longest power-of-two length whose LRA Text train step
(the trainer's, batch 1) fits the device's memory, with remat none and block, in float32 and
bfloat16, and the time of a step.

    python -m experiments.capacity --out=results/capacity \
        [--attentions=full,local] [--min_length=1024] [--max_length=131072] \
        [--remats=none,block] [--dtypes=float32,bfloat16] [--time_budget_s=3600] \
        [--memory_limit_gb=8] [--time_steps=true] [--timed_dtypes=float32] \
        [--step_budget_s=120] [--probe_lengths=2048,4096] \
        [--num_layers=4 --emb_dim=256 ...] [--plugins=my_variants]

Decided from shapes and compiled memory only, never by running what might not fit; see
experiments/bench/capacity.py for the search. Writes capacity.md, capacity.csv and capacity.png
to --out, rewriting the tables after every variant and setting.
"""
from __future__ import annotations

import datetime
import itertools
import shlex
import sys

import jax
from absl import flags, logging

import attention_zoo as az
from experiments import cli, memory
from experiments.bench import capacity
from experiments.bench.measure import environment
from experiments.bench.settings import DTYPES, REMATS, Settings, default_memory_limit_bytes
from experiments.plugins import load_plugins

FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise cli.HarnessError(f"unexpected arguments: {' '.join(argv[1:])}")
  load_plugins(FLAGS.plugins)   # already imported by cli.run from the command line; no-op then
  names = tuple(FLAGS.attentions) or az.available()
  for name in names:
    if name not in az.available():
      raise cli.HarnessError(f"unknown attention {name!r}; registered: "
                             f"{', '.join(az.available())}")
  for flag, values, choices in (("remats", FLAGS.remats, REMATS), ("dtypes", FLAGS.dtypes, DTYPES)):
    unknown = [v for v in values if v not in choices]
    if unknown or not values:
      raise cli.HarnessError(f"--{flag}={','.join(values)}: choose from {', '.join(choices)}")
  try:
    lengths = capacity.candidates(FLAGS.min_length, FLAGS.max_length)
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
  env = environment()
  facts = {"model": f"{model.num_layers} layers, emb {model.emb_dim}, {model.num_heads} heads, "
                    f"MLP {model.mlp_dim}",
           "device": env["device"], "jax_version": jax.__version__, "lengths": lengths,
           "device_memory_bytes": memory.device_memory_bytes(), "memory_limit_bytes": memory_limit,
           "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
  command = " ".join(["python -m experiments.capacity", *map(shlex.quote, sys.argv[1:])])
  logging.info("capacity of %d variants on %s: device memory %.3g GB, memory limit for timing "
               "%.3g GB, lengths %d..%d, time budget %g s", len(names), env["device"],
               facts["device_memory_bytes"] / 1e9, memory_limit / 1e9, lengths[0], lengths[-1],
               FLAGS.time_budget_s)

  def progress(results):
    r = results[-1]
    logging.info("%-20s remat %-5s %-8s longest %s, compiled %s, step %s s at %s %s",
                 r.attention, r.remat, r.dtype, r.longest, r.compiled, r.step_s, r.timed_length,
                 r.note)
    capacity.write_outputs(results, FLAGS.out, facts=facts, command=command, plots=False)

  results = capacity.run_capacity(
      names, lengths, settings=tuple(itertools.product(FLAGS.remats, FLAGS.dtypes)),
      time_budget_s=FLAGS.time_budget_s, memory_limit=memory_limit,
      time_steps=FLAGS.time_steps, timed_dtypes=tuple(FLAGS.timed_dtypes or FLAGS.dtypes),
      step_budget_s=FLAGS.step_budget_s, probe_lengths=probe_lengths, base=base,
      on_result=progress)
  for kind, path in capacity.write_outputs(results, FLAGS.out, facts=facts,
                                           command=command).items():
    logging.info("wrote %s: %s", kind, path)
  return 0


if __name__ == "__main__":
  flags.DEFINE_list("attentions", [], "Variants (default: every registered one).")
  flags.DEFINE_integer("min_length", 1024, "The shortest length tried (rounded up to a power "
                       "of two).")
  flags.DEFINE_integer("max_length", 131072, "The longest length tried.")
  flags.DEFINE_list("remats", ["none", "block"], f"Remat policies ({', '.join(REMATS)}).")
  flags.DEFINE_list("dtypes", ["float32", "bfloat16"], f"Compute dtypes ({', '.join(DTYPES)}).")
  flags.DEFINE_float("time_budget_s", 3600.0, "Seconds for the whole table: past them no more "
                     "compiles or steps (a length found so far is marked as a lower bound).")
  flags.DEFINE_float("memory_limit_gb", None, "Time steps only within this much memory "
                     "(default: the accelerator's memory, or half the free host memory on CPU).")
  flags.DEFINE_bool("time_steps", True, "Time a step of each variant and setting.")
  flags.DEFINE_list("timed_dtypes", [], "Time steps only in these dtypes (default: all of "
                    "--dtypes).")
  flags.DEFINE_float("step_budget_s", 120.0, "Do not time a step predicted (a power law "
                     "through the steps at --probe_lengths) to take longer; a step slower "
                     "than this is timed by its first call alone.")
  flags.DEFINE_list("probe_lengths", [str(n) for n in capacity.PROBE_LENGTHS], "The two short "
                    "lengths timed to predict each step.")
  flags.DEFINE_integer("num_layers", None, "Model size (default: the LRA Text config's: 4 "
                       "layers, emb 256, 4 heads, MLP 1024).")
  flags.DEFINE_integer("emb_dim", None, "Embedding width (and qkv_dim).")
  flags.DEFINE_integer("num_heads", None, "Attention heads.")
  flags.DEFINE_integer("mlp_dim", None, "MLP width.")
  flags.DEFINE_list("plugins", [], "Modules to import first; they may register more attention "
                    "variants.")
  flags.DEFINE_string("out", None, "Output folder.")
  flags.mark_flag_as_required("out")
  cli.run(main)
