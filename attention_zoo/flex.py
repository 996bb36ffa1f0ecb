"""The block-sparse engine under its public path, for users and plug-ins: attention_zoo.ops.flex
(`create_block_mask`, `block_mask_from_states`, `flex_attention`, `pattern_attention`, the mask
and score functions, `dense_mask`), and for a variant over a mask function its base class
`MaskAttention` and `attend` (`masked_attention`: the engine with the variant's scale,
soft-capping and dropout), from attention_zoo.variants.masked. docs/adding_an_attention.md
(section 2) writes a variant this way.

A face only: no module of the library imports it (they import attention_zoo.ops.flex and
attention_zoo.variants.masked; tests/test_lint.py checks it).
"""
from attention_zoo.ops.flex import (DEFAULT_BLOCK, EMPTY, FULL, PARTIAL, BlockMask, alibi,
                                    aligned_positions, block_mask_from_states, causal_mask,
                                    create_block_mask, dense_mask, flex_attention,
                                    full_block_mask, kernel_lists, pattern_attention,
                                    score_function, softcap, with_segments)
from attention_zoo.variants.masked import MaskAttention
from attention_zoo.variants.masked import masked_attention as attend

__all__ = ["DEFAULT_BLOCK", "EMPTY", "FULL", "PARTIAL", "BlockMask", "MaskAttention", "alibi",
           "aligned_positions", "attend", "block_mask_from_states", "causal_mask",
           "create_block_mask", "dense_mask", "flex_attention", "full_block_mask", "kernel_lists",
           "pattern_attention", "score_function", "softcap", "with_segments"]
