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
        **common.RELEASED_TEXT_BASE, **common.model_size(4, 4, 256, 256, 1024),
        "model.max_len": 1000, "num_train_steps": 20_000, "eval_every": 100,
        "schedule.warmup_steps": 8_000,
    },
}
PAPER_CHANGES = common.SINKHORN_MEAN_POOLING

# tiny: the first 256 bytes of each review, a 1-layer model.
TINY = {
    **common.TINY_TEXT_MODEL, "model.max_len": 256, "num_train_steps": 300, "eval_every": 100,
    "log_every": 20, "schedule.warmup_steps": 100,
}


VALUES = TaskValues("text", fields=TASK, released=RELEASED, tiny=TINY,
                    paper_changes=PAPER_CHANGES)


def get_config(arg=None):
  return common.task_config(VALUES, arg)
