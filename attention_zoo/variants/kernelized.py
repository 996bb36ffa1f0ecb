"""Kernelised (linear) attention: the machinery `performer` and `linear_transformer` share.

With a non-negative feature map φ the softmax kernel exp(q·k) is replaced by φ(q)·φ(k), and
the sums over keys are formed once instead of once per query:

    out_i = φ(q_i)ᵀ S_i / φ(q_i)ᵀ z_i,   S_i = Σ_{j seen by i} φ(k_j) v_jᵀ  [m, d],
                                          z_i = Σ_{j seen by i} φ(k_j)       [m]

Non-causal: one S and z for all queries, O(n·m·d) time. Causal (bottom-right alignment): a
`lax.scan` over chunks of C positions carries (S, z) of the keys before the chunk; inside a
chunk the C x C weights φ(q_t)·φ(k_s), s <= t, are formed explicitly, so memory is
O(n·m + n·C + (n/C)·m·d) and no per-position m x d state is stored. One-token decoding carries
the same (S, z) state instead of a KV cache. Padded keys are left out of S and z.

Log space. Feature maps return log φ, of which a query may drop any constant (it cancels
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

`padded_keys="zeroed"` recreates the Nyströmformer LRA code's masking instead: padded keys and
values are set to zero and kept, so each adds φ(0) (not 0) to every normaliser while adding
nothing to the numerator; a row with many padded positions has its output scaled down.

Shapes: q_log [b, q, kvh, g, m] (query heads grouped by the K/V head they share),
k_log [b, k, kvh, m], v [b, k, kvh, d]; all f32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from attention_zoo.contract import Attention
from attention_zoo.ops import softmax
from attention_zoo.ops.blocks import ceil_div
from attention_zoo.options import Choice, Int

# Log scale of "no key yet" and log φ of a padded key: finite, so differences never give
# inf - inf.
_FLOOR = -1e30


def init_state(batch_size: int, num_kv_heads: int, nb_features: int, head_dim: int):
  """The empty recurrent state: S [b, kvh, m, d], z [b, kvh, m], log scales c [b, kvh, m]."""
  return {"kv": jnp.zeros((batch_size, num_kv_heads, nb_features, head_dim), jnp.float32),
          "k_sum": jnp.zeros((batch_size, num_kv_heads, nb_features), jnp.float32),
          "log_scale": jnp.full((batch_size, num_kv_heads, nb_features), _FLOOR, jnp.float32)}


def _absorb(state, k_log, v, real):
  """Adds keys k_log [b, c, kvh, m] (values v [b, c, kvh, d], real [b, c]) to the state."""
  real = real[:, :, None, None]
  k_log = jnp.where(real, k_log, _FLOOR)
  new_log = jax.lax.stop_gradient(jnp.maximum(state["log_scale"], k_log.max(axis=1)))  # [b, kvh, m]
  decay = jnp.exp(state["log_scale"] - new_log)                                 # [b, kvh, m], <= 1
  k_feat = jnp.where(real, jnp.exp(k_log - new_log[:, None]), 0.0)         # [b, c, kvh, m], <= 1
  return {"kv": state["kv"] * decay[..., None] + jnp.einsum("bchm,bchd->bhmd", k_feat, v),
          "k_sum": state["k_sum"] * decay + k_feat.sum(axis=1),
          "log_scale": new_log}


def _read(state, q_log):
  """Queries q_log [b, c, kvh, g, m] against the state -> numerator [b, c, kvh, g, d],
  denominator [b, c, kvh, g] and their common log scale [b, c, kvh, g]."""
  weighted = q_log + state["log_scale"][:, None, :, None]                      # [b, c, kvh, g, m]
  scale = jax.lax.stop_gradient(weighted.max(axis=-1))
  w = jnp.exp(weighted - scale[..., None])
  num = jnp.einsum("bchgm,bhmd->bchgd", w, state["kv"])
  den = jnp.einsum("bchgm,bhm->bchg", w, state["k_sum"])
  return num, den, scale


def _normalise(num, den):
  """num / den; a query that sees no key (den = 0, features are non-negative) gives 0."""
  return num / jnp.where(den > 0, den, 1.0)[..., None]


def linear_attention(q_log, k_log, v, kv_mask, *, causal: bool, chunk_size: int):
  """Kernelised attention -> [b, q, kvh, g, d] f32 (see the module docstring for shapes)."""
  v = jnp.where(kv_mask[:, :, None, None], v, 0.0)   # a non-finite padded value never reaches S
  b, _, num_kv_heads, nb_features = k_log.shape
  state = init_state(b, num_kv_heads, nb_features, v.shape[-1])
  if not causal:
    num, den, _ = _read(_absorb(state, k_log, v, kv_mask), q_log)
    return _normalise(num, den)
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
    num, den, scale = _read(state, q_c)
    # log φ(q_t)·φ(k_s) for the chunk's pairs: a log-sum-exp over the features
    pair = jax.nn.logsumexp(q_c[:, :, None] + k_c[:, None, :, :, None], axis=-1)  # [b,t,s,kvh,g]
    sees = (causal[None] & real_c[:, None, :])[..., None, None]                    # [b, t, s, 1, 1]
    pair = jnp.where(sees, pair, _FLOOR)
    top = jax.lax.stop_gradient(jnp.maximum(scale, pair.max(axis=2)))              # [b, t, kvh, g]
    state_weight = jnp.exp(scale - top)
    pair_weight = jnp.where(sees, jnp.exp(pair - top[:, :, None]), 0.0)           # [b,t,s,kvh,g]
    num = num * state_weight[..., None] + jnp.einsum("btshg,bshd->bthgd", pair_weight, v_c)
    den = den * state_weight + pair_weight.sum(axis=2)
    return _absorb(state, k_c, v_c, real_c), _normalise(num, den)

  _, out = jax.lax.scan(step, state, tuple(map(to_chunks, (q_log, k_log, real, v))))
  out = jnp.moveaxis(out, 0, 1).reshape(out.shape[1], -1, *out.shape[3:])  # [b, L, kvh, g, d]
  return out[:, extra_q:extra_q + q_len]


class KernelizedAttention(Attention):
  """Base of the kernelised variants: subclasses define `feature_maps` and `feature_count`."""
  # chunk_size: positions per step of the causal prefix-sum scan; padded_keys: "removed" (left
  # out of S and z) or "zeroed" (zero keys and values kept: the Nyströmformer LRA code's).
  OPTIONS = {"chunk_size": Int(16, minimum=1),
             "padded_keys": Choice("removed", ("removed", "zeroed"))}
  # Subclasses register with supports_dropout=False; the base refuses dropout_rate > 0 with this.
  WHY_NO_DROPOUT = "kernelised attention never forms the attention weights that dropout drops"

  @classmethod
  def feature_count(cls, head_dim: int, options: dict) -> int:
    """m, the number of features φ maps a head to, given the validated options."""
    raise NotImplementedError

  @property
  def nb_features(self) -> int:
    return self.feature_count(self.head_dim, self.options)

  @classmethod
  def state_size(cls, *, num_kv_heads, head_dim, options, **dims) -> int:
    """The recurrent state S [m, d] and z [m] per kv head, whatever the length."""
    return num_kv_heads * cls.feature_count(head_dim, options) * (head_dim + 1)

  def feature_maps(self, q, k, *, deterministic: bool, kv_mask=None):
    """q [b, n, kvh, g, d], k [b, n, kvh, d] (f32) -> log φ(q) [b, n, kvh, g, m] (up to a
    per-query constant) and log φ(k) [b, n, kvh, m]. kv_mask bool [b, n] (None in decoding):
    the keys attended to, for a map that looks across keys."""
    raise NotImplementedError

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic):
    f32 = lambda x: x.astype(jnp.float32)   # feature maps and sums in f32, even for bf16 inputs
    q, k, v = f32(q), f32(k), f32(v)
    if self.options["padded_keys"] == "zeroed":
      real = kv_mask[:, :, None, None]
      k, v = jnp.where(real, k, 0.0), jnp.where(real, v, 0.0)
      kv_mask = jnp.ones_like(kv_mask)   # every key attended to, the zeroed ones included
    q_log, k_log = self.feature_maps(softmax.group_heads(q, self.num_kv_heads), k,
                                     deterministic=deterministic, kv_mask=kv_mask)
    out = linear_attention(q_log, k_log, v, kv_mask, causal=self.causal,
                           chunk_size=self.options["chunk_size"])
    return out.reshape(q.shape)

  # -- recurrent decoding: the state (S, z) replaces the KV cache ----------------------------

  def init_cache(self, batch_size: int, max_len: int, dtype=jnp.float32):
    """The fixed-size state; max_len is not needed and the state is f32 whatever `dtype` is."""
    self._require_decode()
    return init_state(batch_size, self.num_kv_heads, self.nb_features, self.head_dim)

  def decode(self, q, k, v, cache, *, alibi_slopes=None):
    """q [b, 1, h, d], k, v [b, 1, kvh, d] -> (out [b, 1, h, d], new state)."""
    self._require_decode()
    if alibi_slopes is not None:
      raise ValueError(f"{self.spec.name} does not accept a score bias (ALiBi): it never forms "
                       f"scores")
    f32 = lambda x: x.astype(jnp.float32)
    q_log, k_log = self.feature_maps(
        softmax.group_heads(f32(q), self.num_kv_heads), f32(k), deterministic=True)
    cache = _absorb(cache, k_log, f32(v), jnp.ones(k.shape[:2], bool))
    num, den, _ = _read(cache, q_log)
    out = _normalise(num, den)
    return out.reshape(q.shape).astype(q.dtype), cache
