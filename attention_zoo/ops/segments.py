"""Packed sequences: `segment_ids` int [B, T], each run of equal ids one sequence. What a run
is, in the three forms the ops and layers need (runs, not ids: a new sequence starts wherever
the id changes, so [0, 0, 1, 1, 0] holds three)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_starts(segment_ids):
  """int [B, T] -> bool [B, T]: True where a run starts after another (never at t = 0)."""
  return jnp.pad(segment_ids[:, 1:] != segment_ids[:, :-1], [(0, 0), (1, 0)])


def segment_runs(segment_ids):
  """int [B, T] -> int32 [B, T]: each token's run, counted from 0 along the row."""
  return jnp.cumsum(segment_starts(segment_ids).astype(jnp.int32), axis=1)


def positions_in_segments(segment_ids):
  """int [B, T] -> int [B, T]: each token's position within its run (0 at a run's first
  token)."""
  segment_ids = jnp.asarray(segment_ids)
  index = jnp.arange(segment_ids.shape[1])
  first = segment_starts(segment_ids).at[:, 0].set(True)
  return index - jax.lax.cummax(jnp.where(first, index, 0), axis=1)
