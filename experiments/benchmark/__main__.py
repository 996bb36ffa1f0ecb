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
    python -m experiments.benchmark --mode=context_parallel --out=results/ \
        [--device_counts=1,2,4,8] [--max_length=131072] [--memory_limit_gb=2] [--lengths=4096]

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
                 only, never by running what might not fit.
  flash          the FlashAttention kernels against cuDNN and XLA.
  approximation  each approximate variant's relative error to exact attention at its
                 defaults.
  context_parallel  per variant and device count, the longest length whose Text-model train
                 step fits --memory_limit_gb per device (sequence split over `context`, or
                 fsdp where the variant has no context-parallel form), and the step time at
                 --lengths' first length against one device; on CPU the devices are simulated
                 and their times say nothing about a network.

Each mode is a file in experiments/benchmark/ with its `run_mode(values, command)` (values: the
flags, this mode's defaults filled in), named in MODES below; train and attention share
measuring.py.

Writes into --out: benchmark_<mode>.csv, .md (train mode: the paper's Table 2 layout with its
published TPU figures beside ours), .json, and _time.png / _memory.png (log-log, with the fitted
complexity exponent per variant) for train and attention; benchmark_ops.csv and .md;
capacity.md, .csv and .png; benchmark_flash.md; benchmark_approximation.md;
benchmark_context_parallel.md and .csv. Tables are rewritten
after every measurement, so a run that dies keeps what it measured. See each mode's file for how
its figures are measured. The XLA flags in use (see experiments/common/xla_flags.py) are
written into the outputs.

The flash mode on any machine with an NVIDIA GPU and a CUDA build of jax
(`pip install -U "jax[cuda12]"`, then this repository), starting no new row after 7.5 minutes:
    PYTHONUNBUFFERED=1 python -m experiments.benchmark --mode=flash --out=results/ \
        --time_budget_s=450
"""
from __future__ import annotations

import shlex
import sys
import types

from absl import flags

from experiments.benchmark import approximation, capacity, context_parallel, flash, measuring, ops
from experiments.benchmark.settings import DTYPES, REMATS
from experiments.common import command_line
from experiments.common.errors import HarnessError

FLAGS = flags.FLAGS
# --mode -> the mode's run_mode(values, command).
MODES = {"train": measuring.run_mode, "attention": measuring.run_mode, "ops": ops.run_mode,
         "capacity": capacity.run_mode, "flash": flash.run_mode,
         "approximation": approximation.run_mode, "context_parallel": context_parallel.run_mode}
# Flags whose default depends on the mode (None on the command line: this table, else GENERAL).
GENERAL = {"lengths": ["1024", "2048", "3072", "4096", "8192", "16384"], "dtype": "float32",
           "repeats": 5, "time_budget_s": 60.0, "head_dims": ["64"], "masks": ["none"]}
MODE_DEFAULTS = {
    "capacity": {"time_budget_s": 3600.0},
    "flash": {"lengths": ["1024", "2048", "4096", "8192", "16384"], "dtype": "bfloat16",
              "repeats": 10, "time_budget_s": 420.0, "head_dims": ["64", "128"],
              "masks": ["none", "causal"]},
    "approximation": {"lengths": ["1024"], "num_heads": 4},
    "context_parallel": {"lengths": ["4096"], "time_budget_s": 3600.0},
}
MASKS = ("none", "causal")


def with_mode_defaults(values) -> types.SimpleNamespace:
  """The flags' values (a dict), each one not given replaced by its default in this mode."""
  defaults = {**GENERAL, **MODE_DEFAULTS.get(values["mode"], {})}
  filled = {name: defaults.get(name) if value is None else value
            for name, value in values.items()}
  if set(filled["masks"]) - set(MASKS):
    raise HarnessError(f"--masks={','.join(filled['masks'])}: choose from {', '.join(MASKS)}")
  return types.SimpleNamespace(**filled)


def main(argv):
  if len(argv) > 1:
    raise HarnessError(f"unexpected arguments: {' '.join(argv[1:])}")
  command = " ".join(["python -m experiments.benchmark", *map(shlex.quote, sys.argv[1:])])
  return MODES[FLAGS.mode](with_mode_defaults(FLAGS.flag_values_dict()), command)


if __name__ == "__main__":
  flags.DEFINE_enum("mode", "train", tuple(MODES),
                    "train: the trainer's train step of the LRA Text model; attention: the "
                    "attention module alone; ops: attention_zoo.ops against causal full; "
                    "capacity: the longest length that fits; flash: the FlashAttention kernels; "
                    "approximation: the error to exact attention; context_parallel: the longest "
                    "length per device count.")
  flags.DEFINE_string("out", None, "Output folder.")
  flags.DEFINE_list("attentions", [], "Variants to measure (default: every registered one "
                    "the Text model, an encoder, can build, i.e. not the causal-only ones; "
                    "attention mode: those of them that are attention variants; approximation: "
                    "every one that is not exact). `full` is always measured too in train and "
                    "attention mode: it is the speed-up baseline (and, in attention mode, "
                    "jax.nn.dot_product_attention).")
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
  flags.DEFINE_float("time_budget_s", None, "Seconds of timed calls (warmup + repeats) per "
                     "program in train, attention and ops mode, compiling not counted (default "
                     "60: longer ones, and the longer lengths of that variant, are skipped); for "
                     "the whole run in capacity mode (3600: past them no more "
                     "compiles or steps) and flash mode (420: no new row after them).")
  flags.DEFINE_float("memory_limit_gb", None, "Do not run (capacity: time) programs whose "
                     "compiled memory exceeds this (default: the accelerator's memory, or half "
                     "the free host memory on CPU); context_parallel: the budget per device "
                     "(default: the device's memory; on CPU the host's, shared by its devices).")
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
  flags.DEFINE_integer("matmul_size", 4096, "Attention and ops mode: the n x n matmul whose "
                       "GFLOP/s is the limit the FLOP rates are compared with; 0: skip it.")
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
  flags.DEFINE_list("device_counts", [str(n) for n in context_parallel.DEVICE_COUNTS],
                    "Context_parallel: the device counts (simulated on CPU).")
  flags.DEFINE_list("probe_lengths", [str(n) for n in capacity.PROBE_LENGTHS],
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
  command_line.run(main)
