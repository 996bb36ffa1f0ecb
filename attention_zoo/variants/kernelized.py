"""Kernelised (linear) attention: the base class `performer` and `linear_transformer` share.

With a non-negative feature map φ the softmax kernel exp(q·k) is replaced by φ(q)·φ(k), and
the sums over keys (S = Σ φ(k) vᵀ, z = Σ φ(k)) are formed once instead of once per query:
once for all queries, or as chunked prefix sums when causal. Their numerics (log-space
features, the chunked scan, the context-parallel form) are `attention_zoo.ops.kernelized`.
One-token decoding carries the same (S, z) state instead of a KV cache.

`padded_keys="zeroed"` recreates the Nyströmformer LRA code's masking instead: padded keys and
values are set to zero and kept, so each adds φ(0) (not 0) to every normaliser while adding
nothing to the numerator; a row with many padded positions has its output scaled down.
"""
from __future__ import annotations

import jax.numpy as jnp

from attention_zoo.contract import Attention
from attention_zoo.ops import softmax
from attention_zoo.ops.kernelized import absorb, init_state, linear_attention, normalise, read
from attention_zoo.options import Choice, Int


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
    cache = absorb(cache, k_log, f32(v), jnp.ones(k.shape[:2], bool))
    num, den, _ = read(cache, q_log)
    out = normalise(num, den)
    return out.reshape(q.shape).astype(q.dtype), cache
