"""Longformer attention (Beltagy et al. 2020): a dilated sliding window plus global tokens.

    window(i) = { j : |i - j| <= w·δ and (i - j) mod δ = 0 }        (δ = dilation)
    A(i) = window(i) ∪ { j < g } ∪ { all j if i < g }                 (causal: ∩ { j <= i })
    out_i = Σ_{j ∈ A(i)} softmax_j(q_i·k_j / sqrt(d)) v_j                        (i >= g)
    out_i = Σ_{j ∈ A(i)} softmax_j(q_i W_qg · k_j W_kg / sqrt(d)) v_j W_vg       (i < g)

The first g positions (g = num_global_tokens, e.g. a CLS token) attend to every key and are
attended by every query. Global attention has its own projections (the paper's section 3.1,
Q_g, K_g, V_g initialised to the local ones). Here q, k, v arrive projected, so the variant
learns per-head maps W_qg [h, d, d] and W_kg, W_vg [kvh, d, d] on top of them, initialised to
the identity; they serve the global rows only (a global query against every key). All other
queries, also where they attend to a global key, use the ordinary q, k, v, as the reference
implementation does. `global_projections=False` leaves the maps out. Hence `exact`: equal to
dense attention over `pattern()` while the maps are the identity (at initialisation, or
without them); trained, the global rows are dense attention of the mapped q, k, v.

Non-global rows take one softmax over [window keys ∪ global keys], a mask function
(variants/masked.py) over the keys followed by a copy of the global ones (the window part never
counts a global key twice); global rows are a separate O(g·n) flex pass. With dilation δ > 1,
queries and keys are first regrouped by residue mod δ, where the dilated window is a plain band
(tiles of different residues are empty and skipped), so time and memory are O(n·(w + g)).
LRA's "window 512" is w = 256. Self-attention only (global tokens are positions of one
sequence).

With the sequence split over a mesh's `context` axis, `attend_split` runs the ring (ops/ring.py)
over `mask_mod` at global positions (no regrouping, no copies: a dilated window's tiles are
partial) and, with the global maps, a second ring for the g global rows. The global keys sit
on the first shard and every shard needs them, and the global rows need every shard, so both
rings take all C - 1 steps: full attention's K/V traffic (twice with the maps), while each
device computes only its window tiles, the global keys' tile and (the first) the global rows.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from flax import nnx

from attention_zoo.contract import register
from attention_zoo.ops import softmax
from attention_zoo.ops.context import context_size
from attention_zoo.options import Bool, Int
from attention_zoo.variants.masked import MaskAttention, masked_attention


@register("longformer", exact=True, supports_causal=True, supports_cross=False,
          complexity="O(n·(w + g))",
          paper="Beltagy et al. 2020, Longformer: The Long-Document Transformer (arXiv:2004.05150)",
          supports_alibi=True, supports_softcap=True, supports_segment_ids=True,
          supports_sinks=True, supports_context_parallel=True)
class LongformerAttention(MaskAttention):
  OPTIONS = {"window": Int(256, minimum=0), "dilation": Int(1, minimum=1),
             "num_global_tokens": Int(1, minimum=0), "global_projections": Bool(True)}
  TEST_OPTIONS = dict(window=2, dilation=2, num_global_tokens=2)

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.window, self.dilation, self.num_global = (
        self.options[k] for k in ("window", "dilation", "num_global_tokens"))
    with_maps = self.options["global_projections"] and self.num_global > 0
    d = self.head_dim
    identity = lambda heads: (nnx.Param(jnp.broadcast_to(jnp.eye(d), (heads, d, d)))
                              if with_maps else None)
    self.global_query = identity(self.num_heads)       # W_qg [h, d, d]
    self.global_key = identity(self.num_kv_heads)      # W_kg [kvh, d, d]
    self.global_value = identity(self.num_kv_heads)    # W_vg [kvh, d, d]

  def mask_mod(self, q_len: int, kv_len: int):
    """(b, h, q, kv) -> whether query q sees key kv: the dilated window and the global tokens
    (the pattern; `attend` runs it as a window pass and a pass of the global rows)."""
    if q_len != kv_len:
      raise ValueError(f"longformer is self-attention only: q_len ({q_len}) != kv_len ({kv_len})")
    reach, dilation, num_global = self.window * self.dilation, self.dilation, self.num_global

    def allowed(b, h, i, j):
      keep = (((abs(i - j) <= reach) & ((i - j) % dilation == 0)) | (j < num_global)
              | (i < num_global))
      return keep & softmax.causal_allowed(i, j, 0, 0) if self.causal else keep
    return allowed

  def global_inputs(self, q_rows, k, v):
    """The global rows' queries q_rows [b, g, h, d] and all k, v through W_qg, W_kg, W_vg."""
    mapped = lambda x, w, spec: jnp.einsum(spec, x, w[...].astype(x.dtype))
    return (mapped(q_rows, self.global_query, "bihd,hde->bihe"),   # [b, g, h, d]
            mapped(k, self.global_key, "bjhd,hde->bjhe"),          # [b, n, kvh, d]
            mapped(v, self.global_value, "bjhd,hde->bjhe"))

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic, alibi_slopes=None,
             segment_ids=None):
    if context_size() > 1:
      return self.attend_split(q, k, v, kv_mask=kv_mask, deterministic=deterministic,
                               alibi_slopes=alibi_slopes, segment_ids=segment_ids)
    n, window, dilation = q.shape[1], self.window, self.dilation
    num_global = min(self.num_global, n)
    # positions in residue order (0, δ, 2δ, ..., 1, 1 + δ, ...), then the global keys' copies
    order = np.concatenate([np.arange(r, n, dilation) for r in range(dilation)])
    key_positions = np.concatenate([order, np.arange(num_global)])
    regroup = (lambda x: x) if dilation == 1 else (lambda x: x[:, order])
    with_copies = lambda x: jnp.concatenate([regroup(x), x[:, :num_global]], axis=1)

    def allowed(b, h, q, kv):
      i, j = jnp.asarray(order)[q], jnp.asarray(key_positions)[kv]
      in_window = ((jnp.abs(i - j) <= window * dilation) & ((i - j) % dilation == 0)
                   & (j >= num_global))
      keep = in_window | (kv >= n)
      return keep & softmax.causal_allowed(i, j, n, n) if self.causal else keep

    out = masked_attention(self, regroup(q), with_copies(k), with_copies(v), allowed,
                           kv_mask=with_copies(kv_mask), deterministic=deterministic,
                           alibi_slopes=alibi_slopes, segment_ids=segment_ids,
                           sequence_lengths=(n, n), query_positions=order,
                           key_positions=key_positions)
    out = out if dilation == 1 else out[:, np.argsort(order)]
    if not num_global:
      return out
    # global rows: a query i < g sees every key (causal: every j <= i), through W_qg, W_kg, W_vg
    global_q, global_k, global_v = ((q[:, :num_global], k, v) if self.global_query is None
                                    else self.global_inputs(q[:, :num_global], k, v))
    sees_all = lambda b, h, q, kv: kv <= q if self.causal else kv >= 0
    global_segments = None if segment_ids is None else (segment_ids[0][:, :num_global],
                                                        segment_ids[1])
    rows = masked_attention(self, global_q, global_k, global_v, sees_all, kv_mask=kv_mask,
                            deterministic=deterministic, alibi_slopes=alibi_slopes,
                            segment_ids=global_segments, sequence_lengths=(n, n))
    return out.at[:, :num_global].set(rows)

  def attend_split(self, q, k, v, *, kv_mask, deterministic, alibi_slopes, segment_ids):
    """With the sequence split over the mesh's `context` axis: the ring (ops/ring.py) over
    `mask_mod` at global positions, then, with the global maps, a second ring of the mapped
    q, k, v whose only visible rows are the g global ones, which replace the first's."""
    n, num_global = q.shape[1], min(self.num_global, q.shape[1])
    ring = functools.partial(masked_attention, self, kv_mask=kv_mask, deterministic=deterministic,
                             alibi_slopes=alibi_slopes, segment_ids=segment_ids)
    out = ring(q, k, v, self.mask_mod(n, n))
    if self.global_query is None:
      return out
    causal = self.causal
    global_rows = lambda b, h, i, j: (i < num_global) & ((j <= i) if causal else True)
    rows = ring(*self.global_inputs(q, k, v), global_rows)
    return jnp.where((jnp.arange(n) < num_global)[None, :, None, None], rows, out)
