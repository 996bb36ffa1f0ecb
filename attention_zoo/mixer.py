"""The `Mixer` base class: a sequence mixer is a block's token-mixing layer on x itself.

An attention variant maps q, k, v to an output; the projections around it are the model's
(`attention_zoo.layers.MultiHeadAttention`). A sequence mixer (RetNet, Mamba2, GLA, DeltaNet,
Gated DeltaNet, FoX) owns its projections, gates, short convolution and output norm, so it takes
the block's input x [b, n, emb] and returns [b, n, emb], called exactly like MultiHeadAttention:

    mixer = az.create_mixer("gated_deltanet", emb_dim=64, num_heads=4, causal=True,
                            rngs=nnx.Rngs(0))
    y = mixer(x, mask=mask)                            # mask bool [b, n], True = real token
    mixer.init_cache(batch_size, max_len); y_t = mixer(x_t, decode=True)   # carried state

A subclass registers with `@az.register_mixer(name, complexity=..., paper=...)`, declares its
options in `OPTIONS` (typed, `attention_zoo.options`) and implements

    forward(x, mask, state) -> (y, state)    the causal mixer; state None: a whole sequence from
                                             the empty state (the parallel / chunked form);
                                             otherwise the carried decode state, returned updated
    empty_state(batch_size, max_len, dtype)  the decode state before any token
    state_size(...)                          floats of recurrent state per layer (classmethod)

and keeps its short convolution (a `layers.ShortConv`, or None) in `self.conv`, whose decode
cache `init_cache` prepares too. The base class validates construction and calls, zeroes masked
output rows, and runs the encoder form.

Masks: a masked token (False) outputs 0 and leaves the recurrent state untouched; it enters the
short convolution as a zero input (in the parallel form and in decoding alike, so the two agree).

Encoders (causal=False): the option `bidirectional` (default True) runs the causal mixer over
the sequence and over the reversed sequence (reversed mask too; right padding becomes left
padding, which a masked token leaves untouched) with the same parameters and averages the two,
as Caduceus ties the weights of its two Mamba directions (Schiff et al. 2024, arXiv:2403.03234).
bidirectional=False runs the causal mixer even in an encoder. With causal=True the mixer is
causal and `bidirectional` has no effect.
"""
from __future__ import annotations

from typing import ClassVar

import jax.numpy as jnp
from flax import nnx

from attention_zoo import options as options_lib
from attention_zoo.options import Bool, Int

# Options every mixer accepts.
COMMON_OPTIONS = {"bidirectional": Bool(True)}
_MAX_LEN = Int(None, minimum=1, optional=True)


class Mixer(nnx.Module):
  """Base class: `mixer(x, *, mask=None, deterministic=True, decode=False) -> [b, n, emb]`."""
  OPTIONS: ClassVar[dict[str, options_lib.Option]] = {}
  spec: ClassVar  # AttentionSpec (kind "mixer"), set by @register_mixer

  def __init__(self, *, emb_dim: int, num_heads: int, num_kv_heads: int | None = None,
               head_dim: int | None = None, causal: bool = False, max_len: int | None = None,
               dtype=jnp.float32, rngs: nnx.Rngs, **options):
    cls = type(self)
    if "spec" not in cls.__dict__:
      raise TypeError(f"{cls.__qualname__} is not registered: decorate it with "
                      f"@attention_zoo.register_mixer(...)")
    name = cls.spec.name
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    head_dim = emb_dim // num_heads if head_dim is None else head_dim
    if min(emb_dim, num_heads, num_kv_heads, head_dim) <= 0:
      raise ValueError(f"{name}: emb_dim, num_heads, num_kv_heads and head_dim must be positive, "
                       f"got {emb_dim}, {num_heads}, {num_kv_heads}, {head_dim}")
    if num_heads % num_kv_heads:
      raise ValueError(f"{name}: num_heads ({num_heads}) must be a multiple of num_kv_heads "
                       f"({num_kv_heads})")
    if not _MAX_LEN.allows(max_len):
      raise ValueError(f"{name}: max_len must be a positive integer or None, got {max_len!r}")
    self.options = options_lib.validate(name, cls.spec.option_specs, options)
    self.emb_dim, self.num_heads, self.num_kv_heads = emb_dim, num_heads, num_kv_heads
    self.head_dim, self.causal, self.dtype = head_dim, bool(causal), dtype
    self.bidirectional = self.options["bidirectional"] and not self.causal
    self.conv = nnx.data(None)       # a subclass's ShortConv, if it has one
    self.cache = nnx.data(None)      # the decode state, set by init_cache

  @classmethod
  def declared_options(cls) -> dict[str, options_lib.Option]:
    """Every option the class accepts: the common ones, then its own."""
    return {**COMMON_OPTIONS, **cls.OPTIONS}

  def option_error(self, name: str, expected: str) -> ValueError:
    """The error for a rule relating options, shaped like a rejected value's."""
    return options_lib.invalid(self.spec.name, name, self.options[name], expected)

  @classmethod
  def state_size(cls, *, emb_dim: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 seq_len: int, options: dict) -> int:
    """Floats of recurrent state one layer keeps per sequence (`az.state_size`); the short
    convolution's cache of conv_size - 1 inputs is not counted."""
    raise NotImplementedError(f"{cls.__qualname__} does not define state_size")

  # -- the call ---------------------------------------------------------------------------

  def __call__(self, x, *, mask=None, deterministic: bool = True, decode: bool = False):
    name = self.spec.name
    if x.ndim != 3 or x.shape[-1] != self.emb_dim:
      raise ValueError(f"{name}: x must be [batch, len, {self.emb_dim}], got {x.shape}")
    b, n, _ = x.shape
    if mask is None:
      mask = jnp.ones((b, n), bool)
    mask = jnp.asarray(mask)
    if mask.shape != (b, n):
      raise ValueError(f"{name}: mask must be bool [batch, len] = {(b, n)}, got {mask.shape}")
    mask = mask.astype(bool)
    if decode:
      if self.cache is None:
        raise ValueError(f"{name}: decode=True needs init_cache(batch_size, max_len) first")
      y, state = self.forward(x, mask, self.cache.get_value())
      self.cache.set_value(state)
    else:
      y, _ = self.forward(x, mask, None)
      if self.bidirectional:
        flip = lambda a: jnp.flip(a, axis=1)
        y = (y + flip(self.forward(flip(x), flip(mask), None)[0])) / 2
    return jnp.where(mask[..., None], y, 0).astype(x.dtype)

  def init_cache(self, batch_size: int, max_len: int, dtype=jnp.float32):
    """Prepares decoding (`decode=True`, any number of tokens per call) for max_len tokens."""
    if not self.spec.can_decode:
      raise ValueError(f"{self.spec.name} cannot decode (spec.can_decode is False)")
    if not self.causal:
      raise ValueError(f"{self.spec.name}: decoding needs causal=True")
    self.cache = nnx.Cache(self.empty_state(batch_size, max_len, dtype))
    if self.conv is not None:
      self.conv.init_cache(batch_size, dtype)

  def forward(self, x, mask, state):
    """The causal mixer: x [b, n, emb], mask bool [b, n], state None or the decode state ->
    (y [b, n, emb], the state after these tokens, or None for state None)."""
    raise NotImplementedError(f"{type(self).__qualname__} does not implement forward()")

  def empty_state(self, batch_size: int, max_len: int, dtype):
    """The decode state before any token (a pytree of arrays)."""
    raise NotImplementedError(f"{type(self).__qualname__} does not implement empty_state()")
