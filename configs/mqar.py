"""Multi-query associative recall (synthetic.mqar), trained as a causal language model: the
diagnostic that separates the variants at CPU scale (Arora et al. 2023, "Zoology").

COMMAND: python -m experiments.reproduce --preset=tiny --tasks=mqar \
             --attentions=full,sliding_window,linear_transformer
         python -m experiments.sweep --task=mqar --field=data.num_pairs --values=4,8,16,32 \
             --attentions=full,sliding_window,linear_transformer --out=results/mqar_sweep

One preset, `tiny`: vocabulary 512, sequences of 64 tokens holding 8 key-value pairs, each key
queried once at least 8 positions after the last pair (so at least 10 after its pair), a
2-layer decoder (emb 64, 2 heads, RoPE) with Zoology's short convolution (kernel 3) beside
attention in each block, 800 steps of 64 sequences. Without the convolution a plain 2-layer
decoder needs far more steps to form the induction circuit (full attention: 12% after 1,500
steps on this preset). Larger settings are
overrides of these fields (data.*, model.*). Variants that cannot be causal are not applicable.
"""
from configs import presets
from configs.lra import common
from configs.task_values import TaskValues

# Attention settings for 64-token sequences: windows and blocks shorter than the distance
# between a pair and its query (>= 10), so local patterns cannot reach the pair.
ATTENTION_SETTINGS = {
    "sliding_window": presets.attention_options(window=8),
    "local": presets.attention_options(block_size=8),
    "longformer": presets.attention_options(window=8, num_global_tokens=1),
    "sparse_transformer": presets.attention_options(block_size=8, num_summary=2),
    "bigbird": presets.attention_options(block_size=4, num_window_blocks=3, num_random_blocks=2),
    "reformer": presets.attention_options(chunk_len=8),
    "sinkhorn": presets.attention_options(block_size=8),
    # Their blocks chosen from the data: 8-token blocks, so a query sees 3 (MoBA) or 4 (NSA:
    # the first, the two local ones and one chosen) of the 8 blocks, not the whole sequence.
    "moba": presets.attention_options(block_size=8, top_k=2),
    "nsa": presets.attention_options(block_length=8, block_stride=4, selection_block=8,
                                     selected_blocks=4, window=8),
    # A query attends to 16 of its up to 64 keys, the indexer's top 16 (its default, 256, is
    # every key here).
    "dsa": presets.attention_options(top_k=16, block_size=16),
    # Its window beside the linear attention, as short as sliding_window's (its default, 64, is
    # the whole sequence here).
    "based": presets.attention_options(window=8),
    # The paper's form: the order is in the weights themselves, no positional encoding.
    "stick_breaking": {"model.positions": "none"},
}


# The tiny preset, its one preset.
TINY = {
    "data_dir": "",   # generated in memory
    "data.vocab_size": 512, "data.num_pairs": 8, "data.min_gap": 8,
    "data.num_train": 20_000, "data.num_validation": 1_000, "data.num_test": 1_000,
    "model.vocab_size": 512, "model.num_classes": 512, "model.max_len": 64,
    "model.num_layers": 2, "model.emb_dim": 64, "model.num_heads": 2,
    "model.mlp_dim": 128, "model.positions": "rope", "model.short_conv": 3,
    "model.dropout_rate": 0.0, "model.attention_dropout_rate": 0.0,
    "batch_size": 64, "num_train_steps": 800, "eval_every": 200, "log_every": 50,
    "optimizer.weight_decay": 0.1,
    # Clipped: unclipped, a causal Performer run once diverged (NaN at step 444).
    "optimizer.grad_clip_norm": 1.0,
    "schedule.factors": common.COSINE, "schedule.base_learning_rate": 3e-3,
    "schedule.warmup_steps": 100,
}
VALUES = TaskValues("mqar", tiny=TINY, attention_settings=ATTENTION_SETTINGS, length=64)


def get_config(arg=None):
  """"<attention>[,tiny]": tiny, the one preset, when none is named. Larger runs override its
  fields (data.num_pairs, model.max_len, model.emb_dim, ...)."""
  return diagnostic_config(VALUES, arg)


def diagnostic_config(values: TaskValues, arg=None):
  """The whole config of a diagnostic with one preset, tiny: its values, then the variant's
  attention settings (configs/presets.py)."""
  attention, preset = presets.parse_arg(values.task, arg, ("tiny",))
  config = common.base_config(values.task, attention, preset)
  layers = [("preset tiny", values.tiny),
            ("variant settings", values.attention_settings.get(attention, {}))]
  return presets.apply(config, layers, task_len=values.max_len)
