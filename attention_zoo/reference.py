"""Dense softmax attention for users and plug-ins: the oracle every exact variant is tested
against (`dense_attention`) and the numerics the variants share (`masked_softmax_attention`,
the plain dense path, and `masked_softmax`, `group_heads`, `causal_allowed`, `causal_pattern`,
`alibi_bias`, `dropout`, `MASK_VALUE`).

The two jobs live in two ops modules, attention_zoo.ops.oracle and attention_zoo.ops.softmax;
this module shows them together under their public path. A face only: no module of the library
imports it (tests/test_lint.py checks it).
"""
from attention_zoo.ops.oracle import dense_attention
from attention_zoo.ops.softmax import (MASK_VALUE, alibi_bias, causal_allowed, causal_pattern,
                                       dropout, group_heads, masked_softmax,
                                       masked_softmax_attention)

__all__ = ["MASK_VALUE", "alibi_bias", "causal_allowed", "causal_pattern", "dense_attention",
           "dropout", "group_heads", "masked_softmax", "masked_softmax_attention"]
