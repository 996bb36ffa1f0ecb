"""Dropout on activations, with the cheap counter-based mask the attention weights use
(`ops.softmax.keep_mask`): `nnx.Dropout` draws a threefry bit per entry, a large share of a
small model's CPU train step at long lengths (docs/results.md#dropout-masks)."""
from __future__ import annotations

from flax import nnx

from attention_zoo.ops import softmax


class Dropout(nnx.Module):
  """Inverted dropout: x ⊙ keep / (1 - rate) with keep ~ Bernoulli(1 - rate) per entry, a fresh
  key from `rngs.dropout()` at every call; the identity when deterministic or rate is 0."""

  def __init__(self, rate: float, *, rngs: nnx.Rngs):
    if not 0.0 <= rate < 1.0:
      raise ValueError(f"Dropout: rate must be in [0, 1), got {rate}")
    self.rate, self.rngs = rate, rngs

  def __call__(self, x, *, deterministic: bool = True):
    if deterministic or self.rate == 0.0:
      return x
    return softmax.dropout(x, self.rate, self.rngs.dropout())
