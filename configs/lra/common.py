"""What every LRA task config shares: the `"<attention>[,<preset>]"` argument, the fields the
trainer reads, and the tables of the three presets. Plain values only: this file imports
nothing from the project outside configs/; experiments/train/ checks a config once and turns
it into the model, the data and the optimizer.

Presets:
  paper  the released LRA code as it ran (google-research/long-range-arena, per-model configs at
         HEAD): each task's released hyper-parameters, each variant's released dimensions and
         attention settings, and every quirk of the released code that changes results, each
         behind a named field. docs/lra_fidelity.md lists every value and every difference.
  fair   the same data, budget, schedule and optimiser with every quirk fixed and every variant
         on the task's Transformer dimensions: the comparison to publish.
  tiny   CPU-sized `fair`: short sequences, a small model, a few hundred steps; minutes per run.
  light       the Nyströmformer paper's LRA protocol (Xiong et al. 2021; mlpen/Nystromformer,
              LRA/code) as its released code ran it: a 2-layer model of width 64 for every
              variant, its optimiser, schedule, evaluation and data, and every quirk of that
              code that changes results, each behind a named field (ListOps only).
  light_fair  the same protocol with every quirk fixed.

A task file (configs/lra/<task>.py) declares its values once, `VALUES = TaskValues(...)`
(configs/task_values.py): its released values (the base config as "shared", then what each
model's file changes), where `paper` departs from them and its tiny sizes, all in dotted config
field names; ListOps also the light protocol's values (each with where the released code sets
it) and what `light_fair` fixes (each with the quirk). `task_config` returns the whole run:
the task's values, the preset's, then the variant's settings (`task_layers`: its options,
model.attention_ignores_padding, and under `paper` what the variant's released file changes),
applied by configs/presets.py, which also scales the token-counted options to the preset's
model.max_len and records each field's source. A value set after get_config wins; the variant
is named in the argument, not overridden (docs/harness.md, Configs).

Fields (override any with --config.<field>=value):
  task, preset, model.attention (fixed by the config file and argument), made (what get_config
  applied: configs/presets.py), seed, data_dir, data (extra lra.load
  arguments), generate (sizes used when the tiny preset generates missing ListOps / Pathfinder
  data), generate_data (True: generate them into a data_dir other than the tiny preset's own),
  batch_size, eval_batch_size, grad_accum_steps, num_train_steps, eval_every, eval_batches,
  eval_stream, test_drop_last, checkpoint_every, keep_checkpoints, log_every,
  max_skipped_fraction, check_memory, model
  (every TransformerConfig field; model.max_len is also the data length), optimizer,
  schedule, mesh (the device mesh). The comments in `base_config` say what each means.
"""
from __future__ import annotations

import ml_collections
from ml_collections.config_dict import placeholder

from configs import presets as presets_lib
from configs.presets import LENGTH_OPTIONS, OPTIONS, attention_options
from configs.task_values import TaskValues

PRESETS = ("paper", "fair", "tiny", "light", "light_fair", "grazzi")
LRA_PRESETS = PRESETS[:5]   # grazzi: the formal languages' (configs/formal_languages.py)
LIGHT_PRESETS = ("light", "light_fair")
DATA_DIRS = {"paper": "data/lra", "fair": "data/lra", "tiny": "data/lra_tiny", "light": "data/lra",
             "light_fair": "data/lra", "grazzi": ""}
RSQRT = "constant * linear_warmup * rsqrt_decay"
COSINE = "constant * linear_warmup * cosine_decay"

def model_size(layers, heads, emb, qkv, mlp, **model_fields) -> dict:
  """An encoder's size as config fields, and any other `model.` field given by name."""
  return {"model.num_layers": layers, "model.num_heads": heads, "model.emb_dim": emb,
          "model.qkv_dim": qkv, "model.mlp_dim": mlp,
          **{f"model.{field}": value for field, value in model_fields.items()}}


# The base config the released ListOps, Text and Retrieval files share (train.py passes no
# dropout rates, so the encoders' 0.1 apply; CLS pooling, sinusoidal positions, the rsqrt
# schedule at 0.05, weight decay 0.1, batch 32); each task adds its size, length and steps.
RELEASED_TEXT_BASE = {
    "model.dropout_rate": 0.1, "model.attention_dropout_rate": 0.1, "model.pooling": "cls",
    "model.positions": "sinusoidal", "batch_size": 32, "optimizer.weight_decay": 0.1,
    "schedule.factors": RSQRT, "schedule.base_learning_rate": 0.05,
}
# The text tasks' tiny model: one layer of width 32, two heads.
TINY_TEXT_MODEL = model_size(1, 2, 32, 32, 64)
# The released Sinkhorn encoder pools by MEAN only: with a config's CLS it raises ValueError.
SINKHORN_MEAN_POOLING = {"sinkhorn": {"model.pooling": (
    "mean", "the released Sinkhorn encoder supports MEAN pooling only (CLS raises ValueError)")}}

# The models of the LRA paper, by registry name (the Transformer is `full`).
LRA_VARIANTS = ("full", "local", "sparse_transformer", "longformer", "linformer", "reformer",
                "sinkhorn", "synthesizer", "bigbird", "linear_transformer", "performer")
# Option values computed when the model is built: the released Reformer multiplied its logits
# by sqrt(head_dim) instead of dividing by it; the Nyströmformer code's Performer scaled q and k
# by head_dim^-1/4 twice, so its logits were q·k / head_dim.
SQRT_HEAD_DIM = "sqrt(head_dim)"
INVERSE_HEAD_DIM = "1/head_dim"

# -- each variant's attention settings, for every task ---------------------------------------
# Quirks of the released encoders, for every variant: token embeddings ~ N(0, 1), and a padding
# mask `inputs > 0`, which also masks every black pixel of Image, Pathfinder and Path-X.
RELEASED_QUIRKS = {"model.embed_init_std": 1.0, "model.zero_token_is_padding": True}
# `paper`: each variant's attention settings as the released code ran them.
RELEASED_ATTENTION = {
    "full": {},
    "local": {"model.attention_options.block_size": 50},
    "sparse_transformer": {"model.attention_options.block_size": 50,
                           "model.attention_options.num_summary": 10},
    "longformer": {"model.attention_options.window": 256,
                   "model.attention_options.num_global_tokens": 0},
    "bigbird": {"model.attention_options.block_size": 64,
                "model.attention_options.num_window_blocks": 3,
                "model.attention_options.num_random_blocks": 3,
                "model.attention_options.dropout_rate": 0.0,
                "model.attention_ignores_padding": True},
    "linformer": {"model.attention_options.k": 16, "model.attention_options.share": "kv",
                  "model.attention_ignores_padding": True},
    "reformer": {"model.attention_options.n_hashes": 1, "model.attention_options.n_buckets": 10,
                 "model.attention_options.num_chunks": 10,
                 "model.attention_options.scale": SQRT_HEAD_DIM,
                 "model.attention_options.dropout_rate": 0.0,
                 "model.attention_ignores_padding": True},
    # "generalized" attention: relu(x) + 0.001 on the unscaled q and k, no random features.
    "performer": {"model.attention_options.kernel": "relu",
                  "model.attention_options.features": "deterministic",
                  "model.attention_options.scale": 1.0, "model.attention_ignores_padding": True},
    "sinkhorn": {"model.attention_options.block_size": 50},
    "synthesizer": {"model.attention_options.mode": "random",
                    "model.attention_options.mixture": "sum"},
    "linear_transformer": {"model.attention_ignores_padding": True},
}
# `fair` and `tiny`: the quirks fixed, LRA's sizes kept, each variant as its paper defines it.
FAIR_ATTENTION = {
    "full": {},
    "local": attention_options(block_size=50),
    "sparse_transformer": attention_options(block_size=50, num_summary=10),
    "longformer": attention_options(window=256, num_global_tokens=1),
    "bigbird": attention_options(block_size=64, num_window_blocks=3, num_random_blocks=3),
    "linformer": attention_options(k=16),
    "reformer": attention_options(n_hashes=1),
    "performer": attention_options(kernel="softmax", nb_features=256),
    "sinkhorn": attention_options(block_size=50),
    "synthesizer": attention_options(mode="random"),
    "linear_transformer": {},
}
# Not in the LRA paper: the Nyströmformer paper's own LRA runs (64 landmarks, a depthwise
# convolution of width 35 on the values), in every preset.
EXTRA_ATTENTION = {"nystromformer": {"model.attention_options.num_landmarks": 64,
                                     "model.attention_options.conv_kernel_size": 35}}


def base_config(task: str, attention: str, preset: str) -> ml_collections.ConfigDict:
  """The fields every task has, with neutral defaults; a task's get_config sets its values.

  The attention name is not checked here: a module passed with --plugins may register it.
  The command line checks it before the run starts.
  """
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
  config.length_bucket = 0                        # > 0: micro-batches of rows sorted by length,
                                                  # each cut to a multiple of this (classifiers;
                                                  # exact, checked at the start; see
                                                  # experiments/train/steps.py)
  config.num_train_steps = 1000
  config.eval_every = 100                         # validation accuracy picks the best checkpoint
  config.eval_batches = 0                         # batches per validation; 0 = the whole split
  config.eval_stream = False                      # True: validation k reads batches
                                                  # [k·eval_batches, (k+1)·eval_batches) of an
                                                  # endless reshuffled stream; False: the
                                                  # split's first eval_batches batches
  config.test_drop_last = False                   # True: test on the full batches of one shuffled
                                                  # pass (the rest of the split is never tested)
  config.checkpoint_every = 0                     # 0 = eval_every
  config.keep_checkpoints = 3
  config.log_every = 50
  config.max_skipped_fraction = 0.01              # more unreadable source examples: refuse to start
  config.check_memory = True                      # step larger than the device: refuse to start

  # attention_models.TransformerConfig, field by field (tests/experiments/test_harness_configs.py
  # checks that the two agree).
  config.model = ml_collections.ConfigDict()
  config.model.attention = attention
  # The variant's options by name, e.g. block_size: the variant's settings for the task and
  # preset (configs/presets.py); an option the config leaves out takes the variant's default.
  config.model.attention_options = ml_collections.ConfigDict()
  config.model.vocab_size = 256
  config.model.max_len = 512                      # also the length the data is cut or padded to
  config.model.num_layers = 2
  config.model.emb_dim = 64
  config.model.num_heads = 4
  config.model.num_kv_heads = placeholder(int)    # None = num_heads (MHA); 1 = MQA
  config.model.qkv_dim = placeholder(int)         # None = emb_dim
  config.model.mlp_dim = 128
  config.model.dropout_rate = 0.1
  config.model.attention_dropout_rate = 0.0
  config.model.cross_attention = "full"
  config.model.positions = "sinusoidal"           # sinusoidal | learned | rope | alibi | none
  config.model.pooling = "cls"                    # cls | mean | padded_mean (classifiers)
  config.model.num_classes = 2
  config.model.interaction = "nli"                # dual encoder: [u, v, u*v, u-v] | concat
  config.model.pre_ln = True
  config.model.dtype = "float32"                  # compute dtype; parameters stay float32
  config.model.embed_init_std = placeholder(float)   # None = 1/sqrt(emb_dim)
  config.model.short_conv = 0                     # causal depthwise conv before attention; 0 = none
  config.model.zero_token_is_padding = False      # LRA's `inputs > 0` mask (a released quirk)
  config.model.attention_ignores_padding = False  # the variant sees every key (a released quirk)
  config.model.gelu_approximate = True            # the MLP's GELU: tanh approximation, or exact
  config.model.layer_norm_epsilon = 1e-6
  config.model.share_attention_across_layers = False   # one set of the variant's own parameters
  config.model.remat = "none"                     # none | block | dots
  config.model.output_gate = "none"               # none | headwise | elementwise (attention)
  config.model.canon = ""                         # Canon layers at points of "ABCD"; "" = none

  config.optimizer = ml_collections.ConfigDict()
  config.optimizer.name = "adamw"                 # adamw: decoupled weight decay (LRA's) | adam
  config.optimizer.b1 = 0.9
  config.optimizer.b2 = 0.98
  config.optimizer.eps = 1e-9
  config.optimizer.weight_decay = 0.0
  config.optimizer.grad_clip_norm = 0.0           # global-norm clipping; 0 = off
  config.schedule = ml_collections.ConfigDict()
  config.schedule.factors = RSQRT                 # LRA's learning-rate factors, multiplied
  config.schedule.base_learning_rate = 0.05
  config.schedule.warmup_steps = 1000
  config.schedule.steps_per_cycle = 0             # cosine_decay's period, one_cycle's length;
                                                  # 0 = num_train_steps
  config.schedule.div_factor = 25.0               # one_cycle: starts at 1 / div_factor of the peak
  config.schedule.final_div_factor = 1e4          # one_cycle: ends at 1 / (div * final_div)
  config.schedule.cycle_b1 = False                # one_cycle: Adam's β1 cycles max_b1 -> min_b1 ->
  config.schedule.min_b1 = 0.85                   # max_b1 against the rate (PyTorch's
  config.schedule.max_b1 = 0.95                   # cycle_momentum); optimizer.b1 is then unused
  # The device mesh (experiments/train/mesh.py): data × fsdp × context = the device count.
  config.mesh = ml_collections.ConfigDict()
  config.mesh.data = -1                           # splits the batch; -1 = the devices left
  config.mesh.fsdp = 1                            # splits the batch, parameters, optimiser state
  config.mesh.context = 1                         # splits the sequence (context parallelism)
  return config


def task_config(values: TaskValues, arg: str | None) -> ml_collections.ConfigDict:
  """The whole config of the LRA task whose file declares `values` (configs/task_values.py),
  for "<attention>[,<preset>]": the task's values, the preset's, then the variant's settings
  (configs/presets.py applies them and scales the token-counted options)."""
  presets = LRA_PRESETS if values.light is not None else tuple(
      p for p in LRA_PRESETS if p not in LIGHT_PRESETS)
  attention, preset = presets_lib.parse_arg(values.task, arg, presets)
  config = base_config(values.task, attention, preset)
  return presets_lib.apply(config, task_layers(values, attention, preset),
                           task_len=values.max_len)


def task_layers(values: TaskValues, variant: str, preset: str) -> list[tuple[str, dict]]:
  """The layers of an LRA task's config, [(source, {dotted field: value})], in order."""
  task = ("task", values.fields)
  if preset in LIGHT_PRESETS:
    return [task, (f"preset {preset}", light_values(values.light, values.light_fixes,
                                                     "shared", preset)),
            ("variant settings", light_values(values.light, values.light_fixes, variant,
                                              preset))]
  if preset == "paper":
    changes = values.paper_changes.get(variant, {})
    return [task, ("preset paper", {**values.released["shared"], **RELEASED_QUIRKS}),
            ("variant settings", {**released_values(values, variant),
                                  **EXTRA_ATTENTION.get(variant, {}),
                                  **{field: value for field, (value, _) in changes.items()}})]
  # LRA's task-specific block sizes (64 on the pixel tasks) are kept.
  task_blocks = {field: value for field, value in values.released.get(variant, {}).items()
                 if field.startswith(OPTIONS) and field[len(OPTIONS):] in LENGTH_OPTIONS}
  layers = [task, ("preset fair", {**values.released["shared"],
                                   **values.released.get("full", {})}),
            ("variant settings", {**FAIR_ATTENTION.get(variant, {}),
                                  **EXTRA_ATTENTION.get(variant, {}), **task_blocks})]
  return layers + ([("preset tiny", values.tiny)] if preset == "tiny" else [])


def released_values(values: TaskValues, variant: str) -> dict:
  """What the released LRA code ran for `variant` on the task of `values`, in dotted config
  fields: the task's base config, the quirks of every released encoder, the variant's attention
  settings, then what the variant's file changes. A variant without a released file takes the
  Transformer's."""
  released = values.released
  own = released.get(variant, {} if variant in LRA_VARIANTS else released.get("full", {}))
  return {**released["shared"], **RELEASED_QUIRKS, **RELEASED_ATTENTION.get(variant, {}), **own}


def light_values(light: dict, light_fixes: dict, variant: str, preset: str) -> dict:
  """The light presets' values for `variant` ("shared": those of every variant), in dotted
  fields: the released light code's (`light`), and under light_fair its quirks fixed."""
  tables = [light] + ([light_fixes] if preset == "light_fair" else [])
  keys = ["shared"] + ([variant] if variant != "shared" else [])
  return {field: value for table in tables for key in keys
          for field, (value, _) in table.get(key, {}).items()}
