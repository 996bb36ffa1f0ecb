"""Name -> attention variant: `register`, `create`, `available`, `spec`, `scoped_registry`.

A variant is one class (a subclass of `attention_zoo.Attention`) registered under a name with
the facts a caller needs before building it: whether it is exact, causal, cross-capable, its
cost, its paper, and its options (the class attribute `OPTIONS`, merged with the options every
variant has: `scale`, `dropout_rate`), each with its default and its type.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
from typing import Any

from attention_zoo import options as options_lib

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
  # every accepted option's declaration (its type and allowed values)
  option_specs: dict[str, options_lib.Option] = dataclasses.field(repr=False)
  can_decode: bool = False    # one-token decoding against a cache (KV or recurrent state)
  supports_alibi: bool = False  # accepts a per-head linear score bias (ALiBi)
  shared_qk: bool = False     # keys are derived from the queries: the layer projects one tensor
  needs_max_len: bool = False  # parameters sized by max_len (create() requires it)
  supports_dropout: bool = True  # forms attention weights that dropout_rate can drop

  @property
  def option_types(self) -> dict[str, type]:
    """Each option's value type (int, float, bool or str), also for those whose default is None."""
    return {name: spec.python_type for name, spec in self.option_specs.items()}


def register(name: str, *, exact: bool, supports_causal: bool, supports_cross: bool,
             complexity: str, paper: str, can_decode: bool = False,
             supports_alibi: bool = False, shared_qk: bool = False,
             needs_max_len: bool = False, supports_dropout: bool = True):
  """Class decorator: `@register("cosine", exact=False, ...)` on an `Attention` subclass.

  TypeError for a class that is not an `Attention`, options not declared as
  `attention_zoo.options` types, or exact=True without a `pattern` method; ValueError for a
  name already taken by another class.
  """
  from attention_zoo.base import Attention  # late import: base imports nothing from here

  def wrap(cls):
    if not (isinstance(cls, type) and issubclass(cls, Attention)):
      raise TypeError(f"@register({name!r}) needs a subclass of attention_zoo.Attention, "
                      f"got {cls!r}")
    if name in _REGISTRY and _REGISTRY[name] is not cls:
      raise ValueError(f"attention {name!r} is already registered by "
                       f"{_REGISTRY[name].__qualname__}")
    declared = cls.declared_options()
    untyped = {k: v for k, v in declared.items() if not isinstance(v, options_lib.Option)}
    if untyped:
      raise TypeError(
          f"{cls.__qualname__}.OPTIONS must map each name to an option type from "
          f"attention_zoo.options (Int, Float, Bool, Choice); got "
          + ", ".join(f"{k}={v!r}" for k, v in sorted(untyped.items()))
          + " (e.g. {'temperature': Float(1.0, above=0)})")
    if exact and cls.pattern is Attention.pattern:
      raise TypeError(f"{cls.__qualname__} is registered with exact=True but defines no "
                      f"pattern(q_len, kv_len): the pattern its softmax runs over is what the "
                      f"exactness is checked against")
    cls.spec = AttentionSpec(
        name=name, exact=exact, supports_causal=supports_causal, supports_cross=supports_cross,
        complexity=complexity, paper=paper,
        options={k: option.default for k, option in declared.items()}, option_specs=declared,
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


@contextlib.contextmanager
def scoped_registry():
  """`with scoped_registry(): ...` undoes on exit every registration made inside.

  The registry is restored as it was on entry, and modules first imported inside the block
  that registered a variant are dropped from `sys.modules`, so importing them again later
  registers their variants again. For tests and for trying plug-ins.
  """
  before = dict(_REGISTRY)
  modules_before = set(sys.modules)
  try:
    yield
  finally:
    added = [cls for name, cls in _REGISTRY.items() if before.get(name) is not cls]
    _REGISTRY.clear()
    _REGISTRY.update(before)
    for cls in added:
      if cls.__module__ not in modules_before:
        sys.modules.pop(cls.__module__, None)
