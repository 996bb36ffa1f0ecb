"""Retrieval: do two ACL Anthology papers cite each other? Byte level, one shared tower per
document, classified from [u, v, u * v, u - v] (the paper's NLI interaction).

COMMAND: python -m experiments.train --config=configs/lra/retrieval.py:performer --workdir=runs/retrieval/performer
Data: data_dir/tsv_data/new_aan_pairs.{train,eval,test}.tsv from the LRA release.
"""
from configs.lra import common


def get_config(arg=None):
  config = common.base_config("retrieval", arg)
  config.model.update(pooling="cls", interaction="nli")
  config.optimizer.weight_decay = 0.1
  config.schedule.update(factors=common.RSQRT, base_learning_rate=0.05)
  if config.preset == "paper":
    config.model.update(max_len=4000, num_layers=4, emb_dim=128, num_heads=4, mlp_dim=512)
    config.update(batch_size=32, num_train_steps=5_000, eval_every=500)
    config.schedule.warmup_steps = 8_000   # as released: longer than the run
  else:  # tiny: the first 128 bytes of each document
    config.model.update(max_len=128, num_layers=1, emb_dim=32, num_heads=2, mlp_dim=64)
    config.update(batch_size=32, num_train_steps=300, eval_every=100, log_every=20)
    config.schedule.warmup_steps = 100
  return common.finalize(config)
