"""Pure sequence-mixing ops: gated linear attention and the (gated) delta rule, each in a
chunkwise-parallel form (`chunk_*`, for training and prefill) and a token-by-token form
(`recurrent_*`, the reference and the decode step). Layout as flash-linear-attention's:
q, k [B, T, H, K], v [B, T, H, V]; every op returns (o, final_state [B, H, K, V])."""
from attention_zoo.ops.delta_rule import (chunk_delta_rule, chunk_gated_delta_rule,
                                          recurrent_delta_rule, recurrent_gated_delta_rule)
from attention_zoo.ops.forgetting_attention import forgetting_attention, forgetting_attention_step
from attention_zoo.ops.gla import chunk_gla, chunk_simple_gla, recurrent_gla, recurrent_simple_gla

__all__ = ["chunk_delta_rule", "chunk_gated_delta_rule", "chunk_gla", "chunk_simple_gla",
           "forgetting_attention", "forgetting_attention_step", "recurrent_delta_rule",
           "recurrent_gated_delta_rule", "recurrent_gla", "recurrent_simple_gla"]
