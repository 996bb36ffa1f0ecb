"""Text: IMDb reviews, byte level, positive / negative.

COMMAND: python -m experiments.train --config=configs/lra/text.py:performer --workdir=runs/text/performer
Data: data_dir/aclImdb (the raw IMDb archive unpacked) or TFDS imdb_reviews (pip install -e ".[data]").
"""
from configs.lra import common


def get_config(arg=None):
  config = common.base_config("text", arg)
  config.model.pooling = "cls"
  config.optimizer.weight_decay = 0.1
  config.schedule.update(factors=common.RSQRT, base_learning_rate=0.05)
  if config.preset == "paper":
    config.model.update(max_len=1000, num_layers=4, emb_dim=256, num_heads=4, mlp_dim=1024)
    config.update(batch_size=32, num_train_steps=20_000, eval_every=1_000)
    config.schedule.warmup_steps = 8_000
  else:  # tiny: the first 256 bytes of each review
    config.model.update(max_len=256, num_layers=1, emb_dim=32, num_heads=2, mlp_dim=64)
    config.update(batch_size=32, num_train_steps=300, eval_every=100, log_every=20)
    config.schedule.warmup_steps = 100
  return common.finalize(config)
