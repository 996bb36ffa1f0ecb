"""ListOps: nested MIN / MAX / MED / SM expressions, classify the value (10 classes).

COMMAND: python -m experiments.train --config=configs/lra/listops.py:performer \
             --workdir=runs/listops/performer
         python -m experiments.train --config=configs/lra/listops.py:full,tiny \
             --workdir=runs/tiny/listops
         python -m experiments.train --config=configs/lra/listops.py:full,light \
             --workdir=runs/light/listops/full
The paper and fair presets read data_dir (`python -m lra.generate listops --out data/lra` writes
it); the tiny preset generates its small data when missing.
"""
from configs.lra import common
from configs.task_values import TaskValues

TASK = {"model.vocab_size": 16, "model.num_classes": 10}   # lra.task_spec

# lra_benchmarks/listops/configs: every model's file is the base config, except Performer's.
# train.py passes no dropout rates (the encoders' 0.1 apply) and no pooling (CLS).
RELEASED = {
    "shared": {
        **common.RELEASED_TEXT_BASE, **common.model_size(4, 8, 512, 512, 1024),
        "model.max_len": 2000, "num_train_steps": 5_000, "eval_every": 50,
        "schedule.warmup_steps": 1_000,
    },
    # FAVOR+ softmax with 2 random features, redrawn at every call (q, k scaled by d^-1/4).
    "performer": {"model.attention_options.kernel": "softmax",
                  "model.attention_options.features": "random",
                  "model.attention_options.nb_features": 2, "model.attention_options.redraw": True,
                  "model.attention_options.scale": None},
    # The released Sinkhorn encoder pools by MEAN (its only pooling; ListOps passes none).
    "sinkhorn": {"model.pooling": "mean"},
}

# tiny: expressions of 16..128 tokens, a 1-layer model; 20-30 s of CPU per run.
TINY = {
    **common.TINY_TEXT_MODEL, "model.max_len": 128,
    "generate.num_train": 5_000, "generate.num_val": 1_000, "generate.num_test": 1_000,
    "generate.min_length": 16, "generate.max_length": 128,
    "num_train_steps": 300, "eval_every": 50, "log_every": 25, "schedule.warmup_steps": 100,
}


# The light protocol of the Nyströmformer paper (Xiong et al. 2021): every value its released
# ListOps run used (mlpen/Nystromformer, LRA/code, cited as file:line), in our fields, with where
# the code sets it. Only fp16 autocast cannot be kept: everything runs in float32 here.
_OPTIONS = "model.attention_options."
_ONE_CYCLE = "run_tasks.py:68-74 (PyTorch 1.7.1 OneCycleLR defaults)"
LIGHT = {
    "shared": {
        "model.vocab_size": (32, "lra_config.py:18"),
        "model.max_len": (2048, "lra_config.py:19 says 2000; run_tasks.py:34 rounds it up to a "
                                "power of two"),
        "model.num_layers": (2, "lra_config.py:17 (tied_weights False, :11)"),
        "model.emb_dim": (64, "lra_config.py:12-13"),
        "model.qkv_dim": (64, "lra_config.py:15-16: 2 heads x 32"),
        "model.num_heads": (2, "lra_config.py:16"),
        "model.mlp_dim": (128, "lra_config.py:14; model_wrapper.py:24-36 (the head's too)"),
        "model.dropout_rate": (0.1, "lra_config.py:20; model.py:23,52,58,60"),
        "model.attention_dropout_rate": (0.1, "lra_config.py:21; attention.py:11,20"),
        "model.positions": ("learned", "model.py:20-21,37-40"),
        "model.embed_init_std": (0.02, "model.py:17-18 (positions: N(0, 0.02) too)"),
        "model.pooling": ("padded_mean", "model.py:99 zeroes padded outputs; "
                                         "model_wrapper.py:11 averages all positions"),
        "model.pre_ln": (True, "model.py:63-66, final LayerNorm :83"),
        "model.gelu_approximate": (False, "model.py:57 (nn.GELU, exact)"),
        "model.layer_norm_epsilon": (1e-5, "model.py:50,53,83 (PyTorch's default)"),
        "model.zero_token_is_padding": (False, "dataset.py:32: mask = ids != 0, the data's mask"),
        "batch_size": (32, "lra_config.py:26"),
        "num_train_steps": (5000, "lra_config.py:32"),
        "eval_every": (50, "lra_config.py:31; run_tasks.py:187"),
        "eval_batches": (62, "lra_config.py:33"),
        "eval_stream": (True, "run_tasks.py:58,190-191; dataset.py:39-49 (endless, reshuffled)"),
        "test_drop_last": (True, "run_tasks.py:59,200-204; dataset.py:18 (shuffled at load)"),
        "optimizer.name": ("adamw", "run_tasks.py:62"),
        "optimizer.b1": (0.9, "run_tasks.py:65 (never used: schedule.cycle_b1)"),
        "optimizer.b2": (0.999, "run_tasks.py:65"),
        "optimizer.eps": (1e-6, "run_tasks.py:65"),
        "optimizer.weight_decay": (0.0, "lra_config.py:30"),
        "schedule.factors": ("constant * one_cycle", "run_tasks.py:68-74 (anneal linear: "
                                                     "lra_config.py:29)"),
        "schedule.base_learning_rate": (1e-4, "lra_config.py:27"),
        "schedule.warmup_steps": (1000, "lra_config.py:28 (pct_start = 1000 / 5000)"),
        "schedule.div_factor": (25.0, _ONE_CYCLE),
        "schedule.final_div_factor": (1e4, _ONE_CYCLE),
        "schedule.cycle_b1": (True, _ONE_CYCLE + ": cycle_momentum"),
        "schedule.min_b1": (0.85, _ONE_CYCLE + ": base_momentum"),
        "schedule.max_b1": (0.95, _ONE_CYCLE + ": max_momentum"),
        "data.closing_brackets": (False, "LRA/datasets/listops.py:1-9 ran LRA's input pipeline "
                                         "of before 2021-03-04, whose tokenizer dropped `]`"),
    },
    "full": {},
    "reformer": {
        _OPTIONS + "n_hashes": (2, "lra_config.py:53"),
        _OPTIONS + "chunk_len": (64, "HF ReformerConfig default lsh_attn_chunk_length"),
        _OPTIONS + "n_buckets": (64, "HF: num_buckets None -> 2 x 2048 / 64"),
        _OPTIONS + "scale": (1.0, "HF _len_and_dim_norm: unit keys x / ‖x‖, logits q·k̂"),
        _OPTIONS + "dropout_rate": (0.0, "HF lsh_attention_probs_dropout_prob default"),
        _OPTIONS + "eval_rotations": ("fresh", "HF hash_seed None: new rotations every call"),
        _OPTIONS + "duplicate_correction": (False, "HF LSHSelfAttention has none"),
    },
    "linformer": {
        _OPTIONS + "k": (256, "lra_config.py:52"),
        _OPTIONS + "share": ("kv_per_head", "attention_linformer.py:20,25-26: one E per head "
                                            "for K and V"),
        _OPTIONS + "init_std": (0.02, "attention_linformer.py:21"),
        _OPTIONS + "dropout_rate": (0.0, "attention_linformer.py (no attention dropout)"),
        "model.share_attention_across_layers": (True, "attention_linformer.py:7,17-22: E is a "
                                                      "class attribute"),
    },
    "performer": {
        "model.attention_dropout_rate": (0.0, "FastAttention drops nothing: the 0.1 of "
                                              "lra_config.py:21 reaches softmax only"),
        _OPTIONS + "kernel": ("softmax", "attention_performer.py:15: generalized_attention "
                                         "left False, so kernel_fn=ReLU is unused"),
        _OPTIONS + "features": ("random", "performer-pytorch 0.15 FastAttention"),
        _OPTIONS + "nb_features": (256, "lra_config.py:54"),
        _OPTIONS + "redraw": (False, "FastAttention draws its projection once, a buffer"),
        _OPTIONS + "scale": (common.INVERSE_HEAD_DIM, "attention_performer.py:21-22 and "
                                                      "softmax_kernel both scale q, k by d^-1/4"),
        _OPTIONS + "padded_keys": ("zeroed", "attention_performer.py:22-23: K, V x mask"),
        _OPTIONS + "stabiliser": ("performer_pytorch", "performer-pytorch 0.15 softmax_kernel"),
    },
    "nystromformer": {
        _OPTIONS + "num_landmarks": (64, "lra_config.py:49"),
        _OPTIONS + "conv_kernel_size": (35, "lra_config.py:49"),
        _OPTIONS + "pinv_iterations": (6, "attention_nystrom.py:51 (n_iter = 6)"),
        _OPTIONS + "landmarks": ("padded_segments", "attention_nystrom.py:31-32,38-43"),
        _OPTIONS + "pinv_init": ("batch_global", "attention_nystrom.py:16-19,55-56 ('original')"),
        _OPTIONS + "dropout_rate": (0.0, "attention_nystrom.py (no attention dropout)"),
    },
}
# light_fair: every quirk of the light code that changes results, fixed; the protocol kept.
LIGHT_FIXES = {
    "shared": {
        "model.pooling": ("mean", "the mean over real tokens; the released pooling divided by "
                                  "the padded 2048, scaling each row by its length / 2048"),
        "data.closing_brackets": (True, "the `]` tokens kept, as LRA's pipeline has since "
                                        "2021-03-04: without them an expression's tree cannot "
                                        "be recovered"),
        "eval_batches": (0, "every validation example at every evaluation; the released code "
                            "read a different 62-batch window each time and kept the best"),
        "eval_stream": (False, "one fixed validation set (see eval_batches)"),
        "test_drop_last": (False, "every test example; the released code dropped 16 of 2000"),
        "schedule.cycle_b1": (False, "Adam's β1 = 0.9 as the code's betas say; OneCycleLR's "
                                     "default cycle_momentum overwrote it"),
    },
    "reformer": {
        _OPTIONS + "eval_rotations": ("fixed", "one fixed hashing for evaluation: the released "
                                               "test predictions were random"),
        _OPTIONS + "duplicate_correction": (True, "a key seen in both rounds counts once, as in "
                                                  "the Reformer paper"),
        _OPTIONS + "dropout_rate": (0.1, "attention dropout 0.1 as for softmax; the released "
                                         "variants other than softmax had none"),
    },
    "linformer": {
        _OPTIONS + "dropout_rate": (0.1, "attention dropout 0.1 as for softmax; the released "
                                         "variants other than softmax had none"),
    },
    "performer": {
        _OPTIONS + "scale": (None, "q·k / sqrt(head_dim): the released q, k were scaled twice"),
        _OPTIONS + "padded_keys": ("removed", "padded keys left out; the released zero keys "
                                              "still entered every normaliser"),
        _OPTIONS + "stabiliser": ("per_feature", "exact log-space sums; the released 1e-4 floor "
                                                 "under a batch-wide max flattened attention"),
    },
    "nystromformer": {
        _OPTIONS + "landmarks": ("real_tokens", "landmarks from the real tokens only; the "
                                                "released ones averaged padding"),
        _OPTIONS + "pinv_init": ("per_matrix", "each matrix its own init; the released one "
                                               "depended on the other rows of the batch"),
        _OPTIONS + "dropout_rate": (0.1, "attention dropout 0.1 as for softmax; the released "
                                         "variants other than softmax had none"),
    },
}


VALUES = TaskValues("listops", fields=TASK, released=RELEASED, tiny=TINY, light=LIGHT,
                    light_fixes=LIGHT_FIXES)


def get_config(arg=None):
  return common.task_config(VALUES, arg)
