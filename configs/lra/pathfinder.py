"""Pathfinder: are the two dots on one dashed contour? 32x32 pixels (1024 tokens), 2 classes.

COMMAND: python -m experiments.train --config=configs/lra/pathfinder.py:performer --workdir=runs/pathfinder/performer
Missing data is generated into data_dir (`python -m lra.generate pathfinder` does the same).
"""
from configs.lra import common

NUM_IMAGES = 200_000   # split 80 / 10 / 10 by lra.load


def get_config(arg=None):
  config = common.base_config("pathfinder", arg)
  config.data.update(resolution=32, difficulty="hard")
  config.model.update(pooling="mean", positions="sinusoidal")
  config.schedule.update(factors=common.COSINE, base_learning_rate=1e-3)
  if config.preset == "paper":
    config.model.update(num_layers=4, emb_dim=32, num_heads=4, mlp_dim=32)
    config.generate.num = NUM_IMAGES
    epoch = NUM_IMAGES * 8 // 10 // 512
    config.update(batch_size=512, num_train_steps=200 * epoch, eval_every=epoch)
    config.schedule.warmup_steps = epoch
  else:  # tiny: 2,000 images; checks the pipeline on a CPU (expect chance level at this budget)
    config.model.update(num_layers=1, emb_dim=32, num_heads=2, mlp_dim=64)
    config.generate.num = 2_000
    config.update(batch_size=16, num_train_steps=200, eval_every=100, log_every=20)
    config.schedule.warmup_steps = 50
  return common.finalize(config)
