"""Path-X: Pathfinder at 128x128 pixels (16,384 tokens); every LRA model failed it.

COMMAND: python -m experiments.train --config=configs/lra/pathx.py:performer --workdir=runs/pathx/performer
Missing data is generated into data_dir (`python -m lra.generate pathfinder --resolution 128`).
The tiny preset uses 64x64 images (4,096 tokens): 128x128 does not fit a CPU run.
"""
from configs.lra import common

NUM_IMAGES = 200_000   # split 80 / 10 / 10 by lra.load


def get_config(arg=None):
  config = common.base_config("pathx", arg)
  config.model.update(pooling="mean", positions="learned")
  config.schedule.update(factors=common.COSINE, base_learning_rate=1e-3)
  config.optimizer.grad_clip_norm = 1.0
  if config.preset == "paper":   # the released pathfinder128 config
    config.data.update(resolution=128, difficulty="hard")
    config.model.update(num_layers=1, emb_dim=32, qkv_dim=16, num_heads=2, mlp_dim=32)
    config.generate.num = NUM_IMAGES
    epoch = NUM_IMAGES * 8 // 10 // 64
    config.update(batch_size=64, num_train_steps=200 * epoch, eval_every=epoch)
    config.schedule.warmup_steps = epoch
  else:
    config.data.update(resolution=64, difficulty="hard")
    config.model.update(max_len=64 * 64, num_layers=1, emb_dim=16, num_heads=2, mlp_dim=32)
    config.generate.num = 1_000   # a pipeline check: full attention takes ~6 s a step here
    config.update(batch_size=4, num_train_steps=60, eval_every=30, log_every=10)
    config.schedule.warmup_steps = 50
  return common.finalize(config)
