"""Lengths cut into blocks: how many blocks, and arrays padded to a whole number of them."""
from __future__ import annotations

import math

import jax.numpy as jnp


def ceil_div(a: int, b: int) -> int:
  return -(-a // b)


def pad_to_multiple(x, multiple: int, axis: int = 1, value=0):
  """Pads `axis` of x at the end up to a multiple of `multiple`."""
  length = x.shape[axis]
  padded = math.ceil(length / multiple) * multiple
  if padded == length:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, padded - length)
  return jnp.pad(x, widths, constant_values=value)
