"""Kernelised (linear) attention's numerics: the one-device form and the context-parallel form.

With a non-negative feature map φ the softmax kernel exp(q·k) is replaced by φ(q)·φ(k), and
the sums over keys are formed once instead of once per query:

    out_i = φ(q_i)ᵀ S_i / φ(q_i)ᵀ z_i,   S_i = Σ_{j seen by i} φ(k_j) v_jᵀ  [m, d],
                                          z_i = Σ_{j seen by i} φ(k_j)       [m]

Non-causal: one S and z for all queries, O(n·m·d) time. Causal (bottom-right alignment): a
`lax.scan` over chunks of C positions carries (S, z) of the keys before the chunk; inside a
chunk the C x C weights φ(q_t)·φ(k_s), s <= t, are formed explicitly, so memory is
O(n·m + n·C + (n/C)·m·d) and no per-position m x d state is stored. Padded keys are left out
of S and z.

Log space. Feature maps give log φ, of which a query may drop any constant (it cancels
between numerator and denominator). Exponential features (FAVOR+) span hundreds of e-folds at
large input norms, so one scale for all keys would underflow most of them (and zero whole
rows). Instead each feature m is stored relative to its own max log φ(k_j)_m over the keys
absorbed, c_m: S_m = Σ_j exp(log φ(k_j)_m - c_m) v_j, z_m likewise, so z_m >= 1. Query i
weighs feature m by exp(log φ(q_i)_m + c_m - a_i), a_i = the max over m; its denominator is
then >= z_m* >= 1, so a query that sees a real key never gets an all-zero row. Causal: c is a
running max, the state rescaled when it grows (as in online softmax); inside a chunk each
(query, key) weight is a log-sum-exp over the m features, C·m exponentials per query (hence a
small default C). Every max is taken over keys the query sees, so no padded or future key
changes a real output, not even by rounding.

Context parallelism (the active mesh's `context` axis splits the sequence, ops/context.py):
each device absorbs its shard's keys into its shard's (S, z, c). Not causal: the shard states
are summed across `context` (pmax of c, then psum of S and z rescaled to it) and every device
reads its own queries from the total. Causal: the shard states are all-gathered (C states of
m x (d + 2) per K/V head, whatever the length) and each device merges those of the shards
before it, an exclusive scan, then runs the chunked scan over its own shard from that state.
No query, key or value leaves its device; per-device memory is that of a length n/C.

Shapes: q_log [b, q, kvh, g, m] (query heads grouped by the K/V head they share),
k_log [b, k, kvh, m], v [b, k, kvh, d]; all f32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from attention_zoo.ops.blocks import ceil_div
from attention_zoo.ops.context import CONTEXT_AXIS, context_size, sequence_spec

# Log scale of "no key yet" and log φ of a padded key: finite, so differences never give
# inf - inf.
FLOOR = -1e30


def init_state(batch_size: int, num_kv_heads: int, nb_features: int, head_dim: int):
  """The empty recurrent state: S [b, kvh, m, d], z [b, kvh, m], log scales c [b, kvh, m]."""
  return {"kv": jnp.zeros((batch_size, num_kv_heads, nb_features, head_dim), jnp.float32),
          "k_sum": jnp.zeros((batch_size, num_kv_heads, nb_features), jnp.float32),
          "log_scale": jnp.full((batch_size, num_kv_heads, nb_features), FLOOR, jnp.float32)}


def absorb(state, k_log, v, real):
  """Adds keys k_log [b, c, kvh, m] (values v [b, c, kvh, d], real [b, c]) to the state."""
  real = real[:, :, None, None]
  k_log = jnp.where(real, k_log, FLOOR)
  new_log = jax.lax.stop_gradient(jnp.maximum(state["log_scale"], k_log.max(axis=1)))  # [b, kvh, m]
  decay = jnp.exp(state["log_scale"] - new_log)                                 # [b, kvh, m], <= 1
  k_feat = jnp.where(real, jnp.exp(k_log - new_log[:, None]), 0.0)         # [b, c, kvh, m], <= 1
  return {"kv": state["kv"] * decay[..., None] + jnp.einsum("bchm,bchd->bhmd", k_feat, v),
          "k_sum": state["k_sum"] * decay + k_feat.sum(axis=1),
          "log_scale": new_log}


def read(state, q_log):
  """Queries q_log [b, c, kvh, g, m] against the state -> numerator [b, c, kvh, g, d],
  denominator [b, c, kvh, g] and their common log scale [b, c, kvh, g]."""
  weighted = q_log + state["log_scale"][:, None, :, None]                      # [b, c, kvh, g, m]
  scale = jax.lax.stop_gradient(weighted.max(axis=-1))
  w = jnp.exp(weighted - scale[..., None])
  num = jnp.einsum("bchgm,bhmd->bchgd", w, state["kv"])
  den = jnp.einsum("bchgm,bhm->bchg", w, state["k_sum"])
  return num, den, scale


def normalise(num, den):
  """num / den; a query that sees no key (den = 0, features are non-negative) gives 0."""
  return num / jnp.where(den > 0, den, 1.0)[..., None]


def linear_attention(q_log, k_log, v, kv_mask, *, causal: bool, chunk_size: int):
  """Kernelised attention -> [b, q, kvh, g, d] f32 (see the module docstring for shapes); under
  a mesh whose `context` axis splits the sequence, its context-parallel form."""
  if context_size() > 1:
    return _context_parallel(q_log, k_log, v, kv_mask, causal=causal, chunk_size=chunk_size)
  v = jnp.where(kv_mask[:, :, None, None], v, 0.0)   # a non-finite padded value never reaches S
  b, _, num_kv_heads, nb_features = k_log.shape
  state = init_state(b, num_kv_heads, nb_features, v.shape[-1])
  if not causal:
    num, den, _ = read(absorb(state, k_log, v, kv_mask), q_log)
    return normalise(num, den)
  return _causal(q_log, k_log, v, kv_mask, state, chunk_size)


def _causal(q_log, k_log, v, kv_mask, state, chunk_size):
  q_len, kv_len = q_log.shape[1], k_log.shape[1]
  # Align query i with key i + (kv_len - q_len) by prepending dummy queries or padded keys,
  # then pad both to a whole number of chunks.
  extra_q, extra_k = max(kv_len - q_len, 0), max(q_len - kv_len, 0)
  length = max(q_len, kv_len)
  chunk = min(chunk_size, length)
  tail = ceil_div(length, chunk) * chunk - length
  pad = lambda x, front, value=0.0: jnp.pad(
      x, [(0, 0), (front, tail)] + [(0, 0)] * (x.ndim - 2), constant_values=value)
  q_log, k_log, v = pad(q_log, extra_q), pad(k_log, extra_k), pad(v, extra_k)
  real = pad(kv_mask, extra_k, False)
  to_chunks = lambda x: jnp.moveaxis(x.reshape(x.shape[0], -1, chunk, *x.shape[2:]), 1, 0)
  causal = jnp.arange(chunk)[:, None] >= jnp.arange(chunk)[None, :]                # [t, s]

  @jax.checkpoint   # the backward pass recomputes a chunk's C x C x m pair terms, never stores them
  def step(state, xs):
    q_c, k_c, real_c, v_c = xs      # [b, C, kvh, g, m], [b, C, kvh, m], [b, C], [b, C, kvh, d]
    num, den, scale = read(state, q_c)
    # log φ(q_t)·φ(k_s) for the chunk's pairs: a log-sum-exp over the features
    pair = jax.nn.logsumexp(q_c[:, :, None] + k_c[:, None, :, :, None], axis=-1)  # [b,t,s,kvh,g]
    sees = (causal[None] & real_c[:, None, :])[..., None, None]                    # [b, t, s, 1, 1]
    pair = jnp.where(sees, pair, FLOOR)
    top = jax.lax.stop_gradient(jnp.maximum(scale, pair.max(axis=2)))              # [b, t, kvh, g]
    state_weight = jnp.exp(scale - top)
    pair_weight = jnp.where(sees, jnp.exp(pair - top[:, :, None]), 0.0)           # [b,t,s,kvh,g]
    num = num * state_weight[..., None] + jnp.einsum("btshg,bshd->bthgd", pair_weight, v_c)
    den = den * state_weight + pair_weight.sum(axis=2)
    return absorb(state, k_c, v_c, real_c), normalise(num, den)

  _, out = jax.lax.scan(step, state, tuple(map(to_chunks, (q_log, k_log, real, v))))
  out = jnp.moveaxis(out, 0, 1).reshape(out.shape[1], -1, *out.shape[3:])  # [b, L, kvh, g, d]
  return out[:, extra_q:extra_q + q_len]


def _merge_states(states, take):
  """The state of the keys of the stacked states [C, ...] where take bool [C]: each feature
  rescaled to the largest log scale taken (none taken: the empty state)."""
  taken = take.reshape(-1, *(1,) * (states["log_scale"].ndim - 1))
  log_scale = jnp.where(taken, states["log_scale"], FLOOR)
  top = jax.lax.stop_gradient(log_scale.max(axis=0))
  weight = jnp.where(taken, jnp.exp(log_scale - top), 0.0)
  return {"kv": (states["kv"] * weight[..., None]).sum(axis=0),
          "k_sum": (states["k_sum"] * weight).sum(axis=0), "log_scale": top}


def _context_parallel(q_log, k_log, v, kv_mask, *, causal: bool, chunk_size: int):
  if causal and q_log.shape[1] != k_log.shape[1]:
    raise ValueError(f"causal kernelised attention under context parallelism needs q_len == "
                     f"kv_len (each shard's queries and keys at the same positions); got "
                     f"q_len={q_log.shape[1]}, kv_len={k_log.shape[1]}: run it without a "
                     f"`context` mesh axis, or non-causal")
  spec = sequence_spec()

  def shard(q_log, k_log, v, kv_mask):
    v = jnp.where(kv_mask[:, :, None, None], v, 0.0)
    b, _, num_kv_heads, nb_features = k_log.shape
    own = absorb(init_state(b, num_kv_heads, nb_features, v.shape[-1]), k_log, v, kv_mask)
    if not causal:
      top = jax.lax.pmax(own["log_scale"], CONTEXT_AXIS)   # own["log_scale"] is a constant
      weight = jnp.exp(own["log_scale"] - top)
      total = {"kv": jax.lax.psum(own["kv"] * weight[..., None], CONTEXT_AXIS),
               "k_sum": jax.lax.psum(own["k_sum"] * weight, CONTEXT_AXIS), "log_scale": top}
      num, den, _ = read(total, q_log)
      return normalise(num, den)
    shards = jax.lax.all_gather(own, CONTEXT_AXIS)                       # [C, b, kvh, m, ...]
    before = jnp.arange(shards["log_scale"].shape[0]) < jax.lax.axis_index(CONTEXT_AXIS)
    return _causal(q_log, k_log, v, kv_mask, _merge_states(shards, before), chunk_size)

  return jax.shard_map(shard, in_specs=(spec,) * 4, out_specs=spec)(q_log, k_log, v, kv_mask)
