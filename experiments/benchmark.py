r"""Efficiency benchmark (LRA Table 2, extended): every variant, longer lengths, any machine.

    python -m experiments.benchmark --out=results/ \
        [--attentions=full,local,performer] [--lengths=1024,2048,3072,4096,8192,16384] \
        [--mode=train|attention] [--dtype=float32|bfloat16] [--batch_size=B] [--repeats=5] \
        [--time_budget_s=60] [--memory_limit_gb=8] [--plugins=my_variants] \
        [--attention_options=performer:nb_features=128,redraw=false]

`train` mode times a train step of the LRA Text model; `attention` mode the attention module
alone (forward, and forward+backward). Writes to --out: benchmark_<mode>.csv, .md (the paper's
Table 2 layout with its published TPU figures beside ours), .json, and _time.png /
_memory.png (log-log, with the fitted complexity exponent per variant).

The XLA flags in use (see `cli.avoid_cpu_scheduler_deadlock`) are written into the outputs.
"""
from __future__ import annotations

import shlex
import sys

from absl import flags, logging
from tqdm import tqdm

import attention_zoo as az
from experiments import benchmarking, cli
from experiments.plugins import load_plugins

FLAGS = flags.FLAGS
flags.DEFINE_list("attentions", [], "Variants to measure (default: every registered one). "
                  "`full` is always measured too: it is the speed-up baseline.")
flags.DEFINE_list("lengths", ["1024", "2048", "3072", "4096", "8192", "16384"], "Sequence lengths.")
flags.DEFINE_enum("mode", "train", benchmarking.MODES,
                  "train: LRA Text model train step; attention: the attention module alone.")
flags.DEFINE_enum("dtype", "float32", benchmarking.DTYPES, "Compute dtype (parameters stay float32).")
flags.DEFINE_integer("batch_size", None, "Batch size (default: 1 on CPU, the paper's 32 on an accelerator).")
flags.DEFINE_integer("repeats", 5, "Timed calls per measurement (the median is reported).")
flags.DEFINE_integer("warmup", 1, "Untimed calls first; the first one estimates the cost.")
flags.DEFINE_float("time_budget_s", 60.0, "Seconds per measurement; longer ones, and the longer lengths "
                   "of that variant, are skipped.")
flags.DEFINE_float("memory_limit_gb", None, "Do not run programs whose compiled memory exceeds this "
                   "(default: the accelerator's memory, or half the free host memory on CPU).")
flags.DEFINE_list("plugins", [], "Modules to import first; they may register more attention variants.")
flags.DEFINE_multi_string("attention_options", [], "name:key=value,... overriding a variant's LRA "
                          "options; repeat the flag for several variants.")
flags.DEFINE_integer("num_layers", 4, "Model size (LRA Text: 4 layers, emb 256, 4 heads, MLP 1024).")
flags.DEFINE_integer("emb_dim", 256, "Embedding width; head_dim = emb_dim / num_heads.")
flags.DEFINE_integer("num_heads", 4, "Attention heads.")
flags.DEFINE_integer("mlp_dim", 1024, "MLP width.")
flags.DEFINE_integer("seed", 0, "Seed of parameters and inputs.")
flags.DEFINE_string("out", None, "Output folder.")
flags.mark_flag_as_required("out")


def settings_from_flags() -> benchmarking.Settings:
  try:
    lengths = tuple(int(n) for n in FLAGS.lengths)
  except ValueError:
    raise ValueError(f"--lengths must be integers, got {','.join(FLAGS.lengths)}") from None
  return benchmarking.Settings(
      attentions=tuple(FLAGS.attentions) or az.available(),
      lengths=lengths, mode=FLAGS.mode, dtype=FLAGS.dtype,
      batch_size=FLAGS.batch_size or benchmarking.default_batch_size(),
      repeats=FLAGS.repeats, warmup=FLAGS.warmup, time_budget_s=FLAGS.time_budget_s,
      memory_limit_bytes=None if FLAGS.memory_limit_gb is None else FLAGS.memory_limit_gb * 1e9,
      num_layers=FLAGS.num_layers, emb_dim=FLAGS.emb_dim, num_heads=FLAGS.num_heads, mlp_dim=FLAGS.mlp_dim,
      attention_options=benchmarking.parse_attention_options(FLAGS.attention_options), seed=FLAGS.seed)


def main(argv):
  if len(argv) > 1:
    raise cli.HarnessError(f"unexpected arguments: {' '.join(argv[1:])}")
  load_plugins(FLAGS.plugins)   # already imported by cli.run from the command line; no-op then
  try:
    settings = settings_from_flags()
  except ValueError as e:       # unknown attention or option, bad lengths: one line, no traceback
    raise cli.HarnessError(str(e)) from e
  command = " ".join(["python -m experiments.benchmark"] + [
      shlex.quote(flag.serialize()) for flag in FLAGS.get_key_flags_for_module(sys.modules[__name__])
      if flag.present])
  write = lambda rows, plots: benchmarking.write_outputs(rows, settings, FLAGS.out, command=command, plots=plots)
  rows = benchmarking.run(settings, progress=lambda total: tqdm(total=total, unit="run", file=sys.stderr),
                          on_row=lambda rows: write(rows, plots=False))   # the tables, kept if the run dies
  paths = write(rows, plots=True)
  for kind, path in paths.items():
    logging.info("wrote %s: %s", kind, path)
  failed = [f"{r['attention']}@{r['length']}" for r in rows if r["status"] == "error"]
  if failed:
    logging.error("measurements that failed (see the log and the CSV notes): %s", ", ".join(failed))
    return 1
  return 0


if __name__ == "__main__":
  cli.run(main)
