"""Name -> attention variant or sequence mixer: `register`, `register_mixer`, `create`,
`create_mixer`, `available`, `accepting_alibi`, `accepting`, `spec`, `state_size`,
`scoped_registry`.

Two kinds of class share one namespace. An attention variant (a subclass of
`attention_zoo.Attention`, `@register`) maps q, k, v to an output; a sequence mixer (a subclass
of `attention_zoo.mixer.Mixer`, `@register_mixer`) maps a block's input x to its output and owns
its projections, gates, convolution and norm. Each is registered under a name with the facts a
caller needs before building it: whether it is exact, causal, cross-capable, its cost, its
paper, and its options (the class attribute `OPTIONS`, merged with the options every class of its
kind has), each with its default and its type. `create_mixer` builds any name as a layer on x:
a mixer itself, or an attention variant inside `attention_zoo.layers.MultiHeadAttention`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
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
  supports_softcap: bool = False  # accepts the `softcap` option (tanh soft-capping of scores)
  supports_segment_ids: bool = False  # accepts q/kv_segment_ids (packed sequences)
  shared_qk: bool = False     # keys are derived from the queries: the layer projects one tensor
  needs_max_len: bool = False  # parameters sized by max_len (create() requires it)
  supports_dropout: bool = True  # forms attention weights that dropout_rate can drop
  kind: str = "attention"     # "attention" (q, k, v -> out) or "mixer" (x -> out)

  @property
  def option_types(self) -> dict[str, type]:
    """Each option's value type (int, float, bool or str), also for those whose default is None."""
    return {name: spec.python_type for name, spec in self.option_specs.items()}


def register(name: str, *, exact: bool, supports_causal: bool, supports_cross: bool,
             complexity: str, paper: str, can_decode: bool = False,
             supports_alibi: bool = False, shared_qk: bool = False,
             needs_max_len: bool = False, supports_dropout: bool = True,
             supports_softcap: bool = False, supports_segment_ids: bool = False):
  """Class decorator: `@register("cosine", exact=False, ...)` on an `Attention` subclass.

  supports_softcap adds the shared `softcap` option (base.SOFTCAP_OPTION) to the class's options;
  supports_segment_ids lets calls pass q_segment_ids / kv_segment_ids.

  TypeError for a class that is not an `Attention`, options not declared as
  `attention_zoo.options` types, or exact=True without a `pattern` method; ValueError for a
  name already taken by another class.
  """
  from attention_zoo.base import SOFTCAP_OPTION, Attention  # late: base imports this module

  def wrap(cls):
    if not (isinstance(cls, type) and issubclass(cls, Attention)):
      raise TypeError(f"@register({name!r}) needs a subclass of attention_zoo.Attention, "
                      f"got {cls!r}")
    _check_free(name, cls)
    declared = cls.declared_options()
    _check_typed(cls, declared)
    if supports_softcap:
      declared = {**declared, "softcap": SOFTCAP_OPTION}
    if exact and cls.pattern is Attention.pattern:
      raise TypeError(f"{cls.__qualname__} is registered with exact=True but defines no "
                      f"pattern(q_len, kv_len): the pattern its softmax runs over is what the "
                      f"exactness is checked against")
    cls.spec = AttentionSpec(
        name=name, exact=exact, supports_causal=supports_causal, supports_cross=supports_cross,
        complexity=complexity, paper=paper,
        options={k: option.default for k, option in declared.items()}, option_specs=declared,
        can_decode=can_decode, supports_alibi=supports_alibi, shared_qk=shared_qk,
        needs_max_len=needs_max_len, supports_dropout=supports_dropout,
        supports_softcap=supports_softcap, supports_segment_ids=supports_segment_ids)
    _REGISTRY[name] = cls
    return cls

  return wrap


def register_mixer(name: str, *, complexity: str, paper: str, can_decode: bool = True):
  """Class decorator: `@register_mixer("gla", complexity="O(n·d²)", paper=...)` on a `Mixer`
  subclass (attention_zoo.mixer). A mixer is causal (an encoder runs it both ways: the
  `bidirectional` option), inexact, self-only, without ALiBi or attention dropout.

  TypeError for a class that is not a `Mixer` or options not declared as `attention_zoo.options`
  types; ValueError for a name already taken by another class.
  """
  from attention_zoo.mixer import Mixer  # late import: mixer imports this module

  def wrap(cls):
    if not (isinstance(cls, type) and issubclass(cls, Mixer)):
      raise TypeError(f"@register_mixer({name!r}) needs a subclass of attention_zoo.mixer.Mixer, "
                      f"got {cls!r}")
    _check_free(name, cls)
    declared = cls.declared_options()
    _check_typed(cls, declared)
    cls.spec = AttentionSpec(
        name=name, exact=False, supports_causal=True, supports_cross=False,
        complexity=complexity, paper=paper,
        options={k: option.default for k, option in declared.items()}, option_specs=declared,
        can_decode=can_decode, supports_dropout=False, kind="mixer")
    _REGISTRY[name] = cls
    return cls

  return wrap


def _check_free(name: str, cls: type):
  if name in _REGISTRY and _REGISTRY[name] is not cls:
    raise ValueError(f"{name!r} is already registered by {_REGISTRY[name].__qualname__}")


def _check_typed(cls: type, declared: dict):
  untyped = {k: v for k, v in declared.items() if not isinstance(v, options_lib.Option)}
  if untyped:
    raise TypeError(
        f"{cls.__qualname__}.OPTIONS must map each name to an option type from "
        f"attention_zoo.options (Int, Float, Bool, Choice); got "
        + ", ".join(f"{k}={v!r}" for k, v in sorted(untyped.items()))
        + " (e.g. {'temperature': Float(1.0, above=0)})")


KINDS = ("attention", "mixer")


def available(kind: str | None = None) -> tuple[str, ...]:
  """The registered names, sorted: all of them, or those of one kind ("attention" | "mixer")."""
  if kind is not None and kind not in KINDS:
    raise ValueError(f"kind must be one of {', '.join(KINDS)} or None, got {kind!r}")
  return tuple(sorted(n for n, cls in _REGISTRY.items() if kind in (None, cls.spec.kind)))


def accepting(capability: str) -> tuple[str, ...]:
  """The registered names, sorted, whose spec has `capability` (a bool field such as
  "supports_softcap" or "supports_segment_ids") set."""
  return tuple(n for n in available() if getattr(_REGISTRY[n].spec, capability))


def accepting_alibi() -> tuple[str, ...]:
  """The registered names, sorted, whose spec accepts a per-head linear score bias (ALiBi)."""
  return accepting("supports_alibi")


def get(name: str) -> type:
  """The class registered under `name`; ValueError listing the choices if there is none."""
  try:
    return _REGISTRY[name]
  except KeyError:
    close = difflib.get_close_matches(name, available(), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"unknown attention {name!r}{hint}; available: {', '.join(available())}"
                     ) from None


def spec(name: str) -> AttentionSpec:
  return get(name).spec


def create(name: str, *, num_heads: int, head_dim: int, num_kv_heads: int | None = None,
           causal: bool = False, max_len: int | None = None, rngs, **options):
  """Builds the attention variant `name` as an nnx.Module; bad options or capabilities ->
  ValueError.

  A mixer name is refused: a mixer takes x, not q, k, v (build it with `create_mixer`)."""
  cls = get(name)
  if cls.spec.kind != "attention":
    raise ValueError(f"{name!r} is a sequence mixer (it takes x, not q, k, v); build it with "
                     f"create_mixer({name!r}, emb_dim=..., num_heads=..., ...)")
  return cls(num_heads=num_heads, head_dim=head_dim, num_kv_heads=num_kv_heads, causal=causal,
             max_len=max_len, rngs=rngs, **options)


def create_mixer(name: str, *, emb_dim: int, num_heads: int, num_kv_heads: int | None = None,
                 qkv_dim: int | None = None, causal: bool = False, max_len: int | None = None,
                 position_kind: str = "none", dtype=None, rngs, **options):
  """Builds any registered name as a layer x [b, n, emb] -> [b, n, emb]: a mixer, or an
  attention variant inside `attention_zoo.layers.MultiHeadAttention` (its q/k/v/out
  projections). Both are called `layer(x, mask=..., deterministic=..., decode=...)`.

  qkv_dim (default emb_dim) / num_heads is the head dimension. position_kind ("rope", "alibi")
  applies to attention scores; a mixer has none and accepts only "none" (RetNet rotates its own
  q and k).
  """
  import jax.numpy as jnp

  from attention_zoo.layers import MultiHeadAttention  # late import: layers imports this module
  cls = get(name)
  dtype = jnp.float32 if dtype is None else dtype
  if cls.spec.kind == "attention":
    return MultiHeadAttention(emb_dim, num_heads, num_kv_heads=num_kv_heads, qkv_dim=qkv_dim,
                              attention=name, attention_options=options, causal=causal,
                              max_len=max_len, position_kind=position_kind, dtype=dtype, rngs=rngs)
  if position_kind != "none":
    raise ValueError(f"mixer {name!r} forms no attention scores, so position_kind must be 'none' "
                     f"(got {position_kind!r}); add positions to the embeddings instead")
  qkv_dim = emb_dim if qkv_dim is None else qkv_dim
  if qkv_dim % num_heads:
    raise ValueError(f"qkv_dim ({qkv_dim}) must be divisible by num_heads ({num_heads})")
  return cls(emb_dim=emb_dim, num_heads=num_heads, num_kv_heads=num_kv_heads,
             head_dim=qkv_dim // num_heads, causal=causal, max_len=max_len, dtype=dtype,
             rngs=rngs, **options)


def state_size(name: str, *, emb_dim: int, num_heads: int, num_kv_heads: int | None = None,
               head_dim: int | None = None, seq_len: int, options=None) -> int:
  """Floats one layer of `name` keeps per sequence to continue it after seq_len tokens: the KV
  cache of attention, the recurrent state of kernelised attention and mixers (the class's
  `state_size`). head_dim None: emb_dim // num_heads; options: as for create (validated)."""
  cls = get(name)
  values = options_lib.validate(name, cls.spec.option_specs, dict(options or {}))
  return int(cls.state_size(
      emb_dim=emb_dim, num_heads=num_heads,
      num_kv_heads=num_heads if num_kv_heads is None else num_kv_heads,
      head_dim=emb_dim // num_heads if head_dim is None else head_dim, seq_len=seq_len,
      options=values))


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
