"""What every LRA task config shares: the `"<attention>[,<preset>]"` argument, the fields the
trainer reads, and the per-variant attention settings (with the tiny preset's scaling).

Presets:
  paper  the released LRA hyper-parameters (the paper's appendix and its released configs),
         each variant with its LRA attention settings (configs/lra/attention_settings.py).
         For a GPU / TPU.
  tiny   CPU-sized: short sequences, a small model, a few hundred steps; minutes per run.

Fields (override any with --config.<field>=value):
  task, preset, seed, data_dir, data (extra lra.load arguments), generate (sizes used when
  ListOps / Pathfinder data is missing and is generated into data_dir), batch_size,
  eval_batch_size, grad_accum_steps, num_train_steps, eval_every, checkpoint_every,
  keep_checkpoints, log_every, model (every TransformerConfig field; model.max_len is also
  the data length), optimizer (adam | adamw, betas, eps, weight decay, gradient clipping),
  schedule (LRA's learning-rate factors, e.g. "constant * linear_warmup * rsqrt_decay").
"""
from __future__ import annotations

import dataclasses

import ml_collections

import attention_zoo as az
import lra
from attention_zoo.models import TransformerConfig
from configs.lra.attention_settings import lra_attention_options

PRESETS = ("paper", "tiny")
DATA_DIRS = {"paper": "data/lra", "tiny": "data/lra_tiny"}  # tiny and paper data never mix
RSQRT = "constant * linear_warmup * rsqrt_decay"
COSINE = "constant * linear_warmup * cosine_decay"

# Attention options measured in tokens, with the smallest value the tiny preset scales them to.
# The tiny preset shortens sequences, so these shrink by the same factor: a block or window
# then covers the same fraction of the sequence as in the paper's runs.
LENGTH_OPTIONS = {"block_size": 4, "window": 4, "chunk_len": 4, "chunk_size": 4,
                  "query_chunk": 4, "num_summary": 1}


def parse_arg(arg: str | None) -> tuple[str, str]:
  """"performer" -> ("performer", "paper"); "performer,tiny" -> ("performer", "tiny")."""
  parts = [p.strip() for p in (arg or "full").split(",")]
  if len(parts) > 2 or not parts[0]:
    raise ValueError(f"config argument {arg!r}: expected '<attention>[,<preset>]', "
                     f"e.g. 'performer,tiny'")
  attention, preset = parts[0], parts[1] if len(parts) == 2 else "paper"
  if preset not in PRESETS:
    raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
  return attention, preset


def base_config(task: str, arg: str | None) -> ml_collections.ConfigDict:
  """The fields every task has, with defaults; the task file then sets its own values.

  The attention name is not checked here: a module passed with --plugins may register it
  after this config is built. The trainer checks it.
  """
  attention, preset = parse_arg(arg)
  spec = lra.task_spec(task)
  config = ml_collections.ConfigDict()
  config.task = task
  config.preset = preset
  config.seed = 0
  config.data_dir = DATA_DIRS[preset]
  config.data = ml_collections.ConfigDict()       # extra lra.load arguments (pixel tasks)
  config.generate = ml_collections.ConfigDict()   # generator sizes (listops, pathfinder, pathx)

  config.batch_size = 32
  config.eval_batch_size = 0                      # 0 = batch_size
  config.grad_accum_steps = 1                     # batch_size is split into this many micro-batches
  config.num_train_steps = 1000
  config.eval_every = 100                         # validation accuracy picks the best checkpoint
  config.checkpoint_every = 0                     # 0 = eval_every
  config.keep_checkpoints = 3
  config.log_every = 50

  defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig)
              if f.default is not dataclasses.MISSING}
  config.model = ml_collections.ConfigDict(defaults)
  config.model.qkv_dim = ml_collections.config_dict.placeholder(int)
  config.model.num_kv_heads = ml_collections.config_dict.placeholder(int)
  config.model.update(attention=attention, vocab_size=spec.vocab_size, max_len=spec.max_len,
                      num_classes=spec.num_classes, dropout_rate=0.1, attention_dropout_rate=0.1)
  config.model.attention_options = ml_collections.ConfigDict()  # filled by finalize()

  config.optimizer = ml_collections.ConfigDict(dict(
      name="adamw",            # adamw: decoupled weight decay, as flax.optim.Adam in LRA
      b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.0,
      grad_clip_norm=0.0))     # global-norm clipping; 0 = off
  config.schedule = ml_collections.ConfigDict(dict(
      factors=RSQRT, base_learning_rate=0.05, warmup_steps=1000,
      steps_per_cycle=0))      # cosine_decay's period; 0 = num_train_steps
  return config


def finalize(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Fills model.attention_options and applies the per-variant rules; call last."""
  attention, task = config.model.attention, config.task
  known = attention in az.available()
  spec = az.spec(attention) if known else None
  # Every option of the variant (so any is overridable), then its LRA setting for this task.
  # None-valued defaults stay out: a config field needs a type to be overridden.
  options = {k: v for k, v in (spec.options if known else {}).items()
             if k not in ("scale", "dropout_rate") and v is not None}
  options.update(lra_attention_options(attention, task))
  if config.preset == "tiny":
    options = scale_length_options(options, config.model.max_len / lra.task_spec(task).max_len)
  config.model.attention_options = ml_collections.ConfigDict(options)
  if known and not spec.supports_dropout:
    config.model.attention_dropout_rate = 0.0   # the variant forms no attention weights to drop
  return config


def scale_length_options(options: dict, ratio: float) -> dict:
  """Token-counted options times `ratio` (rounded, at least LENGTH_OPTIONS' minimum)."""
  if ratio >= 1:
    return dict(options)
  scaled = dict(options)
  for name, minimum in LENGTH_OPTIONS.items():
    value = options.get(name)
    if isinstance(value, int) and not isinstance(value, bool):
      scaled[name] = max(minimum, round(value * ratio))
  return scaled
