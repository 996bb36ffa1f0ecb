"""MoBA, Mixture of Block Attention (Lu et al. 2025): each query attends to its own block and to
the `top_k` past blocks whose mean key is most like it, with one softmax.

Keys in blocks of B (block j: positions jB .. jB + B - 1), K̄_j the mean of block j's real keys.
Per query head, for query i in block c = ⌊i/B⌋:

    s(i, j) = q_i · K̄_j                                        gate score (no gradient)
    S(i)    = the top_k blocks j < c by s(i, j)                 (all of them if fewer)
    A(i)    = { t : ⌊t/B⌋ ∈ S(i) } ∪ { t : ⌊t/B⌋ = c, t ≤ i }
    out_i   = Σ_{t ∈ A(i)} softmax_t(q_i·k_t / sqrt(d)) v_t

The paper's top-k counts the query's own block, which it always selects (its gate is set to
+inf): its k is `top_k + 1` here. Bidirectional (causal=False): S(i) is the top_k of all blocks
j ≠ c and the own block is seen whole. Blocks without a real key (padding) are no candidates, and
padded keys enter neither a mean nor the softmax. Ties in s go to the lower block index
(`lax.top_k`'s order). The selection is per query token and per query head (a GQA group's heads
share the K/V head's means but choose for themselves).

On the engine (`attention_zoo.ops.flex`): a tile of queries in which each token chooses its own
blocks would visit the union of their choices, nearly every block. So each (query, head, slot)
with slot 0 the own block and slots 1..top_k the chosen ones becomes one row; per K/V head and
batch row the rows are sorted by their block, so a tile of B rows sees one or two key blocks
(`block_mask_from_states`, from the sorted blocks, never from an n x n mask), and the engine
returns each row's output and log-sum-exp (`return_lse`); a query's k + 1 rows are merged with
weights softmax(lse), which is exactly the softmax over the union of its blocks. Time
O(n·(k + 1)·B·d) for the attention plus O(n·(n/B)·d) for the gate scores (computed one query
block at a time), memory linear in n but for the engine's tile lists, O((n/B)²·g·(k + 1)) small
integers per K/V head. Self-attention only (blocks are positions of one sequence); no one-token
decoding. With the sequence split over a mesh's `context` axis, `attend` runs
ops/selection_ring.py's `moba_ring`: the block means made whole on every device (a `psum` of
the block sums), each device's queries choosing with the same `gate_choice`, and a ring of the
K/V shards over the chosen blocks.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from attention_zoo.ops import flex
from attention_zoo.contract import Attention, register
from attention_zoo.ops import softmax, tiles
from attention_zoo.ops.autodiff import autodiff_modes
from attention_zoo.ops.block_selection import gate_choice
from attention_zoo.ops.blocks import pad_to_multiple
from attention_zoo.ops.context import context_size
from attention_zoo.ops.selection_ring import moba_ring
from attention_zoo.options import Int


def choose_blocks(q, k, kv_real, q_real, *, block: int, top_k: int, causal: bool):
  """The key blocks each query attends to, for one K/V head of one batch row.

  q [L, g, d] (the group's query heads), k [L, d], kv_real, q_real bool [L], L a multiple of
  block -> int32 [L, g, 1 + top_k']: slot 0 the query's own block, then its chosen blocks by
  decreasing gate score, top_k' = min(top_k, L / block - 1); -1 for an empty slot (fewer
  candidates than top_k') and for every slot of a padded query.
  """
  length, group, head_dim = q.shape
  num_blocks = length // block
  real_keys = jnp.where(kv_real[:, None], k, 0).astype(jnp.float32).reshape(num_blocks, block, -1)
  counts = kv_real.reshape(num_blocks, block).sum(-1)                          # [N]
  means = real_keys.sum(1) / jnp.maximum(counts, 1)[:, None]                   # K̄ [N, d]
  choose = functools.partial(gate_choice, means=means, counts=counts, block=block, top_k=top_k,
                             causal=causal)
  positions = jnp.arange(length).reshape(num_blocks, block)
  chosen = jax.lax.map(lambda args: choose(*args), (q.reshape(num_blocks, block, group, head_dim),
                                                    positions))
  chosen = chosen.reshape(length, group, -1)
  return jnp.where(q_real[:, None, None], chosen, -1).astype(jnp.int32)


def _attend_chosen(q, k, v, kv_real, chosen, rng, *, block: int, causal: bool, scale: float,
                   dropout_rate: float):
  """Softmax attention of each query over the union of its chosen blocks, for one K/V head of
  one batch row: q [L, g, d], k, v [L, d], kv_real bool [L], chosen int32 [L, g, s] (-1: none)
  -> [L, g, dv] f32. A row per (query, head, slot), sorted by block; the engine's tiles are B
  rows by one key block."""
  length, group, slots = chosen.shape
  num_blocks = length // block
  rows = chosen.reshape(-1)                                                     # [R]: (i, g, s)
  target = jnp.where(rows >= 0, rows, num_blocks)       # an empty slot: past every block
  order = jnp.argsort(target, stable=True)
  sorted_block = target[order]                                                  # [R], ascending
  query = order // (group * slots)                                              # position i
  q_rows = q.reshape(length * group, -1)[order // slots]                        # [R, d]

  # The tiles each B rows visit: their blocks (ascending, so one or two); full when every row
  # has one block and sees all of it (causally: no row of its own block).
  tile_of_row = jnp.arange(rows.size) // block
  states = jnp.zeros((rows.size // block, num_blocks + 1), jnp.int8)
  states = states.at[tile_of_row, sorted_block].set(flex.PARTIAL)[:, :num_blocks]  # [R/B, N]
  whole = (query >= (sorted_block + 1) * block - 1) if causal else jnp.ones_like(query, bool)
  by_tile = lambda x: x.reshape(-1, block)
  one_block = by_tile(sorted_block)[:, 0] == by_tile(sorted_block)[:, -1]
  full = one_block & jnp.all(by_tile(whole), axis=1)
  states = jnp.where(full[:, None] & (states == flex.PARTIAL), flex.FULL, states)

  def mask_mod(b, h, row, kv):
    same = sorted_block[row] == kv // block
    return same & (kv <= query[row]) if causal else same

  block_mask = flex.block_mask_from_states(states[None, None], mask_mod, rows.size, length,
                                           block_q=block, block_k=block)
  out, lse = flex.flex_attention(
      q_rows[None, :, None], k[None, :, None], v[None, :, None], block_mask=block_mask,
      scale=scale, kv_mask=kv_real[None], dropout_rate=dropout_rate, dropout_rng=rng,
      return_lse=True)                                          # [1, R, 1, dv], [1, R, 1]
  out = jnp.zeros((rows.size, out.shape[-1]), jnp.float32).at[order].set(out[0, :, 0])
  lse = jnp.full((rows.size,), -jnp.inf).at[order].set(lse[0, :, 0])
  out, lse = out.reshape(length, group, slots, -1), lse.reshape(length, group, slots)
  # The slots' keys are disjoint: weighing each slot's softmax by exp(lse) / Σ exp(lse) gives
  # the softmax over their union (a slot that saw no key has lse -inf: weight 0).
  weights = softmax.masked_softmax(lse, lse > -jnp.inf)                          # [L, g, s]
  return jnp.einsum("ngs,ngsd->ngd", weights, out, precision=tiles.matmul_precision(out.dtype))


def attend_chosen_blocks(variant, q, k, v, *, q_mask, kv_mask, deterministic, block: int, choose,
                         per_head=()):
  """Each query's softmax attention over the union of the key blocks `choose` picks for it, one
  (batch row, K/V head) at a time: q [b, n, h, d], k, v [b, n, kvh, d], masks bool [b, n] ->
  [b, n, h, dv] f32. choose(q [L, g, d], k [L, d], kv_real [L], q_real [L], *extras) -> int32
  [L, g, s] as `choose_blocks` gives (L: n padded to whole blocks); per_head: arrays
  [b·kvh, ...] whose row for the head becomes `extras` (batch row major). MoBA's `attend`, and
  NSA's selected branch."""
  batch, length, num_heads, _ = q.shape
  kv_heads = variant.num_kv_heads
  group = num_heads // kv_heads
  # One sequence per (batch row, K/V head): [b·kvh, L, ...], L padded to whole blocks.
  by_head = lambda x: jnp.moveaxis(pad_to_multiple(x, block), 2, 1).reshape(
      batch * kv_heads, -1, *x.shape[3:])
  q_heads = by_head(softmax.group_heads(q, kv_heads))                         # [b·kvh, L, g, d]
  k_heads, v_heads = by_head(k), by_head(v)                                    # [b·kvh, L, d]
  real = lambda mask: jnp.repeat(pad_to_multiple(mask, block, value=False), kv_heads, axis=0)
  kv_real, q_real = real(kv_mask), real(q_mask)                                # [b·kvh, L]
  rng = variant.dropout_rng(deterministic)
  rngs = None if rng is None else jax.random.split(rng, batch * kv_heads)

  def one_head(args):
    index, q, k, v, kv_real, q_real, extras = args
    chosen = choose(q, k, kv_real, q_real, *extras)   # integers: no gradient, as in the papers
    return _attend_chosen(q, k, v, kv_real, chosen, None if rngs is None else rngs[index],
                          block=block, causal=variant.causal, scale=variant.scale,
                          dropout_rate=variant.dropout_rate)

  heads = (jnp.arange(batch * kv_heads), q_heads, k_heads, v_heads, kv_real, q_real,
           tuple(per_head))
  # A head at a time; but lax.map would hide forward-mode autodiff from the engine (which then
  # needs its plain forward: ops/autodiff.py), so under jax.jvp the heads go through vmap.
  forward_mode = autodiff_modes()[:1] == ("forward",)
  out = jax.vmap(one_head)(heads) if forward_mode else jax.lax.map(one_head, heads)
  # out [b·kvh, L, g, dv]
  out = jnp.moveaxis(out.reshape(batch, kv_heads, -1, group, out.shape[-1]), 1, 2)
  return out.reshape(batch, -1, num_heads, out.shape[-1])[:, :length]


@register("moba", exact=False, supports_causal=True, supports_cross=False,
          supports_context_parallel=True,
          complexity="O(n·(k + 1)·b + n²/b)",
          paper="Lu et al. 2025, MoBA: Mixture of Block Attention for Long-Context LLMs "
                "(arXiv:2502.13189)")
class MobaAttention(Attention):
  # 64-token blocks give 16-64 blocks at LRA's lengths (1K-4K), where a choice among blocks
  # means something (the paper's 512-4096 are for 32K-1M contexts); top_k=3 past blocks plus
  # the own block is the paper's k = 4, 256 keys per query.
  OPTIONS = {"block_size": Int(64, minimum=1), "top_k": Int(3, minimum=0)}
  # 5 blocks at length 20: queries with none, one (fewer than top_k) and several past blocks.
  TEST_OPTIONS = dict(block_size=4, top_k=2)

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.block_size = self.options["block_size"]
    self.top_k = self.options["top_k"]

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic):
    if context_size() > 1:   # the sequence split over the mesh: ops/selection_ring.py
      return moba_ring(q, k, v, q_mask=q_mask, kv_mask=kv_mask, block=self.block_size,
                       top_k=self.top_k, causal=self.causal, scale=self.scale,
                       dropout_rate=self.dropout_rate, dropout_rng=self.dropout_rng(deterministic))
    choose = functools.partial(choose_blocks, block=self.block_size, top_k=self.top_k,
                               causal=self.causal)
    return attend_chosen_blocks(self, q, k, v, q_mask=q_mask, kv_mask=kv_mask,
                                deterministic=deterministic, block=self.block_size, choose=choose)
