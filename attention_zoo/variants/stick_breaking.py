r"""Stick-breaking attention (Tan et al. 2024, "Scaling Stick-Breaking Attention: An Efficient
Implementation and In-depth Study", arXiv:2410.17980): each query breaks a stick of length 1 at
the keys before it, nearest first; no positional encoding is needed (the order is the weighting).

    β_ij = σ(q_i·k_j · scale),   A_ij = β_ij ∏_{j<l<i} (1 − β_il)   (j < i),
    out_i = Σ_{j<i} A_ij v_j + (1 − Σ_{j<i} A_ij) v_i

computed in log space, key blocks from the diagonal backwards with the log of the stick left
carried per query (attention_zoo.ops.key_scan), so memory is linear in the length.

Conventions, read from the authors' code (github.com/shawntan/stickbreaking-attention):
- the diagonal is excluded (j < i), as their kernel's default `attend_current=False`; option
  attend_current=True breaks the stick at j <= i, as that flag does;
- the stick left after every key, 1 − Σ_j A_ij = ∏_j (1 − β_ij), goes to the query's own value
  v_i (remainder="current"), as their reference test adds `rem[..., None] * v`; their released
  model (dolomite-engine) adds rem times a learned per-head bias vector instead, which this
  variant, having no parameters, does not; remainder="none" drops it (out = Σ A v alone);
- their Triton kernels run on packed sequences (cu_seqlens); here padding is a key mask: a
  masked key takes no weight and breaks no stick, so a left-padded sequence gives the outputs of
  the unpadded one. The token at i is the key at i + (kv_len − q_len) (bottom-right alignment),
  so the base class's right-aligned KV cache decodes it exactly.
- no bidirectional form: the paper's stick is broken from the query backwards, so causal=False
  is refused; no attention dropout (the weights are never formed as an array).
"""
from __future__ import annotations

import jax.numpy as jnp

from attention_zoo.contract import Attention, register
from attention_zoo.ops import key_scan, softmax
from attention_zoo.options import Bool, Choice, Int


@register("stick_breaking", exact=False, supports_causal=True, supports_bidirectional=False,
          supports_cross=True, complexity="O(n²) time, O(n) memory",
          paper="Tan et al. 2024, Scaling Stick-Breaking Attention (arXiv:2410.17980)",
          can_decode=True, supports_dropout=False)
class StickBreakingAttention(Attention):
  OPTIONS = {"attend_current": Bool(False), "remainder": Choice("current", ("current", "none")),
             "block_q": Int(key_scan.DEFAULT_BLOCK, minimum=1),
             "block_k": Int(key_scan.DEFAULT_BLOCK, minimum=1)}
  # Tiles smaller than the suite's lengths: several key blocks carry the stick between them.
  TEST_OPTIONS = dict(block_q=8, block_k=4)
  WHY_NOT_BIDIRECTIONAL = ("the stick is broken from each query backwards over the keys before "
                           "it (Tan et al. define no bidirectional form)")
  WHY_NO_DROPOUT = "its tiled scan never forms the attention weights as an array to drop"

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic):
    del q_mask, deterministic   # the base zeroes masked query rows; no dropout
    out, remainder = key_scan.stick_breaking_attention(
        q, k, v, scale=self.scale, kv_mask=kv_mask, attend_current=self.options["attend_current"],
        block_q=self.options["block_q"], block_k=self.options["block_k"], return_remainder=True)
    if self.options["remainder"] == "none":
      return out
    batch, q_len, num_heads, head_dim = q.shape
    kv_len = k.shape[1]
    # the query's own value: key i + (kv_len - q_len), zero where that key is padding
    own = jnp.where(kv_mask[:, kv_len - q_len:, None, None], v[:, kv_len - q_len:], 0)
    out = softmax.group_heads(out, self.num_kv_heads)                      # [b, q, kvh, g, d]
    remainder = remainder.reshape(out.shape[:-1])                          # [b, q, kvh, g]
    out = out + (remainder[..., None] * own[:, :, :, None, :]).astype(out.dtype)
    return out.reshape(batch, q_len, num_heads, head_dim)
