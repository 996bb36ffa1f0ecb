"""Image: CIFAR-10 in grayscale, one pixel per token (1024 tokens), 10 classes.

COMMAND: python -m experiments.train --config=configs/lra/image.py:performer --workdir=runs/image/performer
Data: data_dir/cifar-10-batches-py (the python pickles) or TFDS cifar10 (pip install -e ".[data]").
"""
from configs.lra import common

TRAIN_EXAMPLES = 45_000


def get_config(arg=None):
  config = common.base_config("image", arg)
  config.model.update(pooling="cls", positions="learned", dropout_rate=0.3,
                      attention_dropout_rate=0.2)
  config.schedule.update(factors=common.COSINE, base_learning_rate=5e-4)
  if config.preset == "paper":
    config.model.update(num_layers=1, emb_dim=128, num_heads=8, mlp_dim=128)
    epoch = TRAIN_EXAMPLES // 256
    config.update(batch_size=256, num_train_steps=200 * epoch, eval_every=epoch)
    config.schedule.warmup_steps = epoch
  else:  # tiny: the whole image (a pixel sequence cannot be shortened), a small model
    config.model.update(num_layers=1, emb_dim=32, num_heads=2, mlp_dim=64)
    config.update(batch_size=16, num_train_steps=200, eval_every=100, log_every=20)
    config.schedule.update(warmup_steps=50, base_learning_rate=1e-3)
  return common.finalize(config)
