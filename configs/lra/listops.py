"""ListOps: nested MIN / MAX / MED / SM expressions, classify the value (10 classes).

COMMAND: python -m experiments.train --config=configs/lra/listops.py:performer \
             --workdir=runs/listops/performer
         python -m experiments.train --config=configs/lra/listops.py:full,tiny \
             --workdir=runs/tiny/listops
The paper and fair presets read data_dir (`python -m lra.generate listops --out data/lra` writes
it); the tiny preset generates its small data when missing.
"""
from configs.lra import common
from configs.task_values import TaskValues

TASK = {"model.vocab_size": 16, "model.num_classes": 10}   # lra.task_spec

# lra_benchmarks/listops/configs: every model's file is the base config, except Performer's.
# train.py passes no dropout rates (the encoders' 0.1 apply) and no pooling (CLS).
RELEASED = {
    "shared": {
        "model.max_len": 2000, "model.num_layers": 4, "model.emb_dim": 512, "model.qkv_dim": 512,
        "model.num_heads": 8, "model.mlp_dim": 1024, "model.dropout_rate": 0.1,
        "model.attention_dropout_rate": 0.1, "model.pooling": "cls",
        "model.positions": "sinusoidal",
        "batch_size": 32, "num_train_steps": 5_000, "eval_every": 50,
        "optimizer.weight_decay": 0.1,
        "schedule.factors": common.RSQRT, "schedule.base_learning_rate": 0.05,
        "schedule.warmup_steps": 1_000,
    },
    # FAVOR+ softmax with 2 random features, redrawn at every call (q, k scaled by d^-1/4).
    "performer": {"model.attention_options.kernel": "softmax",
                  "model.attention_options.features": "random",
                  "model.attention_options.nb_features": 2, "model.attention_options.redraw": True,
                  "model.attention_options.scale": None},
    # The released Sinkhorn encoder pools by MEAN (its only pooling; ListOps passes none).
    "sinkhorn": {"model.pooling": "mean"},
}

# tiny: expressions of 16..128 tokens, a 1-layer model; 20-30 s of CPU per run.
TINY = {
    "model.max_len": 128, "model.num_layers": 1, "model.emb_dim": 32, "model.qkv_dim": 32,
    "model.num_heads": 2, "model.mlp_dim": 64,
    "generate.num_train": 5_000, "generate.num_val": 1_000, "generate.num_test": 1_000,
    "generate.min_length": 16, "generate.max_length": 128,
    "num_train_steps": 300, "eval_every": 50, "log_every": 25, "schedule.warmup_steps": 100,
}


VALUES = TaskValues("listops", fields=TASK, released=RELEASED, tiny=TINY)


def get_config(arg=None):
  return common.task_config(VALUES, arg)
