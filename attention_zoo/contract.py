"""The contract every registered class follows, and the one way to register it.

Two kinds of class share one name table (attention_zoo.registry). An attention variant
(`Attention`) maps q, k, v to an output, inside the model's projections; a sequence mixer
(`Mixer`) maps a block's input x to its output and owns its projections, gates, short
convolution and norm. Both declare their options in `OPTIONS` (typed: `attention_zoo.options`)
and the conformance suite's small-shape settings in `TEST_OPTIONS`, and both go through one set
of checks (`Registered`): construction (registered, heads, max_len, every option's name and
value), masks, and what decoding needs. `register` and `register_mixer` are two spellings of
one registration path (`_register`): it checks the class, builds its spec (`AttentionSpec`,
`MixerSpec`) and enters it in the table.

An attention variant subclasses `Attention`, implements `attend` (and `pattern`, when
registered exact); the base class validates every call (shapes, GQA, masks), turns missing
masks into all-True ones, and zeroes the output rows of masked queries.
"""
from __future__ import annotations

from typing import ClassVar

import jax.numpy as jnp
from flax import nnx

from attention_zoo import options as options_lib
from attention_zoo.ops import softmax
from attention_zoo.ops.context import context_size
from attention_zoo.options import Bool, Float, Int
from attention_zoo.registry import (AttentionSpec, MixerSpec, accepting, accepting_alibi, add,
                                    get)

_MAX_LEN = Int(None, minimum=1, optional=True)
# Tanh soft-capping of the scores (Gemma 2), s -> softcap · tanh(s / softcap), on the scaled dot
# products before any bias (ALiBi) and mask; None: off. Declared by the variants registered with
# supports_softcap=True (they read it as self.softcap).
SOFTCAP_OPTION = Float(None, above=0, optional=True)
# Attention sinks (gpt-oss; Xiao et al. 2023, StreamingLLM): a learned logit s_h per head in the
# softmax's denominator, p_ij = e^{x_ij} / (e^{s_h} + Σ_k e^{x_ik}): mass that reaches no value.
# Declared by the variants registered with supports_sinks=True; with sink=True the variant holds
# `sink_logits` [num_heads] (zeros at first: the sink weighs as one key of score 0) and its
# softmax divides by the sink too (ops/softmax.py's apply_sinks).
SINK_OPTION = Bool(False)


class Registered(nnx.Module):
  """What `Attention` and `Mixer` share: typed options, the suite's settings, the construction
  checks, and the checks before decoding."""
  # The class's own options: name -> attention_zoo.options.Int / Float / Bool / Choice.
  OPTIONS: ClassVar[dict[str, options_lib.Option]] = {}
  # The options every class of the kind accepts (Attention's, Mixer's).
  COMMON_OPTIONS: ClassVar[dict[str, options_lib.Option]] = {}
  # How the conformance suite builds the class at its small shapes (length 20, 4 heads, 2 kv
  # heads, head_dim 8), so that its structure is exercised there (e.g. a block size below 20);
  # checked against the declared options at registration. Production code never reads it.
  TEST_OPTIONS: ClassVar[dict] = {}
  DECORATOR: ClassVar[str]    # the decorator that registers the kind (for error messages)
  spec: ClassVar  # AttentionSpec or MixerSpec, set by the decorator

  @classmethod
  def registered_spec(cls):
    """cls.spec; TypeError for a class not registered itself (a subclass inherits no name)."""
    if "spec" not in cls.__dict__:
      raise TypeError(f"{cls.__qualname__} is not registered: decorate it with "
                      f"@attention_zoo.{cls.DECORATOR}(...)")
    return cls.spec

  @classmethod
  def declared_options(cls) -> dict[str, options_lib.Option]:
    """Every option the class accepts: the common ones, then its own."""
    return {**cls.COMMON_OPTIONS, **cls.OPTIONS}

  def _construct(self, *, num_heads: int, head_dim: int, num_kv_heads: int | None, causal: bool,
                 max_len: int | None, options: dict, **sizes: int):
    """The construction checks of every kind; sets num_heads, head_dim, num_kv_heads, causal,
    max_len and options (validated, defaults filled in). sizes: further sizes that must be
    positive (a mixer's emb_dim)."""
    name = self.registered_spec().name
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    sizes = {**sizes, "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    if min(sizes.values()) <= 0:
      names = ", ".join(list(sizes)[:-1]) + f" and {list(sizes)[-1]}"
      raise ValueError(f"{name}: {names} must be positive, got "
                       f"{', '.join(map(str, sizes.values()))}")
    if num_heads % num_kv_heads:
      raise ValueError(f"{name}: num_heads ({num_heads}) must be a multiple of num_kv_heads "
                       f"({num_kv_heads})")
    if not _MAX_LEN.allows(max_len):
      raise ValueError(f"{name}: max_len must be a positive integer or None, got {max_len!r}")
    self.options = options_lib.validate(name, self.spec.option_specs, options)
    self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
    self.causal, self.max_len = bool(causal), None if max_len is None else int(max_len)

  def option_error(self, name: str, expected: str) -> ValueError:
    """The error for a rule a class checks itself (e.g. one relating two options), in the same
    shape as a value its declaration rejects: `raise self.option_error(name, expected)`."""
    return options_lib.invalid(self.spec.name, name, self.options[name], expected)

  def _require_context_parallel(self):
    """Every call: ValueError when the active mesh splits the sequence (ops/context.py) and the
    class has no context-parallel form (spec.supports_context_parallel)."""
    size = context_size()
    if size > 1 and not self.spec.supports_context_parallel:
      able = ", ".join(accepting("supports_context_parallel")) or "none"
      raise ValueError(f"{self.spec.name} cannot run with the sequence split over the mesh's "
                       f"context axis (context={size}); use a mesh with context=1 for it, or one "
                       f"of the variants and mixers that can: {able}")

  def _require_decode(self):
    if not self.spec.can_decode:
      raise ValueError(f"{self.spec.name} cannot decode (spec.can_decode is False)")
    if not self.causal:
      raise ValueError(f"{self.spec.name}: decoding needs causal=True")


def normalise_mask(mask, batch: int, length: int, what: str, name: str):
  """A call's mask as bool [batch, length] (all True when None); ValueError naming `what` for
  another shape."""
  if mask is None:
    return jnp.ones((batch, length), bool)
  mask = jnp.asarray(mask)
  if mask.shape != (batch, length):
    raise ValueError(f"{name}: {what} must be bool [batch, len] = {(batch, length)}, "
                     f"got {mask.shape}")
  return mask.astype(bool)


class Attention(Registered):
  """Base class: `attn(q, k, v, *, q_mask=None, kv_mask=None, deterministic=True,
  alibi_slopes=None, q_segment_ids=None, kv_segment_ids=None) -> out`.

  q [batch, q_len, num_heads, head_dim]; k, v [batch, kv_len, num_kv_heads, head_dim];
  masks bool [batch, len] (True = real token); alibi_slopes [num_heads] (spec.supports_alibi);
  segment ids int [batch, len] (spec.supports_segment_ids; packed sequences: a query sees only
  the keys of its own segment; give both or neither). Output like q.
  """
  COMMON_OPTIONS = {"scale": Float(None, above=0, optional=True),   # None: 1/sqrt(head_dim)
                    "dropout_rate": Float(0.0, minimum=0, below=1)}
  DECORATOR = "register"
  # Why causal=True is refused (for variants whose spec says supports_causal=False).
  WHY_NOT_CAUSAL: ClassVar[str] = "its formulation has no causal form"
  # Why causal=False is refused (for variants whose spec says supports_bidirectional=False).
  WHY_NOT_BIDIRECTIONAL: ClassVar[str] = "its formulation has no bidirectional form"
  # Why dropout_rate > 0 is refused (for variants whose spec says supports_dropout=False).
  WHY_NO_DROPOUT: ClassVar[str] = "it never forms attention weights"
  # Which keys a query sees is chosen from token contents across the whole sequence (e.g. LSH
  # buckets), so the conformance suite checks causality by changing future values only.
  CONTENT_ROUTING: ClassVar[bool] = False

  def __init__(self, *, num_heads: int, head_dim: int, num_kv_heads: int | None = None,
               causal: bool = False, max_len: int | None = None, rngs: nnx.Rngs, **options):
    spec = self.registered_spec()
    name = spec.name
    if "softcap" in options and not spec.supports_softcap:
      raise ValueError(f"{name} does not accept softcap (tanh soft-capping of softmax scores); "
                       f"variants that do: {', '.join(accepting('supports_softcap'))}")
    if "sink" in options and not spec.supports_sinks:
      raise ValueError(f"{name} does not accept sink (a learned attention sink per head); "
                       f"variants that do: {', '.join(accepting('supports_sinks'))}")
    if causal and not spec.supports_causal:
      raise ValueError(f"{name} cannot be causal: {self.WHY_NOT_CAUSAL}")
    if not causal and not spec.supports_bidirectional:
      raise ValueError(f"{name} is causal only (pass causal=True; an encoder needs a variant "
                       f"with a bidirectional form): {self.WHY_NOT_BIDIRECTIONAL}")
    if spec.needs_max_len and max_len is None:
      raise ValueError(f"{name} needs max_len: its parameters are sized by the longest sequence")
    self._construct(num_heads=num_heads, head_dim=head_dim, num_kv_heads=num_kv_heads,
                    causal=causal, max_len=max_len, options=options)
    scale = self.options["scale"]
    self.scale = head_dim ** -0.5 if scale is None else scale
    self.dropout_rate = self.options["dropout_rate"]
    self.softcap = self.options.get("softcap")   # declared only with spec.supports_softcap
    if self.dropout_rate and not spec.supports_dropout:
      raise self.option_error("dropout_rate", f"0 ({name} cannot apply attention dropout: "
                                              f"{self.WHY_NO_DROPOUT})")
    self.rngs = rngs
    self.sink_logits = (nnx.Param(jnp.zeros((num_heads,), jnp.float32))
                        if self.options.get("sink") else nnx.data(None))

  @classmethod
  def state_size(cls, *, emb_dim: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 seq_len: int, options: dict) -> int:
    """Floats per layer and sequence kept to continue after seq_len tokens (`az.state_size`):
    by default the KV cache, 2·seq_len·num_kv_heads·head_dim. `options`: validated, complete."""
    return 2 * seq_len * num_kv_heads * head_dim

  # -- the call ---------------------------------------------------------------------------

  def __call__(self, q, k, v, *, q_mask=None, kv_mask=None, deterministic: bool = True,
               alibi_slopes=None, q_segment_ids=None, kv_segment_ids=None):
    name = self.spec.name
    self._require_context_parallel()
    if self.sink_logits is not None and context_size() > 1:
      raise ValueError(f"{name}: sink=True has no context-parallel form (ring attention merges "
                       f"no sink); use a mesh with context=1, or sink=False")
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
                       f"{', '.join(accepting_alibi())}")
    q_mask = normalise_mask(q_mask, b, q_len, "q_mask", name)
    kv_mask = normalise_mask(kv_mask, b, kv_len, "kv_mask", name)
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

  def sinks(self):
    """The sink logits f32 [num_heads] for the softmax (option sink=True), or None."""
    return None if self.sink_logits is None else self.sink_logits[...]

  def dropout(self, weights, deterministic: bool):
    rng = self.dropout_rng(deterministic)
    return weights if rng is None else softmax.dropout(weights, self.dropout_rate, rng)

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


def _segment_ids(q_ids, kv_ids, batch: int, q_len: int, kv_len: int, spec):
  """Checked (q_segment_ids, kv_segment_ids) as int32, or None when neither is given."""
  if q_ids is None and kv_ids is None:
    return None
  if q_ids is None or kv_ids is None:
    _require_segment_ids(spec)
    raise ValueError(f"{spec.name}: pass both q_segment_ids and kv_segment_ids, or neither")
  return (_checked_ids(q_ids, "q_segment_ids", batch, q_len, spec),
          _checked_ids(kv_ids, "kv_segment_ids", batch, kv_len, spec))


def _require_segment_ids(spec) -> None:
  if not spec.supports_segment_ids:
    same_kind = [n for n in accepting("supports_segment_ids") if get(n).spec.kind == spec.kind]
    kinds = "variants" if spec.kind == "attention" else "mixers"
    raise ValueError(f"{spec.name} does not accept segment ids (packed sequences); the {kinds} "
                     f"that do: {', '.join(same_kind)}")


def _checked_ids(ids, what: str, batch: int, length: int, spec):
  """Segment ids as int32 [batch, length]; ValueError naming `what` otherwise."""
  _require_segment_ids(spec)
  ids = jnp.asarray(ids)
  if ids.shape != (batch, length) or not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"{spec.name}: {what} must be int [batch, len] = {(batch, length)}, got "
                     f"{ids.dtype} {ids.shape}")
  return ids.astype(jnp.int32)


class Mixer(Registered):
  """Base class of the sequence mixers: `mixer(x, *, mask=None, deterministic=True,
  decode=False, segment_ids=None) -> [b, n, emb]`.

  A sequence mixer is a block's token-mixing layer on x itself. An attention variant maps q, k,
  v to an output; the projections around it are the model's (`layers.MultiHeadAttention`). A
  sequence mixer (RetNet, Mamba2, GLA, DeltaNet, Gated DeltaNet, FoX) owns its projections,
  gates, short convolution and output norm, so it takes the block's input x [b, n, emb] and
  returns [b, n, emb], called exactly like MultiHeadAttention:

      mixer = az.create_mixer("gated_deltanet", emb_dim=64, num_heads=4, causal=True,
                              rngs=nnx.Rngs(0))
      y = mixer(x, mask=mask)                            # mask bool [b, n], True = real token
      mixer.init_cache(batch_size, max_len); y_t = mixer(x_t, decode=True)   # carried state

  A subclass registers with `@az.register_mixer(name, complexity=..., paper=...)`, declares its
  options in `OPTIONS` (typed, `attention_zoo.options`) and implements

      forward(x, mask, state, segment_ids=None) -> (y, state)
                                               the causal mixer; state None: a whole sequence
                                               from the empty state (the parallel / chunked
                                               form); otherwise the carried decode state,
                                               returned updated
      empty_state(batch_size, max_len, dtype)  the decode state before any token
      state_size(...)                          floats of recurrent state per layer (classmethod)

  and keeps its short convolution (a `convolution.ShortConv`, or None) in `self.conv`, whose
  decode cache `init_cache` prepares too. The base class validates construction and calls,
  zeroes masked output rows, and runs the encoder form.

  Masks: a masked token (False) outputs 0 and leaves the recurrent state untouched; it enters
  the short convolution as a zero input (in the parallel form and in decoding alike, so the two
  agree).

  Packed sequences (mixers registered with supports_segment_ids=True): segment_ids int [b, n],
  each run of equal ids processed as if alone, from the empty state; the short convolutions and
  token shifts do not reach across a run's start either. Whole sequences only, not decoding.

  Encoders (causal=False): the option `bidirectional` (default True) runs the causal mixer over
  the sequence and over the reversed sequence (reversed mask too; right padding becomes left
  padding, which a masked token leaves untouched) with the same parameters and averages the
  two, as Caduceus ties the weights of its two Mamba directions (Schiff et al. 2024,
  arXiv:2403.03234). bidirectional=False runs the causal mixer even in an encoder. With
  causal=True the mixer is causal and `bidirectional` has no effect. A class with
  ONE_PASS_ENCODER (softmax attention that owns its projections: MLA) is not run twice: its
  forward sees every token when self.bidirectional is True.
  """
  COMMON_OPTIONS = {"bidirectional": Bool(True)}
  DECORATOR = "register_mixer"
  # Why num_kv_heads != num_heads is refused (a mixer with no key/value heads to share), or
  # None: GQA/MQA accepted.
  WHY_NO_GQA: ClassVar[str | None] = None
  # The encoder form (bidirectional) is forward() itself over the whole sequence (softmax
  # attention owning its projections, MLA), not the mean of two causal passes: forward reads
  # self.bidirectional.
  ONE_PASS_ENCODER: ClassVar[bool] = False

  def __init__(self, *, emb_dim: int, num_heads: int, num_kv_heads: int | None = None,
               head_dim: int | None = None, causal: bool = False, max_len: int | None = None,
               dtype=jnp.float32, rngs: nnx.Rngs, **options):
    head_dim = emb_dim // num_heads if head_dim is None else head_dim
    self._construct(num_heads=num_heads, head_dim=head_dim, num_kv_heads=num_kv_heads,
                    causal=causal, max_len=max_len, options=options, emb_dim=emb_dim)
    if self.WHY_NO_GQA and self.num_kv_heads != num_heads:
      raise ValueError(f"{self.spec.name}: num_kv_heads ({self.num_kv_heads}) must equal "
                       f"num_heads ({num_heads}) or be None: {self.WHY_NO_GQA}")
    self.emb_dim, self.dtype = emb_dim, dtype
    self.bidirectional = self.options["bidirectional"] and not self.causal
    self.conv = nnx.data(None)       # a subclass's ShortConv, if it has one
    self.cache = nnx.data(None)      # the decode state, set by init_cache

  @classmethod
  def state_size(cls, *, emb_dim: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 seq_len: int, options: dict) -> int:
    """Floats of recurrent state one layer keeps per sequence (`az.state_size`); the short
    convolution's cache of conv_size - 1 inputs is not counted."""
    raise NotImplementedError(f"{cls.__qualname__} does not define state_size")

  # -- the call ---------------------------------------------------------------------------

  def __call__(self, x, *, mask=None, deterministic: bool = True, decode: bool = False,
               segment_ids=None):
    name = self.spec.name
    self._require_context_parallel()
    if x.ndim != 3 or x.shape[-1] != self.emb_dim:
      raise ValueError(f"{name}: x must be [batch, len, {self.emb_dim}], got {x.shape}")
    b, n, _ = x.shape
    mask = normalise_mask(mask, b, n, "mask", name)
    packed = {}
    if segment_ids is not None:
      if decode:
        raise ValueError(f"{name}: segment_ids (packed sequences) apply to a whole sequence, "
                         f"not to decoding")
      packed["segment_ids"] = _checked_ids(segment_ids, "segment_ids", b, n, self.spec)
    if decode:
      if self.cache is None:
        raise ValueError(f"{name}: decode=True needs init_cache(batch_size, max_len) first")
      y, state = self.forward(x, mask, self.cache.get_value())
      self.cache.set_value(state)
    else:
      y, _ = self.forward(x, mask, None, **packed)
      if self.bidirectional and not self.ONE_PASS_ENCODER:
        flip = lambda a: jnp.flip(a, axis=1)
        flipped = {key: flip(ids) for key, ids in packed.items()}   # runs stay runs
        y = (y + flip(self.forward(flip(x), flip(mask), None, **flipped)[0])) / 2
    return jnp.where(mask[..., None], y, 0).astype(x.dtype)

  def init_cache(self, batch_size: int, max_len: int, dtype=jnp.float32):
    """Prepares decoding (`decode=True`, any number of tokens per call) for max_len tokens."""
    self._require_decode()
    self.cache = nnx.Cache(self.empty_state(batch_size, max_len, dtype))
    if self.conv is not None:
      self.conv.init_cache(batch_size, dtype)

  def forward(self, x, mask, state, segment_ids=None):
    """The causal mixer: x [b, n, emb], mask bool [b, n], state None or the decode state,
    segment_ids int32 [b, n] or None (with state None only) -> (y [b, n, emb], the state after
    these tokens, or None for state None)."""
    raise NotImplementedError(f"{type(self).__qualname__} does not implement forward()")

  def empty_state(self, batch_size: int, max_len: int, dtype):
    """The decode state before any token (a pytree of arrays)."""
    raise NotImplementedError(f"{type(self).__qualname__} does not implement empty_state()")


# -- registration ---------------------------------------------------------------------------

def register(name: str, *, exact: bool, supports_causal: bool, supports_cross: bool,
             complexity: str, paper: str, can_decode: bool = False,
             supports_alibi: bool = False, shared_qk: bool = False,
             needs_max_len: bool = False, supports_dropout: bool = True,
             supports_softcap: bool = False, supports_segment_ids: bool = False,
             supports_context_parallel: bool = False, supports_bidirectional: bool = True,
             supports_sinks: bool = False):
  """Class decorator: `@register("cosine", exact=False, ...)` on an `Attention` subclass.

  supports_softcap adds the shared `softcap` option (SOFTCAP_OPTION) to the class's options;
  supports_sinks the shared `sink` option (SINK_OPTION: the variant passes `self.sinks()` to its
  softmax);
  supports_segment_ids lets calls pass q_segment_ids / kv_segment_ids; supports_context_parallel
  declares that it runs with the sequence split over a mesh's `context` axis (ops/context.py);
  supports_bidirectional=False makes it causal only (causal=False refused, WHY_NOT_BIDIRECTIONAL).

  TypeError for a class that is not an `Attention`, options not declared as
  `attention_zoo.options` types, or exact=True without a `pattern` method; ValueError for
  TEST_OPTIONS its options do not allow, or a name already taken by another class.
  """
  added = {**({"softcap": SOFTCAP_OPTION} if supports_softcap else {}),
           **({"sink": SINK_OPTION} if supports_sinks else {})}
  return _register(name, Attention, AttentionSpec, added,
                   exact=exact, supports_causal=supports_causal, supports_cross=supports_cross,
                   complexity=complexity, paper=paper, can_decode=can_decode,
                   supports_alibi=supports_alibi, shared_qk=shared_qk,
                   needs_max_len=needs_max_len, supports_dropout=supports_dropout,
                   supports_softcap=supports_softcap, supports_segment_ids=supports_segment_ids,
                   supports_context_parallel=supports_context_parallel,
                   supports_bidirectional=supports_bidirectional, supports_sinks=supports_sinks)


def register_mixer(name: str, *, complexity: str, paper: str, can_decode: bool = True,
                   supports_segment_ids: bool = False, supports_context_parallel: bool = False):
  """Class decorator: `@register_mixer("gla", complexity="O(n·d²)", paper=...)` on a `Mixer`
  subclass. A mixer is causal (an encoder runs it both ways: the `bidirectional` option),
  inexact, self-only, without ALiBi or attention dropout. supports_segment_ids: its forward
  takes segment_ids (packed sequences). Errors as `register`'s.
  """
  return _register(name, Mixer, MixerSpec, {}, exact=False, supports_causal=True,
                   supports_cross=False,
                   complexity=complexity, paper=paper, can_decode=can_decode,
                   supports_dropout=False, supports_segment_ids=supports_segment_ids,
                   supports_context_parallel=supports_context_parallel)


def _register(name: str, base: type, spec_type: type, added_options: dict, **facts):
  """The decorator that checks a subclass of `base`, builds its spec_type from `facts` and
  its declared options (plus `added_options`), and enters it in the registry."""
  def wrap(cls):
    if not (isinstance(cls, type) and issubclass(cls, base)):
      raise TypeError(f"@{base.DECORATOR}({name!r}) needs a subclass of "
                      f"attention_zoo.{base.__name__}, got {cls!r}")
    declared = cls.declared_options()
    untyped = {k: v for k, v in declared.items() if not isinstance(v, options_lib.Option)}
    if untyped:
      raise TypeError(
          f"{cls.__qualname__}.OPTIONS must map each name to an option type from "
          f"attention_zoo.options (Int, Float, Bool, Choice); got "
          + ", ".join(f"{k}={v!r}" for k, v in sorted(untyped.items()))
          + " (e.g. {'temperature': Float(1.0, above=0)})")
    declared = {**declared, **added_options}
    if facts["exact"] and cls.pattern is Attention.pattern:
      raise TypeError(f"{cls.__qualname__} is registered with exact=True but defines no "
                      f"pattern(q_len, kv_len): the pattern its softmax runs over is what the "
                      f"exactness is checked against")
    options_lib.validate(f"{name} (TEST_OPTIONS)", declared, cls.TEST_OPTIONS)
    spec = spec_type(
        name=name, options={k: option.default for k, option in declared.items()},
        option_specs=declared, **facts)
    add(name, cls)
    cls.spec = spec
    return cls

  return wrap
