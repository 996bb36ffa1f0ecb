"""Each attention variant's settings in the LRA paper's runs (lra_reference.md), by registry name.

Variants not listed run with their own defaults. Options a variant does not accept are never
passed: these names are the variants' own option names.
"""
LRA_ATTENTION_OPTIONS = {
    "local": {"block_size": 50},
    "sparse_transformer": {"block_size": 50, "num_summary": 10},
    "longformer": {"window": 256, "num_global_tokens": 1},          # LRA's window 512 = 256 each side
    "bigbird": {"block_size": 64, "num_window_blocks": 3, "num_random_blocks": 3},
    "linformer": {"k": 16, "share": "kv"},
    "reformer": {"n_hashes": 1, "n_buckets": 10},
    "performer": {"kernel": "softmax", "nb_features": 256},
    "sinkhorn": {"block_size": 50},
    "synthesizer": {"mode": "random"},
}

# The Image task used 64-wide local blocks (two pixel rows of a 32x32 image per block).
TASK_OVERRIDES = {"image": {"local": {"block_size": 64}}}


def lra_attention_options(attention: str, task: str) -> dict:
  return {**LRA_ATTENTION_OPTIONS.get(attention, {}), **TASK_OVERRIDES.get(task, {}).get(attention, {})}
