"""Text: IMDb reviews, byte level, positive / negative.

COMMAND: python -m experiments.train --config=configs/lra/text.py:performer \
             --workdir=runs/text/performer
Data: data_dir/aclImdb (the raw IMDb archive unpacked) or TFDS imdb_reviews
(pip install -e ".[data]").
Validation is carved from the training reviews (lra.load), never the test set.
"""
from configs.lra import common
from configs.task_values import TaskValues

TASK = {"model.vocab_size": 257, "model.num_classes": 2}   # lra.task_spec

# lra_benchmarks/text_classification/configs: every model's file is the base config (Linformer's
# `low_rank_features = 32` and Synthesizer's mode fields are set where train.py never reads
# them). train.py passes qkv_dim, max_len and the pooling; no dropout rates (0.1 apply).
RELEASED = {
    "shared": {
        "model.max_len": 1000, "model.num_layers": 4, "model.emb_dim": 256, "model.qkv_dim": 256,
        "model.num_heads": 4, "model.mlp_dim": 1024, "model.dropout_rate": 0.1,
        "model.attention_dropout_rate": 0.1, "model.pooling": "cls",
        "model.positions": "sinusoidal",
        "batch_size": 32, "num_train_steps": 20_000, "eval_every": 100,
        "optimizer.weight_decay": 0.1,
        "schedule.factors": common.RSQRT, "schedule.base_learning_rate": 0.05,
        "schedule.warmup_steps": 8_000,
    },
}
# The released Sinkhorn encoder pools by MEAN only: with the config's CLS it raises ValueError.
PAPER_CHANGES = {"sinkhorn": {"model.pooling": (
    "mean", "the released Sinkhorn encoder supports MEAN pooling only (CLS raises ValueError)")}}

# tiny: the first 256 bytes of each review, a 1-layer model.
TINY = {
    "model.max_len": 256, "model.num_layers": 1, "model.emb_dim": 32, "model.qkv_dim": 32,
    "model.num_heads": 2, "model.mlp_dim": 64,
    "num_train_steps": 300, "eval_every": 100, "log_every": 20, "schedule.warmup_steps": 100,
}


VALUES = TaskValues("text", fields=TASK, released=RELEASED, tiny=TINY,
                    paper_changes=PAPER_CHANGES)


def get_config(arg=None):
  return common.task_config(VALUES, arg)
