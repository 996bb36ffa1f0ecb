"""The short causal convolution: beside attention in a model's block, inside the sequence
mixers, and as Canon layers (a residual around it) at the block's points A-D."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from attention_zoo.ops.segments import segment_starts


class ShortConv(nnx.Module):
  """A causal depthwise convolution over the last `kernel_size` positions (the short
  convolution Zoology puts beside attention; Arora et al. 2023):

      y_t = b + Σ_{i < k} w_i ⊙ x_{t-i}          x, y [b, n, emb]; w [k, emb]

  It hands each position its recent neighbours (a key to the value after it), so attention
  is left with the long-range part. The sequence mixers (DeltaNet, Mamba2, ...) run it on their
  projections (their authors' kernel 4, followed by SiLU). For decoding it keeps the last
  k - 1 inputs, so any number of tokens can be fed at a time. With `segment_ids` int [b, n]
  (packed sequences) a tap reaches back only within the token's own run, as if each sequence
  were alone.
  """

  def __init__(self, features: int, kernel_size: int, *, bias: bool = True, dtype=jnp.float32,
               rngs: nnx.Rngs):
    if kernel_size < 1:
      raise ValueError(f"short_conv must be a kernel size >= 1 (0 = none), got {kernel_size}")
    self.kernel_size, self.dtype = kernel_size, dtype
    self.weight = nnx.Param(nnx.initializers.normal(kernel_size ** -0.5)(
        rngs.params(), (kernel_size, features)))
    self.bias = nnx.Param(jnp.zeros((features,))) if bias else None
    self.state = nnx.data(None)   # [b, k - 1, emb] in decoding, set by init_cache

  def init_cache(self, batch_size: int, dtype=jnp.float32):
    self.state = nnx.Cache(jnp.zeros((batch_size, self.kernel_size - 1, self.weight.shape[1]),
                                     dtype))

  def __call__(self, x, *, decode: bool = False, segment_ids=None):
    k, n = self.kernel_size, x.shape[1]
    if segment_ids is not None and decode:
      raise ValueError("segment_ids (packed sequences) apply to a whole sequence, not decoding")
    if decode:
      window = jnp.concatenate([self.state[...].astype(x.dtype), x], axis=1)   # [b, k - 1 + n, emb]
      self.state[...] = window[:, n:]
    else:
      window = jnp.pad(x, ((0, 0), (k - 1, 0), (0, 0)))
    weight = self.weight[...].astype(self.dtype)
    # Tap i reads x_{t-i}: the slice of the left-padded window that ends i positions early.
    taps = [window[:, k - 1 - i:k - 1 - i + n] for i in range(k)]                # [b, n, emb]
    if segment_ids is not None:
      # tap i stays in the token's run when none of x_{t-i+1..t} starts one: local shifts (a
      # running count of runs would be a cumulative sum along the row, which a sequence split
      # over devices would gather)
      start_window = jnp.pad(segment_starts(segment_ids), ((0, 0), (k - 1, 0)))   # [b, k-1+n]
      crossed = jnp.zeros((x.shape[0], n), bool)
      kept = []
      for i, tap in enumerate(taps):
        kept.append(jnp.where(crossed[..., None], 0, tap))
        crossed = crossed | start_window[:, k - 1 - i:k - 1 - i + n]
      taps = kept
    out = sum(w * tap for w, tap in zip(weight, taps))
    return out if self.bias is None else out + self.bias[...].astype(self.dtype)


# The authors' kernel (PhysicsLM4's canon_kernel default; their code allows 2 to 4).
CANON_KERNEL = 4


class Canon(nnx.Module):
  """A Canon layer (Allen-Zhu 2025, "Physics of Language Models: Part 4.1, Architecture Design
  and the Magic of Canon Layers"): a causal depthwise convolution with a residual,

      h'_t = h_t + Σ_{i < 4} w_i ⊙ h_{t-i} · m_{t-i}       h [b, n, f]; w [4, f]; m: 1 = real

  bias-free and without an activation (the authors' defaults, canon_bias=False,
  canon_activation=False). A masked token (m = 0) enters the convolution as zero, so padding
  contributes nothing to a real token; its own output is its input plus its neighbours' (the
  layers after it mask it). Decoding keeps the last 3 inputs (ShortConv's cache); packed
  sequences (`segment_ids`) keep each tap inside its run. The weights start as ShortConv's,
  N(0, 1/4) (PyTorch's Conv1d default, which the authors keep, is U(±1/2))."""

  def __init__(self, features: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
    self.conv = ShortConv(features, CANON_KERNEL, bias=False, dtype=dtype, rngs=rngs)

  def init_cache(self, batch_size: int, dtype=jnp.float32):
    self.conv.init_cache(batch_size, dtype)

  def __call__(self, x, mask=None, *, decode: bool = False, segment_ids=None):
    """x [b, n, f], mask bool [b, n] or None (all real) -> [b, n, f]."""
    real = x if mask is None else jnp.where(mask[..., None], x, 0)
    return x + self.conv(real, decode=decode, segment_ids=segment_ids).astype(x.dtype)


class TokenShift(nnx.Module):
  """RWKV's token shift: each position's previous input x_{t-1} (zeros before the first), which
  RWKV mixes into x_t by a learned per-channel lerp (a weightless one-tap causal convolution).
  For decoding it keeps the last input, as ShortConv keeps its window, so any number of tokens
  can be fed at a time.
  """

  def __init__(self, features: int):
    self.features = features
    self.state = nnx.data(None)   # [b, 1, features] in decoding, set by init_cache

  def init_cache(self, batch_size: int, dtype=jnp.float32):
    self.state = nnx.Cache(jnp.zeros((batch_size, 1, self.features), dtype))

  def __call__(self, x, *, decode: bool = False, segment_ids=None):
    """x [b, n, f] -> x shifted one position right [b, n, f]; with segment_ids int [b, n]
    (packed sequences, not decoding) zeros at each run's first token, as at the first."""
    if decode:
      window = jnp.concatenate([self.state[...].astype(x.dtype), x], axis=1)     # [b, 1 + n, f]
      self.state[...] = window[:, -1:]
    else:
      window = jnp.pad(x, ((0, 0), (1, 0), (0, 0)))
    shifted = window[:, :-1]
    if segment_ids is None:
      return shifted
    return jnp.where(segment_starts(segment_ids)[..., None], 0, shifted)
