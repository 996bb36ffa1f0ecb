"""The six MAD tasks (synthetic.mad) trained as causal language models, one config file per task
(configs/mad/<task>.py: `get_config("<attention>,<preset>")`).

COMMAND: python -m experiments.reproduce --preset=tiny --tasks=mad \
             --attentions=full,sliding_window,linear_transformer,performer --seeds=0,1
         python -m experiments.train --config=configs/mad/selective_copying.py:full,tiny \
             --workdir=runs/tiny/selective_copying

Two presets, one recipe for every variant and every task (only the data differ by task):
  tiny   CPU scale: MAD's tasks at 64 tokens (compression and memorization at MAD's 32), a
         2-layer decoder (emb 64, 2 heads, RoPE) with a short causal convolution (kernel 3)
         beside attention as in configs/mqar.py, 600 steps of 64 sequences.
  paper  MAD's baseline task settings (configs/tasks/*.yml of the released mad-lab code) and
         its training: 2 blocks of width 128 (16 heads, RoPE, no convolution), AdamW at 5e-4
         without weight decay or clipping, cosine decay, batch 128, 200 epochs of the training
         examples.
docs/mad.md lists where each departs from MAD. Variants that cannot be causal are not
applicable.
"""
from configs import mqar, presets
from configs.lra import common
from configs.task_values import TaskValues

# Windows and blocks of 8 tokens, as for MQAR: local patterns see only the last few pairs.
ATTENTION_SETTINGS = mqar.ATTENTION_SETTINGS
MAD_PRESETS = ("paper", "tiny")   # paper when none is named, as for the LRA tasks

# MAD's baseline data settings per task (paper), and the tiny preset's changes to them.
PAPER_DATA = {
    "compression": {"data.vocab_size": 16, "model.max_len": 32},
    "fuzzy_in_context_recall": {"data.vocab_size": 16, "data.k_motif_size": 3,
                                "data.v_motif_size": 3, "model.max_len": 128},
    "in_context_recall": {"data.vocab_size": 16, "model.max_len": 128},
    "memorization": {"data.vocab_size": 256, "data.num_train": 256, "model.max_len": 32},
    "noisy_in_context_recall": {"data.vocab_size": 32, "data.noise_vocab_size": 16,
                                "data.frac_noise": 0.2, "model.max_len": 128},
    "selective_copying": {"data.vocab_size": 16, "data.num_tokens_to_copy": 16,
                          "model.max_len": 256},
}
TINY_DATA = {
    "fuzzy_in_context_recall": {"model.max_len": 64},
    "in_context_recall": {"model.max_len": 64},
    "noisy_in_context_recall": {"model.max_len": 64},
    "selective_copying": {"data.num_tokens_to_copy": 8, "model.max_len": 64},
}
PAPER_EPOCHS, PAPER_BATCH = 200, 128

SHARED = {
    "data_dir": "",   # generated in memory
    "data.num_train": 12_800, "data.num_validation": 1_280, "data.num_test": 1_280,
    "model.dropout_rate": 0.0, "model.attention_dropout_rate": 0.0, "model.positions": "rope",
    "schedule.factors": common.COSINE,
}
PRESET_FIELDS = {
    "tiny": {
        "model.num_layers": 2, "model.emb_dim": 64, "model.qkv_dim": 64, "model.num_heads": 2,
        "model.mlp_dim": 128, "model.short_conv": 3,
        "batch_size": 64, "num_train_steps": 600, "eval_every": 200, "log_every": 50,
        "optimizer.weight_decay": 0.1, "optimizer.grad_clip_norm": 1.0,
        "schedule.base_learning_rate": 3e-3, "schedule.warmup_steps": 60,
    },
    "paper": {
        "model.num_layers": 2, "model.emb_dim": 128, "model.qkv_dim": 128, "model.num_heads": 16,
        "model.mlp_dim": 512, "model.short_conv": 0,
        "batch_size": PAPER_BATCH, "eval_every": 1_000, "log_every": 100,
        "optimizer.weight_decay": 0.0, "optimizer.grad_clip_norm": 0.0,
        "schedule.base_learning_rate": 5e-4, "schedule.warmup_steps": 0,
    },
}


def values(task: str) -> TaskValues:
  """What configs/mad/<task>.py declares (configs/task_values.py): the windows and blocks per
  variant; the presets' values are this file's tables."""
  return TaskValues(task, attention_settings=ATTENTION_SETTINGS,
                    length=PAPER_DATA[task]["model.max_len"])


def task_config(values: TaskValues, arg=None):
  """The config of the MAD task whose file declares `values` for "<attention>[,<preset>]"
  (preset paper by default, as for the LRA tasks)."""
  task = values.task
  attention, preset = presets.parse_arg(task, arg, MAD_PRESETS)
  config = common.base_config(task, attention, preset)
  fields = {**SHARED, **PRESET_FIELDS[preset], **PAPER_DATA[task]}
  if preset == "tiny":
    fields.update(TINY_DATA.get(task, {}))
  else:   # 200 epochs of the training examples
    examples = fields["data.num_train"]
    fields["num_train_steps"] = PAPER_EPOCHS * max(1, examples // PAPER_BATCH)
  vocab_size = fields["data.vocab_size"]
  fields.update({"model.vocab_size": vocab_size, "model.num_classes": vocab_size})
  layers = [(f"preset {preset}", fields),
            ("variant settings", values.attention_settings.get(attention, {}))]
  return presets.apply(config, layers, task_len=values.max_len)
