"""The `Attention` base class of the extension contract, and helpers shared by the variants.

A variant subclasses `Attention`, declares its options in `OPTIONS` (typed, with defaults:
`attention_zoo.options`), and implements `attend` (and `pattern`, when registered exact). The
base class validates construction (heads, causal support, max_len, every option's name and
value) and every call (shapes, GQA, masks), turns missing masks into all-True ones, and zeroes
the output rows of masked queries.
"""
from __future__ import annotations

import math
from typing import ClassVar

import jax.numpy as jnp
from flax import nnx

from attention_zoo import options as options_lib
from attention_zoo import reference, registry
from attention_zoo.options import Float, Int

# Options every variant accepts. scale None: 1/sqrt(head_dim).
COMMON_OPTIONS = {"scale": Float(None, above=0, optional=True),
                  "dropout_rate": Float(0.0, minimum=0, below=1)}
_MAX_LEN = Int(None, minimum=1, optional=True)
# Tanh soft-capping of the scores (Gemma 2), s -> softcap · tanh(s / softcap), on the scaled dot
# products before any bias (ALiBi) and mask; None: off. Declared by the variants registered with
# supports_softcap=True (they read it as self.softcap).
SOFTCAP_OPTION = Float(None, above=0, optional=True)


class Attention(nnx.Module):
  """Base class: `attn(q, k, v, *, q_mask=None, kv_mask=None, deterministic=True,
  alibi_slopes=None, q_segment_ids=None, kv_segment_ids=None) -> out`.

  q [batch, q_len, num_heads, head_dim]; k, v [batch, kv_len, num_kv_heads, head_dim];
  masks bool [batch, len] (True = real token); alibi_slopes [num_heads] (spec.supports_alibi);
  segment ids int [batch, len] (spec.supports_segment_ids; packed sequences: a query sees only
  the keys of its own segment; give both or neither). Output like q.
  """
  # The variant's own options: name -> attention_zoo.options.Int / Float / Bool / Choice.
  OPTIONS: ClassVar[dict[str, options_lib.Option]] = {}
  # Why causal=True is refused (for variants whose spec says supports_causal=False).
  WHY_NOT_CAUSAL: ClassVar[str] = "its formulation has no causal form"
  # Why dropout_rate > 0 is refused (for variants whose spec says supports_dropout=False).
  WHY_NO_DROPOUT: ClassVar[str] = "it never forms attention weights"
  spec: ClassVar  # AttentionSpec, set by @register

  def __init__(self, *, num_heads: int, head_dim: int, num_kv_heads: int | None = None,
               causal: bool = False, max_len: int | None = None, rngs: nnx.Rngs, **options):
    cls = type(self)
    if "spec" not in cls.__dict__:
      raise TypeError(f"{cls.__qualname__} is not registered: decorate it with "
                      f"@attention_zoo.register(...)")
    name = cls.spec.name
    if "softcap" in options and not cls.spec.supports_softcap:
      raise ValueError(f"{name} does not accept softcap (tanh soft-capping of softmax scores); "
                       f"variants that do: {', '.join(registry.accepting('supports_softcap'))}")
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_heads <= 0 or head_dim <= 0 or num_kv_heads <= 0:
      raise ValueError(f"{name}: num_heads, head_dim and num_kv_heads must be positive, got "
                       f"{num_heads}, {head_dim}, {num_kv_heads}")
    if num_heads % num_kv_heads:
      raise ValueError(f"{name}: num_heads ({num_heads}) must be a multiple of num_kv_heads "
                       f"({num_kv_heads})")
    if causal and not cls.spec.supports_causal:
      raise ValueError(f"{name} cannot be causal: {cls.WHY_NOT_CAUSAL}")
    if not _MAX_LEN.allows(max_len):
      raise ValueError(f"{name}: max_len must be a positive integer or None, got {max_len!r}")
    if cls.spec.needs_max_len and max_len is None:
      raise ValueError(f"{name} needs max_len: its parameters are sized by the longest sequence")
    self.options = options_lib.validate(name, cls.spec.option_specs, options)
    self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
    self.causal, self.max_len = bool(causal), None if max_len is None else int(max_len)
    scale = self.options["scale"]
    self.scale = head_dim ** -0.5 if scale is None else scale
    self.dropout_rate = self.options["dropout_rate"]
    self.softcap = self.options.get("softcap")   # declared only with spec.supports_softcap
    if self.dropout_rate and not cls.spec.supports_dropout:
      raise self.option_error("dropout_rate", f"0 ({name} cannot apply attention dropout: "
                                              f"{cls.WHY_NO_DROPOUT})")
    self.rngs = rngs

  @classmethod
  def declared_options(cls) -> dict[str, options_lib.Option]:
    """Every option the class accepts: the common ones, then its own."""
    return {**COMMON_OPTIONS, **cls.OPTIONS}

  @classmethod
  def state_size(cls, *, emb_dim: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 seq_len: int, options: dict) -> int:
    """Floats per layer and sequence kept to continue after seq_len tokens (`az.state_size`):
    by default the KV cache, 2·seq_len·num_kv_heads·head_dim. `options`: validated, complete."""
    return 2 * seq_len * num_kv_heads * head_dim

  def option_error(self, name: str, expected: str) -> ValueError:
    """The error for a rule a variant checks itself (e.g. one relating two options), in the
    same shape as a value its declaration rejects: `raise self.option_error(name, expected)`."""
    return options_lib.invalid(self.spec.name, name, self.options[name], expected)

  # -- the call ---------------------------------------------------------------------------

  def __call__(self, q, k, v, *, q_mask=None, kv_mask=None, deterministic: bool = True,
               alibi_slopes=None, q_segment_ids=None, kv_segment_ids=None):
    name = self.spec.name
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
      raise ValueError(f"{name}: q, k, v must be [batch, len, heads, head_dim], got shapes "
                       f"{q.shape}, {k.shape}, {v.shape}")
    b, q_len, _, _ = q.shape
    kv_len = k.shape[1]
    want_q = (self.num_heads, self.head_dim)
    want_kv = (self.num_kv_heads, self.head_dim)
    if q.shape[2:] != want_q or k.shape[2:] != want_kv or v.shape[2:] != want_kv:
      raise ValueError(f"{name}: expected q [..., {self.num_heads}, {self.head_dim}] and k, v "
                       f"[..., {self.num_kv_heads}, {self.head_dim}]; got {q.shape}, {k.shape}, "
                       f"{v.shape}")
    if k.shape[:2] != v.shape[:2] or k.shape[0] != b:
      raise ValueError(f"{name}: batch and length of q {q.shape}, k {k.shape}, v {v.shape} "
                       f"disagree")
    if q_len != kv_len and not self.spec.supports_cross:
      raise ValueError(f"{name} supports self-attention only (q_len == kv_len); got "
                       f"q_len={q_len}, kv_len={kv_len}")
    if alibi_slopes is not None and not self.spec.supports_alibi:
      raise ValueError(f"{name} does not accept a score bias (ALiBi); variants that do: "
                       f"{', '.join(registry.accepting_alibi())}")
    q_mask = _normalise_mask(q_mask, b, q_len, "q_mask", name)
    kv_mask = _normalise_mask(kv_mask, b, kv_len, "kv_mask", name)
    extra = {} if alibi_slopes is None else {"alibi_slopes": jnp.asarray(alibi_slopes, jnp.float32)}
    segment_ids = _segment_ids(q_segment_ids, kv_segment_ids, b, q_len, kv_len, self.spec)
    if segment_ids is not None:
      extra["segment_ids"] = segment_ids
    out = self.attend(q, k, v, q_mask=q_mask, kv_mask=kv_mask, deterministic=deterministic, **extra)
    return jnp.where(q_mask[:, :, None, None], out, 0).astype(q.dtype)

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic, alibi_slopes=None,
             segment_ids=None):
    """The variant's attention: q [b, q_len, h, d], k, v [b, kv_len, kvh, d], masks bool
    [b, len] (never None), alibi_slopes f32 [h] (passed only when given, and only to variants
    registered with supports_alibi=True), segment_ids (int32 [b, q_len], int32 [b, kv_len])
    (likewise, supports_segment_ids=True) -> [b, q_len, h, d]."""
    raise NotImplementedError(f"{type(self).__qualname__} does not implement attend()")

  def pattern(self, q_len: int, kv_len: int):
    """Exact variants (spec.exact): bool [heads or 1, q_len, kv_len], the keys each query's
    softmax runs over before masks; `reference.dense_attention` over it is the oracle."""
    raise NotImplementedError(
        f"{self.spec.name} is not exact (spec.exact is False): it has no fixed attention pattern")

  # -- helpers for the variants ------------------------------------------------------------

  def dropout_rng(self, deterministic: bool):
    """A fresh key for attention dropout, or None when dropout is off."""
    if deterministic or self.dropout_rate == 0.0:
      return None
    return self.rngs.dropout()

  def dropout(self, weights, deterministic: bool):
    rng = self.dropout_rng(deterministic)
    return weights if rng is None else reference.dropout(weights, self.dropout_rate, rng)

  # -- one-token decoding (spec.can_decode) ------------------------------------------------
  # The default is a right-aligned KV cache: the newest token sits in the last slot, so the
  # bottom-right causal alignment (and ALiBi distances) hold for a query decoded at any step.

  def init_cache(self, batch_size: int, max_len: int, dtype=jnp.float32):
    self._require_decode()
    shape = (batch_size, max_len, self.num_kv_heads, self.head_dim)
    return {"key": jnp.zeros(shape, dtype), "value": jnp.zeros(shape, dtype),
            "filled": jnp.zeros((batch_size, max_len), bool)}

  def decode(self, q, k, v, cache, *, alibi_slopes=None):
    """q [b, 1, h, d], k, v [b, 1, kvh, d] -> (out [b, 1, h, d], new cache)."""
    self._require_decode()
    shift = lambda buf, new: jnp.concatenate([buf[:, 1:], new.astype(buf.dtype)], axis=1)
    cache = {"key": shift(cache["key"], k), "value": shift(cache["value"], v),
             "filled": shift(cache["filled"], jnp.ones((q.shape[0], 1), bool))}
    out = self(q, cache["key"], cache["value"], kv_mask=cache["filled"], alibi_slopes=alibi_slopes)
    return out, cache

  def _require_decode(self):
    if not self.spec.can_decode:
      raise ValueError(f"{self.spec.name} cannot decode one token at a time "
                       f"(spec.can_decode is False)")
    if not self.causal:
      raise ValueError(f"{self.spec.name}: decoding needs causal=True")


def _normalise_mask(mask, batch: int, length: int, what: str, name: str):
  if mask is None:
    return jnp.ones((batch, length), bool)
  mask = jnp.asarray(mask)
  if mask.shape != (batch, length):
    raise ValueError(f"{name}: {what} must be bool [batch, len] = {(batch, length)}, "
                     f"got {mask.shape}")
  return mask.astype(bool)


def _segment_ids(q_ids, kv_ids, batch: int, q_len: int, kv_len: int, spec):
  """Checked (q_segment_ids, kv_segment_ids) as int32, or None when neither is given."""
  if q_ids is None and kv_ids is None:
    return None
  name = spec.name
  if not spec.supports_segment_ids:
    raise ValueError(f"{name} does not accept segment ids (packed sequences); variants that do: "
                     f"{', '.join(registry.accepting('supports_segment_ids'))}")
  if q_ids is None or kv_ids is None:
    raise ValueError(f"{name}: pass both q_segment_ids and kv_segment_ids, or neither")
  q_ids, kv_ids = jnp.asarray(q_ids), jnp.asarray(kv_ids)
  for what, ids, length in (("q_segment_ids", q_ids, q_len), ("kv_segment_ids", kv_ids, kv_len)):
    if ids.shape != (batch, length) or not jnp.issubdtype(ids.dtype, jnp.integer):
      raise ValueError(f"{name}: {what} must be int [batch, len] = {(batch, length)}, got "
                       f"{ids.dtype} {ids.shape}")
  return q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)


# -- shared helpers for blockwise variants --------------------------------------------------

def pad_to_multiple(x, multiple: int, axis: int = 1, value=0):
  """Pads `axis` of x at the end up to a multiple of `multiple`."""
  length = x.shape[axis]
  padded = math.ceil(length / multiple) * multiple
  if padded == length:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, padded - length)
  return jnp.pad(x, widths, constant_values=value)


def ceil_div(a: int, b: int) -> int:
  return -(-a // b)
