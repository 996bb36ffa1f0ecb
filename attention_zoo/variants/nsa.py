"""NSA, Native Sparse Attention (Yuan et al. 2025): three attention branches over the same
queries, mixed by learned gates.

The paper (1-based positions, t the query, l / d the compression block length / stride, l' the
selection block, n blocks selected (n_sel below), w the window, C = {cmp, slc, win}):

    o*_t = Σ_{c ∈ C} g_t^c · Attn(q_t, K̃_t^c, Ṽ_t^c),    g_t^c = σ(MLP(x_t))           (5)
    K̃_t^cmp = { φ(k_{id+1 : id+l}) | 0 <= i <= ⌊(t - l)/d⌋ }  (Ṽ_t^cmp likewise)       (7)
    p_t^cmp = Softmax(q_tᵀ K̃_t^cmp)                                                       (8)
    p_t^slc[j] = Σ_{m=0}^{l'/d - 1} Σ_{n=0}^{l/d - 1} p_t^cmp[(l'/d)·j - m - n]           (9)
    p_t^slc'   = Σ_{h in the GQA group} p_t^{slc,(h)}                                     (10)
    I_t = { i | rank(p_t^slc'[i]) <= n },   K̃_t^slc = Cat[{ k_{il'+1 : (i+1)l'} | i ∈ I_t }] (11-12)
    K̃_t^win = k_{t-w : t}

φ is a learned MLP with intra-block position encoding; n counts the initial block and the two
local blocks, which are always selected. Here, 0-based (T tokens, query t of block c = ⌊t/l'⌋,
scale s = d_head^-1/2, m_t = 1 for a real key):

    K̃_i = φ_K(k_{id .. id+l-1}),   φ(X) = W₂ gelu(W₁ vec(m ⊙ X + P) + b₁) + b₂,   i < ⌈T/d⌉
    o_t^cmp = Σ_{i : id + l - 1 <= t} softmax_i(s q_t·K̃_i) Ṽ_i        (blocks ending by t)
    P_t[i]  = that softmax, one per head; importance of selection block j:
    imp_t[j] = Σ_{heads of the group} Σ_{m=0}^{l'/d - 1} Σ_{r=0}^{l/d - 1} P_t[(l'/d)·j + m - r]
    S_t     = {0, c - 1, c} ∪ the best of the other blocks j <= c by imp_t, n_sel in all
    o_t^slc = Σ_{t' <= t, ⌊t'/l'⌋ ∈ S_t} softmax_{t'}(s q_t·k_{t'}) v_{t'}
    o_t^win = Σ_{t - w <= t' <= t} softmax_{t'}(s q_t·k_{t'}) v_{t'}
    o_t     = Σ_c σ(w_c^h·q_t^h + b_c^h) o_t^c                           per head h

imp_t is (9)-(10) in 0-based indices: each of block j's l'/d stride segments collects the l/d
compression blocks that cover it (the paper's (l'/d)·j - m - n is that sum with j and i
counted from 1). Every selection block is a candidate only if it holds a real key; ties go to
the lower block (`lax.top_k`); with at most n_sel candidates a query sees them all (the selected
branch is then causal `full`). The selection is integers: no gradient, as in the paper.

Where ours differs from the paper:
- The gates come from the head's query, not from x: a variant is handed q, k, v (the layer's
  projections), and q_t^h = W_Q^h x_t, so σ(w·q_t^h + b) is a linear gate on x through the
  head's query projection (rank d_head, not d_model), as some reimplementations do; this keeps
  NSA a plain attention variant that every model and `interop` can use.
- The three branches share the layer's K and V (the paper gives each branch its own, against
  shortcut learning); only the compressed branch transforms them (φ_K, φ_V).
- φ: two layers (hidden width d_head, tanh-approximated gelu) on the flattened block plus a
  learned position encoding P [l, d_head], one for keys and one for values, shared by the K/V
  heads. Padded keys enter φ as zeros; a compressed block with no real key is masked.
- Compression blocks start every d positions up to the sequence's end (the last ones zero-
  padded), so appended padding creates no block a real query sees. Causally a query sees only
  blocks that end at or before it, which is (7).
- P_t uses the compressed branch's scaled scores (the paper writes q_tᵀ K̃ without the scale).
- The window holds keys t - w .. t (w + 1 keys: the zoo's `sliding_window`).
- A bidirectional form (causal=False; the paper's is causal): every real compressed block,
  the selection among all blocks (still with 0, c - 1 and c), the window |t - t'| <= w.

Every branch runs on the block-sparse engine (attention_zoo.ops.flex): the compressed one over the
⌈T/d⌉ compressed keys with the mask id + l - 1 <= t (O(T²/d) time, as the paper's), the
selected one as MoBA's (`moba.attend_chosen_blocks`: a row per (query, head, selected block),
sorted by block, tiles of l' rows by one key block, the rows merged by their log-sum-exps; the
importance computed one query block at a time), the window as `sliding_window`'s mask. Memory is
linear in T, mostly the selected branch's rows (each query copied once per selected block:
T·g·n_sel·d floats per K/V head, 16x the queries at the defaults), but for the engine's tile
lists of that branch, O((T/l')²·g·n_sel) small integers per K/V head. Self-attention only; no
one-token decoding. With the sequence split over a mesh's `context` axis: each device compresses
the blocks that start in its shard (`sequence_compression_blocks`), the compressed and selected
branches run ops/selection_ring.py's `nsa_ring` (the compressed keys and values gathered, the
selection local, a ring of the K/V shards over the chosen blocks) and the window the ring
attention of ops/ring.py.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from attention_zoo.contract import Attention, register
from attention_zoo.ops import softmax
from attention_zoo.ops.block_selection import (compressed_seen, group_probabilities,
                                               importance_choice)
from attention_zoo.ops.context import context_size
from attention_zoo.ops.selection_ring import nsa_ring, sequence_compression_blocks
from attention_zoo.options import Int
from attention_zoo.variants.masked import masked_attention
from attention_zoo.variants.moba import attend_chosen_blocks

BRANCHES = ("compressed", "selected", "window")


def choose_blocks(q, k, kv_real, q_real, compressed_keys, compressed_real, *, scale: float,
                  length: int, stride: int, block: int, count: int, causal: bool):
  """The selection blocks each query attends to, for one K/V head of one batch row, shared by
  its query heads: q [L, g, d], kv_real, q_real bool [L] (L a multiple of block), compressed_keys
  [N, d], compressed_real bool [N] -> int32 [L, g, min(count, L / block)], by decreasing
  importance (the forced blocks first); -1 for an empty slot and every slot of a padded query.
  k (the keys themselves) is unused: the choice reads only their compressions."""
  seq_len, group, _ = q.shape
  num_blocks = seq_len // block
  has_real = kv_real.reshape(num_blocks, block).any(-1)                        # [N_s]

  def choose(q_c, positions):   # one query block: q_c [B, g, d] -> [B, slots]
    seen = compressed_seen(positions, compressed_real, length=length, stride=stride,
                           causal=causal)                                     # [B, N]
    p = group_probabilities(q_c, compressed_keys, seen, scale=scale)          # [B, N]
    return importance_choice(p, positions, has_real, length=length, stride=stride, block=block,
                             count=count, causal=causal)

  positions = jnp.arange(seq_len).reshape(num_blocks, block)
  chosen = jax.lax.map(lambda args: choose(*args), (q.reshape(num_blocks, block, group, -1),
                                                    positions))
  chosen = chosen.reshape(seq_len, 1, -1)
  chosen = jnp.broadcast_to(chosen, (seq_len, group, chosen.shape[-1]))
  return jnp.where(q_real[:, None, None], chosen, -1).astype(jnp.int32)


class BlockCompression(nnx.Module):
  """φ: a block of keys (or values) [..., l, d] -> one [..., d], an MLP on the flattened block
  plus a learned intra-block position encoding."""

  def __init__(self, length: int, head_dim: int, rngs: nnx.Rngs):
    self.position = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (length, head_dim)))
    self.hidden = nnx.Linear(length * head_dim, head_dim, rngs=rngs)
    self.out = nnx.Linear(head_dim, head_dim, rngs=rngs)

  def __call__(self, blocks):
    x = (blocks.astype(jnp.float32) + self.position[...]).reshape(*blocks.shape[:-2], -1)
    return self.out(jax.nn.gelu(self.hidden(x)))


@register("nsa", exact=False, supports_causal=True, supports_cross=False,
          supports_context_parallel=True,
          complexity="O(n²/d + n·(n_sel·l' + w))",
          paper="Yuan et al. 2025, Native Sparse Attention: Hardware-Aligned and Natively "
                "Trainable Sparse Attention (arXiv:2502.11089)")
class NativeSparseAttention(Attention):
  # The paper's settings: compression blocks of 32 every 16, selection blocks of 64, 16 of them
  # (the initial block and the 2 local ones included), a 512-token window.
  OPTIONS = {"block_length": Int(32, minimum=1), "block_stride": Int(16, minimum=1),
             "selection_block": Int(64, minimum=1), "selected_blocks": Int(16, minimum=3),
             "window": Int(512, minimum=0)}
  # Length 20: 9 compressed blocks, 5 selection blocks of which the last queries choose 1 freely
  # (blocks 0, c - 1, c forced), a window shorter than a block's span.
  TEST_OPTIONS = dict(block_length=4, block_stride=2, selection_block=4, selected_blocks=4,
                      window=3)

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.length, self.stride = self.options["block_length"], self.options["block_stride"]
    self.selection_block = self.options["selection_block"]
    self.selected_blocks, self.window = self.options["selected_blocks"], self.options["window"]
    for name, size in (("block_length", self.length), ("selection_block", self.selection_block)):
      if size % self.stride:
        raise self.option_error(name, f"a multiple of block_stride={self.stride} (the paper's "
                                      f"mapping from compression to selection blocks needs it)")
    self.compress_key = BlockCompression(self.length, self.head_dim, self.rngs)
    self.compress_value = BlockCompression(self.length, self.head_dim, self.rngs)
    init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    self.gate_kernel = nnx.Param(init(self.rngs.params(),
                                      (self.num_heads, self.head_dim, len(BRANCHES))))
    self.gate_bias = nnx.Param(jnp.zeros((self.num_heads, len(BRANCHES))))

  def compress(self, k, v, kv_mask):
    """-> compressed keys and values [b, N, kvh, d] (k's dtype), N = ⌈n/stride⌉, and which
    blocks hold a real key, bool [b, N]."""
    blocks = functools.partial(sequence_compression_blocks, length=self.length, stride=self.stride)
    real = kv_mask[:, :, None, None]
    k_blocks, v_blocks = (blocks(jnp.where(real, x, 0)) for x in (k, v))      # [b, N, kvh, l, d]
    compressed_real = blocks(real)[:, :, 0, :, 0].any(-1)                      # [b, N]
    return (self.compress_key(k_blocks).astype(k.dtype),
            self.compress_value(v_blocks).astype(v.dtype), compressed_real)

  def gates(self, q):
    """q [b, n, h, d] -> σ(w_c^h·q_t^h + b_c^h), f32 [b, n, h, 3] in BRANCHES' order."""
    logits = jnp.einsum("bnhd,hdc->bnhc", q.astype(jnp.float32), self.gate_kernel[...])
    return jax.nn.sigmoid(logits + self.gate_bias[...])

  def branches(self, q, k, v, *, q_mask, kv_mask, deterministic=True):
    """The three branches' outputs, each [b, n, h, d] f32, in BRANCHES' order."""
    causal, length, stride, window = self.causal, self.length, self.stride, self.window
    k_cmp, v_cmp, cmp_real = self.compress(k, v, kv_mask)
    if context_size() > 1:   # split over the mesh: ops/selection_ring.py (the window: the ring)
      compressed, selected = nsa_ring(
          q, k, v, k_cmp, v_cmp, cmp_real, q_mask=q_mask, kv_mask=kv_mask, length=length,
          stride=stride, block=self.selection_block, count=self.selected_blocks, causal=causal,
          scale=self.scale, dropout_rate=self.dropout_rate,
          dropout_rng=self.dropout_rng(deterministic))
    else:
      ends_by = lambda b, h, t, i: (i * stride + length - 1 <= t) if causal else (i >= 0)
      compressed = masked_attention(self, q, k_cmp, v_cmp, ends_by, kv_mask=cmp_real,
                                    deterministic=deterministic, alibi_slopes=None)

      rows = k.shape[0] * self.num_kv_heads
      per_head = (jnp.moveaxis(k_cmp, 2, 1).reshape(rows, -1, k.shape[-1]),       # [b·kvh, N, d]
                  jnp.repeat(cmp_real, self.num_kv_heads, axis=0))                # [b·kvh, N]
      choose = functools.partial(choose_blocks, scale=self.scale, length=length, stride=stride,
                                 block=self.selection_block, count=self.selected_blocks,
                                 causal=causal)
      selected = attend_chosen_blocks(self, q, k, v, q_mask=q_mask, kv_mask=kv_mask,
                                      deterministic=deterministic, block=self.selection_block,
                                      choose=choose, per_head=per_head)

    near = softmax.window_allowed(window, q.shape[1], k.shape[1], causal)
    windowed = masked_attention(self, q, k, v, near, kv_mask=kv_mask,
                                deterministic=deterministic, alibi_slopes=None)
    return tuple(x.astype(jnp.float32) for x in (compressed, selected, windowed))

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic):
    outputs = self.branches(q, k, v, q_mask=q_mask, kv_mask=kv_mask, deterministic=deterministic)
    gates = self.gates(q)                                                     # [b, n, h, 3]
    return sum(gates[..., c, None] * out for c, out in enumerate(outputs))
