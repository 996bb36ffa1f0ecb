"""The layers every model shares: multi-head attention around any registered variant, the MLP,
and the short causal convolution (beside attention in a block, and inside the sequence mixers)."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from attention_zoo import positions, registry


class MultiHeadAttention(nnx.Module):
  """Projections around an attention variant chosen by name.

  x [b, n, emb] -> [b, n, emb]. q/k/v/out projections with `qkv_dim` = num_heads · head_dim;
  `num_kv_heads` < num_heads gives GQA (1 gives MQA) with smaller k/v projections.
  `position_kind` "rope" rotates q and k, "alibi" passes per-head slopes to variants whose spec
  allows a score bias; other kinds are added to the embeddings by the model, not here.
  A variant whose spec says `shared_qk` gets the queries as keys (no key projection).
  Packed sequences: `segment_ids` int [b, n] (self-attention; variants with
  spec.supports_segment_ids) keep each token's attention inside its segment, and `position_ids`
  [b, n] (default 0..n-1) are the positions RoPE rotates by.
  """

  def __init__(self, emb_dim: int, num_heads: int, *, num_kv_heads: int | None = None,
               qkv_dim: int | None = None, attention: str = "full", attention_options=None,
               causal: bool = False, max_len: int | None = None, position_kind: str = "none",
               rope_base: float = 10000.0, dtype=jnp.float32, rngs: nnx.Rngs):
    qkv_dim = emb_dim if qkv_dim is None else qkv_dim
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if qkv_dim % num_heads:
      raise ValueError(f"qkv_dim ({qkv_dim}) must be divisible by num_heads ({num_heads})")
    positions.check_kind(position_kind)
    spec = registry.spec(attention)
    if position_kind == "alibi" and not spec.supports_alibi:
      raise ValueError(f"attention {attention!r} does not accept a score bias, so ALiBi cannot "
                       f"be used with it; variants that do: "
                       f"{', '.join(registry.accepting_alibi())}")
    if spec.shared_qk and num_kv_heads != num_heads:
      raise ValueError(f"attention {attention!r} uses the queries as keys (shared QK), so "
                       f"num_kv_heads ({num_kv_heads}) must equal num_heads ({num_heads})")
    self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
    self.head_dim = qkv_dim // num_heads
    self.position_kind, self.rope_base, self.shared_qk = position_kind, rope_base, spec.shared_qk
    self.alibi_slopes = positions.alibi_slopes(num_heads) if position_kind == "alibi" else None
    self.attention = registry.create(attention, num_heads=num_heads, head_dim=self.head_dim,
                                     num_kv_heads=num_kv_heads, causal=causal, max_len=max_len,
                                     rngs=rngs, **dict(attention_options or {}))
    linear = lambda i, o: nnx.Linear(i, o, dtype=dtype, rngs=rngs)
    self.query = linear(emb_dim, num_heads * self.head_dim)
    self.key = None if spec.shared_qk else linear(emb_dim, num_kv_heads * self.head_dim)
    self.value = linear(emb_dim, num_kv_heads * self.head_dim)
    self.out = linear(num_heads * self.head_dim, emb_dim)
    self.cache = nnx.data(None)   # set by init_cache

  def init_cache(self, batch_size: int, max_len: int, dtype=jnp.float32):
    """Prepares one-token decoding (`decode=True`) for up to max_len tokens."""
    self.cache = nnx.Cache(self.attention.init_cache(batch_size, max_len, dtype))
    self.cache_index = nnx.Cache(jnp.zeros((), jnp.int32))

  def __call__(self, x, context=None, *, mask=None, context_mask=None, deterministic: bool = True,
               decode: bool = False, segment_ids=None, position_ids=None):
    """Self-attention over x, or cross-attention from x to `context`. Masks: bool [b, len]."""
    b, n, _ = x.shape
    if decode and self.cache is None:
      raise ValueError("decode=True needs init_cache(batch_size, max_len) first")
    if segment_ids is not None and (context is not None or decode):
      raise ValueError("segment_ids (packed sequences) apply to self-attention over a whole "
                       "sequence, not to cross-attention or decoding")
    kv_input = x if context is None else context
    kv_mask = mask if context is None else context_mask
    q = self.query(x).reshape(b, n, self.num_heads, self.head_dim)
    if self.shared_qk:
      k = q
    else:
      k = self.key(kv_input).reshape(b, kv_input.shape[1], self.num_kv_heads, self.head_dim)
    v = self.value(kv_input).reshape(b, kv_input.shape[1], self.num_kv_heads, self.head_dim)
    if self.position_kind == "rope":
      offset = self.cache_index[...] if decode else 0
      q_positions = jnp.arange(n) + offset if position_ids is None else position_ids
      kv_positions = (jnp.arange(k.shape[1]) + offset if position_ids is None or context is not None
                      else position_ids)
      q = positions.rope(q, q_positions, self.rope_base)
      k = q if self.shared_qk else positions.rope(k, kv_positions, self.rope_base)
    if decode:
      if n != 1 or context is not None:
        raise ValueError(f"decode=True takes one token of self-attention at a time, got length {n}")
      out, new_cache = self.attention.decode(q, k, v, self.cache.get_value(),
                                             alibi_slopes=self.alibi_slopes)
      self.cache.set_value(new_cache)
      self.cache_index[...] += 1
    else:
      out = self.attention(q, k, v, q_mask=mask, kv_mask=kv_mask, deterministic=deterministic,
                           alibi_slopes=self.alibi_slopes, q_segment_ids=segment_ids,
                           kv_segment_ids=segment_ids)
    return self.out(out.reshape(b, n, self.num_heads * self.head_dim))


class MLP(nnx.Module):
  """Dense(mlp_dim) -> GELU (tanh approximation, or exact with approximate_gelu=False) ->
  dropout -> Dense(emb_dim)."""

  def __init__(self, emb_dim: int, mlp_dim: int, *, dropout_rate: float = 0.0,
               approximate_gelu: bool = True, dtype=jnp.float32, rngs: nnx.Rngs):
    self.up = nnx.Linear(emb_dim, mlp_dim, dtype=dtype, rngs=rngs)
    self.down = nnx.Linear(mlp_dim, emb_dim, dtype=dtype, rngs=rngs)
    self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)
    self.approximate_gelu = approximate_gelu

  def __call__(self, x, *, deterministic: bool = True):
    hidden = nnx.gelu(self.up(x), approximate=self.approximate_gelu)
    return self.down(self.dropout(hidden, deterministic=deterministic))


class ShortConv(nnx.Module):
  """A causal depthwise convolution over the last `kernel_size` positions (the short
  convolution Zoology puts beside attention; Arora et al. 2023):

      y_t = b + Σ_{i < k} w_i ⊙ x_{t-i}          x, y [b, n, emb]; w [k, emb]

  It hands each position its recent neighbours (a key to the value after it), so attention
  is left with the long-range part. The sequence mixers (DeltaNet, Mamba2, ...) run it on their
  projections (their authors' kernel 4, followed by SiLU). For decoding it keeps the last
  k - 1 inputs, so any number of tokens can be fed at a time.
  """

  def __init__(self, features: int, kernel_size: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
    if kernel_size < 1:
      raise ValueError(f"short_conv must be a kernel size >= 1 (0 = none), got {kernel_size}")
    self.kernel_size, self.dtype = kernel_size, dtype
    self.weight = nnx.Param(nnx.initializers.normal(kernel_size ** -0.5)(
        rngs.params(), (kernel_size, features)))
    self.bias = nnx.Param(jnp.zeros((features,)))
    self.state = nnx.data(None)   # [b, k - 1, emb] in decoding, set by init_cache

  def init_cache(self, batch_size: int, dtype=jnp.float32):
    self.state = nnx.Cache(jnp.zeros((batch_size, self.kernel_size - 1, self.weight.shape[1]),
                                     dtype))

  def __call__(self, x, *, decode: bool = False):
    k, n = self.kernel_size, x.shape[1]
    if decode:
      window = jnp.concatenate([self.state[...].astype(x.dtype), x], axis=1)   # [b, k - 1 + n, emb]
      self.state[...] = window[:, n:]
    else:
      window = jnp.pad(x, ((0, 0), (k - 1, 0), (0, 0)))
    weight = self.weight[...].astype(self.dtype)
    # Tap i reads x_{t-i}: the slice of the left-padded window that ends i positions early.
    out = sum(weight[i] * window[:, k - 1 - i:k - 1 - i + n] for i in range(k))
    return out + self.bias[...].astype(self.dtype)
