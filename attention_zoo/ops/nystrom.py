"""Nyströmformer's reductions over the sequence, on one device and context-parallel.

Three parts of Nyströmformer (variants/nystromformer.py) look across the whole sequence:

    landmark_means   the landmarks, means of m contiguous segments of the queries or keys
    landmark_values  B V = softmax(Q̃ Kᵀ · s) V, a softmax over all n keys
    sequence_conv    the skip connection's depthwise convolution of V, a window centred on
                     each token

Under a mesh whose `context` axis splits the sequence (ops/context.py) each runs as a
`shard_map` over `context`: a device forms its own positions' partial segment sums and counts
(a segment may cross a shard edge: each token's rank among the real tokens is its shard's
count before it, all-gathered, plus its rank in the shard) and psums them; for B V it takes its
keys' scores, the global row max (pmax) and sum (psum) of their exponentials, and psums its
weighted values; the convolution exchanges a halo of kernel // 2 positions with each neighbour
(ppermute). What crosses devices is m x d per head and the halo, whatever the length. The rest
of the variant (F against the replicated landmarks, A and its pseudo-inverse) needs nothing
from other shards.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from attention_zoo.ops import softmax
from attention_zoo.ops.context import CONTEXT_AXIS, context_size, exchange_halo, sequence_spec


def segments(mask, num_landmarks: int, *, real_before=0, real_total=None):
  """Which landmark each real token belongs to: one-hot [b, n, m].

  The c real tokens of a row, in order, fill m contiguous segments of ⌊c/m⌋ or ⌈c/m⌉ tokens.
  For a shard of a longer sequence: real_before [b, 1], the real tokens before the shard, and
  real_total [b, 1], the row's real tokens (default: those of `mask`).
  """
  count = mask.sum(axis=-1, keepdims=True) if real_total is None else real_total   # [b, 1]
  rank = real_before + jnp.cumsum(mask, axis=-1) - 1           # [b, n]: index among real tokens
  segment = rank * num_landmarks // jnp.maximum(count, 1)                  # [b, n], in [0, m)
  return (segment[..., None] == jnp.arange(num_landmarks)) & mask[..., None]


def landmark_means(x, mask, num_landmarks: int, *, equal_segments: bool = False):
  """The landmarks of x [b, n, ...]: the means of m contiguous segments -> ([b, m, ...], the
  non-empty landmarks bool [b, m]). Segments split the real tokens of `mask`; with
  `equal_segments`, all n positions (padding counted, n a multiple of m, every landmark real)."""
  if context_size() == 1:
    return _landmark_means(x, mask, num_landmarks, equal_segments, across=False)
  spec = sequence_spec()
  return jax.shard_map(
      lambda x, mask: _landmark_means(x, mask, num_landmarks, equal_segments, across=True),
      in_specs=(spec, spec), out_specs=(P(spec[0]), P(spec[0])))(x, mask)


def _landmark_means(x, mask, num_landmarks: int, equal_segments: bool, *, across: bool):
  """`across`: x and mask are this device's shard, and the sums are reduced over `context`."""
  batch, length = mask.shape
  shard, shards = ((jax.lax.axis_index(CONTEXT_AXIS), jax.lax.axis_size(CONTEXT_AXIS)) if across
                   else (0, 1))
  total = (lambda a: jax.lax.psum(a, CONTEXT_AXIS)) if across else (lambda a: a)
  if equal_segments:
    position = shard * length + jnp.arange(length)
    segment = position // (length * shards // num_landmarks)
    one_hot = jnp.broadcast_to(segment[:, None] == jnp.arange(num_landmarks),
                               (batch, length, num_landmarks))
  else:
    own = mask.sum(axis=-1, keepdims=True)                                   # [b, 1]
    before, count = 0, own
    if across:
      counts = jax.lax.all_gather(own, CONTEXT_AXIS)                         # [C, b, 1]
      before = jnp.where((jnp.arange(shards) < shard)[:, None, None], counts, 0).sum(axis=0)
      count = counts.sum(axis=0)
    one_hot = segments(mask, num_landmarks, real_before=before, real_total=count)
  sums = total(jnp.einsum("bnm,bn...->bm...", one_hot.astype(x.dtype), x))  # [b, m, ...]
  sizes = total(one_hot.sum(axis=1))                                        # [b, m]
  means = sums / jnp.maximum(sizes, 1).reshape(batch, num_landmarks, *(1,) * (x.ndim - 2))
  return means, (jnp.ones_like(sizes, bool) if equal_segments else sizes > 0)


def landmark_values(scores, allowed, v, *, dropout_rate: float = 0.0, dropout_rng=None):
  """B V: the softmax of scores [b, kvh, g, l, n] over the keys n where `allowed` (broadcast to
  scores; a row with none allowed gives 0), dropout on B when dropout_rng is given, applied to
  v [b, n, kvh, d] -> [b, kvh, g, l, d]. Context-parallel: each device drops its own keys'
  weights with its own key (the rng folded with its index), so the mask is not one device's."""
  def drop(weights, rng):
    return weights if rng is None else softmax.dropout(weights, dropout_rate, rng)

  if context_size() == 1:
    weights = drop(softmax.masked_softmax(scores, allowed), dropout_rng)
    return jnp.einsum("bhgln,bnhd->bhgld", weights, v)
  spec = sequence_spec()
  keys_spec = P(spec[0], None, None, None, CONTEXT_AXIS)

  def shard(scores, allowed, v, rng):
    scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
    top = jax.lax.pmax(jax.lax.stop_gradient(scores.max(axis=-1, keepdims=True)), CONTEXT_AXIS)
    unnormalised = jnp.where(allowed, jnp.exp(scores - top), 0.0)
    row_total = jax.lax.psum(unnormalised.sum(axis=-1, keepdims=True), CONTEXT_AXIS)
    weights = unnormalised / jnp.where(row_total > 0, row_total, 1.0)
    if rng is not None:
      rng = jax.random.fold_in(rng, jax.lax.axis_index(CONTEXT_AXIS))
    return jax.lax.psum(jnp.einsum("bhgln,bnhd->bhgld", drop(weights, rng), v), CONTEXT_AXIS)

  return jax.shard_map(shard, in_specs=(keys_spec, keys_spec, spec, P()), out_specs=P(spec[0]))(
      scores, allowed, v, dropout_rng)


def sequence_conv(x, kernel, *, feature_group_count: int):
  """Depthwise convolution along the sequence of x [b, n, channels] with kernel [taps, 1,
  channels_out] (taps odd: a window centred on each position, zeros beyond the sequence)."""
  conv = lambda x, kernel, padding: jax.lax.conv_general_dilated(
      x, kernel, window_strides=(1,), padding=padding, dimension_numbers=("NWC", "WIO", "NWC"),
      feature_group_count=feature_group_count)
  if context_size() == 1:
    return conv(x, kernel, "SAME")
  spec = sequence_spec()
  half = kernel.shape[0] // 2
  return jax.shard_map(lambda x, kernel: conv(exchange_halo(x, half, half), kernel, "VALID"),
                       in_specs=(spec, P()), out_specs=spec)(x, kernel)
