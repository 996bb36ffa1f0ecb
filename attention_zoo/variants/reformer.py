"""Reformer LSH attention (Kitaev, Kaiser & Levskaya 2020), with shared QK.

Shared QK: keys are the unit-normalised queries, k_j = q_j / ||q_j|| (the spec says
`shared_qk=True`: the layer projects one tensor for both). `attend` ignores the values of its
`k` argument and uses q for both. With GQA each query head hashes and sorts its own queries and
gathers the values of its K/V group in that order.

Each of `n_hashes` rounds r draws a random rotation R_r [d, n_buckets/2] and hashes

    h_r(x) = argmax([x R_r ; -x R_r])          (x = q / ||q||)

sorts the tokens by (bucket, position), cuts the sorted order into chunks of `chunk_len`, and
lets each chunk see itself and the previous chunk (no wrap-around). `num_chunks` (instead of
chunk_len) cuts a sequence of n into that many chunks of ceil(n / num_chunks), as the released
LRA code did (n_buckets = 10 chunks per hash round, whatever the length). Query i attends to
the union of what it sees over the rounds, P_i = ∪_r P_i^(r), without itself:

    o_i = Σ_{j ∈ P_i} exp(s_ij) v_j / Σ_{j ∈ P_i} exp(s_ij),     s_ij = q_i·k_j / sqrt(d)

computed round by round with the paper's duplicate correction s_ij - log N_ij (N_ij = rounds
in which j ∈ P_i^(r)) and combined by the rounds' log-sum-exp. A query attends to itself only
when P_i is empty. Causal: j ≤ i by original position. Padding: tokens that are neither a real
query nor a real key go to an extra bucket sorted after every real one, so they never move a
real token's chunk; padded keys are masked. `n_buckets=None` uses twice the number of chunks,
2·max(1, n // chunk length), for the padded length n; `n_buckets=1` skips hashing, so chunks
are contiguous blocks of the real tokens in position order.

Rotations are drawn from a key fixed at construction in evaluation (deterministic=True) and
fresh from `rngs.dropout()` at each training call; `eval_rotations="fresh"` draws them from
`rngs.dropout()` in evaluation too, as HuggingFace's LSHSelfAttention does (hash_seed=None), so
predictions are random. `duplicate_correction=False` drops the - log N_ij term, as
HuggingFace's does: a key seen in several rounds then counts once per round. Dropout acts on
the chunk weights.
Memory O(n·chunk_len·n_hashes) per head; the hashing runs over blocks of about 1024 positions,
so its rotated vectors take O(1024·n_buckets), not O(n·n_buckets) (n_buckets grows with n).

Causality with content routing: the chunk boundaries depend on every token's bucket, so a
future token's query can move which past tokens a query sees (never a future one). The causal
guarantee is therefore: outputs before position t do not depend on values at positions ≥ t;
the conformance suite checks it by changing future values only (its settings for reformer).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from attention_zoo.contract import Attention, register
from attention_zoo.ops import softmax
from attention_zoo.ops.blocks import pad_to_multiple
from attention_zoo.options import Bool, Choice, Int


_HASH_BLOCK = 1024  # positions hashed at once (rounded to whole chunks)


class RotationKey(nnx.Variable):
  """Non-trainable state: the key the evaluation-time random rotations are drawn from."""


@register("reformer", exact=False, supports_causal=True, supports_cross=False,
          complexity="O(n·c·r)",
          paper="Kitaev, Kaiser & Levskaya 2020, Reformer: The Efficient Transformer "
                "(arXiv:2001.04451)",
          shared_qk=True)
class ReformerAttention(Attention):
  # num_chunks None: chunks of chunk_len; n_buckets None: derived from the length.
  OPTIONS = {"chunk_len": Int(64, minimum=1), "num_chunks": Int(None, minimum=1, optional=True),
             "n_buckets": Int(None, minimum=1, optional=True, where=(
                 "1 or even (random-rotation hashing splits buckets into ± pairs)",
                 lambda n: n == 1 or n % 2 == 0)),
             "n_hashes": Int(1, minimum=1),
             # HuggingFace's LSHSelfAttention: "fresh" and False (module docstring)
             "eval_rotations": Choice("fixed", ("fixed", "fresh")),
             "duplicate_correction": Bool(True)}
  # A fixed n_buckets, so lengths 20 and 25 (appended padding) hash the same way.
  TEST_OPTIONS = dict(chunk_len=4, n_buckets=4)
  CONTENT_ROUTING = True   # LSH buckets: which keys a query sees depends on content

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    if self.options["num_chunks"] is not None and "chunk_len" in kwargs:
      raise self.option_error("num_chunks", f"None when chunk_len is given (chunk_len="
                                            f"{self.options['chunk_len']}): give chunk_len or "
                                            f"num_chunks, not both")
    self.n_hashes = self.options["n_hashes"]
    self.rotation_key = RotationKey(jax.random.key_data(self.rngs.params()))

  def chunk_length(self, length: int) -> int:
    """Chunk length for a sequence of `length` (the same before and after padding to it)."""
    num_chunks = self.options["num_chunks"]
    return self.options["chunk_len"] if num_chunks is None else -(-length // num_chunks)

  def num_buckets(self, padded_len: int) -> int:
    """The bucket count used for a sequence padded to `padded_len` (a chunk-length multiple)."""
    if self.options["n_buckets"] is None:
      return 2 * max(1, padded_len // self.chunk_length(padded_len))
    return self.options["n_buckets"]

  def hash_buckets(self, q, in_use, n_buckets: int, deterministic: bool):
    """q [b, n, h, d] (n a chunk-length multiple), in_use bool [b, n] -> buckets [b, h, r, n].

    Tokens not in use get bucket `n_buckets`, sorted after every real one.
    """
    b, n, h, d = q.shape
    if n_buckets == 1:
      buckets = jnp.zeros((b, h, self.n_hashes, n), jnp.int32)
    else:
      fixed = deterministic and self.options["eval_rotations"] == "fixed"
      key = jax.random.wrap_key_data(self.rotation_key[...]) if fixed else self.rngs.dropout()
      rotations = jax.random.normal(key, (h, self.n_hashes, d, n_buckets // 2), jnp.float32)

      def hash_block(x):  # x [b, block, h, d] -> [b, h, r, block]
        rotated = jnp.einsum("bnhd,hrdk->bhrnk", _unit(x), rotations)  # [b, h, r, block, buckets/2]
        # argmax over [rotated, -rotated] without forming the concatenation
        positive = jnp.max(rotated, axis=-1) >= -jnp.min(rotated, axis=-1)
        return jnp.where(positive, jnp.argmax(rotated, axis=-1),
                         jnp.argmin(rotated, axis=-1) + n_buckets // 2).astype(jnp.int32)

      # Hash _HASH_BLOCK positions at a time: the rotated vectors grow with n_buckets (∝ n by
      # default), so hashing everything at once would take O(n²/chunk_len) memory.
      cl = self.chunk_length(n)
      blocks = jnp.moveaxis(q.reshape(b, n // cl, cl, h, d), 1, 0)
      buckets = jax.lax.map(hash_block, blocks, batch_size=max(1, _HASH_BLOCK // cl))
      buckets = jnp.moveaxis(buckets, 0, 3).reshape(b, h, self.n_hashes, n)  # [b, h, r, n]
    return jnp.where(in_use[:, None, None, :], buckets, n_buckets)

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic):
    del k  # shared QK: the keys are the unit-normalised queries
    b, q_len, h, d = q.shape
    kvh, cl, rounds = self.num_kv_heads, self.chunk_length(q_len), self.n_hashes
    q, v = pad_to_multiple(q, cl), pad_to_multiple(v, cl)
    q_mask = pad_to_multiple(q_mask, cl, value=False)
    kv_mask = pad_to_multiple(kv_mask, cl, value=False)
    n = q.shape[1]
    nc = n // cl

    buckets = self.hash_buckets(q, q_mask | kv_mask, self.num_buckets(n), deterministic)
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), buckets.shape)
    _, order = jax.lax.sort((buckets, positions), num_keys=2)      # [b, h, r, n]: slot -> position
    undo = jnp.argsort(order, axis=-1)                             # [b, h, r, n]: position -> slot

    # Each round's tokens in sorted order (per query head: every head sorts differently).
    sq = jnp.take_along_axis(jnp.swapaxes(q, 1, 2)[:, :, None], order[..., None],
                             axis=3)                               # [b, h, r, n, d]
    sv = jnp.take_along_axis(jnp.swapaxes(v, 1, 2), order.reshape(b, kvh, -1, 1), axis=2)
    sv = sv.reshape(b, h, rounds, n, d)                            # [b, h, r, n, d]
    s_real = jnp.take_along_axis(kv_mask[:, None, None, :], order, axis=-1)  # [b, h, r, n]

    # Chunks of the sorted order; keys are the chunk itself and the previous chunk.
    chunk = lambda x: x.reshape(b, h, rounds, nc, cl, *x.shape[4:])
    look_back = lambda x, fill: jnp.concatenate([_previous_chunk(x, fill), x], axis=4)
    cq = chunk(sq)                                                 # [b, h, r, c, cl, d]
    ck = look_back(chunk(_unit(sq).astype(sq.dtype)), 0)           # [b, h, r, c, 2cl, d]
    cv = look_back(chunk(sv), 0)                                   # [b, h, r, c, 2cl, d]
    q_pos = chunk(order)                                           # [b, h, r, c, cl]
    k_pos = look_back(q_pos, -1)                                   # [b, h, r, c, 2cl]
    k_real = look_back(chunk(s_real), False)

    allowed = (k_real[..., None, :]
               & (k_pos[..., None, :] != q_pos[..., :, None]))     # [b, h, r, c, cl, 2cl]
    if self.causal:
      allowed &= softmax.causal_allowed(q_pos[..., :, None], k_pos[..., None, :], n, n)
    scores = jnp.einsum("bhrcqd,bhrckd->bhrcqk", cq, ck,
                        preferred_element_type=jnp.float32) * self.scale
    if rounds > 1 and self.options["duplicate_correction"]:
      scores = scores - jnp.log(_duplicate_counts(undo, order, cl).astype(jnp.float32))
    weights = self.dropout(softmax.masked_softmax(scores, allowed), deterministic)
    out = jnp.einsum("bhrcqk,bhrckd->bhrcqd", weights.astype(cv.dtype), cv,
                     preferred_element_type=jnp.float32)           # [b, h, r, c, cl, d]
    lse, sees = _masked_logsumexp(scores, allowed)                 # [b, h, r, c, cl]

    # Back to positions; the rounds are combined by their log-sum-exp.
    unsort = lambda x: jnp.take_along_axis(x.reshape(b, h, rounds, n, *x.shape[5:]),
                                           undo.reshape(undo.shape + (1,) * (x.ndim - 5)), axis=3)
    out, lse, sees = unsort(out), unsort(lse), unsort(sees)       # [b, h, r, n, (d)]
    round_weights = softmax.masked_softmax(lse, sees, axis=2)   # [b, h, r, n]
    out = jnp.sum(round_weights[..., None] * out, axis=2)         # [b, h, n, d]

    # A query that sees nothing but itself attends to itself (when it is a real key).
    group = lambda x: x.reshape(b, kvh, h // kvh, *x.shape[2:])
    self_value = jnp.where(kv_mask[:, None, None, :, None], jnp.swapaxes(v, 1, 2)[:, :, None], 0)
    out = jnp.where(group(jnp.any(sees, axis=2))[..., None], group(out),
                    self_value)                                    # [b, kvh, g, n, d]
    return jnp.swapaxes(out.reshape(b, h, n, d), 1, 2)[:, :q_len]  # [b, q, h, d]


def _duplicate_counts(undo, order, cl: int):
  """N_ij: in how many rounds key j falls in query i's window (its chunk or the previous one).

  undo, order [b, h, r, n], chunk length cl -> counts [b, h, r, c, cl, 2cl] (>= 1), laid out
  like the scores.
  """
  b, h, rounds, n = order.shape
  chunk_of = jnp.swapaxes(undo // cl, 2, 3)[:, :, None]          # [b, h, 1, n, r']
  # for each sorted slot of round r, the chunk its token falls in in every round r'
  chunks = jnp.take_along_axis(chunk_of, order[..., None], axis=3)  # [b, h, r, n, r']
  chunks = chunks.reshape(b, h, rounds, n // cl, cl, rounds)
  key_chunks = jnp.concatenate([_previous_chunk(chunks, -2), chunks], axis=4)  # [b,h,r,c,2cl,r']
  q_c, k_c = chunks[..., :, None, :], key_chunks[..., None, :, :]
  return jnp.maximum(jnp.sum((k_c == q_c) | (k_c == q_c - 1), axis=-1), 1)


def _unit(x):
  """x / ||x|| over the last axis, in f32 (a zero vector stays zero)."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), 1e-12))


def _previous_chunk(x, fill):
  """x [b, h, r, c, ...] -> the previous chunk along axis 3 (chunk 0 gets `fill`)."""
  first = jnp.full_like(x[:, :, :, :1], fill)
  return jnp.concatenate([first, x[:, :, :, :-1]], axis=3)


def _masked_logsumexp(scores, allowed):
  """log Σ_allowed exp(scores) over the last axis, and whether any entry is allowed.

  Rows with nothing allowed give a finite placeholder (0) and finite gradients.
  """
  row_max = jax.lax.stop_gradient(
      jnp.max(jnp.where(allowed, scores, -jnp.inf), axis=-1, keepdims=True))
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  total = jnp.sum(jnp.where(allowed, jnp.exp(jnp.where(allowed, scores - row_max, 0.0)), 0.0),
                  axis=-1)
  sees = total > 0
  return row_max[..., 0] + jnp.log(jnp.where(sees, total, 1.0)), sees
