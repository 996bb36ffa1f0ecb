"""Path-X: Pathfinder at 128x128 pixels (16,384 tokens); every LRA model failed it.

COMMAND: python -m experiments.train --config=configs/lra/pathx.py:performer \
             --workdir=runs/pathx/performer
The paper and fair presets read data_dir (`python -m lra.generate pathfinder --resolution 128
--difficulty hard --num 200000 --out data/lra`). The tiny preset uses 64x64 images (4,096
tokens, generated when missing): 128x128 does not fit a CPU run.
"""
from configs.lra import common
from configs.task_values import TaskValues

EPOCH = 160_000 // 64   # steps per epoch of the 160,000 training images

TASK = {"model.vocab_size": 256, "model.num_classes": 2}   # lra.task_spec

# lra_benchmarks/image/configs/pathfinder128: only the Transformer's config was released, so
# every variant runs with it.
RELEASED = {
    "shared": {
        **common.model_size(1, 2, 32, 16, 32), "model.dropout_rate": 0.1,
        "model.attention_dropout_rate": 0.1,
        "model.max_len": 128 * 128, "model.pooling": "mean", "model.positions": "learned",
        "data.resolution": 128, "data.difficulty": "hard",
        "batch_size": 64, "num_train_steps": 200 * EPOCH, "eval_every": EPOCH,
        "optimizer.weight_decay": 0.0, "optimizer.grad_clip_norm": 1.0,
        "schedule.factors": common.COSINE, "schedule.base_learning_rate": 1e-3,
        "schedule.warmup_steps": EPOCH, "schedule.steps_per_cycle": 200 * EPOCH,
    },
}

# tiny: 1,000 generated 64x64 images; a pipeline check (full attention takes ~6 s a step here).
TINY = {
    **common.model_size(1, 2, 16, 16, 32), "data.resolution": 64, "model.max_len": 64 * 64,
    "generate.num": 1_000,
    "batch_size": 4, "num_train_steps": 60, "eval_every": 30, "log_every": 10,
    "schedule.warmup_steps": 50, "schedule.steps_per_cycle": 60,
}


VALUES = TaskValues("pathx", fields=TASK, released=RELEASED, tiny=TINY)


def get_config(arg=None):
  return common.task_config(VALUES, arg)
