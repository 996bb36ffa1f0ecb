"""Name -> attention variant: `register`, `create`, `available`, `spec`.

A variant is one class (a subclass of `attention_zoo.Attention`) registered under a name with
the facts a caller needs before building it: whether it is exact, causal, cross-capable, its
cost, its paper, and its options with their defaults (the class attribute `options`, merged
with the options every variant has: `scale`, `dropout_rate`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

_REGISTRY: dict[str, type] = {}


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """What a registered variant is and can do."""
  name: str
  exact: bool                 # softmax over a fixed pattern: equals reference.dense_attention
                              # (as built: longformer's learned global maps start as the identity)
  supports_causal: bool
  supports_cross: bool        # q_len != kv_len
  complexity: str             # e.g. "O(n·w)"
  paper: str
  options: dict[str, Any]     # every accepted option with its default
  can_decode: bool = False    # one-token decoding against a cache (KV or recurrent state)
  supports_alibi: bool = False  # accepts a per-head linear score bias (ALiBi)
  shared_qk: bool = False     # keys are derived from the queries: the layer projects one tensor
  needs_max_len: bool = False  # parameters sized by max_len (create() requires it)
  supports_dropout: bool = True  # forms attention weights that dropout_rate can drop


def register(name: str, *, exact: bool, supports_causal: bool, supports_cross: bool,
             complexity: str, paper: str, can_decode: bool = False,
             supports_alibi: bool = False, shared_qk: bool = False,
             needs_max_len: bool = False, supports_dropout: bool = True):
  """Class decorator: `@register("cosine", exact=False, ...)` on an `Attention` subclass."""
  from attention_zoo.base import Attention  # late import: base imports nothing from here

  def wrap(cls):
    if not (isinstance(cls, type) and issubclass(cls, Attention)):
      raise TypeError(f"@register({name!r}) needs a subclass of attention_zoo.Attention, got {cls!r}")
    if name in _REGISTRY and _REGISTRY[name] is not cls:
      raise ValueError(f"attention {name!r} is already registered by {_REGISTRY[name].__qualname__}")
    cls.spec = AttentionSpec(
        name=name, exact=exact, supports_causal=supports_causal, supports_cross=supports_cross,
        complexity=complexity, paper=paper, options=cls.default_options(),
        can_decode=can_decode, supports_alibi=supports_alibi, shared_qk=shared_qk,
        needs_max_len=needs_max_len, supports_dropout=supports_dropout)
    _REGISTRY[name] = cls
    return cls

  return wrap


def available() -> tuple[str, ...]:
  """The registered names, sorted."""
  return tuple(sorted(_REGISTRY))


def get(name: str) -> type:
  """The class registered under `name`; ValueError listing the choices if there is none."""
  try:
    return _REGISTRY[name]
  except KeyError:
    raise ValueError(
        f"unknown attention {name!r}; available: {', '.join(available())}") from None


def spec(name: str) -> AttentionSpec:
  return get(name).spec


def create(name: str, *, num_heads: int, head_dim: int, num_kv_heads: int | None = None,
           causal: bool = False, max_len: int | None = None, rngs, **options):
  """Builds the variant `name` as an nnx.Module. Bad options or capabilities -> ValueError."""
  return get(name)(num_heads=num_heads, head_dim=head_dim, num_kv_heads=num_kv_heads,
                   causal=causal, max_len=max_len, rngs=rngs, **options)
