"""Sparse Sinkhorn attention (Tay, Bahri, Yang, Metzler & Juan 2020).

The sequence is cut into contiguous blocks of `block_size`. A learned sorting network scores
block pairs from block summaries (masked means of the block's queries, s^q_i, and keys, s^k_j),
per query head:

    R_ij = (s^q_i W_q) · (s^k_j W_k) / sqrt(d)          # W_q, W_k [d, d]: nnx.Params

and `sinkhorn_iters` rounds of Sinkhorn normalisation turn exp((R + ε) / temperature) into a
soft permutation P (rows, then columns, normalised in log space). ε is the Gumbel noise of
Gumbel-Sinkhorn: in training (deterministic=False) ε_ij = -log(-log U_ij), U_ij ~ U(0, 1),
drawn from the `dropout` RNG stream at each call; in evaluation ε = 0, so evaluation is
deterministic. `gumbel_noise=False` leaves the noise out in training too. Query block i
attends, with one softmax, to its own block and to the soft-sorted block Σ_j P_ij K_j (values
likewise):

    o = softmax([Q_i K_iᵀ ; Q_i (P K)_iᵀ] / sqrt(d)) [V_i ; (P V)_i]

Slot t of the sorted block is the P-weighted mean of the real tokens at slot t of the blocks
(equal to (P K)_i when P is a permutation and nothing is padded); a slot with no real token is
masked. Fully padded blocks take no part in the sort, so padding never moves a real block.

Causal (the paper's causal Sinkhorn balancing): block i may only be sorted onto blocks j < i,
its summary is the mean of the queries of the blocks before it, the column normalisation of
row i runs over rows ≤ i only (a cumulative log-sum-exp), and the own block is causally masked.

Deviation from the paper, which maps each block summary to logits over a fixed maximum number
of blocks: the sorting network here scores block pairs, so it needs no max_len.
Memory O(n·b + (n/b)²) per head for block size b.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from attention_zoo.contract import Attention, register
from attention_zoo.ops import softmax
from attention_zoo.ops.blocks import pad_to_multiple
from attention_zoo.options import Bool, Float, Int

_MASKED = -1e30  # log-weight of a block pair outside the sort (finite: keeps gradients finite)


@register("sinkhorn", exact=False, supports_causal=True, supports_cross=False,
          complexity="O(n·b + (n/b)²)",
          paper="Tay, Bahri, Yang, Metzler & Juan 2020, Sparse Sinkhorn Attention "
                "(arXiv:2002.11296)")
class SinkhornAttention(Attention):
  OPTIONS = {"block_size": Int(50, minimum=1), "sinkhorn_iters": Int(5, minimum=1),
             "temperature": Float(0.75, above=0), "gumbel_noise": Bool(True)}
  TEST_OPTIONS = dict(block_size=4)

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.block_size, self.sinkhorn_iters, self.temperature = (
        self.options[k] for k in ("block_size", "sinkhorn_iters", "temperature"))
    init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    shape = (self.num_heads, self.head_dim, self.head_dim)
    self.sort_query = nnx.Param(init(self.rngs.params(), shape))  # [h, d, d]
    self.sort_key = nnx.Param(init(self.rngs.params(), shape))    # [h, d, d]

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic):
    q_len = q.shape[1]
    q, k, v = (pad_to_multiple(x, self.block_size) for x in (q, k, v))
    q_mask, kv_mask = (pad_to_multiple(m, self.block_size, value=False) for m in (q_mask, kv_mask))
    sort = self.sort_matrix(q, k, q_mask=q_mask, kv_mask=kv_mask, deterministic=deterministic)
    return self.attend_sorted(q, k, v, sort, q_mask=q_mask, kv_mask=kv_mask,
                              deterministic=deterministic)[:, :q_len]

  def sort_matrix(self, q, k, *, q_mask, kv_mask, deterministic: bool = True):
    """The soft permutation P [b, kvh, g, nb, nb] (row i: which blocks block i is sorted onto).

    q [b, n, h, d], k [b, n, kvh, d], masks [b, n]; n a multiple of block_size. Gumbel noise
    is added to the logits only when deterministic=False (and gumbel_noise=True).
    """
    b, n, h, d = q.shape
    kvh, bs, nb = self.num_kv_heads, self.block_size, n // self.block_size
    q_in, k_in = q_mask.reshape(b, nb, bs), kv_mask.reshape(b, nb, bs)
    qb = softmax.group_heads(q, kvh).reshape(b, nb, bs, kvh, h // kvh, d)
    kb = k.reshape(b, nb, bs, kvh, d)
    q_sum = jnp.einsum("bnt,bntkgd->bnkgd", q_in.astype(jnp.float32), qb,
                       preferred_element_type=jnp.float32)         # [b, nb, kvh, g, d]
    q_count = jnp.sum(q_in, axis=-1).astype(jnp.float32)           # [b, nb]
    k_sum = jnp.einsum("bnt,bntkd->bnkd", k_in.astype(jnp.float32), kb,
                       preferred_element_type=jnp.float32)         # [b, nb, kvh, d]
    k_count = jnp.sum(k_in, axis=-1).astype(jnp.float32)
    if self.causal:  # block i asks with the queries of the blocks before it
      q_sum = jnp.cumsum(q_sum, axis=1) - q_sum
      q_count = jnp.cumsum(q_count, axis=1) - q_count
    q_summary = q_sum / jnp.maximum(q_count, 1.0)[:, :, None, None, None]
    k_summary = k_sum / jnp.maximum(k_count, 1.0)[:, :, None, None]

    w_q = self.sort_query[...].reshape(kvh, h // kvh, d, d)
    w_k = self.sort_key[...].reshape(kvh, h // kvh, d, d)
    rows = jnp.einsum("bikgd,kgde->bkgie", q_summary, w_q)        # [b, kvh, g, nb, d]
    cols = jnp.einsum("bjkd,kgde->bkgje", k_summary, w_k)         # [b, kvh, g, nb, d]
    logits = jnp.einsum("bkgie,bkgje->bkgij", rows, cols) * d ** -0.5  # [b, kvh, g, nb, nb]
    if self.options["gumbel_noise"] and not deterministic:
      logits = logits + jax.random.gumbel(self.rngs.dropout(), logits.shape, logits.dtype)

    valid = (k_count > 0)[:, None, :]                              # [b, 1, nb]: real key blocks
    if self.causal:
      valid = valid & (jnp.arange(nb)[None, :, None] > jnp.arange(nb)[None, None, :])
    else:
      valid = valid & (q_count > 0)[:, :, None]
    return sinkhorn(logits / self.temperature, valid[:, None, None], self.sinkhorn_iters,
                    self.causal)

  def attend_sorted(self, q, k, v, sort, *, q_mask, kv_mask, deterministic):
    """Block attention to the own block and the block sorted by `sort` [b, kvh, g, nb, nb].

    Shapes as `sort_matrix`; -> [b, n, h, d] (f32).
    """
    b, n, h, d = q.shape
    kvh, bs, nb = self.num_kv_heads, self.block_size, n // self.block_size
    qb = softmax.group_heads(q, kvh).reshape(b, nb, bs, kvh, h // kvh, d)
    k_in = kv_mask.reshape(b, nb, bs)
    kb, vb = (jnp.where(k_in[..., None, None], x.reshape(b, nb, bs, kvh, d), 0) for x in (k, v))

    # The sorted block: at each slot, the sort-weighted mean of the real tokens of the blocks.
    slot_weight = jnp.einsum("bkgij,bjt->bkgit", sort,
                             k_in.astype(sort.dtype))              # [b, kvh, g, nb, bs]
    sorted_real = slot_weight > 0
    norm = jnp.where(sorted_real, slot_weight, 1.0)[..., None]
    sorted_k, sorted_v = (jnp.einsum("bkgij,bjtkd->bkgitd", sort, x,
                                     preferred_element_type=jnp.float32) / norm
                          for x in (kb, vb))                       # [b, kvh, g, nb, bs, d]

    own = jnp.einsum("bitkgd,biskd->bkgits", qb, kb, preferred_element_type=jnp.float32)
    other = jnp.einsum("bitkgd,bkgisd->bkgits", qb, sorted_k.astype(q.dtype),
                       preferred_element_type=jnp.float32)         # [b, kvh, g, nb, bs, bs]
    scores = jnp.concatenate([own, other], axis=-1) * self.scale   # [b, kvh, g, nb, bs, 2bs]
    own_allowed = k_in[:, None, None, :, None, :]                  # [b, 1, 1, nb, 1, bs]
    if self.causal:
      own_allowed = own_allowed & softmax.causal_allowed(
          jnp.arange(bs)[:, None], jnp.arange(bs)[None, :], bs, bs)
    own_allowed = jnp.broadcast_to(own_allowed, own.shape)
    allowed = jnp.concatenate(
        [own_allowed, jnp.broadcast_to(sorted_real[..., None, :], other.shape)], -1)
    weights = self.dropout(softmax.masked_softmax(scores, allowed), deterministic)
    weights = weights.astype(v.dtype)
    out = (jnp.einsum("bkgits,biskd->bitkgd", weights[..., :bs], vb,
                      preferred_element_type=jnp.float32)
           + jnp.einsum("bkgits,bkgisd->bitkgd", weights[..., bs:], sorted_v.astype(v.dtype),
                        preferred_element_type=jnp.float32))      # [b, nb, bs, kvh, g, d]
    return out.reshape(b, n, h, d)


def sinkhorn(logits, valid, iters: int, causal: bool):
  """Sinkhorn normalisation in log space over the `valid` entries of [..., rows, cols].

  Each iteration normalises the rows, then the columns; causal: the columns of row i are
  normalised over rows ≤ i only. Rows with no valid entry give zeros.
  """
  def iteration(_, x):
    x = jnp.where(valid, x - jax.nn.logsumexp(x, axis=-1, keepdims=True), _MASKED)
    col = (jax.lax.cumlogsumexp(x, axis=x.ndim - 2) if causal
           else jax.nn.logsumexp(x, axis=-2, keepdims=True))
    return jnp.where(valid, x - col, _MASKED)

  x = jax.lax.fori_loop(0, iters, iteration, jnp.where(valid, logits, _MASKED))
  return jnp.where(valid, jnp.exp(x), 0.0)
