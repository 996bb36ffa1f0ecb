"""Attention over the top-k keys a scorer picks per query, in memory linear in the length for a
fixed k (DeepSeek Sparse Attention's selection and sparse attention; variants/dsa.py).

Two steps, both tiled:

- `lightning_top_k`: the lightning indexer's scores I_ts = Σ_j w_tj · ReLU(q_tj · k_s), one
  block of queries against one block of keys at a time, each key block merged into a running
  top-k per query (`lax.top_k` of the k best so far followed by the block's scores). No score
  array longer than a block: memory O(n·k) for the chosen positions. Integers out, so no
  gradient flows back through it.
- `attend_selected`: each query's softmax attention over its chosen keys, a block of queries at
  a time: the block gathers its keys and values [b, B, c, k, d] and the body is rematerialised
  in the backward pass (jax.checkpoint), so the gathered copies never exist for more than one
  block.

`c` is the channel axis: the K/V heads, each with its own selection, shared by the query heads
of its group.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from attention_zoo.ops import softmax
from attention_zoo.ops.blocks import ceil_div, pad_to_multiple
from attention_zoo.ops.tiles import matmul_precision

_HIGHEST = jax.lax.Precision.HIGHEST


def lightning_scores(index_q, weights, index_k):
  """I [b, m, c, n] = Σ_j weights[b, t, c, j] · ReLU(index_q[b, t, c, j] · index_k[b, s, c]):
  index_q [b, m, c, H, e], weights [b, m, c, H], index_k [b, n, c, e], all f32."""
  dots = jnp.einsum("bqcje,bkce->bqcjk", index_q, index_k, precision=_HIGHEST)  # [b, m, c, H, n]
  return jnp.einsum("bqcj,bqcjk->bqck", weights, jax.nn.relu(dots), precision=_HIGHEST)


def lightning_top_k(index_q, weights, index_k, *, kv_mask, top_k: int, causal: bool,
                    block_size: int):
  """The top_k keys by the lightning indexer's score, per query and channel.

  index_q [b, m, c, H, e], weights [b, m, c, H], index_k [b, n, c, e], kv_mask bool [b, n]
  -> int32 [b, m, c, min(top_k, n)]: key positions by decreasing score (ties: the lower
  position first, as a dense `lax.top_k` of the row), -1 in the slots left empty when a query
  sees fewer keys. A query sees the real keys, and causally those at or before it with the
  bottom-right alignment (query t of m sees keys s <= t + n - m).
  """
  batch, m, channels, _, _ = index_q.shape
  n = index_k.shape[1]
  slots = min(top_k, n)
  index_q, weights, index_k = (jax.lax.stop_gradient(jnp.asarray(x, jnp.float32))
                               for x in (index_q, weights, index_k))
  q_blocks, k_blocks = ceil_div(m, block_size), ceil_div(n, block_size)
  by_block = lambda x: jnp.moveaxis(
      pad_to_multiple(x, block_size).reshape(batch, -1, block_size, *x.shape[2:]), 1, 0)
  keys = by_block(index_k)                                                  # [K, b, B, c, e]
  real = by_block(kv_mask.astype(bool))                                     # [K, b, B]

  def query_block(args):
    qi, q_block, w_block = args                                            # [b, B, c, H, e]
    q_position = qi * block_size + jnp.arange(block_size) + (n - m)         # [B] (aligned)

    def merge(best, args):
      kj, k_block, real_block = args
      k_position = kj * block_size + jnp.arange(block_size)                 # [B]
      seen = real_block[:, None, :] & (
          (k_position[None, :] <= q_position[:, None]) if causal else True)  # [b, B, B]

      def merged(best):
        scores = jnp.where(seen[:, :, None], lightning_scores(q_block, w_block, k_block),
                           -jnp.inf)                                        # [b, B, c, B]
        # the best so far come first and hold lower positions: ties keep the lower position
        values = jnp.concatenate([best[0], scores], -1)
        positions = jnp.concatenate(
            [best[1], jnp.broadcast_to(k_position, scores.shape).astype(jnp.int32)], -1)
        top, where = jax.lax.top_k(values, slots)
        return top, jnp.take_along_axis(positions, where, -1)

      # a block no query of this block sees (causally: past the diagonal) is skipped
      return jax.lax.cond(jnp.any(seen), merged, lambda best: best, best), None

    empty = (jnp.full((batch, block_size, channels, slots), -jnp.inf),
             jnp.full((batch, block_size, channels, slots), -1, jnp.int32))
    (top, chosen), _ = jax.lax.scan(merge, empty, (jnp.arange(k_blocks), keys, real))
    return jnp.where(top > -jnp.inf, chosen, -1)

  chosen = jax.lax.map(query_block, (jnp.arange(q_blocks), by_block(index_q), by_block(weights)))
  return jnp.moveaxis(chosen, 0, 1).reshape(batch, -1, channels, slots)[:, :m]


def attend_selected(q, k, v, chosen, *, scale: float, block_size: int, dropout_rate: float = 0.0,
                    dropout_rng=None):
  """softmax(scale · q kᵀ) v of each query over its chosen keys only.

  q [b, m, h, d], k [b, n, c, d], v [b, n, c, dv] (h a multiple of c: query head i reads
  channel i // (h / c)), chosen int32 [b, m, c, s] (key positions, -1 for none) ->
  [b, m, h, dv] f32. A query with no chosen key gives 0. Dropout (rate, rng) on the weights.
  """
  batch, m, heads, _ = q.shape
  channels = k.shape[2]
  blocks = ceil_div(m, block_size)
  precision = matmul_precision(q.dtype)
  by_block = lambda x, value=0: jnp.moveaxis(pad_to_multiple(x, block_size, value=value).reshape(
      batch, blocks, block_size, *x.shape[2:]), 1, 0)
  # one gather per (batch row, channel): keys [n, d], positions [B, s] -> [B, s, d]
  gather = jax.vmap(jax.vmap(lambda x, i: x[i], in_axes=(1, 1), out_axes=1))

  @jax.checkpoint
  def query_block(args):
    index, q_block, chosen_block = args          # [b, B, c, g, d], [b, B, c, s]
    taken = chosen_block >= 0
    safe = jnp.maximum(chosen_block, 0)
    k_sel, v_sel = gather(k, safe), gather(v, safe)                         # [b, B, c, s, d]
    scores = jnp.einsum("bqcgd,bqcsd->bqcgs", q_block, k_sel, precision=precision,
                        preferred_element_type=jnp.float32) * scale         # [b, B, c, g, s]
    weights = softmax.masked_softmax(scores, taken[:, :, :, None])
    if dropout_rng is not None:
      weights = softmax.dropout(weights, dropout_rate, jax.random.fold_in(dropout_rng, index))
    return jnp.einsum("bqcgs,bqcsd->bqcgd", weights, v_sel.astype(jnp.float32),
                      precision=_HIGHEST)                                   # [b, B, c, g, dv]

  out = jax.lax.map(query_block, (jnp.arange(blocks), by_block(softmax.group_heads(q, channels)),
                                  by_block(chosen, -1)))
  return jnp.moveaxis(out, 0, 1).reshape(batch, blocks * block_size, heads, -1)[:, :m]
