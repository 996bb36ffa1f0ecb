"""State tracking (synthetic/state_tracking.py): the running parity and the running product
of permutations (S3, S5), trained at lengths 3..40 and tested at 256, as Grazzi et al. 2024
(arXiv:2411.12537) test parity; one config file per task (configs/parity.py, s3.py, s5.py).

COMMAND: python -m experiments.reproduce --preset=tiny --tasks=parity,s3 \
             --attentions=full,mamba2,deltanet,gated_deltanet --seeds=0,1 --out=results/st/base
         python -m experiments.reproduce --preset=tiny --tasks=parity,s3 \
             --attentions=deltanet,gated_deltanet --seeds=0,1 --out=results/st/neg \
             --override=model.attention_options.allow_neg_eigval=True
         python -m experiments.report --runs=results/st --out=results/st
             (-> results/st/state_tracking_tiny.csv, a row per variant and allow_neg_eigval)

One preset, `tiny` (CPU minutes per run): 20,000 training sequences of 3..40 tokens, a 2-layer
decoder (emb 64, 2 heads, RoPE for attention, no short convolution beside the mixer: the
mixers' own convolutions stay), 600 steps of 64 sequences, AdamW at 3e-3 without weight decay
(as Grazzi et al.'s parity runs), cosine decay. Validation (128 sequences) and test (512) at
length 256 ask only the prefixes longer than 40. docs/state_tracking.md: the protocol, what is
kept from the papers and what is shrunk.
"""
from configs import mqar
from configs.lra import common
from configs.task_values import TaskValues

TINY = {
    "data_dir": "",   # generated in memory
    "data.min_train_len": 3, "data.max_train_len": 40,
    "data.num_train": 20_000, "data.num_validation": 128, "data.num_test": 512,
    "model.max_len": 256,
    "model.num_layers": 2, "model.emb_dim": 64, "model.qkv_dim": 64, "model.num_heads": 2,
    "model.mlp_dim": 128, "model.positions": "rope", "model.short_conv": 0,
    "model.dropout_rate": 0.0, "model.attention_dropout_rate": 0.0,
    "batch_size": 64, "eval_batch_size": 128, "num_train_steps": 600, "eval_every": 200,
    "log_every": 50,
    "optimizer.weight_decay": 0.0, "optimizer.grad_clip_norm": 1.0,
    "schedule.factors": common.COSINE, "schedule.base_learning_rate": 3e-3,
    "schedule.warmup_steps": 100,
}


def values(task: str, vocab_size: int) -> TaskValues:
  """What configs/<task>.py declares: the tiny preset, its vocabulary the group's order; the
  windows and blocks of the local variants are MQAR's 8 tokens, far shorter than the test."""
  return TaskValues(task, tiny={**TINY, "model.vocab_size": vocab_size,
                                "model.num_classes": vocab_size},
                    attention_settings=mqar.ATTENTION_SETTINGS, length=TINY["model.max_len"])


def task_config(values: TaskValues, arg=None):
  """The config of the state-tracking task whose file declares `values`, for
  "<attention>[,tiny]" (tiny, its one preset, when none is named); larger runs override its
  fields (data.max_train_len, model.max_len, ...)."""
  return mqar.diagnostic_config(values, arg)
