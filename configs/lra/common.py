"""What every LRA task config shares: the `"<attention>[,<preset>]"` argument, the fields the
trainer reads, and the three presets.

Presets:
  paper  the released LRA code as it ran (google-research/long-range-arena, per-model configs at
         HEAD): each task's released hyper-parameters, each variant's released dimensions and
         attention settings, and every quirk of the released code that changes results, each
         behind a named field. docs/lra_fidelity.md lists every value and every difference.
  fair   the same data, budget, schedule and optimiser with every quirk fixed and every variant
         on the task's Transformer dimensions: the comparison to publish.
  tiny   CPU-sized `fair`: short sequences, a small model, a few hundred steps; minutes per run.

A task file (configs/lra/<task>.py) holds its released values (`RELEASED`: the base config as
`"shared"`, then what each model's file changes) and its tiny sizes; `task_config` turns them
into an ml_collections config of plain values. What depends on the attention variant is
resolved when the model is built (`resolve_attention`, called by experiments/build.py):
its options (the preset's settings for that variant, token-counted ones scaled to a shortened
`model.max_len`, then any option set in the config), and `model.attention_ignores_padding`
when left at None. So `--config.model.attention=...`, `--config.model.attention_options.<x>=...`
and `--config.model.max_len=...` each give what they say. The preset and the task are fixed
by the config argument and file, and cannot be overridden.

Fields (override any with --config.<field>=value):
  task, preset, seed, data_dir, data (extra lra.load arguments), generate (sizes used when
  the tiny preset generates missing ListOps / Pathfinder data), generate_data (True: generate
  them into a data_dir other than the tiny preset's own), batch_size, eval_batch_size,
  grad_accum_steps, num_train_steps, eval_every, checkpoint_every, keep_checkpoints, log_every,
  max_skipped_fraction (the share of unreadable source examples a run accepts),
  check_memory (refuse to start a run whose compiled train step needs more memory than the
  device has),
  model (every TransformerConfig field; model.max_len is also the data length; option values
  left at None in model.attention_options come from the preset), optimizer (adam | adamw,
  betas, eps, weight decay, gradient clipping), schedule (LRA's learning-rate factors, e.g.
  "constant * linear_warmup * rsqrt_decay").
"""
from __future__ import annotations

import dataclasses
import importlib
import math

import ml_collections

import attention_zoo as az
import lra
from attention_zoo.models import TransformerConfig

PRESETS = ("paper", "fair", "tiny")
DATA_DIRS = {"paper": "data/lra", "fair": "data/lra", "tiny": "data/lra_tiny"}
RSQRT = "constant * linear_warmup * rsqrt_decay"
COSINE = "constant * linear_warmup * cosine_decay"
# The models of the LRA paper, by registry name (the Transformer is `full`).
LRA_VARIANTS = ("full", "local", "sparse_transformer", "longformer", "linformer", "reformer",
                "sinkhorn", "synthesizer", "bigbird", "linear_transformer", "performer")
# An attention-option value resolved when the model is built: the released Reformer multiplied
# its logits by sqrt(head_dim) instead of dividing by it.
SQRT_HEAD_DIM = "sqrt(head_dim)"

# Attention options measured in tokens, with the smallest value a shortened sequence scales them
# to: a block or window then covers the same fraction of the sequence as at the task's length.
LENGTH_OPTIONS = {"block_size": 4, "window": 4, "chunk_len": 4, "chunk_size": 4,
                  "query_chunk": 4, "num_summary": 1}

# -- what the released code ran, for every task ----------------------------------------------
# Quirks of the released encoders, for every variant: token embeddings ~ N(0, 1), and a padding
# mask `inputs > 0`, which also masks every black pixel of Image, Pathfinder and Path-X.
RELEASED_QUIRKS = {"model.embed_init_std": 1.0, "model.zero_token_is_padding": True}
# Each variant's attention settings as the released code ran them. "model.*" keys here are
# attention-dependent fields resolved at build time (see module docstring).
RELEASED_ATTENTION = {
    "full": {},
    "local": {"attention.block_size": 50},
    "sparse_transformer": {"attention.block_size": 50, "attention.num_summary": 10},
    "longformer": {"attention.window": 256, "attention.num_global_tokens": 0},
    "bigbird": {"attention.block_size": 64, "attention.num_window_blocks": 3,
                "attention.num_random_blocks": 3, "attention.dropout_rate": 0.0,
                "model.attention_ignores_padding": True},
    "linformer": {"attention.k": 16, "attention.share": "kv",
                  "model.attention_ignores_padding": True},
    "reformer": {"attention.n_hashes": 1, "attention.n_buckets": 10, "attention.num_chunks": 10,
                 "attention.scale": SQRT_HEAD_DIM, "attention.dropout_rate": 0.0,
                 "model.attention_ignores_padding": True},
    # "generalized" attention: relu(x) + 0.001 on the unscaled q and k, no random features.
    "performer": {"attention.kernel": "relu", "attention.features": "deterministic",
                  "attention.scale": 1.0, "model.attention_ignores_padding": True},
    "sinkhorn": {"attention.block_size": 50},
    "synthesizer": {"attention.mode": "random", "attention.mixture": "sum"},
    "linear_transformer": {"model.attention_ignores_padding": True},
}
# `fair` and `tiny`: the quirks fixed, LRA's sizes kept, each variant as its paper defines it.
FAIR_ATTENTION = {
    "full": {},
    "local": {"attention.block_size": 50},
    "sparse_transformer": {"attention.block_size": 50, "attention.num_summary": 10},
    "longformer": {"attention.window": 256, "attention.num_global_tokens": 1},
    "bigbird": {"attention.block_size": 64, "attention.num_window_blocks": 3,
                "attention.num_random_blocks": 3},
    "linformer": {"attention.k": 16},
    "reformer": {"attention.n_hashes": 1},
    "performer": {"attention.kernel": "softmax", "attention.nb_features": 256},
    "sinkhorn": {"attention.block_size": 50},
    "synthesizer": {"attention.mode": "random"},
    "linear_transformer": {},
}
# Not in the LRA paper: the Nyströmformer paper's own LRA runs (64 landmarks, a depthwise
# convolution of width 35 on the values), in every preset.
EXTRA_ATTENTION = {"nystromformer": {"attention.num_landmarks": 64,
                                     "attention.conv_kernel_size": 35}}


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


def base_config(task: str, attention: str, preset: str) -> ml_collections.ConfigDict:
  """The fields every task has, with neutral defaults; `task_config` fills in the preset.

  The attention name is not checked here: a module passed with --plugins may register it
  after this config is built. The trainer checks it.
  """
  spec = lra.task_spec(task)
  config = ml_collections.ConfigDict()
  config.task = task
  config.preset = preset
  config.seed = 0
  config.data_dir = DATA_DIRS[preset]
  config.data = ml_collections.ConfigDict()       # extra lra.load arguments (pixel tasks)
  config.generate = ml_collections.ConfigDict()   # generator sizes (tiny listops/pathfinder/pathx)
  config.generate_data = False   # True: tiny generates into any data_dir, not only its own

  config.batch_size = 32
  config.eval_batch_size = 0                      # 0 = batch_size
  config.grad_accum_steps = 1                     # batch_size is split into this many micro-batches
  config.num_train_steps = 1000
  config.eval_every = 100                         # validation accuracy picks the best checkpoint
  config.checkpoint_every = 0                     # 0 = eval_every
  config.keep_checkpoints = 3
  config.log_every = 50
  config.max_skipped_fraction = 0.01              # more unreadable source examples: refuse to start
  config.check_memory = True                      # step larger than the device: refuse to start

  model = {}
  for field in dataclasses.fields(TransformerConfig):
    if field.name == "attention_options":
      continue
    default = field.default
    # A None default needs a typed placeholder to be overridable from the command line.
    model[field.name] = _placeholder(field.type) if default is None else default
  config.model = ml_collections.ConfigDict(model)
  config.model.update(attention=attention, vocab_size=spec.vocab_size, max_len=spec.max_len,
                      num_classes=spec.num_classes)
  # Resolved at build time from the preset unless set here (None = the preset's value).
  config.model.attention_ignores_padding = _placeholder("bool")
  config.model.attention_options = ml_collections.ConfigDict(_option_placeholders(attention))

  config.optimizer = ml_collections.ConfigDict(dict(
      name="adamw",            # adamw: decoupled weight decay, as flax.optim.Adam in LRA
      b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.0,
      grad_clip_norm=0.0))     # global-norm clipping; 0 = off
  config.schedule = ml_collections.ConfigDict(dict(
      factors=RSQRT, base_learning_rate=0.05, warmup_steps=1000,
      steps_per_cycle=0))      # cosine_decay's period; 0 = num_train_steps
  return config


def _placeholder(type_name: str):
  kinds = {"int": int, "float": float, "bool": bool, "str": str}
  name = str(type_name).split("|")[0].strip()
  return ml_collections.config_dict.placeholder(kinds[name])


def _option_placeholders(attention: str) -> dict:
  """One None field per option of the variant, typed by its declaration (dropout is
  model.attention_dropout_rate)."""
  if attention not in az.available():
    return {}
  return {name: ml_collections.config_dict.placeholder(kind)
          for name, kind in az.spec(attention).option_types.items() if name != "dropout_rate"}


def task_config(task: str, arg: str | None, *, released: dict, tiny: dict,
                paper_changes: dict | None = None) -> ml_collections.ConfigDict:
  """The config of `task` for "<attention>[,<preset>]".

  released: {"shared": {...}, "<variant>": {...}} in dotted field names ("model.emb_dim",
      "attention.block_size", ...): what the released code ran (its base config, then what each
      model's file changes). "attention.*" keys are resolved at build time.
  tiny: the tiny preset's values on top of the fair ones.
  paper_changes: {"<variant>": {"field": (value, reason)}}: where `paper` departs from the
      released value, and why (the released value cannot run, or its authors corrected it).
  """
  attention, preset = parse_arg(arg)
  config = base_config(task, attention, preset)
  set_fields(config, preset_fields(task, attention, preset, released=released, tiny=tiny,
                                   paper_changes=paper_changes or {}))
  return config


def preset_fields(task: str, attention: str, preset: str, *, released: dict, tiny: dict,
                  paper_changes: dict) -> dict:
  """The preset's values of every config field it sets, in dotted names (attention-dependent
  settings excluded: see `attention_settings`)."""
  # A variant without a released file (one not in the LRA paper) takes the Transformer's.
  own = released.get(attention, {} if attention in LRA_VARIANTS else released.get("full", {}))
  if preset == "paper":
    fields = {**released["shared"], **own, **RELEASED_QUIRKS}
    fields.update({k: value for k, (value, _) in paper_changes.get(attention, {}).items()})
  else:
    fields = {**released["shared"], **released.get("full", {})}
    if preset == "tiny":
      fields.update(tiny)
  return {k: v for k, v in fields.items() if not k.startswith("attention.")}


def set_fields(config: ml_collections.ConfigDict, fields: dict) -> None:
  for dotted, value in fields.items():
    *parents, name = dotted.split(".")
    node = config
    for parent in parents:
      node = node[parent]
    node[name] = value


def task_module(task: str):
  """The config file of a task: configs/lra/<task>.py, configs/mad/<task>.py for a MAD task,
  or configs/<task>.py for another diagnostic."""
  package = ("configs.lra" if task in lra.available_tasks() else
             "configs.mad" if task in lra.mad_tasks() else "configs")
  return importlib.import_module(f"{package}.{task}")


def attention_settings(task: str, attention: str, preset: str) -> dict:
  """The preset's attention-dependent settings for a variant, in dotted names: "attention.*"
  options and "model.*" fields (before length scaling and config overrides). A diagnostic's
  config file gives its own (ATTENTION_SETTINGS)."""
  module = task_module(task)
  if hasattr(module, "ATTENTION_SETTINGS"):
    return dict(module.ATTENTION_SETTINGS.get(attention, {}))
  task_released = module.RELEASED.get(attention, {})
  if preset == "paper":
    settings = {**RELEASED_ATTENTION.get(attention, {}), **EXTRA_ATTENTION.get(attention, {})}
    settings.update({k: v for k, v in task_released.items() if k.startswith("attention.")})
  else:   # LRA's task-specific block sizes (64 on the pixel tasks) are kept
    settings = {**FAIR_ATTENTION.get(attention, {}), **EXTRA_ATTENTION.get(attention, {})}
    settings.update({k: v for k, v in task_released.items()
                     if k.startswith("attention.") and k.split(".")[1] in LENGTH_OPTIONS})
  return settings


def resolve_attention(config) -> tuple[dict, dict]:
  """(attention options, attention-dependent model fields) for the model built from `config`.

  Options: the preset's settings for config.model.attention, token-counted ones scaled when
  model.max_len is shorter than the task's length, `scale` markers made numbers, then every
  option set in config.model.attention_options (those are taken as they are).
  """
  attention, task = config.model.attention, config.task
  settings = attention_settings(task, attention, config.preset)
  options = {k.split(".", 1)[1]: v for k, v in settings.items() if k.startswith("attention.")}
  options = scale_length_options(options, config.model.max_len / lra.task_spec(task).max_len)
  if options.get("scale") == SQRT_HEAD_DIM:
    qkv_dim = config.model.qkv_dim or config.model.emb_dim
    options["scale"] = math.sqrt(qkv_dim // config.model.num_heads)
  explicit = {k: v for k, v in config.model.attention_options.items() if v is not None}
  if attention in az.available():
    accepted = az.spec(attention).options
    unknown = sorted(set(explicit) - set(accepted))
    if unknown:
      raise ValueError(f"model.attention_options sets {', '.join(unknown)}, which "
                       f"{attention} does not accept; its options: {', '.join(sorted(accepted))}")
  options.update(explicit)
  model_fields = {k.split(".", 1)[1]: v for k, v in settings.items() if k.startswith("model.")}
  model_fields = {k: v for k, v in model_fields.items() if config.model.get(k) is None}
  return options, model_fields


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
