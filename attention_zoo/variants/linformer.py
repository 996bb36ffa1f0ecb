"""Linformer (Wang et al. 2020): softmax attention over k learned projections of the sequence.

    head_i = softmax(Q_i (E_iᵀ K_i)ᵀ · s) (F_iᵀ V_i),   E_i, F_i [n, k]

E and F are learned, stored at [max_len, k] and sliced to the first n rows for shorter inputs.
`share` chooses how they are shared (the paper's parameter-sharing options):

    "none"         each head its own E_i and F_i (the paper's default)
    "headwise"     one E and one F for all heads
    "kv"           one E = F for all heads (key-value sharing, what the LRA code ran)
    "kv_per_head"  each head its own E_i = F_i (what the Nyströmformer LRA code ran)

Heads here are K/V heads: with GQA the query heads of a group share their K/V head and its
projections. The paper's layerwise sharing (one matrix across layers) is the model's
`share_attention_across_layers`: a layer holds only its own parameters. E and F start as
Xavier-normal, or N(0, init_std²) with `init_std` (the Nyströmformer code's 0.02). Padded keys
and values are zeroed before the projection, so padding adds nothing to the k projected keys.
Cost O(n·k·d) per head instead of O(n²·d).

Every projected key mixes the whole sequence, so a query would see the future: no causal form.
Cross-attention works for kv_len <= max_len (queries are never projected).
Under a `context` mesh each device projects its own positions and the k rows are psummed
(ops/length_projection.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from attention_zoo.contract import Attention, register
from attention_zoo.ops import softmax
from attention_zoo.ops.length_projection import project_length
from attention_zoo.options import Choice, Float, Int

SHARING = ("none", "headwise", "kv", "kv_per_head")


@register("linformer", exact=False, supports_causal=False, supports_cross=True,
          complexity="O(n·k)",
          paper="Wang et al. 2020, Linformer: Self-Attention with Linear Complexity "
                "(arXiv:2006.04768)",
          needs_max_len=True, supports_context_parallel=True)
class LinformerAttention(Attention):
  # k: the projected length; share: "none" (E_i, F_i per head), "headwise" (one E, one F),
  # "kv" (one E = F) or "kv_per_head" (E_i = F_i); init_std: None = Xavier normal.
  OPTIONS = {"k": Int(256, minimum=1), "share": Choice("none", SHARING),
             "init_std": Float(None, above=0, optional=True)}
  TEST_OPTIONS = dict(k=8)
  WHY_NOT_CAUSAL = ("each of its k projected keys is a weighted sum over all positions, "
                    "so every query would see future tokens")

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    rank, share = self.options["k"], self.options["share"]
    # [kvh or 1, max_len, k]: the leading axis is the head (1 = shared by all heads)
    per_head = share in ("none", "kv_per_head")
    shape = (self.num_kv_heads if per_head else 1, self.max_len, rank)
    std = self.options["init_std"]
    init = (nnx.initializers.xavier_normal(batch_axis=(0,)) if std is None
            else nnx.initializers.normal(std))
    self.key_projection = nnx.Param(init(self.rngs.params(), shape))              # E
    self.value_projection = (None if share in ("kv", "kv_per_head")
                             else nnx.Param(init(self.rngs.params(), shape)))     # F

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic):
    kv_len, kvh = k.shape[1], self.num_kv_heads
    if kv_len > self.max_len:
      raise ValueError(f"linformer: kv_len {kv_len} exceeds max_len {self.max_len}, the length its "
                       f"projections were sized for; build it with max_len >= {kv_len}")
    per_head = lambda p: jnp.broadcast_to(p[...][:, :kv_len], (kvh, kv_len, p.shape[-1]))
    e = per_head(self.key_projection)                                       # [kvh, n, k]
    f = e if self.value_projection is None else per_head(self.value_projection)
    real = kv_mask[:, :, None, None]
    k = jnp.where(real, k.astype(jnp.float32), 0.0)
    v = jnp.where(real, v.astype(jnp.float32), 0.0)
    k_proj = project_length(k, e)                                           # [b, k, kvh, d]
    v_proj = project_length(v, f)                                           # [b, k, kvh, d]
    grouped = softmax.group_heads(q.astype(jnp.float32), kvh)            # [b, q, kvh, g, d]
    scores = jnp.einsum("bqhgd,brhd->bhgqr", grouped, k_proj) * self.scale  # [b, kvh, g, q, k]
    weights = self.dropout(jax.nn.softmax(scores, axis=-1), deterministic)
    out = jnp.einsum("bhgqr,brhd->bqhgd", weights, v_proj)                 # [b, q, kvh, g, d]
    return out.reshape(q.shape)
