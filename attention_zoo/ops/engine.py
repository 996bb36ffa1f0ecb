r"""The linear recurrences behind every op of this package, each in two forms.

Per batch row and head, a state S [K, V] evolves over tokens t with a log-decay g_t <= 0 (one
scalar, or one per key channel) and an optional write strength beta_t:

    S̃_t = Diag(exp g_t) S_{t-1}                          decay
    u_t = v_t                  (additive)                  or
    u_t = beta_t (v_t - S̃_tᵀ k_t)   (delta rule)          what is written, or
    u_t = v_t - S̃_tᵀ (e_t ⊙ k_t)     (delta rule with an erase gate e_t [K] per key
                                       channel; a write gate per value channel is folded into v)
    S_t = S̃_t + k_t u_tᵀ                                  write
    o_t = S_tᵀ q_t             (q already scaled)          read, after the write

The diagonal-plus-low-rank (DPLR) recurrence adds a rank-1 correction read from the state
before the decay, with its own directions a_t, b_t [K]:

    S_t = Diag(exp g_t) S_{t-1} + b_t (a_tᵀ S_{t-1}) + k_t v_tᵀ,      o_t = S_tᵀ q_t

Packed sequences: at a segment start (`resets`) S_{t-1} is replaced by 0 first, so each segment
runs as if alone.

`token_recurrence` and `token_dplr_recurrence` run these literally, a `lax.scan` over t (the
reference forms, and decoding). `chunk_recurrence` and `chunk_dplr_recurrence` split T into N
chunks of C tokens. With chunk-local cumulative gates G_r = Σ_{s <= r} g_s (never a global
cumsum: it would reach -1e4 and lose every digit of G_i - G_j in float32) and S the state
entering the chunk, every chunk of the first recurrence satisfies

    O     = (Q ⊙ e^G) S + P U'                   P_ij = Σ_d q_id k_jd e^{G_id - G_jd}, j <= i
    S_out = Diag(e^{G_C}) S + (K ⊙ e^{G_C - G})ᵀ U'

with U' = V for the additive rule. For the delta rule the chunk's C writes unroll to the WY /
UT form (Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule"; Gated
DeltaNet folds the decay in):

    A  = strictly lower part of diag(beta) [Σ_d k_id k_jd e^{G_id - G_jd}]_ij      [C, C]
    W  = -(I + A)^{-1} diag(beta) (K ⊙ e^G),    U = (I + A)^{-1} diag(beta) V
    U' = U + W S                                 (the "pseudo-values")

With an erase gate e per key channel, diag(beta) K in A and W becomes E ⊙ K (the read keys
e_i ⊙ k_i; the columns keep k_j) and diag(beta) V becomes V.

For DPLR, unrolling S_r = Diag(e^{G_r}) S + Σ_{i <= r} Diag(e^{G_r - G_i}) (k_i v_iᵀ + b_i u_iᵀ)
with u_r = a_rᵀ S_{r-1} (what the rank-1 term writes along b_r) gives, with decays from the
token *before* each row (G_{r-1}, G_0 = 0: a reads the undecayed state),

    A_ab = [Σ_d a_id b_jd e^{G_{i-1,d} - G_jd}]_{j < i},   A_ak likewise with k     [C, C]
    W  = (I - A_ab)^{-1} [a_r ⊙ e^{G_{r-1}}]_r,   U = (I - A_ab)^{-1} A_ak V,   u = U + W S
    O     = (Q ⊙ e^G) S + P_qk V + P_qb u
    S_out = Diag(e^{G_C}) S + (K ⊙ e^{G_C - G})ᵀ V + (B ⊙ e^{G_C - G})ᵀ u

A_ab and A_ak are the inclusive products of the rows a_{r+1} (shifted up one token) moved down
one row, so they reuse P's code and its numerics.

Under a mesh whose `context` axis splits the sequence, `run` and `run_dplr` run either form on
each device's shard and correct it by the state the shards before it leave
(context_recurrence.py): the same algorithm one level up, each device one chunk.

Everything that does not involve S (the products, the triangular solve for W and U, the decayed
keys) is computed for all chunks at once; only the pseudo-values and S_out run in a `lax.scan`
over chunks, whose body is under `jax.checkpoint`, so the backward pass keeps the N
chunk-boundary states and no per-token state: memory is linear in T. The outputs are then
formed for all chunks at once from the entering states.

Segments inside a chunk: with r_t the index of token t's segment (a running count of resets),
pairs (i, j) of different segments are set to 0 in every product (the products are finite, so
that is a plain select), the entering state reaches only the tokens of the segment it belongs
to (e^G masked), only the last segment's tokens reach S_out (e^{G_C - G} masked), and the
entering state carries on only if the chunk holds no reset (e^{G_C} masked). Chunk and segment
boundaries need not align.

Numerics. Every exponent is masked before `exp` (`where(mask, x, -inf)`, never `where(mask,
exp(x), 0)`: exp overflows in the unused branch and its gradient becomes NaN), and every
exponent used is <= 0 (or, through a midpoint below, within ±MIDPOINT_SPAN/2), so gates of any
size underflow (the true value) but never overflow. An exponent that is identically 0 is
written as the constant 0, and G_C - G_r as a sum: as differences of cumulative sums they would
send two opposite O(1) gradients into the cumulative sum, whose rounding (~1e-7) then swamps
the true dg under strong gates (~e^-20). Identically 0 means that no token of the interval
decays: G_i - G_i on the diagonal, and a pair apart only by tokens whose g is 0 by construction
(masked tokens; a delta product's later steps), which the DPLR products, their rows decayed up
to the token before, meet at every hole; the products count the decaying tokens of each chunk
and take equal counts as the constant 0.
With a scalar gate the C x C decay e^{G_i - G_j} is formed directly. With a per-channel gate
the products are not one matmul of the inputs, and factoring e^{G_i - G_j} = e^{G_i} e^{-G_j}
across a chunk overflows for strong gates. When in every chunk and channel the cumulative
gates span at most MIDPOINT_SPAN (max G - min G <= 40: weak gates, the usual case), each
channel's midpoint m keeps both factors of e^{G_i - m} e^{m - G_j} within e^{±20}, and the
products are that one matmul, the pairs over no decaying token taking the undecayed product
(their exponent is the constant 0). Otherwise they are built by halves: the pairs of a block's
second half (rows i) and first half (columns j) are one matmul of (Q_i ⊙ e^{G_i - G_r}) and
(K_j ⊙ e^{G_r - G_j}) with r the first half's last token (j <= r < i: both exponents <= 0, so no
overflow), then each half the same way, down to single tokens (a block of odd length: one key
column at a time, elementwise): log2(C) exponentials per token and channel, and half of the
C x C matmul. A `lax.cond` on the largest span picks one way for the whole call. Forward and
backward of chunk_gla at 4K (one CPU process) took 1.8x chunk_simple_gla through the midpoint
and 2.2x by halves (2.4x before the midpoint and the checkpointed branches);
sub-chunks of 8 with an elementwise diagonal had taken 2-2.5x by halves' time.
Gates, cumulative sums, states, the solve and all accumulation are float32 (float64 for
float64 inputs), matmuls at Precision.HIGHEST. No intermediate has more than five axes (a
rank-7 reduction made XLA's CPU backward corrupt memory: docs/xla_cpu_fault.md).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from attention_zoo.ops.blocks import ceil_div
from attention_zoo.ops.context import context_size
from attention_zoo.ops.context_recurrence import split_over_context
from attention_zoo.ops.segments import segment_starts

# chunk_gated_delta_rule forward+backward at T = 8192 (B=1, H=4, K=V=64, f32) on a shared
# 2-core CPU, medians of 7 interleaved calls: chunk 16 568 ms, 32 498 ms, 64 550 ms, 128 772 ms.
# 32 and 64 are within the machine's noise (~10%); 64 is flash-linear-attention's default.
DEFAULT_CHUNK_SIZE = 64
# A short sequence is one chunk of a multiple of this many tokens.
SHORT_CHUNK_MULTIPLE = 8
# A block of per-channel gates spanning at most this (max G - min G, every channel) has its
# products as one matmul through its midpoint: factors within e^{±20}, far inside float32
MIDPOINT_SPAN = 40.0

_einsum = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)


def _zero_if_empty(same_count, exponent):
  """An exponent over no decaying token (equal counts at its ends) is the constant 0."""
  return jnp.where(same_count, 0.0, exponent)


def _causal(L: int, strict: bool = False):
  """[L, L] bool: the pairs j <= i (j < i if strict)."""
  i, j = jnp.arange(L)[:, None], jnp.arange(L)[None, :]
  return j < i if strict else j <= i


def _decayed_products_scalar(a, b, G, counts):
  """Σ_d a_id b_jd e^{G_i - G_j} over the causal pairs j <= i of each chunk, 0 elsewhere; the
  exponent the constant 0 where no token of (j, i] decays (equal counts: the diagonal, and
  pairs apart only by tokens whose g is 0 by construction: see the module docstring).
  a, b [n, b, h, C, K]; G [n, b, h, C]; counts [n, b, 1, C] -> [n, b, h, C, C]."""
  same_count = counts[..., :, None] == counts[..., None, :]
  exponent = jnp.where(_causal(G.shape[-1]), _zero_if_empty(
      same_count, G[..., :, None] - G[..., None, :]), -jnp.inf)         # [n, b, h, C, C]
  return _einsum("nbhik,nbhjk->nbhij", a, b) * jnp.exp(exponent)                   # [n,b,h,C,C]


def _decayed_products_vector(a, b, G, counts):
  """As `_decayed_products_scalar` with G [n, b, h, C, K], per channel, and counts
  [n, b, 1, C, 1]: through each chunk's midpoint if the gates of every chunk span at most
  MIDPOINT_SPAN in every channel, else by halves (see the module docstring). Each branch is
  under `jax.checkpoint`: `cond` would keep the residuals of both (the untaken one's as
  zeros), and recomputing them was cheaper than storing them. The leading dims are merged
  (M = n·b·h) and no intermediate has more than four axes: a rank-7 broadcast product here
  made XLA's CPU backward corrupt memory on some CPUs (docs/xla_cpu_fault.md)."""
  *lead, C, K = G.shape
  a, b, G = (x.reshape(-1, C, K) for x in (a, b, G))                        # [M, C, K]
  counts = jnp.broadcast_to(counts, (*lead, C, 1)).reshape(-1, C, 1)      # [M, C, 1]
  span = jnp.max(jnp.max(G, axis=1) - jnp.min(G, axis=1))
  products = jax.lax.cond(span <= MIDPOINT_SPAN, jax.checkpoint(_products_through_midpoint),
                          jax.checkpoint(_products_by_halves), a, b, G, counts)
  return products.reshape(*lead, C, C)


def _products_through_midpoint(a, b, G, counts):
  """[M, L, K] (counts [M, L, 1]) -> [M, L, L], for gates spanning at most MIDPOINT_SPAN:
  (A ⊙ e^{G - m}) (B ⊙ e^{m - G})ᵀ with m the midpoint of each channel's range, both exponents
  within ±MIDPOINT_SPAN/2. The pairs over no decaying token (the diagonal, holes) take the
  undecayed A Bᵀ: their exponent is the constant 0 (see the module docstring). The exponents
  are clipped at ±MIDPOINT_SPAN, which changes nothing here, so that the branch and its
  gradient stay finite wherever it runs on gates it was not chosen for (a `cond` with a
  batched predicate is a select of both branches)."""
  midpoint = 0.5 * (jnp.max(G, axis=1, keepdims=True) + jnp.min(G, axis=1, keepdims=True))
  from_midpoint = jnp.clip(G - midpoint, -MIDPOINT_SPAN, MIDPOINT_SPAN)   # [M, L, K]
  decayed = _einsum("mik,mjk->mij", a * jnp.exp(from_midpoint),
                    b * jnp.exp(-from_midpoint))                          # [M, L, L]
  undecayed = _einsum("mik,mjk->mij", a, b)                               # [M, L, L]
  products = jnp.where(counts == counts.swapaxes(1, 2), undecayed, decayed)
  return jnp.where(_causal(a.shape[1]), products, 0.0)


def _products_by_halves(a, b, G, counts):
  """[M, L, K] (counts [M, L, 1]) -> [M, L, L]. The pairs of the second half's rows and the
  first half's columns are one matmul through the first half's last token r, then each half
  recursively (as one batch of 2M); a block of odd length one column at a time."""
  M, L, K = a.shape
  if L % 2:
    return _products_by_columns(a, b, G, counts)
  h = L // 2
  ref, ref_count = G[:, h - 1:h], counts[:, h - 1:h]                      # [M, 1, K], [M, 1, 1]
  late = a[:, h:] * jnp.exp(_zero_if_empty(counts[:, h:] == ref_count, G[:, h:] - ref))
  early = b[:, :h] * jnp.exp(_zero_if_empty(counts[:, :h] == ref_count, ref - G[:, :h]))
  across = _einsum("mik,mjk->mij", late, early)                           # [M, h, h]
  halves = lambda x: x.reshape(2 * M, h, x.shape[-1])                     # [2M, h, K|1]
  within = _products_by_halves(*map(halves, (a, b, G, counts))).reshape(M, 2, h, h)
  return jnp.concatenate([
      jnp.concatenate([within[:, 0], jnp.zeros_like(across)], axis=-1),
      jnp.concatenate([across, within[:, 1]], axis=-1)], axis=-2)          # [M, L, L]


def _products_by_columns(a, b, G, counts):
  """[M, L, K] (counts [M, L, 1]) -> [M, L, L], e^{G_i - G_j} elementwise, one column j at a
  time."""
  row = jnp.arange(a.shape[1])[:, None]                                    # [L, 1]
  columns = []
  for j in range(a.shape[1]):
    exponent = _zero_if_empty(counts == counts[:, j:j + 1], G - G[:, j:j + 1])
    exponent = jnp.where(row >= j, exponent, -jnp.inf)                  # [M, L, K]
    columns.append(jnp.sum(a * b[:, j:j + 1] * jnp.exp(exponent), axis=-1))   # [M, L]
  return jnp.stack(columns, axis=-1)


def _decayed_products(pairs, G, counts, segments):
  """Σ_d a_id b_jd e^{G_id - G_jd} over the causal pairs j <= i of each chunk, 0 elsewhere and
  between segments, for each (a, b) of `pairs` (a, b [n, b, h, C, K]; G [n, b, h, C, 1|K];
  counts [n, b, 1, C, 1]) -> a list of [n, b, h, C, C]. The pairs go through as one batch
  along the chunk axis: a per-channel gate compiles (and runs) its `cond` once."""
  rows, columns = (jnp.concatenate(x, axis=0) for x in zip(*pairs))     # [pn, b, h, C, K]
  G, counts = (jnp.concatenate([x] * len(pairs), axis=0) for x in (G, counts))
  products = (_decayed_products_scalar(rows, columns, G[..., 0], counts[..., 0])
              if G.shape[-1] == 1 else _decayed_products_vector(rows, columns, G, counts))
  return [_within_segments(x, segments) for x in jnp.split(products, len(pairs), axis=0)]


@jax.custom_jvp
def unit_lower_inverse(A):
  """(I + A)^{-1} for strictly lower-triangular A [..., C, C]. Blocked, as flash-linear-
  attention's solve_tril: blocks of b <= 16 rows inverted by forward substitution, then merged
  pairwise, [[X11, 0], [L21, X22]] -> [[X11, 0], [-X22 L21 X11, X22]]. For 512 chunks of 64
  with K + V = 128 right-hand sides this inverse and the product took 45 ms on a shared 2-core
  CPU where jax.scipy.linalg.solve_triangular took 422 ms (forward). The leading dims are
  merged and the blocks sliced out, so no array has more than four axes."""
  *lead, C, _ = A.shape
  A = A.reshape(-1, C, C)                                    # [M, C, C]
  b = C
  while b > 16 and b % 2 == 0:
    b //= 2
  S = C // b                                                 # a power of two
  block = lambda row, col, m: A[:, row * m:(row + 1) * m, col * m:(col + 1) * m]  # [M, m, m]
  diagonal = jnp.stack([block(s, s, b) for s in range(S)], axis=1)  # [M, S, b, b]
  X = jnp.broadcast_to(jnp.eye(b, dtype=A.dtype), diagonal.shape)
  for i in range(1, b):   # row i of X = e_i - A_i X (rows above already final)
    X = X.at[..., i, :].add(-_einsum("msj,msjk->msk", diagonal[..., i, :], X))
  while S > 1:
    m = X.shape[-1]
    lower = jnp.stack([block(2 * s + 1, 2 * s, m) for s in range(S // 2)], axis=1)  # L21
    X11, X22 = X[:, 0::2], X[:, 1::2]                        # [M, S/2, m, m]
    X21 = -_einsum("msij,msjk,mskl->msil", X22, lower, X11)
    top = jnp.concatenate([X11, jnp.zeros_like(X11)], axis=-1)
    X = jnp.concatenate([top, jnp.concatenate([X21, X22], axis=-1)], axis=-2)
    S //= 2
  return X[:, 0].reshape(*lead, C, C)


@unit_lower_inverse.defjvp
def _unit_lower_inverse_jvp(primals, tangents):
  """d(I + A)^{-1} = -X dA X, dA kept strictly lower as A is. Linear in dA, so reverse mode
  transposes it (dA = -Xᵀ dX Xᵀ, strictly lower) and keeps only X, and forward mode (jax.jvp,
  Hessian-vector products) works too, which a custom_vjp would refuse."""
  (A,), (dA,) = primals, tangents
  X = unit_lower_inverse(A)
  dA = jnp.where(jnp.tril(jnp.ones(dA.shape[-2:], bool), -1), dA, 0.0)
  return X, -_einsum("...ij,...jk,...kl->...il", X, dA, X)


class Segments(NamedTuple):
  """Where segment starts cut the chunks (see the module docstring); each broadcasts over heads
  and features. same [n, b, 1, C, C]: tokens i and j in one segment; from_entering
  [n, b, 1, C, 1]: token r in the segment of the state entering its chunk; to_leaving
  [n, b, 1, C, 1]: token r in the chunk's last segment; through [n, b, 1, 1, 1]: no segment
  starts in the chunk."""
  same: jax.Array
  from_entering: jax.Array
  to_leaving: jax.Array
  through: jax.Array


def _segments(resets, N: int, C: int) -> Segments | None:
  """resets bool [B, T] (True where a segment starts) or None. A reset at t = 0 (a shard of a
  context-parallel run whose first token starts a segment) keeps the initial state from every
  token: the state entering the first chunk belongs to run 0, before any reset."""
  if resets is None:
    return None
  B, T = resets.shape
  runs = jnp.cumsum(resets.astype(jnp.int32), axis=1)        # [B, T], the segment of each token
  runs = jnp.pad(runs, [(0, 0), (0, N * C - T)], mode="edge")  # padding: the last segment
  runs = runs.reshape(B, N, C).transpose(1, 0, 2)[:, :, None, :, None]  # [n, b, 1, C, 1]
  entering = jnp.concatenate([jnp.zeros_like(runs[:1, ..., :1, :]), runs[:-1, ..., -1:, :]])
  last = runs[..., -1:, :]                                   # [n, b, 1, 1, 1]
  return Segments(same=runs == runs.swapaxes(-1, -2), from_entering=runs == entering,
                  to_leaving=runs == last, through=last == entering)


def _decay_counts(decaying, B: int, T: int, N: int, C: int):
  """[n, b, 1, C, 1] int32: the decaying tokens of each chunk up to each token (decaying
  [B, T] bool, False where g is 0 by construction; None: every token; never the padding)."""
  decaying = jnp.ones((B, T), bool) if decaying is None else decaying
  decaying = jnp.pad(decaying, [(0, 0), (0, N * C - T)]).reshape(B, N, C).astype(jnp.int32)
  return jnp.cumsum(decaying, axis=-1).transpose(1, 0, 2)[:, :, None, :, None]


def _within_segments(products, segments: Segments | None):
  """Pairs of different segments set to 0 (the products are finite: a select is safe)."""
  return products if segments is None else jnp.where(segments.same, products, 0.0)


def _chunk_layout(T: int, chunk_size: int) -> tuple[int, int]:
  """(C, N): tokens per chunk (a short T: one padded chunk) and chunks."""
  C = min(chunk_size, ceil_div(T, SHORT_CHUNK_MULTIPLE) * SHORT_CHUNK_MULTIPLE)
  return C, ceil_div(T, C)


def _to_chunks(x, N: int, C: int):
  """[B, T, H, D] -> [N, B, H, C, D], T padded with neutral zeros."""
  B, T, H, D = x.shape
  x = jnp.pad(x, [(0, 0), (0, N * C - T), (0, 0), (0, 0)])
  return x.reshape(B, N, C, H, D).transpose(1, 0, 3, 2, 4)


def _from_chunks(o, T: int):
  """[N, B, H, C, V] -> [B, T, H, V]."""
  N, B, H, C, V = o.shape
  return o.transpose(1, 0, 3, 2, 4).reshape(B, N * C, H, V)[:, :T]


def _chunk_gates(g, segments: Segments | None):
  """From the chunked log-decays g [n, b, h, C, 1|K]: G, the chunk-local cumulative gate, and
  the masked exponents: `read` (G where the entering state reaches the token), `to_end`
  (G_C - G_r = Σ_{s > r} g_s where token r reaches S_out) and the state's decay
  e^{G_C} [n, b, h, 1|K, 1] (0 past a segment start)."""
  G = jnp.cumsum(g, axis=-2)                                 # [n, b, h, C, 1|K]
  # G_C - G_r summed directly (a difference would be a cancelling pair for the last real
  # token, whose later g are padding zeros)
  to_end = jnp.cumsum(g[..., ::-1, :], axis=-2)[..., ::-1, :]  # Σ_{s >= r}
  to_end = jnp.concatenate([to_end[..., 1:, :], jnp.zeros_like(to_end[..., :1, :])], axis=-2)
  read, carry = G, G[..., -1:, :]
  if segments is not None:
    read = jnp.where(segments.from_entering, G, -jnp.inf)
    to_end = jnp.where(segments.to_leaving, to_end, -jnp.inf)
    carry = jnp.where(segments.through, carry, -jnp.inf)
  return G, read, to_end, jnp.exp(carry).swapaxes(-1, -2)


def _scan_chunks(initial_state, decay, writes, corrections):
  """The sequential part: chunk by chunk S <- decay S + writes + Kᵀ U' with the pseudo-values
  U' = U + W S; writes [n, b, h, K, V] or None, corrections (W [n, b, h, C, K],
  U [n, b, h, C, V], K [n, b, h, C, K]) or None. -> (final state, the states entering each
  chunk [n, b, h, K, V], U' or None)."""
  @jax.checkpoint
  def step(S, xs):
    decay, writes, corrections = xs
    S_next = decay * S if writes is None else decay * S + writes
    if corrections is None:
      return S_next, (S, None)
    W, U, keys = corrections
    pseudo_values = U + _einsum("bhck,bhkv->bhcv", W, S)     # [b, h, C, V]
    return S_next + _einsum("bhck,bhcv->bhkv", keys, pseudo_values), (S, pseudo_values)

  final_state, (entering, pseudo_values) = jax.lax.scan(
      step, initial_state, (decay, writes, corrections))
  return final_state, entering, pseudo_values


def chunk_recurrence(q, k, v, g, beta, initial_state, chunk_size: int, decaying=None,
                     resets=None, erase=None):
  """The additive or delta recurrence by chunks. q, k [B, T, H, K] (q scaled), v [B, T, H, V],
  g [B, T, H, 1] (scalar) or [B, T, H, K], beta [B, T, H] or None, erase [B, T, H, K] or None
  (both None: the additive rule; erase: the delta rule reading with erase ⊙ k, v written as
  given), initial_state [B, H, K, V], all in the compute dtype, masked tokens already neutral;
  decaying (False where g is 0 by construction) and resets bool [B, T] or None ->
  (o [B, T, H, V], S_T [B, H, K, V])."""
  B, T = k.shape[:2]
  C, N = _chunk_layout(T, chunk_size)
  q, k, v, g = (_to_chunks(x, N, C) for x in (q, k, v, g))
  counts, segments = _decay_counts(decaying, B, T, N, C), _segments(resets, N, C)
  G, read, to_end, decay = _chunk_gates(g, segments)
  k_to_end = k * jnp.exp(to_end)                             # [n, b, h, C, K]
  if beta is None and erase is None:
    (scores,) = _decayed_products([(q, k)], G, counts, segments)  # [n, b, h, C, C]
    values = v
    writes = _einsum("nbhck,nbhcv->nbhkv", k_to_end, v)      # [n, b, h, K, V]
    final_state, entering, _ = _scan_chunks(initial_state, decay, writes, None)
  else:
    if erase is None:
      beta = _to_chunks(beta[..., None], N, C)               # [n, b, h, C, 1]
      scores, strength = _decayed_products([(q, k), (k, k)], G, counts, segments)
      strength = beta * jnp.where(_causal(C, strict=True), strength, 0.0)  # [n,b,h,C,C], A
      read_keys, written = beta * k, beta * v
    else:   # the read keys e ⊙ k in A's rows and in W; v written as given
      read_keys, written = _to_chunks(erase, N, C) * k, v    # [n, b, h, C, K], [.., V]
      scores, strength = _decayed_products([(q, k), (read_keys, k)], G, counts, segments)
      strength = jnp.where(_causal(C, strict=True), strength, 0.0)   # [n, b, h, C, C], A
    inverse = unit_lower_inverse(strength)                   # [n, b, h, C, C], (I + A)^{-1}
    W = -_einsum("nbhij,nbhjk->nbhik", inverse, read_keys * jnp.exp(read))  # [n, b, h, C, K]
    U = _einsum("nbhij,nbhjv->nbhiv", inverse, written)      # [n, b, h, C, V]
    final_state, entering, values = _scan_chunks(initial_state, decay, None, (W, U, k_to_end))

  o = (_einsum("nbhck,nbhkv->nbhcv", q * jnp.exp(read), entering)  # [n, b, h, C, V]
       + _einsum("nbhij,nbhjv->nbhiv", scores, values))
  return _from_chunks(o, T), final_state


def chunk_dplr_recurrence(q, k, v, a, b, g, initial_state, chunk_size: int, decaying=None,
                          resets=None):
  """The DPLR recurrence by chunks. q, k, a, b, g [B, T, H, K] (q scaled), v [B, T, H, V],
  initial_state [B, H, K, V], compute dtype, masked tokens neutral; decaying and resets as
  `chunk_recurrence`'s -> (o [B, T, H, V], S_T [B, H, K, V])."""
  B, T = k.shape[:2]
  C, N = _chunk_layout(T, chunk_size)
  q, k, v, a, b, g = (_to_chunks(x, N, C) for x in (q, k, v, a, b, g))
  counts, segments = _decay_counts(decaying, B, T, N, C), _segments(resets, N, C)
  G, read, to_end, decay = _chunk_gates(g, segments)
  # a_r reads S_{r-1}, decayed up to the token before: G_{r-1} (0 for the first)
  read_before = jnp.concatenate([jnp.zeros_like(G[..., :1, :]), G[..., :-1, :]], axis=-2)
  if segments is not None:
    read_before = jnp.where(segments.from_entering, read_before, -jnp.inf)
  # row r of a_next holds a_{r+1}: the inclusive products of a_next, moved down a row, are
  # Σ_d a_id x_jd e^{G_{i-1,d} - G_jd} for j < i
  a_next = jnp.concatenate([a[..., 1:, :], jnp.zeros_like(a[..., :1, :])], axis=-2)
  # P_qk, P_qb, and A_ab, A_ak before the shift: [n, b, h, C, C] each
  to_v, to_low_rank, A_ab, A_ak = _decayed_products(
      [(q, k), (q, b), (a_next, b), (a_next, k)], G, counts, segments)
  below = lambda products: _within_segments(jnp.concatenate(
      [jnp.zeros_like(products[..., :1, :]), products[..., :-1, :]], axis=-2), segments)
  A_ab, A_ak = below(A_ab), below(A_ak)
  inverse = unit_lower_inverse(-A_ab)                        # (I - A_ab)^{-1}
  W = _einsum("nbhij,nbhjk->nbhik", inverse, a * jnp.exp(read_before))  # [n, b, h, C, K]
  U = _einsum("nbhij,nbhjv->nbhiv", inverse,
              _einsum("nbhij,nbhjv->nbhiv", A_ak, v))        # [n, b, h, C, V]
  writes = _einsum("nbhck,nbhcv->nbhkv", k * jnp.exp(to_end), v)  # [n, b, h, K, V]
  final_state, entering, low_rank_values = _scan_chunks(
      initial_state, decay, writes, (W, U, b * jnp.exp(to_end)))

  o = (_einsum("nbhck,nbhkv->nbhcv", q * jnp.exp(read), entering)  # [n, b, h, C, V]
       + _einsum("nbhij,nbhjv->nbhiv", to_v, v)
       + _einsum("nbhij,nbhjv->nbhiv", to_low_rank, low_rank_values))
  return _from_chunks(o, T), final_state


def _token_scan(update, initial_state, q, xs, resets):
  """The token forms' loop: for each t, S <- 0 at a segment start, S <- update(S, *xs_t),
  o_t = Sᵀ q_t. q [B, T, H, K], xs a tuple of [B, T, ...] arrays (None allowed), resets bool
  [B, T] or None -> (o [B, T, H, V], S_T)."""
  time_major = lambda x: jnp.moveaxis(x, 1, 0)               # [B, T, ...] -> [T, B, ...]

  def step(S, inputs):
    q_t, reset_t, xs_t = inputs
    if reset_t is not None:
      S = jnp.where(reset_t[:, None, None, None], 0.0, S)
    S = update(S, *xs_t)                                     # [B, H, K, V]
    return S, _einsum("bhk,bhkv->bhv", q_t, S)               # [B, H, V]

  final_state, o = jax.lax.scan(step, initial_state, jax.tree.map(time_major, (q, resets, xs)))
  return jnp.moveaxis(o, 0, 1), final_state


def token_recurrence(q, k, v, g, beta, initial_state, resets=None, erase=None):
  """The additive or delta recurrence token by token; arguments and result as
  `chunk_recurrence`'s."""
  def update(S, k_t, v_t, g_t, beta_t, erase_t):  # [B, H, K], [B, H, V], [B, H, 1|K], [B, H]
    S = jnp.exp(g_t)[..., None] * S                          # [B, H, K, V], S̃_t
    if beta_t is not None:
      v_t = beta_t[..., None] * (v_t - _einsum("bhk,bhkv->bhv", k_t, S))  # [B, H, V], u_t
    elif erase_t is not None:
      v_t = v_t - _einsum("bhk,bhkv->bhv", erase_t * k_t, S)  # [B, H, V], u_t
    return S + k_t[..., :, None] * v_t[..., None, :]
  return _token_scan(update, initial_state, q, (k, v, g, beta, erase), resets)


def token_dplr_recurrence(q, k, v, a, b, g, initial_state, resets=None):
  """The DPLR recurrence token by token; arguments and result as `chunk_dplr_recurrence`'s."""
  def update(S, k_t, v_t, a_t, b_t, g_t):                    # [B, H, K|V]
    read = _einsum("bhk,bhkv->bhv", a_t, S)                  # [B, H, V], a_tᵀ S_{t-1}
    return (jnp.exp(g_t)[..., None] * S + b_t[..., :, None] * read[..., None, :]
            + k_t[..., :, None] * v_t[..., None, :])
  return _token_scan(update, initial_state, q, (k, v, a, b, g), resets)


def check_shapes(name: str, expected: dict):
  """ValueError naming the first argument whose shape is not the expected one;
  expected: {argument: (value or None, shape)}."""
  for arg, (value, shape) in expected.items():
    if value is not None and tuple(value.shape) != tuple(shape):
      raise ValueError(f"{name}: {arg} must be {list(shape)}, got {list(value.shape)}")


def _prepare(name: str, q, k, v, per_token: dict, *, scale, initial_state, mask, segment_ids,
             chunk_size):
  """Validates op `name`'s inputs (per_token: {argument: (value or None, channels)}, the
  argument [B, T, H] for channels None, [B, T, H, K] for "key", [B, T, H, V] for "value") and
  brings them to the compute dtype,
  masked tokens neutral (a masked token reads nothing and leaves the state as it was).
  -> (q scaled, k, v, {argument: value}, initial state, mask, output dtype)."""
  out_dtype, dtype = v.dtype, jnp.promote_types(v.dtype, jnp.float32)
  if q.ndim != 4 or k.shape != q.shape:
    raise ValueError(f"{name}: q and k must both be [B, T, H, K], got {q.shape} and {k.shape}")
  B, T, H, K = q.shape
  if v.ndim != 4 or v.shape[:3] != (B, T, H):
    raise ValueError(f"{name}: v must be [B, T, H, V] = ({B}, {T}, {H}, V) like q, got {v.shape}")
  widths = {None: (), "key": (K,), "value": (v.shape[-1],)}
  check_shapes(name, {**{arg: (value, (B, T, H, *widths[channels]))
                         for arg, (value, channels) in per_token.items()},
                      "initial_state": (initial_state, (B, H, K, v.shape[-1])),
                      "mask": (mask, (B, T)), "segment_ids": (segment_ids, (B, T))})
  check_sequence_args(name, mask, segment_ids, chunk_size)
  if scale is None:
    scale = K ** -0.5

  keep = jnp.ones((B, T), bool) if mask is None else mask
  def neutral(x):
    return None if x is None else jnp.where(
        keep.reshape(B, T, *[1] * (x.ndim - 2)), x.astype(dtype), 0)
  q, k, v = map(neutral, (q, k, v))
  state = (jnp.zeros((B, H, K, v.shape[-1]), dtype) if initial_state is None
           else initial_state.astype(dtype))
  return (q * scale, k, v, {arg: neutral(value) for arg, (value, _) in per_token.items()},
          state, mask, out_dtype)


def _run_form(recurrence, v, per_token, state, segment_ids):
  """recurrence(v, per_token, state, resets) on the whole sequence, or with the sequence split
  over the active mesh's `context` axis when it has one (context_recurrence.py); a single
  token (a decode step) has nothing to split."""
  if context_size() > 1 and v.shape[1] > 1:
    return split_over_context(recurrence, v, per_token, state, segment_ids)
  return recurrence(v, per_token, state,
                    None if segment_ids is None else segment_starts(segment_ids))


def run(name: str, q, k, v, g, beta, *, per_channel_gate: bool, scale, initial_state, mask,
        segment_ids, chunk_size: int | None, gated_tokens=None, erase=None, write=None):
  """Validates the op `name`'s inputs, neutralises masked tokens and runs the additive or delta
  recurrence in the chunk form (chunk_size given) or the token form. g None: no decay; beta
  None and erase None: the additive rule; erase [B, T, H, K] and write [B, T, H, V] (with beta
  None): the delta rule u_t = write_t ⊙ v_t - S̃_tᵀ (erase_t ⊙ k_t), the write gate folded
  into v before the recurrence; gated_tokens bool [B, T] or None (all): False where the
  caller's g is 0 by construction. -> (o like v, final state [B, H, K, V] float32, float64 for
  float64 inputs)."""
  q, k, v, x, state, mask, out_dtype = _prepare(
      name, q, k, v, {"g": (g, "key" if per_channel_gate else None), "beta": (beta, None),
                      "erase": (erase, "key"), "write": (write, "value")}, scale=scale,
      initial_state=initial_state, mask=mask, segment_ids=segment_ids, chunk_size=chunk_size)
  if x["write"] is not None:
    v = x["write"] * v
  g = jnp.zeros(q.shape[:3], q.dtype) if x["g"] is None else x["g"]
  g = g if per_channel_gate else g[..., None]                # [B, T, H, 1|K]
  # the tokens whose g may be nonzero (with no gate none), for the constant-0 exponents
  decaying = jnp.full(q.shape[:2], x["g"] is not None)
  for flags in (mask, gated_tokens):
    decaying = decaying if flags is None else decaying & flags
  if chunk_size is None:
    form = lambda v, xs, state, resets: token_recurrence(*xs[:2], v, *xs[2:4], state, resets,
                                                         xs[5])
  else:
    form = lambda v, xs, state, resets: chunk_recurrence(*xs[:2], v, *xs[2:4], state,
                                                         chunk_size, xs[4], resets, xs[5])
  o, state = _run_form(form, v, (q, k, g, x["beta"], decaying, x["erase"]), state, segment_ids)
  return o.astype(out_dtype), state


def run_dplr(name: str, q, k, v, a, b, g, *, scale, initial_state, mask, segment_ids,
             chunk_size: int | None, per_channel_gate: bool = True):
  """As `run`, for the DPLR recurrence (a, b [B, T, H, K]; g [B, T, H, K], or [B, T, H] with
  per_channel_gate False: one decay per head, whose chunk products are one matmul)."""
  q, k, v, x, state, mask, out_dtype = _prepare(
      name, q, k, v, {"a": (a, "key"), "b": (b, "key"),
                      "g": (g, "key" if per_channel_gate else None)}, scale=scale,
      initial_state=initial_state, mask=mask, segment_ids=segment_ids, chunk_size=chunk_size)
  if not per_channel_gate:
    x["g"] = x["g"][..., None]                               # [B, T, H, 1]
  if chunk_size is None:
    form = lambda v, xs, state, resets: token_dplr_recurrence(*xs[:2], v, *xs[2:5], state,
                                                              resets)
  else:
    form = lambda v, xs, state, resets: chunk_dplr_recurrence(*xs[:2], v, *xs[2:5], state,
                                                              chunk_size, xs[5], resets)
  o, state = _run_form(form, v, (q, k, x["a"], x["b"], x["g"], mask), state, segment_ids)
  return o.astype(out_dtype), state


def check_sequence_args(name: str, mask, segment_ids, chunk_size) -> None:
  """ValueError naming `name` for a mask that is not bool, segment ids that are not integers,
  or a chunk size that is not a positive integer (None: the op's default)."""
  if mask is not None and mask.dtype != jnp.bool_:
    raise ValueError(f"{name}: mask must be bool (True = real token), got {mask.dtype}")
  if segment_ids is not None and not jnp.issubdtype(segment_ids.dtype, jnp.integer):
    raise ValueError(f"{name}: segment_ids must be integers (each run of equal ids is one "
                     f"sequence), got {segment_ids.dtype}")
  if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
    raise ValueError(f"{name}: chunk_size must be a positive integer, got {chunk_size!r}")
