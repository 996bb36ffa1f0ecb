"""The name table: name -> attention variant or sequence mixer. `available`, `accepting_alibi`,
`accepting`, `get`, `spec`, `create`, `state_size`, `scoped_registry`; `add` enters a class.

Two kinds of class share one namespace. An attention variant (a subclass of
`attention_zoo.Attention`, `@register`) maps q, k, v to an output; a sequence mixer (a subclass
of `attention_zoo.Mixer`, `@register_mixer`) maps a block's input x to its output and owns its
projections, gates, convolution and norm. Each is registered under a name with the facts a
caller needs before building it (its spec: an `AttentionSpec` or a `MixerSpec`, the one `Spec`
with its kind): whether it is exact, causal, cross-capable, its cost, its paper, and its options
(the class attribute `OPTIONS`, merged with the options every class of its kind has), each with
its default and its type.

This module imports no variant and no contract: the decorators (attention_zoo.contract) enter
classes here, and whoever needs the built-in variants (the package's face, the layers that
build variants by name) imports attention_zoo.variants and attention_zoo.mixers, which register
them. `attention_zoo.layers.create_mixer` builds any name as a layer on x.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import sys
from typing import Any, ClassVar

from attention_zoo import options as options_lib

_REGISTRY: dict[str, type] = {}


@dataclasses.dataclass(frozen=True)
class Spec:
  """What a registered class is and can do; `AttentionSpec` for a variant, `MixerSpec` for a
  mixer (the same fields, so code that asks a capability of any name reads it from either)."""
  kind: ClassVar[str]         # "attention" (q, k, v -> out) or "mixer" (x -> out)
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
  supports_sinks: bool = False  # accepts the `sink` option (a learned sink logit per head)
  supports_segment_ids: bool = False  # accepts q/kv_segment_ids (packed sequences)
  shared_qk: bool = False     # keys are derived from the queries: the layer projects one tensor
  needs_max_len: bool = False  # parameters sized by max_len (create() requires it)
  supports_dropout: bool = True  # forms attention weights that dropout_rate can drop
  # runs with its sequence split over a mesh's `context` axis (ops/context.py), equal to one device
  supports_context_parallel: bool = False
  # accepts causal=False (an encoder); False: causal only, refused with WHY_NOT_BIDIRECTIONAL
  supports_bidirectional: bool = True

  @property
  def option_types(self) -> dict[str, type]:
    """Each option's value type (int, float, bool or str), also for those whose default is None."""
    return {name: spec.python_type for name, spec in self.option_specs.items()}


@dataclasses.dataclass(frozen=True)
class AttentionSpec(Spec):
  """What a registered attention variant (q, k, v -> out) is and can do."""
  kind: ClassVar[str] = "attention"


@dataclasses.dataclass(frozen=True)
class MixerSpec(Spec):
  """What a registered sequence mixer (x -> out) is and can do: causal, inexact, self-only."""
  kind: ClassVar[str] = "mixer"


SPEC_TYPES = {spec_type.kind: spec_type for spec_type in (AttentionSpec, MixerSpec)}
# the words an unknown-name message uses for what was asked for
_KIND_WORDS = {"attention": "attention", "mixer": "mixer", None: "attention or mixer"}


def add(name: str, cls: type) -> None:
  """Enters `cls` (whose `spec` is set) under `name`; ValueError for a name another class holds.
  Called by the registration decorators (attention_zoo.contract), which check the class first."""
  if name in _REGISTRY and _REGISTRY[name] is not cls:
    raise ValueError(f"{name!r} is already registered by {_REGISTRY[name].__qualname__}")
  _REGISTRY[name] = cls


KINDS = tuple(SPEC_TYPES)


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


def get(name: str, kind: str | None = None) -> type:
  """The class registered under `name`; ValueError listing the choices if there is none. kind
  ("attention" | "mixer" | None: either) is what the caller asked for: the error names it and
  lists those names (a close match of either kind is suggested under its own kind)."""
  if name in _REGISTRY:
    return _REGISTRY[name]
  close = difflib.get_close_matches(name, available(kind), n=1)
  noun = _KIND_WORDS[_REGISTRY[close[0]].spec.kind if close else kind]
  hint = f" (did you mean {close[0]!r}?)" if close else ""
  listed = (", ".join(available(kind)) if kind is not None else
            "; ".join(f"{plural}: {', '.join(available(k))}"
                      for k, plural in (("attention", "attention variants"), ("mixer", "mixers"))))
  raise ValueError(f"unknown {noun} {name!r}{hint}; available: {listed}")


def spec(name: str, kind: str | None = None) -> Spec:
  """The spec of `name`: an AttentionSpec or a MixerSpec (kind: as for `get`)."""
  return get(name, kind).spec


def create(name: str, *, num_heads: int, head_dim: int, num_kv_heads: int | None = None,
           causal: bool = False, max_len: int | None = None, rngs, **options):
  """Builds the attention variant `name` as an nnx.Module; bad options or capabilities ->
  ValueError.

  A mixer name is refused: a mixer takes x, not q, k, v (build it with `create_mixer`)."""
  cls = get(name, "attention")
  if cls.spec.kind != "attention":
    raise ValueError(f"{name!r} is a sequence mixer (it takes x, not q, k, v); build it with "
                     f"create_mixer({name!r}, emb_dim=..., num_heads=..., ...)")
  return cls(num_heads=num_heads, head_dim=head_dim, num_kv_heads=num_kv_heads, causal=causal,
             max_len=max_len, rngs=rngs, **options)


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
