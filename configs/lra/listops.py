"""ListOps: nested MIN / MAX / MED / SM expressions, classify the value (10 classes).

COMMAND: python -m experiments.train --config=configs/lra/listops.py:performer --workdir=runs/listops/performer
         python -m experiments.train --config=configs/lra/listops.py:full,tiny --workdir=runs/tiny/listops
Missing data is generated into data_dir (`python -m lra.generate listops` does the same).
"""
from configs.lra import common


def get_config(arg=None):
  config = common.base_config("listops", arg)
  config.model.pooling = "cls"
  config.optimizer.weight_decay = 0.1
  config.schedule.update(factors=common.RSQRT, base_learning_rate=0.05)
  if config.preset == "paper":
    config.model.update(num_layers=4, emb_dim=512, num_heads=8, mlp_dim=1024)
    config.generate.update(num_train=96_000, num_val=2_000, num_test=2_000, min_length=500,
                           max_length=2000)
    config.update(batch_size=32, num_train_steps=5_000, eval_every=100)
    config.schedule.warmup_steps = 1_000
  else:  # tiny: expressions of 17..127 tokens, a 1-layer model; 20-30 s of CPU per run
    config.model.update(max_len=128, num_layers=1, emb_dim=32, num_heads=2, mlp_dim=64)
    config.generate.update(num_train=5_000, num_val=1_000, num_test=1_000, min_length=16,
                           max_length=128)
    config.update(batch_size=32, num_train_steps=300, eval_every=50, log_every=25)
    config.schedule.warmup_steps = 100
  return common.finalize(config)
