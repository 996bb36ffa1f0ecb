"""Retrieval: do two ACL Anthology papers cite each other? Byte level, one shared tower per
document, classified from [u, v, u * v, u - v] (the paper's NLI interaction).

COMMAND: python -m experiments.train --config=configs/lra/retrieval.py:performer \
             --workdir=runs/retrieval/performer
Data: data_dir/tsv_data/new_aan_pairs.{train,eval,test}.tsv from the LRA release.
"""
from configs.lra import common
from configs.task_values import TaskValues

TASK = {"model.vocab_size": 257, "model.num_classes": 2}   # lra.task_spec

# lra_benchmarks/matching/configs: every model's file is the base config. The warm-up (8,000
# steps) is longer than the run (5,000): the learning rate never reaches its peak.
RELEASED = {
    "shared": {
        **common.RELEASED_TEXT_BASE, **common.model_size(4, 4, 128, 128, 512),
        "model.max_len": 4000, "model.interaction": "nli", "num_train_steps": 5_000,
        "eval_every": 100, "schedule.warmup_steps": 8_000,
    },
}
PAPER_CHANGES = common.SINKHORN_MEAN_POOLING

# tiny: the first 128 bytes of each document, a 1-layer model.
TINY = {
    **common.TINY_TEXT_MODEL, "model.max_len": 128, "num_train_steps": 300, "eval_every": 100,
    "log_every": 20, "schedule.warmup_steps": 100,
}


VALUES = TaskValues("retrieval", fields=TASK, released=RELEASED, tiny=TINY,
                    paper_changes=PAPER_CHANGES)


def get_config(arg=None):
  return common.task_config(VALUES, arg)
