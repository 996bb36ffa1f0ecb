"""Kernelised (linear) attention: the machinery `performer` and `linear_transformer` share.

With a non-negative feature map φ the softmax kernel exp(q·k) is replaced by φ(q)·φ(k), and
the sums over keys are formed once instead of once per query:

    out_i = φ(q_i)ᵀ S_i / φ(q_i)ᵀ z_i,   S_i = Σ_{j seen by i} φ(k_j) v_jᵀ  [m, d],
                                          z_i = Σ_{j seen by i} φ(k_j)       [m]

Non-causal: one S and z for all queries, O(n·m·d) time. Causal (bottom-right alignment):
prefix sums computed chunk by chunk, a `lax.scan` over chunks of C positions carrying (S, z):
inside a chunk the C x C products φ(q_t)·φ(k_s), s <= t, are formed explicitly, so memory is
O(n·m + n·C + (n/C)·m·d) and no per-position m x d state is ever stored. One-token decoding
carries the same (S, z) state instead of a KV cache.

Padded keys are removed from both S and z (their features are zeroed).

Stabiliser. Exponential features (FAVOR+) overflow f32 unless a max is subtracted before exp.
A feature map therefore returns key features in factored form φ(k_j) = k_feat_j · exp(log_scale_j)
with k_feat_j <= 1 (`log_scale` holds the max it subtracted, without gradient). A factor
exp(-M) common to all keys a query sees cancels between numerator and denominator, so each
query uses M = the max log scale over the keys *it* sees: the max over real keys when
non-causal, the prefix max when causal (never a padded key, never a future key). The state
(S, z) is stored relative to its own running max and rescaled when the max grows, as in
online softmax. Query features may subtract any per-query constant: it cancels likewise.

Shapes: q_feat [b, q, kvh, g, m] (query heads grouped by the K/V head they share),
k_feat [b, k, kvh, m], log_scale [b, k, kvh], v [b, k, kvh, d]; all f32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from attention_zoo import reference
from attention_zoo.base import Attention, ceil_div

# Log scale of "no key yet": finite, so differences never produce inf - inf.
_FLOOR = -1e30


def init_state(batch_size: int, num_kv_heads: int, nb_features: int, head_dim: int):
  """The empty recurrent state: S [b, kvh, m, d], z [b, kvh, m], running max log scale [b, kvh]."""
  return {"kv": jnp.zeros((batch_size, num_kv_heads, nb_features, head_dim), jnp.float32),
          "k_sum": jnp.zeros((batch_size, num_kv_heads, nb_features), jnp.float32),
          "log_scale": jnp.full((batch_size, num_kv_heads), _FLOOR, jnp.float32)}


def _absorb(state, k_feat, log_scale, v):
  """Adds keys k_feat [b, c, kvh, m] (and v [b, c, kvh, d]) to the state."""
  new_log = jnp.maximum(state["log_scale"], log_scale.max(axis=1))        # [b, kvh]
  decay = jnp.exp(state["log_scale"] - new_log)                           # [b, kvh], <= 1
  weighted = k_feat * jnp.exp(log_scale - new_log[:, None])[..., None]    # [b, c, kvh, m]
  return {"kv": state["kv"] * decay[..., None, None]
                + jnp.einsum("bchm,bchd->bhmd", weighted, v),             # [b, kvh, m, d]
          "k_sum": state["k_sum"] * decay[..., None] + weighted.sum(axis=1),  # [b, kvh, m]
          "log_scale": new_log}


def _read(state, q_feat, q_log):
  """Numerator [b, c, kvh, g, d] and denominator [b, c, kvh, g] of q_feat [b, c, kvh, g, m]
  against the state, rescaled to each query's log scale q_log [b, c, kvh] (>= the state's)."""
  decay = jnp.exp(state["log_scale"][:, None] - q_log)                      # [b, c, kvh]
  num = jnp.einsum("bchgm,bhmd->bchgd", q_feat, state["kv"]) * decay[..., None, None]
  den = jnp.einsum("bchgm,bhm->bchg", q_feat, state["k_sum"]) * decay[..., None]
  return num, den


def _normalise(num, den):
  """num / den; a query that sees no key (den = 0, features are non-negative) gives 0."""
  return num / jnp.where(den > 0, den, 1.0)[..., None]


def linear_attention(q_feat, k_feat, log_scale, v, kv_mask, *, causal: bool, chunk_size: int):
  """Kernelised attention -> [b, q, kvh, g, d] f32 (see the module docstring for shapes)."""
  real = kv_mask[:, :, None]                                                # [b, k, 1]
  k_feat = jnp.where(real[..., None], k_feat, 0.0)
  log_scale = jnp.where(real, log_scale, _FLOOR)
  v = jnp.where(real[..., None], v, 0.0)   # so a non-finite padded value cannot reach the sums
  b, _, num_kv_heads, nb_features = k_feat.shape
  state = init_state(b, num_kv_heads, nb_features, v.shape[-1])
  if not causal:
    state = _absorb(state, k_feat, log_scale, v)
    q_log = jnp.broadcast_to(state["log_scale"][:, None], q_feat.shape[:3])
    return _normalise(*_read(state, q_feat, q_log))
  return _causal(q_feat, k_feat, log_scale, v, state, chunk_size)


def _causal(q_feat, k_feat, log_scale, v, state, chunk_size):
  q_len, kv_len = q_feat.shape[1], k_feat.shape[1]
  # Align query i with key i + (kv_len - q_len) by prepending dummy queries (zero features)
  # or padded keys, then pad both to a whole number of chunks.
  extra_q, extra_k = max(kv_len - q_len, 0), max(q_len - kv_len, 0)
  length = max(q_len, kv_len)
  chunk = min(chunk_size, length)
  tail = ceil_div(length, chunk) * chunk - length
  pad = lambda x, front, value=0.0: jnp.pad(
      x, [(0, 0), (front, tail)] + [(0, 0)] * (x.ndim - 2), constant_values=value)
  q_feat, k_feat, v = pad(q_feat, extra_q), pad(k_feat, extra_k), pad(v, extra_k)
  log_scale = pad(log_scale, extra_k, _FLOOR)
  to_chunks = lambda x: jnp.moveaxis(x.reshape(x.shape[0], -1, chunk, *x.shape[2:]), 1, 0)
  sees = jnp.arange(chunk)[:, None] >= jnp.arange(chunk)[None, :]           # [t, s]

  def step(state, xs):
    q_c, k_c, log_c, v_c = xs               # [b, C, kvh, g, m], [b, C, kvh, m], [b, C, kvh], [b, C, kvh, d]
    # Query t's log scale: the max over the state's keys and this chunk's keys s <= t.
    q_log = jnp.maximum(state["log_scale"][:, None], jax.lax.cummax(log_c, axis=1))  # [b, C, kvh]
    num, den = _read(state, q_c, q_log)
    rel = log_c.transpose(0, 2, 1)[:, None] - q_log[..., None]              # [b, t, kvh, s]
    rel = jnp.where(sees[:, None, :], rel, -jnp.inf)
    scores = jnp.einsum("bthgm,bshm->bthgs", q_c, k_c) * jnp.exp(rel)[:, :, :, None]  # [b, t, kvh, g, s]
    num = num + jnp.einsum("bthgs,bshd->bthgd", scores, v_c)
    den = den + scores.sum(axis=-1)
    return _absorb(state, k_c, log_c, v_c), _normalise(num, den)

  _, out = jax.lax.scan(step, state, tuple(map(to_chunks, (q_feat, k_feat, log_scale, v))))
  out = jnp.moveaxis(out, 0, 1).reshape(out.shape[1], -1, *out.shape[3:])  # [b, L, kvh, g, d]
  return out[:, extra_q:extra_q + q_len]


class KernelizedAttention(Attention):
  """Base of the kernelised variants: subclasses define `feature_maps` and `nb_features`."""
  OPTIONS = {"chunk_size": 64}   # positions per step of the causal prefix-sum scan
  # Subclasses register with supports_dropout=False; the base refuses dropout_rate > 0 with this.
  WHY_NO_DROPOUT = "kernelised attention never forms the attention weights that dropout drops"

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    chunk_size = self.options["chunk_size"]
    if not isinstance(chunk_size, int) or chunk_size <= 0:
      raise ValueError(f"{self.spec.name}: chunk_size must be a positive int, got {chunk_size!r}")

  @property
  def nb_features(self) -> int:
    raise NotImplementedError

  def feature_maps(self, q, k, *, deterministic: bool):
    """q [b, n, kvh, g, d], k [b, n, kvh, d] (f32) -> q_feat [b, n, kvh, g, m],
    k_feat [b, n, kvh, m], log_scale [b, n, kvh] with φ(k) = k_feat · exp(log_scale)."""
    raise NotImplementedError

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic):
    f32 = lambda x: x.astype(jnp.float32)   # feature maps and sums in f32, even for bf16 inputs
    q_feat, k_feat, log_scale = self.feature_maps(
        reference.group_heads(f32(q), self.num_kv_heads), f32(k), deterministic=deterministic)
    out = linear_attention(q_feat, k_feat, log_scale, f32(v), kv_mask, causal=self.causal,
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
      raise ValueError(f"{self.spec.name} does not accept a score bias (ALiBi): it never forms scores")
    f32 = lambda x: x.astype(jnp.float32)
    q_feat, k_feat, log_scale = self.feature_maps(
        reference.group_heads(f32(q), self.num_kv_heads), f32(k), deterministic=True)
    cache = _absorb(cache, k_feat, log_scale, f32(v))
    out = _normalise(*_read(cache, q_feat, cache["log_scale"][:, None]))
    return out.reshape(q.shape).astype(q.dtype), cache
