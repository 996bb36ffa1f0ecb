"""The lowest layer: pure functions on arrays. It imports only jax, numpy, the standard library
and its own modules, so a JAX user without Flax can use it (`import attention_zoo.ops` loads no
other part of the package).

Exported here, the sequence-mixing ops: gated linear attention, the delta rule family (DeltaNet,
Gated DeltaNet, Kimi Delta Attention, Gated DeltaNet-2, Gated DeltaProduct) and the
diagonal-plus-low-rank delta rule (RWKV-7's; Comba's scalar-plus-low-rank one on it), each in a
chunkwise-parallel form (`chunk_*`, for training and prefill) and a token-by-token form
(`recurrent_*`, the reference and the decode step), all on the recurrence engine (engine.py);
xLSTM's mLSTM (mlstm.py: exponential input gate, normaliser and max stabiliser, its state the
tuple (S̃, ñ, m)) in the same two forms; FoX's forgetting attention and PaTH attention
(path_attention.py: blockwise softmax attention over Householder transforms). Layout as
flash-linear-attention's: q, k [B, T, H, K], v [B, T, H, V]; every recurrence returns (o,
final_state [B, H, K, V]; mLSTM's tuple); all take packed sequences (segment_ids), but PaTH's
op.

The attention maths, in its modules: softmax.py (the numerics the variants share and the dense
path), oracle.py (the dense oracle), blocks.py (lengths in blocks), tiles.py (the online
softmax of one tile), flex.py (the block-mask engine, flex_attention), flash/ (FlashAttention:
chunked, and the Pallas kernels), top_k_selection.py (attention over each query's top-k keys by
a scorer: DeepSeek Sparse Attention's lightning indexer, a running top-k, a gather);
segments.py, what a packed sequence is (its starts, runs and positions), for the layers that
must not cross one (short convolutions, token shifts); key_scan.py, attention whose weights are
not a softmax (stick-breaking, softpick) over key blocks. The linear approximations' sums over
the sequence, on one device and context-parallel:
kernelized.py (Performer, Linear Transformer), length_projection.py (Linformer), nystrom.py.
"""
from attention_zoo.ops.delta_rule import (chunk_delta_rule, chunk_gated_delta_product,
                                          chunk_gated_delta_rule, chunk_gated_delta_rule2,
                                          chunk_kda, recurrent_delta_rule,
                                          recurrent_gated_delta_product,
                                          recurrent_gated_delta_rule,
                                          recurrent_gated_delta_rule2, recurrent_kda)
from attention_zoo.ops.dplr import (chunk_comba, chunk_dplr_delta_rule, recurrent_comba,
                                    recurrent_dplr_delta_rule)
from attention_zoo.ops.forgetting_attention import forgetting_attention, forgetting_attention_step
from attention_zoo.ops.gla import (chunk_gla, chunk_simple_gla, recurrent_gla, recurrent_simple_gla,
                                   with_negative_eigenvalues)
from attention_zoo.ops.mlstm import chunk_mlstm, recurrent_mlstm
from attention_zoo.ops.path_attention import path_attention, path_decode_step

__all__ = ["chunk_comba", "chunk_delta_rule", "chunk_dplr_delta_rule",
           "chunk_gated_delta_product", "chunk_gated_delta_rule", "chunk_gated_delta_rule2",
           "chunk_gla", "chunk_kda", "chunk_mlstm", "chunk_simple_gla",
           "forgetting_attention", "forgetting_attention_step", "path_attention",
           "path_decode_step", "recurrent_comba", "recurrent_delta_rule",
           "recurrent_dplr_delta_rule", "recurrent_gated_delta_product",
           "recurrent_gated_delta_rule", "recurrent_gated_delta_rule2", "recurrent_gla",
           "recurrent_kda", "recurrent_mlstm", "recurrent_simple_gla", "with_negative_eigenvalues"]
