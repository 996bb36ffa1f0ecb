"""The layers every model shares: multi-head attention around any registered variant (the
projection layer), the MLP, and `create_mixer`, any registered name as a layer on x.

They build variants and mixers by name, so they import the packages of the built-in ones, which
registers them.
"""
from __future__ import annotations

import itertools

import jax.numpy as jnp
from flax import nnx

import attention_zoo.mixers  # noqa: F401  (registers the built-in mixers)
import attention_zoo.variants  # noqa: F401  (registers the built-in attention variants)
from attention_zoo import positions, registry
from attention_zoo.convolution import Canon
from attention_zoo.dropout import Dropout

# The output gate (Qiu et al. 2025, Gated Attention for Large Language Models, arXiv:2505.06708):
# none, one sigmoid gate per head, or one per channel of each head's output.
OUTPUT_GATES = ("none", "headwise", "elementwise")


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

  `output_gate` (Qiu et al. 2025, arXiv:2505.06708, their G1 position): each head's output is
  multiplied by sigmoid(x W_g + b_g) from the layer's input x (the query side) before the out
  projection: "headwise" one gate per head (W_g [emb, heads]), "elementwise" one per channel
  (W_g [emb, heads · head_dim]); "none" (default) no gate. W_g is initialised like the other
  projections (as in Qwen3-Next, whose gate is part of the query projection) and b_g = 0; with
  W_g = 0 every gate is sigmoid(0) = 1/2, so the layer gives exactly half its ungated output.

  `canon=True`: a Canon layer (convolution.Canon, the paper's point B) on the self-attention's
  q, k and v projections, one depthwise convolution over their concatenation, before RoPE
  (as the authors' code); the queried tokens' mask zeroes padding in it. Not on
  cross-attention (keys from another sequence).
  """

  def __init__(self, emb_dim: int, num_heads: int, *, num_kv_heads: int | None = None,
               qkv_dim: int | None = None, attention: str = "full", attention_options=None,
               causal: bool = False, max_len: int | None = None, position_kind: str = "none",
               rope_base: float = 10000.0, output_gate: str = "none", canon: bool = False,
               dtype=jnp.float32,
               rngs: nnx.Rngs):
    qkv_dim = emb_dim if qkv_dim is None else qkv_dim
    if output_gate not in OUTPUT_GATES:
      raise ValueError(f"output_gate must be one of {', '.join(OUTPUT_GATES)}, got "
                       f"{output_gate!r}")
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
    gates = {"none": 0, "headwise": num_heads, "elementwise": num_heads * self.head_dim}
    self.gate = linear(emb_dim, gates[output_gate]) if gates[output_gate] else nnx.data(None)
    # point B: the q, k (unless shared) and v features in one depthwise convolution
    kv_heads = (1 if spec.shared_qk else 2) * num_kv_heads
    qkv_features = (num_heads + kv_heads) * self.head_dim
    self.canon = Canon(qkv_features, dtype=dtype, rngs=rngs) if canon else None
    self.cache = nnx.data(None)   # set by init_cache

  def init_cache(self, batch_size: int, max_len: int, dtype=jnp.float32):
    """Prepares one-token decoding (`decode=True`) for up to max_len tokens."""
    self.cache = nnx.Cache(self.attention.init_cache(batch_size, max_len, dtype))
    self.cache_index = nnx.Cache(jnp.zeros((), jnp.int32))
    if self.canon is not None:
      self.canon.init_cache(batch_size, dtype)

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
    projected = [self.query(x)] + ([] if self.shared_qk else [self.key(kv_input)])
    projected.append(self.value(kv_input))
    if self.canon is not None:
      if context is not None:
        raise ValueError("canon (point B) applies to self-attention, not cross-attention")
      sizes = [p.shape[-1] for p in projected]
      mixed = self.canon(jnp.concatenate(projected, -1), mask, decode=decode,
                         segment_ids=segment_ids)
      projected = jnp.split(mixed, list(itertools.accumulate(sizes[:-1])), axis=-1)
    q = projected[0].reshape(b, n, self.num_heads, self.head_dim)
    k = q if self.shared_qk else projected[1].reshape(b, kv_input.shape[1], self.num_kv_heads,
                                                      self.head_dim)
    v = projected[-1].reshape(b, kv_input.shape[1], self.num_kv_heads, self.head_dim)
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
    if self.gate is not None:   # [b, n, h, 1] (headwise) or [b, n, h, d] (elementwise)
      out = out * nnx.sigmoid(self.gate(x)).reshape(b, n, self.num_heads, -1).astype(out.dtype)
    return self.out(out.reshape(b, n, self.num_heads * self.head_dim))


class MLP(nnx.Module):
  """Dense(mlp_dim) -> GELU (tanh approximation, or exact with approximate_gelu=False) ->
  dropout -> Dense(emb_dim). `canon=True`: a Canon layer (the paper's point D) on the up
  projection's output, before the GELU; then the call takes the tokens' `mask`, `decode` and
  `segment_ids` as a short convolution does."""

  def __init__(self, emb_dim: int, mlp_dim: int, *, dropout_rate: float = 0.0,
               approximate_gelu: bool = True, canon: bool = False, dtype=jnp.float32,
               rngs: nnx.Rngs):
    self.up = nnx.Linear(emb_dim, mlp_dim, dtype=dtype, rngs=rngs)
    self.down = nnx.Linear(mlp_dim, emb_dim, dtype=dtype, rngs=rngs)
    self.dropout = Dropout(dropout_rate, rngs=rngs)
    self.approximate_gelu = approximate_gelu
    self.canon = Canon(mlp_dim, dtype=dtype, rngs=rngs) if canon else None

  def init_cache(self, batch_size: int, dtype=jnp.float32):
    """Prepares decoding (`decode=True`): the Canon layer's cache, if there is one."""
    if self.canon is not None:
      self.canon.init_cache(batch_size, dtype)

  def __call__(self, x, *, deterministic: bool = True, mask=None, decode: bool = False,
               segment_ids=None):
    hidden = self.up(x)
    if self.canon is not None:
      hidden = self.canon(hidden, mask, decode=decode, segment_ids=segment_ids)
    hidden = nnx.gelu(hidden, approximate=self.approximate_gelu)
    return self.down(self.dropout(hidden, deterministic=deterministic))


def create_mixer(name: str, *, emb_dim: int, num_heads: int, num_kv_heads: int | None = None,
                 qkv_dim: int | None = None, causal: bool = False, max_len: int | None = None,
                 position_kind: str = "none", output_gate: str = "none", canon: bool = False,
                 dtype=None, rngs, **options):
  """Builds any registered name as a layer x [b, n, emb] -> [b, n, emb]: a mixer, or an
  attention variant inside `MultiHeadAttention` (its q/k/v/out projections). Both are called
  `layer(x, mask=..., deterministic=..., decode=...)`.

  qkv_dim (default emb_dim) / num_heads is the head dimension. position_kind ("rope", "alibi")
  applies to attention scores; a mixer has none and accepts only "none" (RetNet rotates its own
  q and k). output_gate: MultiHeadAttention's, for an attention variant; a mixer owns its
  gates and accepts only "none".
  canon: a Canon layer on an attention variant's q/k/v projections
  (`MultiHeadAttention`'s); a mixer owns its projections (several run their own short
  convolution on them), so it refuses it.
  """
  cls = registry.get(name)
  dtype = jnp.float32 if dtype is None else dtype
  if cls.spec.kind == "attention":
    return MultiHeadAttention(emb_dim, num_heads, num_kv_heads=num_kv_heads, qkv_dim=qkv_dim,
                              attention=name, attention_options=options, causal=causal,
                              max_len=max_len, position_kind=position_kind,
                              output_gate=output_gate, canon=canon, dtype=dtype, rngs=rngs)
  if output_gate != "none":
    raise ValueError(f"mixer {name!r} owns its projections and gates, so output_gate must be "
                     f"'none' (got {output_gate!r}); the output gate wraps attention variants")
  if canon:
    raise ValueError(f"canon point B acts on an attention layer's q/k/v projections; the mixer "
                     f"{name!r} owns its projections (many run their own short convolution "
                     f"there): use canon without B (e.g. 'ACD') with it")
  if position_kind != "none":
    raise ValueError(f"mixer {name!r} forms no attention scores, so position_kind must be 'none' "
                     f"(got {position_kind!r}); add positions to the embeddings instead")
  qkv_dim = emb_dim if qkv_dim is None else qkv_dim
  if qkv_dim % num_heads:
    raise ValueError(f"qkv_dim ({qkv_dim}) must be divisible by num_heads ({num_heads})")
  return cls(emb_dim=emb_dim, num_heads=num_heads, num_kv_heads=num_kv_heads,
             head_dim=qkv_dim // num_heads, causal=causal, max_len=max_len, dtype=dtype,
             rngs=rngs, **options)
