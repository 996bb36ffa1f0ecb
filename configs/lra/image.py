"""Image: CIFAR-10 in grayscale, one pixel per token (1024 tokens), 10 classes.

COMMAND: python -m experiments.train --config=configs/lra/image.py:performer \
             --workdir=runs/image/performer
Data: data_dir/cifar-10-batches-py (the python pickles) or TFDS cifar10 (pip install -e ".[data]").
"""
from configs.lra import common
from configs.task_values import TaskValues

EPOCH = 45_000 // 256   # steps per epoch of the 45,000 training images


def _model(layers, emb, qkv, mlp, heads, pooling="cls"):
  """The released image files' size arguments, in their order."""
  return common.model_size(layers, heads, emb, qkv, mlp, pooling=pooling)


TASK = {"model.vocab_size": 256, "model.num_classes": 10}   # lra.task_spec

# lra_benchmarks/image/configs/cifar10: the base config, then each model's file.
RELEASED = {
    "shared": {
        **_model(1, 32, 32, 64, 1), "model.max_len": 1024, "model.dropout_rate": 0.3,
        "model.attention_dropout_rate": 0.2, "model.positions": "learned",
        "batch_size": 256, "num_train_steps": 200 * EPOCH, "eval_every": EPOCH,
        "optimizer.weight_decay": 0.0,
        "schedule.factors": common.COSINE, "schedule.base_learning_rate": 5e-4,
        "schedule.warmup_steps": EPOCH, "schedule.steps_per_cycle": 200 * EPOCH,
    },
    "full": _model(1, 128, 64, 128, 8),
    "local": {**_model(1, 128, 64, 128, 2, "mean"), "model.attention_options.block_size": 64},
    "sparse_transformer": _model(1, 128, 64, 128, 8),
    "longformer": _model(4, 128, 64, 128, 4, "mean"),
    "linformer": _model(1, 128, 64, 128, 8),
    # The file says qkv_dim 32; the released Reformer ignores it and projects to emb_dim.
    "reformer": _model(4, 64, 64, 64, 8),
    # Sinkhorn's file keeps the base dimensions (emb 32, 1 head).
    "sinkhorn": {"model.attention_options.block_size": 64, "optimizer.weight_decay": 0.7,
                 "model.dropout_rate": 0.1},
    "synthesizer": _model(1, 128, 64, 128, 8),
    # The file sets `num_head = 4`, a misspelling: the base's single head stays.
    "bigbird": {**_model(1, 128, 64, 128, 1), "model.attention_options.block_size": 64},
    "linear_transformer": _model(1, 128, 64, 128, 8),
    "performer": _model(1, 128, 64, 128, 8),
}
PAPER_CHANGES = common.SINKHORN_MEAN_POOLING

# tiny: the whole image (a pixel sequence cannot be shortened), a small model.
TINY = {
    **_model(1, 32, 32, 64, 2), "batch_size": 16, "num_train_steps": 200, "eval_every": 100,
    "log_every": 20, "schedule.warmup_steps": 50, "schedule.steps_per_cycle": 200,
    "schedule.base_learning_rate": 1e-3,
}


VALUES = TaskValues("image", fields=TASK, released=RELEASED, tiny=TINY,
                    paper_changes=PAPER_CHANGES)


def get_config(arg=None):
  return common.task_config(VALUES, arg)
