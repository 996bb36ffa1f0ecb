"""BigBird attention, ITC pattern (Zaheer et al. 2020), on blocks of B positions.

With query block a(i) = ⌊i/B⌋, key block a(j) = ⌊j/B⌋ and N = ⌈n/B⌉ blocks:

    A(i) = { j : |a(i) - a(j)| <= (W-1)/2 }            window of W blocks
         ∪ { j : a(j) ∈ {0, N-1} }                     global blocks, seen by every query
         ∪ { all j if a(i) ∈ {0, N-1} }                global blocks see every key
         ∪ { j : a(j) ∈ R_h(a(i)) }                    r random blocks per query block and head
    out_i = Σ_{j ∈ A(i)} softmax_j(q_i·k_j / sqrt(d)) v_j

R_h(a) is drawn with numpy, per head, as a table that depends only on N and the layer's seed:
r distinct blocks from the whole sequence (not only the first 1024 tokens, as in the LRA code),
none already in the window or global. With `seed=None` (the default) the seed is drawn once at
construction from the `params` RNG stream, so each layer of a model gets its own table (as in
the reference encoder) and the model seed reproduces them all; an int seed fixes the table
(every layer built with it shares it). Causal: window and random blocks only from the past,
only the first block global, then ∩ { j <= i }. A mask function (variants/masked.py) with
tiles of B x B, the random blocks as block-level data (a [heads, N, N] table): every tile is full
or empty but for causality and padding. The global rows see all N blocks; every other row
W + 2 + r, so time and memory are O(n·(W + 2 + r)·B) (the engine visits, per query block, the
union of the heads' random blocks). Self-attention only (N counts one sequence's blocks).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from attention_zoo.contract import register
from attention_zoo.ops import softmax
from attention_zoo.ops.blocks import ceil_div
from attention_zoo.options import Int
from attention_zoo.variants.masked import MaskAttention


@functools.lru_cache(maxsize=64)
def random_blocks(seed: int, num_blocks: int, num_heads: int, num_random: int, half_window: int,
                  causal: bool) -> np.ndarray:
  """int [num_heads, num_blocks, num_random]: each query block's random key blocks per head,
  -1 where fewer eligible blocks are left than asked for. Global query blocks (which see every
  key anyway) get none. Depends only on its arguments: the same table every call."""
  query, key = np.arange(num_blocks)[:, None], np.arange(num_blocks)[None, :]
  if causal:   # from the past, outside the window, not the global first block
    eligible = (key >= 1) & (key < query - half_window)
  else:
    inner = lambda a: (a >= 1) & (a <= num_blocks - 2)
    eligible = inner(query) & inner(key) & (np.abs(query - key) > half_window)
  rng = np.random.default_rng([seed, num_blocks, int(causal)])
  draw = np.where(eligible, rng.random((num_heads, num_blocks, num_blocks)), np.inf)
  order = np.argsort(draw, axis=-1)[..., :num_random]     # a uniform subset of the eligible blocks
  return np.sort(np.where(np.take_along_axis(draw, order, -1) < np.inf, order, -1), axis=-1)


def _draw_seed(key) -> int | None:
  """A table seed from a params key: a Python int (the table is static), or None when the key
  is abstract (construction under tracing, where only shapes are needed)."""
  try:
    return int(jax.random.randint(key, (), 0, np.iinfo(np.int32).max))
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
    return None


@register("bigbird", exact=True, supports_causal=True, supports_cross=False,
          complexity="O(n·(w + r + 2)·b)",
          paper="Zaheer et al. 2020, Big Bird: Transformers for Longer Sequences "
                "(arXiv:2007.14062)",
          supports_alibi=True, supports_softcap=True, supports_segment_ids=True,
          supports_context_parallel=True, supports_sinks=True)
class BigBirdAttention(MaskAttention):
  # seed None: drawn from the params stream at construction.
  OPTIONS = {"block_size": Int(64, minimum=1),
             "num_window_blocks": Int(3, minimum=1, where=(
                 "odd (the own block and as many on each side)", lambda n: n % 2 == 1)),
             "num_random_blocks": Int(3, minimum=0),
             "seed": Int(None, minimum=0, optional=True)}
  TEST_OPTIONS = dict(block_size=2, num_window_blocks=3, num_random_blocks=2)

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.block_size = self.options["block_size"]
    self.half_window = self.options["num_window_blocks"] // 2
    self.num_random = self.options["num_random_blocks"]
    seed = self.options["seed"]
    self.seed = _draw_seed(self.rngs.params()) if seed is None else seed

  def random_table(self, length: int) -> np.ndarray:
    """int [num_heads, num_blocks, num_random_blocks] for a sequence of `length`."""
    if self.seed is None:
      raise ValueError("bigbird: this layer was built abstractly (under nnx.eval_shape or jit), "
                       "so its random blocks, drawn from the params key, are unknown; build it "
                       "eagerly or pass an int seed")
    return random_blocks(self.seed, ceil_div(length, self.block_size), self.num_heads,
                         self.num_random, self.half_window, self.causal)

  def mask_mod(self, q_len: int, kv_len: int):
    """(b, h, q, kv) -> whether query q of head h sees key kv (the engine's mask function)."""
    if q_len != kv_len:
      raise ValueError(f"bigbird is self-attention only: q_len ({q_len}) != kv_len ({kv_len})")
    length = q_len
    block, last = self.block_size, ceil_div(length, self.block_size) - 1
    table = self.random_table(length)                                          # [h, N, r]
    blocks = np.arange(last + 1)
    random = (table[..., None] == blocks).any(-2)                             # [h, N, N]

    def allowed(b, h, q, kv):
      qb, kb = q // block, kv // block
      keep = (jnp.abs(qb - kb) <= self.half_window) | (kb == 0) | jnp.asarray(random)[h, qb, kb]
      if self.causal:
        return keep & softmax.causal_allowed(q, kv, length, length)
      return keep | (kb == last) | (qb == 0) | (qb == last)
    return allowed

  def engine_options(self) -> dict:
    return dict(heads=self.num_heads, block_q=self.block_size, block_k=self.block_size)
