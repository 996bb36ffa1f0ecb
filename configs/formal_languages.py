"""The formal-language tasks of Grazzi et al. 2025 (arXiv:2411.12537;
synthetic/formal_languages.py), one config file each (configs/parity_check.py,
modular_arithmetic.py, modular_arithmetic_brackets.py), under their one preset `grazzi`: the
values of the released configs, github.com/adankow/unlocking_state_tracking,
xlstm/experiments/*.yaml (commit dd420c5, the files its README names for the table), each
value with its source below.
docs/formal_languages.md: the protocol and every difference from the released code.

COMMAND (one cell: task x variant x eigenvalue range x seed; S the seed, the released --seed,
which draws both the data and the initialisation):
  python -m experiments.train --config=configs/parity_check.py:deltanet,grazzi \
      --config.seed=S --config.data.seed=S \
      --config.model.attention_options.allow_neg_eigval=True \
      --workdir=runs/parity_check/deltanet_neg/S
  (allow_neg_eigval=True: the [-1, 1] rows, DeltaNet's β in (0, 2); leave it out for [0, 1].)

The table's rows (ROWS): the Transformer, Mamba and DeltaNet, each with eigenvalues in [0, 1]
and [-1, 1]; mLSTM and sLSTM are not in the zoo.
"""
from configs import mqar, presets
from configs.lra import common
from configs.task_values import TaskValues

# The README's commands for the table, per task: Mamba [0, 1], [-1, 1], DeltaNet [0, 1], [-1, 1].
RELEASED_FILES = {
    "parity_check": ("parity_mamba.yaml", "parity_mamba_2.yaml", "parity_delta_net.yaml",
                     "parity_delta_net_2.yaml"),
    "modular_arithmetic": ("mod_arithmetic_mamba.yaml", "mod_arithmetic_mamba_2.yaml",
                           "mod_arithmetic_delta_net.yaml", "mod_arithmetic_delta_net_2.yaml"),
    # The README names mod_arithmetic_with_brackets_delta_net_2.yaml, which the repository
    # lacks; _20.yaml is the file with sigmoid_scale 2.0.
    "modular_arithmetic_brackets": ("mod_arithmetic_with_brackets_mamba.yaml",
                                    "mod_arithmetic_with_brackets_mamba_2.yaml",
                                    "mod_arithmetic_with_brackets_delta_net.yaml",
                                    "mod_arithmetic_with_brackets_delta_net_20.yaml"),
}

# Row of the paper's table -> (variant, its options). Mamba's allow_neg_eigval is the released
# positive_and_negative (the transition 2·exp(ΔA) - 1); DeltaNet's, sigmoid_scale 2.0.
ROWS = {
    "Transformer": ("full", {}),   # no released config: the DeltaNet rows' model and training
    "Mamba [0, 1]": ("mamba", {}),
    "Mamba [-1, 1]": ("mamba", {"allow_neg_eigval": True}),
    "DeltaNet [0, 1]": ("deltanet", {}),
    "DeltaNet [-1, 1]": ("deltanet", {"allow_neg_eigval": True}),
}
CHANCE = {"parity_check": 1 / 2, "modular_arithmetic": 1 / 5,
          "modular_arithmetic_brackets": 1 / 5}   # eval-chomsky.py's `scale`

# What every task shares (the same in all nine yaml files but where TASK changes it).
SHARED = {
    "data_dir": "",                      # generated in memory
    "data.min_train_len": 3,             # dataset.kwargs.min_sequence_length
    "data.max_train_len": 40,            # dataset.kwargs.max_sequence_length
    "data.min_test_len": 40,             # subpar.validation/test.min_sequence_length (their max:
                                         # 256, the context_length)
    "data.num_validation": 8_192,        # dataset.kwargs.count.validation
    "data.num_test": 8_192,              # dataset.kwargs.count.test
    "data.seed": 42,                     # dataset.kwargs.seed (main.py: --seed, default 42)
    # count.train is 5,120,000 (parity) or 102,400,000: every step reads new sequences. The
    # zoo holds a split in memory, so 256,000 of them, the first of the released stream, are
    # read again each epoch (docs/formal_languages.md).
    "data.num_train": 256_000,
    "model.max_len": 255,                # dataset.kwargs.context_length 256, shifted by one
    "model.num_layers": 2,               # model.n_layers
    "model.emb_dim": 128,                # model.d_model
    "model.qkv_dim": 128,                # fla DeltaNetConfig expand_k = expand_v = 1
    "model.num_heads": 4,                # model.n_heads (DeltaNet)
    "model.mlp_dim": 512,                # fla DeltaNetConfig hidden_ratio 4: 4·128 (fla: SwiGLU
                                         # of 512, rounded to 256s; ours GELU)
    "model.positions": "none",           # the recurrent models have none
    "model.short_conv": 0,               # the mixers' own convolutions (use_short_conv) stay
    "model.dropout_rate": 0.0,           # model.dropout
    "model.attention_dropout_rate": 0.0,
    "model.embed_init_std": 0.02,        # fla initializer_range, Mamba base_std
    "batch_size": 256,                   # training.batch_size
    "eval_batch_size": 256,
    "eval_every": 200,                   # training.val_every_step
    "log_every": 200,
    "optimizer.name": "adamw",           # main.py: torch.optim.AdamW, its default betas and eps
    "optimizer.b1": 0.9,
    "optimizer.b2": 0.999,
    "optimizer.eps": 1e-8,
    "optimizer.grad_clip_norm": 0.0,     # training.grad_clip_norm: None
    "schedule.factors": common.COSINE,   # LinearWarmupCosineAnnealing (lr_scheduler.py)
    "schedule.base_learning_rate": 1e-3,   # training.lr
}
# Per task: the vocabulary (dataset.kwargs.vocab_size), steps, warmup, weight decay. The cosine
# runs from the end of warmup to num_steps (lr_decay_until_steps); steps_per_cycle is one more
# than that span so that the last update ends it rather than starting a new cycle.
TASK = {
    "parity_check": {   # parity_*.yaml
        "model.vocab_size": 3, "num_train_steps": 20_000, "schedule.warmup_steps": 2_000,
        "schedule.steps_per_cycle": 18_001, "optimizer.weight_decay": 0.0,
    },
    "modular_arithmetic": {   # mod_arithmetic_*.yaml
        "model.vocab_size": 10, "num_train_steps": 100_000, "schedule.warmup_steps": 10_000,
        "schedule.steps_per_cycle": 90_001, "optimizer.weight_decay": 0.1,
    },
    "modular_arithmetic_brackets": {   # mod_arithmetic_with_brackets_*.yaml
        "model.vocab_size": 12, "num_train_steps": 100_000, "schedule.warmup_steps": 10_000,
        "schedule.steps_per_cycle": 90_001, "optimizer.weight_decay": 0.1,
    },
}
# Per variant, in every task: the released model's own settings.
VARIANT_SETTINGS = {
    # fla DeltaNetConfig (the released delta_net): short convolution of 4, no output gate.
    "deltanet": {"model.attention_options.use_short_conv": True,
                 "model.attention_options.conv_size": 4,
                 "model.attention_options.use_gate": False},
    # xlstm/mamba/mamba.py MambaConfig: d_state 16, expand_factor 2, d_conv 1, dt_rank auto.
    "mamba": {"model.attention_options.d_state": 16, "model.attention_options.expand": 2,
              "model.attention_options.conv_size": 1},
}


def values(task: str) -> TaskValues:
  """What configs/<task>.py declares: the grazzi preset's values (its one preset, so `fields`)
  and the variants' settings."""
  vocab = TASK[task]["model.vocab_size"]
  return TaskValues(task, fields={**SHARED, **TASK[task], "model.num_classes": vocab},
                    attention_settings={**mqar.ATTENTION_SETTINGS, **VARIANT_SETTINGS},
                    length=SHARED["model.max_len"])


def task_config(values: TaskValues, arg=None):
  """The whole config of the formal-language task whose file declares `values`, for
  "<attention>[,grazzi]" (its one preset, also when none is named): the grazzi preset's values,
  then the variant's settings (configs/presets.py)."""
  attention, preset = presets.parse_arg(values.task, arg, ("grazzi",))
  config = common.base_config(values.task, attention, preset)
  layers = [("preset grazzi", values.fields),
            ("variant settings", values.attention_settings.get(attention, {}))]
  return presets.apply(config, layers, task_len=values.max_len)
